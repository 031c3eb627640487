"""`ddiloco launch`'s configuration: the run's sections (as `ddiloco run`'s) plus ``[launch]``.

The descriptor's sections (``policy``, ``codec``, ``versions``, ``merge``, ``outer``, ``learner``,
``guard``) and ``schedule`` are the same classes, defaults and flags as ``ddiloco run``'s
(workers/run_config.py); the model and the job are the user's script's, so there are no ``[model]``
or ``[job]`` sections. ``[launch]`` says how many learners run the command and how they are kept alive.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pipeline.descriptor import RunSections
from pipeline.guard import NormGuardConfig
from .config import Alias
from .launch import RunSettings, Schedule, check_quorum
from .sections import SECTION_CHOICES, SECTION_HELP


@dataclass(frozen=True)
class LaunchOptions:
    """``[launch]``: M learners, each running the command (``nproc_per_learner`` N > 1: under torchrun
    with N ranks); a learner that dies is restarted alone up to ``max_restarts`` times; ``steps``
    is handed to the command as ``DDILOCO_STEPS`` (the script decides what it means; the progress
    display counts towards it); ``store`` none: OUT/store."""

    learners: int = 2
    nproc_per_learner: int = 1
    max_restarts: int = 3
    steps: int | None = None
    store: str | None = None
    s3_endpoint: str | None = None
    syncers: int = 1
    region_specs: str | None = None    # ';'-joined --region NAME=URI[,endpoint=URL][,profile=NAME], home first
    bus: bool = True
    insecure: bool = False
    keys: str | None = None
    seed: int = 0
    propose_wait: float = 600.0
    state_every: float = 5.0
    eval: bool = False
    save_optimizer_every: int | None = None
    eval_command: str | None = None

    def __post_init__(self) -> None:
        for name in ("learners", "nproc_per_learner", "syncers"):
            if getattr(self, name) < 1:
                raise ValueError(f"launch.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_restarts < 0:
            raise ValueError(f"launch.max_restarts must be >= 0, got {self.max_restarts}")
        if self.region_specs is not None:
            from pipeline.regions import regions_from_specs
            regions_from_specs(self.region_specs.split(";"))
            if self.syncers > 1 or self.store is not None:
                raise ValueError("launch.region_specs names every region's store itself: it takes no launch.store "
                                 "or launch.syncers")
        if self.save_optimizer_every is not None and self.save_optimizer_every < 1:
            raise ValueError(f"launch.save_optimizer_every must be >= 1 steps, got {self.save_optimizer_every}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"launch.steps must be >= 1, got {self.steps}")
        if not self.propose_wait > 0 or not self.state_every > 0:
            raise ValueError(f"launch.propose_wait and launch.state_every must be > 0 seconds, got "
                             f"{self.propose_wait}, {self.state_every}")


@dataclass(frozen=True)
class LaunchConfig(RunSections):
    SECTION_ORDER: ClassVar[tuple[str, ...]] = ("launch", "schedule", "policy", "codec", "versions", "merge", "outer",
                                                "learner", "guard")

    launch: LaunchOptions = LaunchOptions()
    schedule: Schedule = Schedule()
    guard: NormGuardConfig = NormGuardConfig()

    def __post_init__(self) -> None:
        try:
            check_quorum(self.policy.quorum, self.launch.learners)
        except ValueError as exc:
            raise ValueError(f"policy.quorum {self.policy.quorum} with launch.learners {self.launch.learners}: "
                             f"{exc}") from None
        if self.launch.syncers > self.schedule.fragments:
            raise ValueError(f"launch.syncers ({self.launch.syncers}) must be <= schedule.fragments "
                             f"({self.schedule.fragments}): every shard owns a fragment")

    def settings(self, regions=None) -> RunSettings:
        return RunSettings(regions=regions, schedule=self.schedule, policy=self.policy, codec=self.codec, versions=self.versions,
                           merge=self.merge, outer=self.outer, learner=self.learner, guard=self.guard,
                           seed=self.launch.seed, syncers=self.launch.syncers, extra={"launched_by": "ddiloco launch"})


SKIP = ("merge.embedding_tensors",)

ALIASES = (
    Alias("--learners", "launch.learners"), Alias("--nproc-per-learner", "launch.nproc_per_learner"),
    Alias("--max-restarts", "launch.max_restarts"), Alias("--steps", "launch.steps"),
    Alias("--store", "launch.store"), Alias("--s3-endpoint", "launch.s3_endpoint"),
    Alias("--syncers", "launch.syncers"), Alias("--no-bus", "launch.bus", False),
    Alias("--insecure", "launch.insecure", True), Alias("--keys", "launch.keys"), Alias("--seed", "launch.seed"),
    Alias("--fragments", "schedule.fragments"), Alias("--sync-every", "schedule.sync_every"),
    Alias("--strategy", "schedule.strategy"), Alias("--quorum", "policy.quorum"),
    Alias("--grace-gamma", "policy.gamma"), Alias("--compression", "codec.scheme"),
    Alias("--codec-format", "codec.format"), Alias("--outer-lr", "outer.lr"),
    Alias("--outer-momentum", "outer.momentum"), Alias("--keep-progress", "learner.keep_progress", True),
    Alias("--norm-guard", "guard.factor"), Alias("--eval", "launch.eval", True),
    Alias("--eval-command", "launch.eval_command"), Alias("--save-optimizer-every", "launch.save_optimizer_every"),
)

CHOICES = SECTION_CHOICES

HELP = {**SECTION_HELP,
        "launch.learners": "learners M, each running the command",
        "launch.nproc_per_learner": "ranks per learner: N > 1 runs the command under torchrun --nproc-per-node N",
        "launch.max_restarts": "restarts of each learner that dies (the others never stop)",
        "launch.steps": "step budget handed to the command as DDILOCO_STEPS (none: the script's own)",
        "launch.store": "the run's location: a directory or s3://bucket/prefix (none: OUT/store); an existing "
                        "run there is continued",
        "launch.s3_endpoint": "S3 endpoint URL (none: AWS_ENDPOINT_URL)",
        "launch.syncers": "syncer shards (docs/scale.md)",
        "launch.region_specs": "regions on their own stores, home first: NAME=URI[,endpoint=URL][,profile=NAME] "
                               "joined by ';' (the --region flag, once per region; learner m in region m mod N)",
        "launch.bus": "ZeroMQ for deltas and versions (false: through storage only)",
        "launch.insecure": "no CURVE and no signatures (default: keys in OUT/keys)",
        "launch.keys": "key directory (none: OUT/keys); missing keys are created",
        "launch.seed": "the run's seed (recorded in the descriptor)",
        "launch.propose_wait": "seconds a learner waits for the run to be created from the proposed model",
        "launch.state_every": "seconds between each learner's resume records",
        "launch.eval": "also run the command once as the run's evaluator (DDILOCO_ROLE=evaluator: it follows the "
                       "global model with workers.evaluator.Evaluator and logs its held-out loss)",
        "launch.save_optimizer_every": "steps between snapshots of each learner's inner optimizer state, kept for "
                                       "its next life (none: a restarted learner starts a fresh optimizer)",
        "launch.eval_command": "the evaluator's own command instead, as one string (implies launch.eval)"}
