"""Help texts and choices of the run descriptor's sections and ``[schedule]``, shared by ``ddiloco run``
(workers/run_config.py) and ``ddiloco launch`` (workers/launch_config.py). Torch-free, so that the
syncer (``ddiloco syncer --create``) reads a launch file without importing the demo job."""
from __future__ import annotations

from pipeline.codec import SCHEMES, VERSIONS as CODEC_FORMATS
from pipeline.descriptor import VERSION_DTYPES
from .launch import STRATEGIES

SECTION_CHOICES = {"schedule.strategy": STRATEGIES, "codec.scheme": SCHEMES, "codec.format": CODEC_FORMATS,
                   "versions.dtype": VERSION_DTYPES, "merge.method": ("rda", "mean")}

SECTION_HELP = {
    "schedule.fragments": "fragments P",
    "schedule.sync_every": "H: steps between two syncs of one fragment (none: 4 x P)",
    "policy.quorum": "minimum quorum K (<= learners)",
    "policy.overlap": "tau: steps a fragment's version is expected back after its round (SPEC §3)",
    "policy.gamma": "gamma of the adaptive grace window (SPEC §4)",
    "policy.cap_s": "cap of the grace window in seconds (0: one step time)",
    "versions.dtype": "how versions travel down: int4 deltas with error feedback, bf16 or fp32 (docs/algorithm.md)",
    "versions.full_every": "int4 versions: a full snapshot every N versions, a new learner reads one and < N deltas (0: min(8, retain))",
    "codec.format": "tensor blob format of the run's deltas and versions (docs/formats.md \"Tensor blobs\")",
    "outer.lr": "outer Nesterov learning rate (SPEC §5)",
    "outer.momentum": "outer Nesterov momentum",
    "learner.keep_progress": "learners keep their steps since answering a round when its version lands",
    "learner.mixing_alpha": "weight of a learner's own parameters when a version lands (0: take the version)",
    "guard.factor": "drop a delta whose per-step norm exceeds this factor x the recent median (docs/algorithm.md)",
    "guard.enabled": "the norm guard (false: every finite delta is merged)",
}
