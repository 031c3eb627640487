"""The three systems of SPEC §9 on one failure trace (docs/simulator.md, "State machines").

- ``dp``: non-elastic data parallel, one ``RestartJob`` over every slice. Each interruption costs a
  per-event downtime: detection + restart (+ waiting for a spare only if the pool ran dry) + the
  progress lost since the last checkpoint.
- ``elastic_dp``: one ``ElasticJob`` over every slice: a reconfiguration to shrink after each
  interruption, training at reduced size while the slice is away, a reconfiguration to grow back.
- ``decoupled``: Decoupled DiLoCo (arXiv 2604.21428 §3): M learners, each an ``ElasticJob`` over its
  own contiguous N/M of the slices, so an interruption touches only its learner; they share the
  spare pool. Global training progresses while at least K learners train. Goodput counts the
  chip-time of training learners, and only while the quorum holds (work done below quorum is
  conservatively counted as lost; with K = 1 that never happens, since a training learner is
  itself a quorum).

Goodput = useful chip-time / allocated chip-time (N · T); uptime = fraction of wall time in which
global training makes progress (for dp: time whose progress was kept, i.e. not redone after a
restart). Both include the lock-step speed efficiency of each job's size (``speed.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import intervals as iv
from .config import ModelConfig
from .engine import EngineResult, JobRecord, run_jobs
from .events import FailureTrace
from .speed import lockstep_efficiency

SYSTEMS = ("dp", "elastic_dp", "decoupled")


@dataclass(frozen=True)
class Outcome:
    goodput: float            # fraction of allocated chip-time that was useful
    uptime: float             # fraction of wall time with global progress
    pool_waits: float = 0.0   # fraction of replacements that waited for a repaired slice


def _waits(res: EngineResult) -> float:
    return res.waited / res.replacements if res.replacements else 0.0


def dp(trace: FailureTrace, model: ModelConfig) -> Outcome:
    """Non-elastic data parallel on the whole cluster."""
    res = run_jobs(trace, [(0, trace.slices)], elastic=False, pool_size=model.pool_slices(trace.slices),
                   checkpoint_s=model.checkpoint_s)
    kept = res.jobs[0].progress_s / trace.duration
    return Outcome(kept * lockstep_efficiency(trace.chips, model.speed_cv), kept, _waits(res))


def elastic_dp(trace: FailureTrace, model: ModelConfig) -> Outcome:
    """Elastic data parallel on the whole cluster (slice-granular shrink and grow)."""
    return decoupled(trace, model, 1, 1).outcome


@dataclass(frozen=True)
class DecoupledRun:
    outcome: Outcome
    learners: tuple[JobRecord, ...]   # each learner's segments and stalls (for the event log)


def learner_bounds(slices: int, learners: int) -> list[tuple[int, int]]:
    """Contiguous slice ranges [lo, hi) of each learner; sizes differ by at most one slice."""
    if not 1 <= learners <= slices:
        raise ValueError(f"{learners} learners need at least as many slices, got {slices}")
    edges = np.linspace(0, slices, learners + 1).round().astype(int)
    return [(int(edges[m]), int(edges[m + 1])) for m in range(learners)]


def _segments(rec: JobRecord) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    seg = np.asarray(rec.segments, dtype=np.float64).reshape(-1, 3)
    return seg[:, 0], seg[:, 1], seg[:, 2]


def decoupled(trace: FailureTrace, model: ModelConfig, learners: int, quorum: int = 1) -> DecoupledRun:
    """Decoupled DiLoCo: ``learners`` elastic jobs; progress while >= ``quorum`` of them train."""
    if not 1 <= quorum <= learners:
        raise ValueError(f"quorum K must be in [1, M={learners}], got {quorum}")
    horizon = trace.duration
    bounds = learner_bounds(trace.slices, learners)
    res = run_jobs(trace, bounds, elastic=True, pool_size=model.pool_slices(trace.slices))
    segs = [_segments(rec) for rec in res.jobs]
    starts = np.concatenate([s for s, _, _ in segs])
    ends = np.concatenate([e for _, e, _ in segs])
    training = iv.step(np.r_[starts, ends], np.r_[np.ones(starts.size), -np.ones(ends.size)], 0.0, horizon)
    quorate = iv.where(training, training[1] >= quorum, horizon)
    useful = 0.0
    for (lo, hi), (s, e, n) in zip(bounds, segs):
        in_service = iv.step(np.r_[s, e], np.r_[n, -n], 0.0, horizon)
        eff = lockstep_efficiency(max(1, round(trace.chips_per_slice * (hi - lo))), model.speed_cv)
        useful += eff * iv.integral(in_service, quorate, horizon) * trace.chips_per_slice
    outcome = Outcome(useful / (trace.chips * horizon), iv.length(quorate) / horizon, _waits(res))
    return DecoupledRun(outcome, res.jobs)
