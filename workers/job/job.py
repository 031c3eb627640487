"""The default job: the GPT of workers/job/model.py on a real offline corpus (workers/job/data.py).

``learner_process`` is what one ``ddiloco learner`` process runs: everything it needs comes from
the run descriptor (model config in ``model``, job settings in ``job``), so a learner
needs only the run's location and its id to join. ``dp_baseline`` is the lock-step data-parallel
comparison (same model, same data order, same token budget), run in one process.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from pipeline.descriptor import RunDescriptor
from storage.store import ObjectStore
from workers.bus.bus import BusConfig
from workers.job.data import Corpus, DataConfig, evaluate
from workers.common.events import EventLog
from workers.learner.learner import Learner, LearnerConfig
from workers.job.model import GPT, GPTConfig, build_model

if TYPE_CHECKING:
    from workers.learner.group import DataParallelGroup


LR_SCHEDULES = ("constant", "cosine")


@dataclass(frozen=True)
class JobSettings:
    """Inner training settings shared by every learner of the default job."""

    steps: int = 300                  # inner steps per learner
    # 16: on 2 cores a version then lands <= 2 of the demo's steps after its answer (docs/results.md
    # "Rounds, defaults and quality")
    batch_size: int = 16
    # docs/results.md "Rounds, defaults and quality": 2e-3 beat 3e-3 and 1e-3-1.5e-3 for decoupled at
    # 300 and 1,200 steps
    lr: float = 2e-3
    weight_decay: float = 0.1
    data: str | None = None
    max_bytes: int = 2_000_000
    shards: int = 4                   # data shards = base learners
    # "constant", or "cosine" (linear warmup, cosine decay to min_lr_ratio). Constant by default: at
    # the demo's 300-1,200 steps the model is still far from converged and cosine trained worse in
    # every mode (docs/results.md "Rounds, defaults and quality").
    lr_schedule: str = "constant"
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.shards < 1:
            raise ValueError(f"steps {self.steps}, batch_size {self.batch_size} and shards {self.shards} must be >= 1")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}")
        if self.warmup_steps < 0 or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"need warmup_steps >= 0 and 0 <= min_lr_ratio <= 1, got {self.warmup_steps}, "
                             f"{self.min_lr_ratio}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "JobSettings":
        # Runs created before the schedule existed trained at a constant lr: keep that for them.
        return cls(**{"lr_schedule": "constant", **d})

    def lr_at(self, step: int) -> float:
        """Inner lr for 0-based inner step ``step`` of a learner's ``steps`` (each learner runs its own
        schedule on its own step count, as each replica of the paper's learners does)."""
        if self.lr_schedule == "constant":
            return self.lr
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = max(1, self.steps - self.warmup_steps)
        frac = min(1.0, (step - self.warmup_steps) / span)
        return self.lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * frac)))

    def data_config(self, block_size: int) -> DataConfig:
        return DataConfig(path=self.data, max_bytes=self.max_bytes, batch_size=self.batch_size, block_size=block_size)


def job_from(descriptor: RunDescriptor) -> tuple[GPTConfig, JobSettings]:
    """The model config and job settings of a run the default job created (its ``model`` and ``job``)."""
    if descriptor.job is None or not descriptor.model:
        raise ValueError(f"run {descriptor.run_id} was not created by the default job (no model/job settings); "
                         "drive it with the Learner API instead")
    return GPTConfig.from_dict(descriptor.model), JobSettings.from_dict(descriptor.job)


def make_optimizer(model: torch.nn.Module, job: JobSettings) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=job.lr_at(0), weight_decay=job.weight_decay, betas=(0.9, 0.95))


def set_lr(opt: torch.optim.Optimizer, job: JobSettings, step: int) -> None:
    """Set the inner lr for 0-based inner step ``step`` (call before the step)."""
    lr = job.lr_at(step)
    for group in opt.param_groups:
        group["lr"] = lr


@dataclass(frozen=True)
class Pace:
    """Pad every inner step to last ``step_s * slow * max(0.5, 1 + jitter * z)`` seconds, z a
    standard normal drawn from (``seed``, the shard). Padding rather than stretching makes a
    learner's speed a controlled quantity even on a busy machine (the chaos experiments'
    heterogeneous speeds: ddiloco learner --pace --jitter)."""

    step_s: float
    slow: float = 1.0
    jitter: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.step_s > 0 or self.slow < 1.0 or not 0.0 <= self.jitter < 0.5:
            raise ValueError(f"need pace > 0, slow >= 1 and 0 <= jitter < 0.5 (got {self.step_s}, {self.slow}, "
                             f"{self.jitter})")


def _step_padding(learner: Learner, shard: int, slow: float, pace: Pace | None) -> Callable[[float], None]:
    """What to do after a step that took ``took`` seconds: nothing, stretch it ``slow`` x (a
    straggler), or pad it to the ``pace``."""
    if pace is not None:
        rng = np.random.default_rng([pace.seed, shard])

        def pad(took: float) -> None:
            factor = pace.slow * max(0.5, 1.0 + pace.jitter * float(rng.standard_normal()))
            time.sleep(max(0.0, pace.step_s * factor - took))
        return pad
    if slow > 1.0:
        def stretch(took: float) -> None:
            # Stretch by the typical step, not this one: a step that spanned a stall (SIGSTOP) must
            # not have the stall added again.
            typical = learner._step_time() or took
            time.sleep(min(took, typical) * (slow - 1.0))
        return stretch
    return lambda took: None


def learner_process(store: ObjectStore, learner_id: str, shard: int, bus: BusConfig | None, events: EventLog,
                    steps: int | None = None, slow: float = 1.0, config: LearnerConfig = LearnerConfig(),
                    stop: Callable[[], bool] = lambda: False, pace: Pace | None = None,
                    data_seed: int | None = None, join_when: Callable[[], bool] | None = None,
                    poll_s: float = 0.05, group: "DataParallelGroup | None" = None,
                    descriptor: RunDescriptor | None = None) -> dict:
    """Train one learner of the default job for ``steps`` (default: the job's) and return its stats.

    ``slow`` stretches every step by that factor; ``pace`` instead pads each step to a set time;
    ``data_seed`` gives the learner its own batch order (default: the run's seed); ``join_when``:
    everything is loaded, then the learner waits (polling every ``poll_s``) until it holds before
    joining the run (a spare machine, booted in advance). ``group``: this process is one rank of a
    torchrun learner (workers/learner/group.py); rank r trains on part r of the learner's shard,
    on the group's device, and only rank 0 uses ``store`` and ``bus``."""
    from storage.layout import read_descriptor
    torch.set_num_threads(1)
    if group is not None and (slow != 1.0 or pace is not None or join_when is not None):
        raise ValueError("a torchrun learner takes no slow/pace/join_when (they pace one process, not a group)")
    if group is not None:
        desc = group.share_descriptor(store)
    else:      # the caller's, when it read it already (one read per process)
        desc = descriptor if descriptor is not None else read_descriptor(store)
    gcfg, job = job_from(desc)
    corpus = Corpus(job.data_config(gcfg.block_size))
    model = GPT(gcfg)                    # weights are overwritten from storage by start(): never used as drawn
    seed = desc.seed if data_seed is None else data_seed
    if group is None:
        learner = Learner(model, make_optimizer(model, job), store, learner_id, config, bus=bus, events=events,
                          descriptor=desc)
        batches = None            # made once start() knows where a resumed life stands in its batch order
    else:
        from workers.learner.group import GroupLearner
        model.to(group.device)
        learner = GroupLearner(model, make_optimizer(model, job), store, learner_id, config, bus=bus, events=events,
                               group=group)
        parts = job.shards * group.world_size
        batches = corpus.batches((shard % job.shards) * group.world_size + group.rank, parts, seed)
    while join_when is not None and not join_when():
        if stop():
            return {"steps": 0, "tokens": 0, "drained": True, "joined": False}
        time.sleep(poll_s)
    learner.start()
    first = learner.step_count            # > 0 only for a life that resumed its record (config.state_every_s)
    if batches is None:
        batches = corpus.batches(shard % job.shards, job.shards, seed, skip=first)
    after_step = _step_padding(learner, shard, slow, pace)
    n = steps if steps is not None else job.steps
    opt = learner.optimizer
    left_early = False
    for i in range(first, n):
        leaving = stop()
        if leaving and group is None:
            left_early = True
            break
        x, y = next(batches)
        set_lr(opt, job, i)
        t0 = time.monotonic()
        if group is None:
            learner.step(lambda: model(x, y)[1], tokens=x.numel())
        elif learner.step(lambda: learner.ddp(x.to(group.device), y.to(group.device))[1], tokens=x.numel(),
                          stop=leaving) is None:
            left_early = True        # a rank is leaving: the whole group leaves at this boundary
            break
        after_step(time.monotonic() - t0)
    # A learner that leaves before its budget (SIGTERM, a released scavenger) flushes its unsent
    # steps; one that finishes its budget does not, like the lock-step baselines, which drop each
    # fragment's steps after its last round too: at the end of a run the flushes are extra merges
    # that each re-apply the outer momentum, often with one learner in them, and measured worse
    # (docs/results.md "Rounds, defaults and quality": 1,200 steps, 3 seeds, 1.709 without vs 1.767 with, every seed lower).
    drained = learner.close(flush=left_early)
    return {"steps": learner.step_count, "tokens": learner.tokens, "drained": drained, **learner.stats()}


def dp_baseline(gcfg: GPTConfig, job: JobSettings, learners: int, seed: int, events: EventLog,
                eval_every: int = 50) -> dict:
    """Lock-step data parallelism: every step, each of ``learners`` replicas takes a batch from its
    shard (same generator as the decoupled learner), gradients are averaged, one AdamW step."""
    torch.set_num_threads(1)
    corpus = Corpus(job.data_config(gcfg.block_size))
    model = build_model(gcfg, seed)
    opt = make_optimizer(model, job)
    streams = [corpus.batches(m % job.shards, job.shards, seed) for m in range(learners)]
    init_eval = evaluate(model, corpus)
    events.emit("eval", tokens=0, loss=init_eval)
    tokens = 0
    t_start = time.monotonic()
    for step in range(job.steps):
        set_lr(opt, job, step)
        opt.zero_grad(set_to_none=True)
        losses = []
        for s in streams:
            x, y = next(s)
            loss = model(x, y)[1] / learners
            loss.backward()
            losses.append(float(loss.detach()) * learners)
            tokens += x.numel()
        opt.step()
        if (step + 1) % 10 == 0:
            events.emit("step", step=step + 1, loss=round(float(np.mean(losses)), 4), tokens=tokens)
        if (step + 1) % eval_every == 0:
            events.emit("eval", tokens=tokens, loss=evaluate(model, corpus))
    final = evaluate(model, corpus)
    events.emit("eval", tokens=tokens, loss=final)
    return {"mode": "dp", "tokens": tokens, "initial_eval_loss": init_eval, "final_eval_loss": final,
            "wall_s": time.monotonic() - t_start,
            # all-reduce of the full gradient every step, fp32, per replica (ring: ~2x the payload)
            "bytes_per_learner_per_step": 2 * 4 * sum(p.numel() for p in model.parameters())}
