"""Configuration of the goodput simulator (SPEC §9): the failure model and the sweep.

Every default is stated with its reason in docs/simulator.md. Exactly one quantity is *fitted*:
the mean restart time of non-elastic data parallel, which ``calibrate.py`` solves from the SPEC's
single calibration point (150k chips, MTBI 1 year, 72% goodput). Everything else is a stated
assumption and is never adjusted to match expected results.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .dists import DIST_KINDS, Dist, parse_dist

__all__ = ["YEAR_S", "DAY_S", "DIST_KINDS", "Dist", "parse_dist", "CALIBRATION_CHIPS", "CALIBRATION_MTBI_S",
           "CALIBRATION_GOODPUT", "DEFAULT_CHIPS", "DEFAULT_LEARNERS", "ModelConfig", "SweepConfig",
           "num_slices"]

YEAR_S = 365.0 * 86400.0
DAY_S = 86400.0

# SPEC §9 calibration point: non-elastic data parallel, 150k chips, MTBI 1 year -> 72% goodput.
CALIBRATION_CHIPS = 150_000
CALIBRATION_MTBI_S = YEAR_S
CALIBRATION_GOODPUT = 0.72

DEFAULT_CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
DEFAULT_LEARNERS = (2, 4, 8, 16)


@dataclass(frozen=True)
class ModelConfig:
    """The physics of one simulated cluster (everything except its size and learner count).

    A chip that computes is interrupted as a Poisson process of mean ``mtbi_s``; the interruption
    takes its slice of ``chips_per_slice`` chips out. What that costs depends on the system
    (``engine.py``): non-elastic data parallel stops for ``detection`` + ``restart`` and loses the
    progress since its last checkpoint (one every ``checkpoint_s`` seconds of progress); an
    elastic job (and each Decoupled DiLoCo learner) stalls for ``detection`` + one
    ``reconfiguration`` to shrink, trains without the slice, and stalls for another
    ``reconfiguration`` when a replacement joins, ``recovery`` after it was taken from the spare
    pool. The broken slice is back in the pool ``detection`` + ``repair`` after its failure; the
    pool holds ``spares`` slices (default ``ceil(spare_fraction x slices)``).
    """

    mtbi_s: float = YEAR_S                        # per computing chip; math.inf = no failures
    chips_per_slice: int = 64                     # a failed chip takes its slice out
    detection: Dist = Dist("fixed", 10.0)         # failure -> noticed (collective / heartbeat timeout)
    restart: Dist = Dist("lognormal", None, 0.5)  # non-elastic DP: noticed -> training again; calibrated
    checkpoint_s: float = 10.0                    # non-elastic DP: progress between checkpoints
    reconfiguration: Dist = Dist("fixed", 30.0)   # elastic: one shrink or grow of a job or learner
    recovery: Dist = Dist("exp", 60.0)            # spare taken -> ready to join an elastic job
    repair: Dist = Dist("exp", 3600.0)            # noticed -> broken slice healthy again in the pool
    spare_fraction: float = 0.02                  # spare pool, as a fraction of the cluster's slices
    spares: int | None = None                     # spare pool in slices (overrides spare_fraction)
    speed_cv: float = 0.0                         # per-step, per-chip step-time coefficient of variation
    duration_s: float = 7 * DAY_S                 # simulated wall time per seed

    def __post_init__(self) -> None:
        if not (self.mtbi_s > 0) or math.isnan(self.mtbi_s):
            raise ValueError(f"mtbi_s must be > 0 seconds (inf = no failures), got {self.mtbi_s!r}")
        if not isinstance(self.chips_per_slice, int) or self.chips_per_slice < 1:
            raise ValueError(f"chips_per_slice must be an int >= 1, got {self.chips_per_slice!r}")
        for name in ("detection", "reconfiguration", "recovery", "repair"):
            if getattr(self, name).mean is None:
                raise ValueError(f"{name} needs a mean (only the restart time is calibrated)")
        if not (math.isfinite(self.checkpoint_s) and self.checkpoint_s >= 0):
            raise ValueError(f"checkpoint_s must be a finite number >= 0 seconds (0: nothing is lost), "
                             f"got {self.checkpoint_s!r}")
        if not (math.isfinite(self.spare_fraction) and 0 <= self.spare_fraction <= 1):
            raise ValueError(f"spare_fraction must be in [0, 1], got {self.spare_fraction!r}")
        if self.spares is not None and (not isinstance(self.spares, int) or self.spares < 0):
            raise ValueError(f"spares must be an int >= 0 (or None for spare_fraction), got {self.spares!r}")
        if not (math.isfinite(self.speed_cv) and 0 <= self.speed_cv <= 1):
            raise ValueError(f"speed_cv must be in [0, 1], got {self.speed_cv!r}")
        if not (math.isfinite(self.duration_s) and self.duration_s > 0):
            raise ValueError(f"duration_s must be a finite number > 0, got {self.duration_s!r}")

    @property
    def calibrated(self) -> bool:
        return self.restart.mean is not None

    def pool_slices(self, slices: int) -> int:
        """Spare slices of a cluster of ``slices`` slices."""
        if self.spares is not None:
            return self.spares
        return math.ceil(self.spare_fraction * slices - 1e-9)


@dataclass(frozen=True)
class SweepConfig:
    """Which points to simulate and how many seeds to spend on each."""

    model: ModelConfig = field(default_factory=ModelConfig)
    chips: tuple[int, ...] = DEFAULT_CHIPS
    learners: tuple[int, ...] = DEFAULT_LEARNERS
    quorum: int = 1                    # K: global progress needs >= K running learners
    seed: int = 0
    min_seeds: int = 3
    max_seeds: int = 30
    target_ci: float = 0.01            # stop when every 95% CI half-width is within this (fraction)

    def __post_init__(self) -> None:
        if not self.chips or any(not isinstance(n, int) or n < 1 for n in self.chips):
            raise ValueError(f"chips must be a non-empty list of ints >= 1, got {self.chips!r}")
        if not self.learners or any(not isinstance(m, int) or m < 1 for m in self.learners):
            raise ValueError(f"learners must be a non-empty list of ints >= 1, got {self.learners!r}")
        if not isinstance(self.quorum, int) or self.quorum < 1:
            raise ValueError(f"quorum (K) must be an int >= 1, got {self.quorum!r}")
        if self.quorum > min(self.learners):
            raise ValueError(f"quorum K={self.quorum} exceeds the smallest learner count "
                             f"M={min(self.learners)}: global training could never progress")
        for n in self.chips:
            slices = num_slices(n, self.model.chips_per_slice)
            if slices < max(self.learners):
                raise ValueError(f"{n} chips make {slices} slices of {self.model.chips_per_slice}, "
                                 f"fewer than M={max(self.learners)} learners")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {self.seed!r}")
        if not (1 <= self.min_seeds <= self.max_seeds):
            raise ValueError(f"need 1 <= min_seeds <= max_seeds, got {self.min_seeds} and {self.max_seeds}")
        if not (0 < self.target_ci < 1):
            raise ValueError(f"target_ci must be in (0, 1), got {self.target_ci!r}")


def num_slices(chips: int, chips_per_slice: int) -> int:
    """Slices in a cluster: the nearest whole number, at least one (the last may hold a few more chips)."""
    return max(1, round(chips / chips_per_slice))
