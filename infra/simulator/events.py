"""Vectorised failure generation (SPEC §9): one failure trace per (cluster size, seed).

Each chip fails as a Poisson process of mean time between interruptions MTBI; a failed chip takes its
slice out, so a slice of c chips fails at rate c/MTBI while in service. After a failure the slice is
out for detection + repair, then back in service (an alternating renewal process per slice; a slice
under repair cannot fail again). Per failure we also draw the reconfiguration times a job may pay,
so that every system is simulated on the *same* trace (common random numbers: differences between
systems are not sampling noise).

Generation is a few (slices x k) numpy draws and a cumulative sum per slice; no per-chip or
per-event Python objects.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .config import ModelConfig, num_slices


@dataclass(frozen=True)
class FailureTrace:
    """All slice failures in [0, duration), sorted by time. Arrays are parallel, one entry per failure."""

    chips: int
    slices: int
    duration: float
    slice: np.ndarray        # int: which slice failed
    t_fail: np.ndarray       # when
    detect: np.ndarray       # failure -> detected
    repair: np.ndarray       # detected -> slice back in service
    reconf_down: np.ndarray  # reconfiguration to shrink around the failed slice
    reconf_up: np.ndarray    # reconfiguration to grow back (or to restart, for non-elastic DP)

    @property
    def t_back(self) -> np.ndarray:
        """When the failed slice is back in service."""
        return self.t_fail + self.detect + self.repair

    @property
    def chips_per_slice(self) -> float:
        return self.chips / self.slices

    def subset(self, lo: int, hi: int) -> "FailureTrace":
        """The failures of slices lo..hi-1, renumbered from 0 (one learner's share of the cluster)."""
        m = (self.slice >= lo) & (self.slice < hi)
        chips = round(self.chips * (hi - lo) / self.slices)
        return FailureTrace(chips, hi - lo, self.duration, self.slice[m] - lo, self.t_fail[m],
                            self.detect[m], self.repair[m], self.reconf_down[m], self.reconf_up[m])


def generate_trace(model: ModelConfig, chips: int, rng: np.random.Generator) -> FailureTrace:
    """Draw the failures of a cluster of ``chips`` chips over ``model.duration_s`` seconds."""
    if model.repair.mean is None:
        raise ValueError("repair time not calibrated; use calibrate.calibrate(model) first")
    if not isinstance(chips, int) or chips < 1:
        raise ValueError(f"chips must be an int >= 1, got {chips!r}")
    slices = num_slices(chips, model.chips_per_slice)
    horizon = model.duration_s
    empty_f, empty_i = np.empty(0), np.empty(0, dtype=np.int64)
    if math.isinf(model.mtbi_s):
        return FailureTrace(chips, slices, horizon, empty_i, empty_f, empty_f, empty_f, empty_f, empty_f)
    mtbf_slice = model.mtbi_s * slices / chips
    expected = horizon / mtbf_slice
    k = int(math.ceil(expected + 6 * math.sqrt(expected) + 4))  # columns per block; rarely a 2nd block

    parts: list[tuple[np.ndarray, ...]] = []
    rows = np.arange(slices)
    offset = np.zeros(slices)  # where each live row's next cycle starts
    while rows.size:
        shape = (rows.size, k)
        up = rng.exponential(mtbf_slice, shape)
        det = model.detection.sample(rng, shape)
        rep = model.repair.sample(rng, shape)
        down = model.reconfiguration.sample(rng, shape)
        grow = model.reconfiguration.sample(rng, shape)
        ends = offset[:, None] + np.cumsum(up + det + rep, axis=1)   # end of each cycle
        t_fail = ends - det - rep
        keep = t_fail < horizon
        r, _ = np.nonzero(keep)
        parts.append((rows[r], t_fail[keep], det[keep], rep[keep], down[keep], grow[keep]))
        more = ends[:, -1] < horizon
        rows, offset = rows[more], ends[more, -1]

    sl, tf, det, rep, down, grow = (np.concatenate(col) for col in zip(*parts))
    order = np.argsort(tf, kind="stable")
    return FailureTrace(chips, slices, horizon, sl[order].astype(np.int64), tf[order], det[order],
                        rep[order], down[order], grow[order])
