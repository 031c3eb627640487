"""What one simulated run is (docs/faultsim.md): the world - learners, their speeds, K, H,
P, how long they train - and its fault schedule, both a pure function of the seed.

:func:`draw` gives ``(SimConfig, faults)`` for a seed: K is 1 (65%), 2 or 3 (3 learners), each learner's
pace is 0.8-1.25 x ``step_s``, three worlds in four have the bus (the rest spill every delta), three in
ten train with ``inner_lr`` 1e-3 instead of 1e-2 (still drifting), one in four waits 8 s for an ack
(longer than a fragment's rounds are apart), and 1-4 faults fall inside ``fault_span``: after a calm start (the
undisturbed level the recovery check compares with) and early enough that the 8H steps after the
last fault ends are still trained (invariant (c) measures 4H..8H steps after a fault).
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np

from .faults import Fault, draw_schedule

LEARNERS = ("l0", "l1", "l2")


def stable_seed(*parts: object) -> int:
    """A 31-bit seed from ``parts`` that is the same in every process (``hash`` of a str is not)."""
    return zlib.crc32("/".join(map(str, parts)).encode()) & 0x7FFFFFFF


@dataclass(frozen=True)
class SimConfig:
    """One simulated run's world. Times are simulated seconds; ``speeds`` multiply ``step_s``
    (larger is slower); ``jitter`` is each step's relative spread."""

    seed: int = 0
    learners: tuple[str, ...] = LEARNERS
    speeds: tuple[float, ...] = (1.0, 1.0, 1.0)
    quorum: int = 1
    fragments: int = 3
    sync_every: int = 6
    overlap: int = 2
    step_s: float = 1.0
    jitter: float = 0.05
    train_s: float = 200.0
    fault_span: tuple[float, float] = (40.0, 140.0)
    drain_s: float = 120.0           # after training: how long the syncer may take to commit what is left
    inner_lr: float = 1e-2           # the learners' AdamW lr (1e-3: the job still drifts when training ends)
    ack_timeout_s: float = 2.0       # a learner spills an answer not acked by then (SenderConfig)
    # The run's decision rules, as a descriptor records them (None: what new runs write). An older
    # rule reproduces what runs written before issue 25 do (their logs keep replaying by it):
    # marks 1 = one high-water mark per learner, guard_version 2 = norm guard on whole-delta norms.
    marks: int | None = None
    guard_version: int | None = None
    # Whether the processes have the ZeroMQ bus (infra/faultsim/simbus.py): learners answer over it
    # and spill when it fails; without it (a region with bucket-only learners) every delta spills.
    bus: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {self.seed!r}")
        if not self.learners or len(set(self.learners)) != len(self.learners):
            raise ValueError(f"learners must be distinct names, got {self.learners!r}")
        if len(self.speeds) != len(self.learners) or not all(
                isinstance(s, (int, float)) and math.isfinite(s) and s > 0 for s in self.speeds):
            raise ValueError(f"speeds must be one positive number per learner, got {self.speeds!r}")
        for name in ("quorum", "fragments", "sync_every", "overlap"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.quorum > len(self.learners):
            raise ValueError(f"quorum K={self.quorum} exceeds the {len(self.learners)} learners")
        if self.sync_every < self.fragments:
            raise ValueError(f"sync_every H={self.sync_every} must be >= fragments P={self.fragments}")
        for name in ("step_s", "train_s", "drain_s", "inner_lr", "ack_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not 0 <= self.jitter < 0.5:
            raise ValueError(f"jitter must lie in [0, 0.5), got {self.jitter!r}")
        if self.marks not in (None, 1, 2) or self.guard_version not in (None, 1, 2, 3):
            raise ValueError(f"marks must be None, 1 or 2 and guard_version None or 1..3, got "
                             f"{self.marks!r} and {self.guard_version!r}")
        if not isinstance(self.bus, bool):
            raise ValueError(f"bus must be True or False, got {self.bus!r}")
        lo, hi = self.fault_span
        if not 0 <= lo < hi <= self.train_s:
            raise ValueError(f"fault_span {self.fault_span} must lie inside 0..train_s ({self.train_s})")


def draw_world(seed: int, **overrides) -> SimConfig:
    """The world of ``seed`` (module docstring); ``overrides`` replace drawn fields (e.g. quorum)."""
    rng = np.random.default_rng(stable_seed("world", seed))
    drawn = dict(seed=seed, quorum=1 if rng.random() < 0.65 else 2,
                 speeds=tuple(round(float(s), 3) for s in rng.uniform(0.8, 1.25, len(LEARNERS))))
    drawn["bus"] = bool(rng.random() < 0.75)      # drawn after the fields above: they keep their draws
    if drawn["quorum"] == 2 and rng.random() < 0.4:
        drawn["quorum"] = 3                         # K = M: any learner down stops the merges (by design)
    # Three worlds in ten train with a 10x smaller lr: the job is still far from converged when
    # training ends, so a delta grows about linearly with its steps, as a real model's does early
    # in a run (at 1e-2 it has converged by the first fault and long deltas are mostly noise, which
    # hid the whole-norm guard's drops of an outage's work from the campaign: issue 25 item 2).
    drawn["inner_lr"] = 1e-3 if rng.random() < 0.3 else 1e-2
    # One world in four waits longer for an ack than a fragment's rounds are apart (8 s against
    # H x step_s = 6 s: a slow link's setting), so each answer of a lineage supersedes the sent,
    # unacked one before its wait ends - the case where a restarted wait kept a blackholed learner
    # from spilling until the syncer was given up for dead (chaos bus-blackhole).
    drawn["ack_timeout_s"] = 8.0 if rng.random() < 0.25 else 2.0
    drawn.update(overrides)
    return SimConfig(**drawn)


def draw(seed: int, **overrides) -> tuple[SimConfig, tuple[Fault, ...]]:
    """The world and the fault schedule of ``seed``."""
    cfg = draw_world(seed, **overrides)
    rng = np.random.default_rng(stable_seed("faults", seed))
    return cfg, draw_schedule(rng, cfg.learners, cfg.fault_span, cfg.quorum, bus=cfg.bus)
