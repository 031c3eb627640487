"""`ddiloco slurm submit | status | summary`: a run on a SLURM cluster (infra/slurm/submit.py; docs/deploy.md)."""
from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

from workers import config
from workers.launch_config import ALIASES, CHOICES, HELP, SKIP, LaunchConfig

from .submit import ROLES, SlurmOptions, describe, plan, submit
from .summary import status, summarize


def configure(parser: argparse.ArgumentParser):
    """A run on SLURM: ddiloco slurm submit --learners M --out SHARED_DIR [-- CMD]; status; summary."""
    sub = parser.add_subparsers(dest="slurm_command", required=True)
    s = sub.add_parser("submit", help="submit the syncer, one job per learner and the stop job",
                       description=__doc__)
    a = s.add_argument
    a("--out", required=True, help="the run's directory, on a filesystem every node mounts (settings, keys, "
                                   "logs, batch scripts, OUT/store unless --store)")
    a("--config", default=None, metavar="FILE.toml", help="the run's settings as TOML (ddiloco launch --print-config)")
    a("--partition", default=None, help="sbatch --partition for every job")
    a("--account", default=None, help="sbatch --account for every job")
    a("--time", dest="time_limit", default=None, help="sbatch --time for every job (e.g. 2-00:00:00)")
    a("--nodes-per-learner", type=int, default=1,
      help="nodes of each learner's torchrun group (srun + torchrun, --nproc-per-learner ranks per node)")
    a("--syncer-restarts", type=int, default=20, help="requeues of the syncer's job after its process fails")
    a("--bind", default="0.0.0.0", help="the address the syncer's bus binds (free ports)")
    a("--advertise", default="", help="the host learners connect to (default: the syncer node's name)")
    a("--sbatch-arg", action="append", default=[], metavar="OPTION",
      help="one more sbatch option for every job (repeatable), e.g. --sbatch-arg=--qos=high")
    a("--region", action="append", default=None, metavar="NAME=URI[,endpoint=URL][,profile=NAME]",
      help="a region of the run on its own store (once per region, home first; learner m in region m mod N)")
    a("--dry-run", action="store_true", help="write OUT's files and print the sbatch calls without submitting")
    config.add_flags(s, LaunchConfig, skip=SKIP, aliases=ALIASES, helps=HELP, choices=CHOICES)
    a("command", nargs=argparse.REMAINDER, metavar="-- CMD ARGS", help="the training command every learner runs")
    st = sub.add_parser("status", help="each job's state and each learner's last step")
    st.add_argument("out", help="the directory given to ddiloco slurm submit --out")
    dr = sub.add_parser("drain", help="wait until the syncer committed every learner's durable deltas (the stop job)")
    dr.add_argument("out", help="the directory given to ddiloco slurm submit --out")
    dr.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS")
    sm = sub.add_parser("summary", help="write OUT/summary.json and OUT/report.png (the stop job runs this)")
    sm.add_argument("out", help="the directory given to ddiloco slurm submit --out")
    sm.add_argument("--summary", default=None, help="also write the summary JSON here")

    def handler(args) -> int:
        try:
            if args.slurm_command == "status":
                print(status(Path(args.out), dict(os.environ)))
                return 0
            if args.slurm_command == "drain":
                return _drain(Path(args.out), args.timeout)
            if args.slurm_command == "summary":
                summary = summarize(Path(args.out), args)
                return 0 if summary["ok"] else 1
            return _submit(args)
        except ValueError as exc:
            raise SystemExit(f"ddiloco slurm {args.slurm_command}: {exc}") from None
    return handler


def _submit(args) -> int:
    regions = {"launch.region_specs": ";".join(args.region)} if args.region else None
    cfg = config.from_args(args, LaunchConfig, SKIP, regions)
    opts = SlurmOptions(partition=args.partition, account=args.account, time_limit=args.time_limit,
                        nodes_per_learner=args.nodes_per_learner, syncer_restarts=args.syncer_restarts,
                        bind=args.bind, advertise=args.advertise, sbatch_args=tuple(args.sbatch_arg))
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    out = Path(args.out)
    jobs = plan(cfg, opts, out, command)
    if args.dry_run:
        print(describe(jobs))
        return 0
    if shutil.which("sbatch") is None:
        raise ValueError("sbatch is not on PATH: run this on a SLURM login node (or --dry-run to see the jobs)")
    try:
        ids = submit(jobs, out, dict(os.environ))
    except RuntimeError as exc:
        raise ValueError(str(exc)) from None
    learners = [r for r in ids if r not in ROLES]
    print(f"submitted run at {out}: syncer job {ids['syncer']}, learner jobs "
          + ", ".join(f"{r}={ids[r]}" for r in learners) + f", stop job {ids['stop']} (after every learner)")
    print(f"  watch: ddiloco slurm status {out}   logs: {out}/slurm/*.out, {out}/logs/*.jsonl")
    print(f"  stop one learner: scancel {ids[learners[0]]}   stop the run: scancel {' '.join(ids.values())}")
    return 0


def _drain(out: Path, timeout_s: float) -> int:
    from storage.store import open_store
    from .drain import wait_drained
    from .submit import read_jobs, run_store
    from .summary import settings
    jobs, lc = read_jobs(out), settings(out).launch
    uri, endpoint = run_store(out, lc)
    store = open_store(uri, s3_endpoint=endpoint, create=False)
    why = wait_drained(store, out / "logs", sorted(jobs["learners"]), timeout_s)
    print("drained: every learner's durable delta is committed" if not why else
          f"not drained after {timeout_s:g} s: {why}")
    return 0 if not why else 1
