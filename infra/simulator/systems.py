"""The three systems of SPEC §9 as state machines over one failure trace (docs/simulator.md).

- ``dp``: non-elastic data parallel. Any failure stops every chip; the job restarts (one
  reconfiguration) once the failed slice is back. Down on [t_fail, t_back + restart]; overlapping
  outages merge. While up, all N chips are useful.
- ``elastic_dp``: on a failure the job hangs until detection, then reconfigures without the slice
  (stall [t_fail, t_fail + detect + reconf]); when the slice returns it reconfigures again to grow
  (stall [t_back, t_back + reconf]). Between stalls it trains on the slices in service. A new event
  during a stall extends it (the reconfiguration restarts), which is what merging intervals does.
- ``decoupled``: M learners, each an ``elastic_dp`` job over its own N/M chips (a contiguous block
  of slices); a failure touches only its learner. Global training progresses while at least K
  learners are training. Goodput counts the chip-time of training learners, and only while the
  quorum holds (work done below quorum is conservatively counted as lost).

Goodput = useful chip-time / allocated chip-time (N · T); uptime = fraction of wall time in which
global training progresses. Both include the lock-step speed efficiency (``speed.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import intervals as iv
from .events import FailureTrace
from .speed import lockstep_efficiency

SYSTEMS = ("dp", "elastic_dp", "decoupled")


@dataclass(frozen=True)
class Outcome:
    goodput: float  # fraction of allocated chip-time that was useful
    uptime: float   # fraction of wall time with global progress


def dp(trace: FailureTrace, speed_cv: float = 0.0) -> Outcome:
    """Non-elastic data parallel on the whole cluster."""
    horizon = trace.duration
    down = iv.union(trace.t_fail, trace.t_back + trace.reconf_up, horizon)
    up = iv.length(iv.complement(down, horizon)) / horizon
    return Outcome(up * lockstep_efficiency(trace.chips, speed_cv), up)


def elastic_running(trace: FailureTrace) -> tuple[iv.Intervals, iv.Step]:
    """When an elastic DP job over ``trace``'s slices trains, and how many slices it has in service."""
    horizon = trace.duration
    tf, tb = trace.t_fail, trace.t_back
    back = tb < horizon
    in_service = iv.step(np.r_[tf, tb], np.r_[-np.ones(tf.size), np.ones(tb.size)], trace.slices, horizon)
    nothing_left = iv.where(in_service, in_service[1] <= 0, horizon)  # all slices out: cannot train
    stalled = iv.union(np.r_[tf, tb[back], nothing_left[0]],
                       np.r_[tf + trace.detect + trace.reconf_down, tb[back] + trace.reconf_up[back],
                             nothing_left[1]], horizon)
    return iv.complement(stalled, horizon), in_service


def elastic_dp(trace: FailureTrace, speed_cv: float = 0.0) -> Outcome:
    """Elastic data parallel on the whole cluster (slice-granular shrink and grow)."""
    horizon = trace.duration
    running, in_service = elastic_running(trace)
    useful = iv.integral(in_service, running, horizon) * trace.chips_per_slice
    eff = lockstep_efficiency(trace.chips, speed_cv)
    return Outcome(eff * useful / (trace.chips * horizon), iv.length(running) / horizon)


@dataclass(frozen=True)
class DecoupledRun:
    outcome: Outcome
    learner_running: tuple[iv.Intervals, ...]  # when each learner trains (for the event log)


def learner_bounds(slices: int, learners: int) -> list[tuple[int, int]]:
    """Contiguous slice ranges [lo, hi) of each learner; sizes differ by at most one slice."""
    if not 1 <= learners <= slices:
        raise ValueError(f"{learners} learners need at least as many slices, got {slices}")
    edges = np.linspace(0, slices, learners + 1).round().astype(int)
    return [(int(edges[m]), int(edges[m + 1])) for m in range(learners)]


def decoupled(trace: FailureTrace, learners: int, quorum: int = 1, speed_cv: float = 0.0) -> DecoupledRun:
    """Decoupled DiLoCo: ``learners`` elastic DP jobs; progress while >= ``quorum`` of them train."""
    if not 1 <= quorum <= learners:
        raise ValueError(f"quorum K must be in [1, M={learners}], got {quorum}")
    horizon = trace.duration
    jobs = []
    for lo, hi in learner_bounds(trace.slices, learners):
        sub = trace.subset(lo, hi)
        running, in_service = elastic_running(sub)
        jobs.append((sub, running, in_service))
    starts = np.concatenate([r[0] for _, r, _ in jobs])
    ends = np.concatenate([r[1] for _, r, _ in jobs])
    training = iv.step(np.r_[starts, ends], np.r_[np.ones(starts.size), -np.ones(ends.size)], 0.0, horizon)
    quorate = iv.where(training, training[1] >= quorum, horizon)
    useful = 0.0
    for sub, running, in_service in jobs:
        counted = running if quorum == 1 else iv.intersect(running, quorate, horizon)
        eff = lockstep_efficiency(max(sub.chips, 1), speed_cv)
        useful += eff * iv.integral(in_service, counted, horizon) * trace.chips_per_slice
    outcome = Outcome(useful / (trace.chips * horizon), iv.length(quorate) / horizon)
    return DecoupledRun(outcome, tuple(r for _, r, _ in jobs))
