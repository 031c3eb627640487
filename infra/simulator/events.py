"""Vectorised failure traces (SPEC §9): one per (cluster size, seed), shared by every system.

A chip that computes is interrupted as a Poisson process of mean MTBI; the interruption takes its
slice out. A trace holds the *potential* interruptions of every slice over the whole horizon, as
if every slice computed all the time: a Poisson process of rate N/MTBI with a uniformly drawn slice
per event (the superposition of one Poisson process of rate (N/S)/MTBI per slice). A system keeps
an event only if that slice is computing for it at that moment (``engine.py``): chips of a stopped
job, of a stalled learner or in the spare pool are not interrupted. By the memorylessness of the
Poisson process this thinning is exact, and every system runs on the *same* random numbers
(common random numbers: differences between systems are not sampling noise).

Every event also carries the draws its consequences may need (detection, restart, the two
reconfigurations, the spare's recovery delay, the repair), so no system consumes randomness of
its own. Generation is a handful of numpy draws; there are no per-event Python objects.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

from .config import ModelConfig, num_slices


@dataclass(frozen=True)
class FailureTrace:
    """Potential interruptions in [0, duration), sorted by time; arrays are parallel, one per event."""

    chips: int
    slices: int
    duration: float
    t: np.ndarray            # when
    slot: np.ndarray         # which slice (int64, 0 .. slices-1)
    detect: np.ndarray       # interruption -> noticed
    restart: np.ndarray      # non-elastic DP: noticed (and a spare at hand) -> training again
    reconf_down: np.ndarray  # elastic: the shrink after detection
    reconf_up: np.ndarray    # elastic: the grow when this event's replacement joins
    recovery: np.ndarray     # elastic: spare taken -> ready to join
    repair: np.ndarray       # noticed -> the broken slice is healthy again, back in the pool

    @property
    def chips_per_slice(self) -> float:
        return self.chips / self.slices

    def arrays(self) -> dict[str, np.ndarray]:
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), np.ndarray)}

    def subset(self, lo: int, hi: int) -> "FailureTrace":
        """The events of slices lo..hi-1, renumbered from 0 (one learner's share of the cluster)."""
        if not 0 <= lo < hi <= self.slices:
            raise ValueError(f"slice range [{lo}, {hi}) is not inside [0, {self.slices})")
        m = (self.slot >= lo) & (self.slot < hi)
        cols = {k: v[m] for k, v in self.arrays().items()}
        cols["slot"] = cols["slot"] - lo
        return FailureTrace(chips=round(self.chips * (hi - lo) / self.slices), slices=hi - lo,
                            duration=self.duration, **cols)


def generate_trace(model: ModelConfig, chips: int, rng: np.random.Generator) -> FailureTrace:
    """Draw the potential interruptions of a cluster of ``chips`` chips over ``model.duration_s``."""
    if model.restart.mean is None:
        raise ValueError("restart time not calibrated; use calibrate.calibrate(model) first")
    if not isinstance(chips, int) or chips < 1:
        raise ValueError(f"chips must be an int >= 1, got {chips!r}")
    slices = num_slices(chips, model.chips_per_slice)
    horizon = model.duration_s
    n = 0 if math.isinf(model.mtbi_s) else int(rng.poisson(chips * horizon / model.mtbi_s))
    t = np.sort(rng.uniform(0.0, horizon, n))
    slot = rng.integers(0, slices, n, dtype=np.int64)
    return FailureTrace(chips, slices, horizon, t, slot,
                        detect=model.detection.sample(rng, n), restart=model.restart.sample(rng, n),
                        reconf_down=model.reconfiguration.sample(rng, n),
                        reconf_up=model.reconfiguration.sample(rng, n),
                        recovery=model.recovery.sample(rng, n), repair=model.repair.sample(rng, n))
