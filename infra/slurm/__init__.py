"""SLURM: batch scripts, `ddiloco slurm submit`, and a local one-node cluster for tests (issue 29)."""
