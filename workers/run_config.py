"""`ddiloco run`'s configuration: one tree of typed sections (workers/config.py), from flag or file
to the run descriptor.

The sections that the descriptor records are the descriptor's own config classes (``policy``,
``codec``, ``versions``, ``merge``, ``outer``, ``learner``, ``guard``; SPEC §2-6), with the job's
(``job``: workers/job/job.py, ``model``: workers/job/model.py); three sections belong to the launcher
alone: ``run`` (what to run and where), ``schedule`` (P, H and how tensors are cut: workers/launch.py,
which ``create_run`` takes) and ``roles`` (how the processes behave on this machine). Each knob's
default is its section class's, defined once there. ``ddiloco run --print-config`` prints the
resolved tree as TOML; ``--config FILE`` reads one; flags override the file. The short flags of
earlier releases (``--quorum``, ``--compression``...) stay as aliases (``ALIASES``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from pipeline.descriptor import RunSections
from pipeline.guard import NormGuardConfig
from pipeline.regions import RegionsConfig
from workers.job.job import LR_SCHEDULES, JobSettings
from workers.job.model import GPTConfig
from .config import Alias
from .sections import SECTION_CHOICES, SECTION_HELP
from .launch import RunSettings, Schedule, check_quorum

MODES = ("decoupled", "dp", "diloco")


@dataclass(frozen=True)
class RunOptions:
    """``[run]``: what to run and where. ``tokens`` (a budget per learner) overrides ``job.steps``;
    ``store``: a directory or ``s3://bucket/prefix`` (none: OUT/store); ``regions`` N: home r0 at the
    store, r1.. in OUT/regions (docs/regions.md); ``syncers``: syncer shards (docs/scale.md)."""

    learners: int = 4
    mode: str = "decoupled"
    seed: int = 0
    tokens: int | None = None
    store: str | None = None
    s3_endpoint: str | None = None
    syncers: int = 1
    regions: int = 1
    region_specs: str | None = None    # ';'-joined --region NAME=URI[,endpoint=URL][,profile=NAME], home first
    bus: bool = True
    insecure: bool = False
    keys: str | None = None
    prices: str | None = None

    def __post_init__(self) -> None:
        if self.learners < 1:
            raise ValueError(f"learners must be >= 1, got {self.learners}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.tokens is not None and self.tokens < 1:
            raise ValueError(f"tokens must be >= 1, got {self.tokens}")
        if self.regions < 1 or self.syncers < 1:
            raise ValueError(f"regions ({self.regions}) and syncers ({self.syncers}) must be >= 1")
        if self.region_specs is not None:
            from pipeline.regions import regions_from_specs
            regions_from_specs(self.region_specs.split(";"))     # refused here, naming the flag, before anything starts
            if self.regions > 1 or self.syncers > 1 or self.store is not None:
                raise ValueError("run.region_specs names every region's store itself: it takes no run.regions, "
                                 "run.syncers or run.store")
        if self.syncers > 1 and self.regions > 1:
            raise ValueError("syncers > 1 with regions > 1 is not supported yet "
                             "(each shard would need its own replicator)")


@dataclass(frozen=True)
class Roles:
    """``[roles]``: how the role processes behave here (never recorded in the run): ``slow``
    stretches every learner step, ``pace`` pads it to that many seconds; ``poll``/``spill_poll``:
    learners' version polls and the syncer's inbox listings (none: their defaults, 0.5 s);
    ``metrics_port`` N: Prometheus at N (syncer) and N+1+m (learner m), 0: free ports;
    ``eval_every``: seconds between held-out evaluations of the global model."""

    slow: float = 1.0
    pace: float | None = None
    poll: float | None = None
    spill_poll: float | None = None
    sync_process: bool = False
    metrics_port: int | None = None
    eval_every: float = 10.0

    def __post_init__(self) -> None:
        if not self.slow >= 1.0:
            raise ValueError(f"roles.slow must be >= 1, got {self.slow}")
        if self.pace is not None and (not self.pace > 0 or self.slow != 1.0):
            raise ValueError(f"roles.pace must be > 0 seconds and takes no roles.slow, got pace {self.pace}, "
                             f"slow {self.slow}")
        for name in ("poll", "spill_poll"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"roles.{name} must be > 0 seconds, got {value}")
        if not self.eval_every > 0:
            raise ValueError(f"roles.eval_every must be > 0 seconds, got {self.eval_every}")


@dataclass(frozen=True)
class RunConfig(RunSections):
    """The whole of a ``ddiloco run``: every knob once, with its one default (its section class's)."""

    SECTION_ORDER: ClassVar[tuple[str, ...]] = ("run", "schedule", "policy", "codec", "versions", "merge", "outer",
                                                "learner", "guard", "job", "model", "roles")

    run: RunOptions = RunOptions()
    schedule: Schedule = Schedule()
    guard: NormGuardConfig = NormGuardConfig()
    job: JobSettings = JobSettings()
    model: GPTConfig = GPTConfig()
    roles: Roles = Roles()

    def __post_init__(self) -> None:
        try:
            check_quorum(self.policy.quorum, self.run.learners)   # K is a minimum: K > M never closes a round
        except ValueError as exc:
            raise ValueError(f"policy.quorum {self.policy.quorum} with run.learners {self.run.learners}: {exc}") from None
        if self.run.syncers > self.schedule.fragments:
            raise ValueError(f"run.syncers ({self.run.syncers}) must be <= schedule.fragments "
                             f"({self.schedule.fragments}): every shard owns a fragment")
        port = self.roles.metrics_port
        if port is not None and not 0 <= port <= 65535 - self.run.learners:
            raise ValueError(f"roles.metrics_port must be 0 (any free ports) or 1..{65535 - self.run.learners} "
                             f"(the syncer's port; learners take the next {self.run.learners}), got {port}")

    def resolved(self) -> "RunConfig":
        """The tree with derived values filled in (H, and the job's shards = learners, its steps
        from a token budget), as the run uses it and ``--print-config`` prints it."""
        steps = self.job.steps if self.run.tokens is None else max(
            1, self.run.tokens // (self.job.batch_size * self.model.block_size))
        return dataclasses.replace(
            self, schedule=dataclasses.replace(self.schedule, sync_every=self.schedule.h),
            job=dataclasses.replace(self.job, shards=self.run.learners, steps=steps))

    def settings(self, regions: RegionsConfig | None = None) -> RunSettings:
        """The settings ``create_run`` takes (the descriptor's sections come from here)."""
        cfg = self.resolved()
        return RunSettings(
            schedule=cfg.schedule, policy=cfg.policy, codec=cfg.codec, versions=cfg.versions, merge=cfg.merge,
            outer=cfg.outer, learner=cfg.learner, guard=cfg.guard, seed=cfg.run.seed, model=cfg.model.to_dict(),
            job=cfg.job.to_dict(), regions=regions, syncers=cfg.run.syncers)


# Derived, never set: the job's data shards are the learners; merge's embedding tensors come from the model.
SKIP = ("job.shards", "merge.embedding_tensors")

# The flags of earlier releases, kept: every one sets exactly one knob.
ALIASES = (
    Alias("--learners", "run.learners"), Alias("--mode", "run.mode"), Alias("--seed", "run.seed"),
    Alias("--tokens", "run.tokens"), Alias("--store", "run.store"), Alias("--s3-endpoint", "run.s3_endpoint"),
    Alias("--syncers", "run.syncers"), Alias("--regions", "run.regions"), Alias("--no-bus", "run.bus", False),
    Alias("--insecure", "run.insecure", True), Alias("--keys", "run.keys"), Alias("--prices", "run.prices"),
    Alias("--fragments", "schedule.fragments"), Alias("--sync-every", "schedule.sync_every"),
    Alias("--strategy", "schedule.strategy"),
    Alias("--quorum", "policy.quorum"), Alias("--grace-gamma", "policy.gamma"),
    Alias("--compression", "codec.scheme"), Alias("--codec-format", "codec.format"),
    Alias("--outer-lr", "outer.lr"), Alias("--outer-momentum", "outer.momentum"),
    Alias("--keep-progress", "learner.keep_progress", True), Alias("--norm-guard", "guard.factor"),
    Alias("--steps", "job.steps"), Alias("--batch-size", "job.batch_size"), Alias("--lr", "job.lr"),
    Alias("--lr-schedule", "job.lr_schedule"), Alias("--warmup-steps", "job.warmup_steps"),
    Alias("--max-bytes", "job.max_bytes"), Alias("--data", "job.data"),
    Alias("--layers", "model.n_layer"), Alias("--width", "model.n_embd"),
    Alias("--slow", "roles.slow"), Alias("--pace", "roles.pace"), Alias("--poll", "roles.poll"),
    Alias("--spill-poll", "roles.spill_poll"), Alias("--sync-process", "roles.sync_process", True),
    Alias("--metrics-port", "roles.metrics_port"), Alias("--eval-every", "roles.eval_every"),
)

CHOICES = {"run.mode": MODES, "job.lr_schedule": LR_SCHEDULES, **SECTION_CHOICES}

HELP = {
    "run.learners": "learner processes (M)",
    "run.mode": "decoupled: M learner processes + syncer; dp: lock-step data parallelism; diloco: lock-step "
                "DiLoCo with the same H (everyone waits for each full sync), both in one process",
    "run.tokens": "token budget per learner (overrides job.steps)",
    "run.store": "the run's location: a directory or s3://bucket/prefix (none: OUT/store)",
    "run.s3_endpoint": "S3 endpoint URL (none: AWS_ENDPOINT_URL)",
    "run.syncers": "syncer shards: shard i owns the fragments p with p %% N == i (docs/scale.md)",
    "run.region_specs": "regions on real stores, home first: NAME=URI[,endpoint=URL][,profile=NAME] joined by ';' "
                        "(the --region flag, once per region; docs/regions.md)",
    "run.regions": "regions: r0 is home (the store), r1.. are directories OUT/regions/rK; learner m runs in "
                   "region m mod N (docs/regions.md; --wan: S3 servers and emulated links)",
    "run.bus": "ZeroMQ for deltas and versions (false: through storage only)",
    "run.insecure": "no CURVE and no signatures (default: ephemeral keys in OUT/keys)",
    "run.keys": "key directory (none: OUT/keys); missing keys are created",
    "run.prices": "price overrides for the cost estimate of a run on S3: a JSON file or inline JSON "
                  "(docs/regions.md \"The price table\")",
    "job.steps": "inner steps per learner",
    "job.lr": "inner AdamW learning rate",
    "job.lr_schedule": "inner lr schedule (cosine: warmup_steps linear warmup, decay to min_lr_ratio x lr)",
    "job.max_bytes": "corpus size in bytes (split into one shard per learner)",
    "job.data": "text file or directory (none: the Python standard library's sources)",
    "model.n_layer": "transformer layers",
    "model.n_embd": "embedding width",
    "roles.slow": "stretch every learner step by this factor (>= 1)",
    "roles.pace": "instead: pad every learner step to this many seconds",
    "roles.poll": "learners' storage polls for versions, seconds (none: 0.5)",
    "roles.spill_poll": "the syncer's inbox listings, seconds (none: 0.5)",
    "roles.sync_process": "each learner's sender and receiver in a child process, off its training loop's GIL",
    "roles.metrics_port": "Prometheus metrics: the syncer at N, learner m at N+1+m (0: free ports, logged)",
    "roles.eval_every": "seconds between global-model evaluations",
    **SECTION_HELP,
}
