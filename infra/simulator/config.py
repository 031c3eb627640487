"""Configuration of the goodput simulator (SPEC §9): distributions, the failure model, the sweep.

Every default is stated with its reason in docs/simulator.md. The one unknown that is *fitted* is the
mean repair time, which ``calibrate.py`` solves from the SPEC's single calibration point; everything
else is a stated assumption and is never adjusted to match expected results.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

YEAR_S = 365.0 * 86400.0
DAY_S = 86400.0
DIST_KINDS = ("fixed", "exp", "lognormal")

# SPEC §9 calibration point: non-elastic data parallel, 150k chips, MTBI 1 year -> 72% goodput.
CALIBRATION_CHIPS = 150_000
CALIBRATION_MTBI_S = YEAR_S
CALIBRATION_GOODPUT = 0.72

DEFAULT_CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
DEFAULT_LEARNERS = (2, 4, 8, 16)


@dataclass(frozen=True)
class Dist:
    """A non-negative duration distribution in seconds.

    ``fixed``: always ``mean``; ``exp``: exponential with ``mean``; ``lognormal``: mean ``mean`` and
    coefficient of variation ``cv``. ``mean=None`` means "to be calibrated" (repair time only).
    """

    kind: str
    mean: float | None
    cv: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in DIST_KINDS:
            raise ValueError(f"distribution kind {self.kind!r} is not one of {DIST_KINDS}")
        if self.mean is not None and not (math.isfinite(self.mean) and self.mean >= 0):
            raise ValueError(f"distribution mean must be a finite number >= 0 seconds, got {self.mean!r}")
        if not (math.isfinite(self.cv) and self.cv >= 0):
            raise ValueError(f"distribution cv must be a finite number >= 0, got {self.cv!r}")
        if self.kind == "lognormal" and self.cv == 0:
            raise ValueError("a lognormal distribution needs cv > 0 (use 'fixed' for a constant)")

    def with_mean(self, mean: float) -> "Dist":
        return replace(self, mean=float(mean))

    def sample(self, rng: np.random.Generator, size: tuple[int, ...] | int) -> np.ndarray:
        if self.mean is None:
            raise ValueError(f"{self.kind} distribution has no mean yet (not calibrated)")
        if self.kind == "fixed" or self.mean == 0:
            return np.full(size, self.mean, dtype=np.float64)
        if self.kind == "exp":
            return rng.exponential(self.mean, size)
        sigma2 = math.log1p(self.cv ** 2)  # lognormal with the requested mean and cv
        return rng.lognormal(math.log(self.mean) - sigma2 / 2, math.sqrt(sigma2), size)

    def __str__(self) -> str:
        mean = "calibrated" if self.mean is None else f"{self.mean:g}"
        return f"{self.kind}:{mean}" + (f":{self.cv:g}" if self.kind == "lognormal" else "")


def parse_dist(text: str) -> Dist:
    """Parse ``kind[:mean[:cv]]`` (seconds), e.g. ``fixed:30``, ``exp:60``, ``lognormal:60:0.5``.

    A missing mean, or ``auto``, leaves it to calibration.
    """
    parts = text.strip().split(":")
    if not 1 <= len(parts) <= 3 or not parts[0]:
        raise ValueError(f"distribution {text!r} must look like kind[:mean[:cv]], e.g. exp:60")
    kind = parts[0].lower()
    mean: float | None = None
    cv = 0.0
    try:
        if len(parts) >= 2 and parts[1].lower() not in ("", "auto"):
            mean = float(parts[1])
        if len(parts) == 3:
            cv = float(parts[2])
    except ValueError:
        raise ValueError(f"distribution {text!r}: mean and cv must be numbers") from None
    return Dist(kind, mean, cv)


@dataclass(frozen=True)
class ModelConfig:
    """The physics of one simulated cluster (everything except its size and learner count)."""

    mtbi_s: float = YEAR_S                       # per chip; math.inf = no failures
    chips_per_slice: int = 64                    # a failed chip takes its slice out
    detection: Dist = Dist("fixed", 10.0)        # failure -> noticed (collective / heartbeat timeout)
    reconfiguration: Dist = Dist("fixed", 30.0)  # one global reconfiguration (shrink, grow or restart)
    repair: Dist = Dist("exp", None)             # noticed -> slice back in service; mean calibrated
    speed_cv: float = 0.0                        # per-step, per-chip step-time coefficient of variation
    duration_s: float = 7 * DAY_S                # simulated wall time per seed

    def __post_init__(self) -> None:
        if not (self.mtbi_s > 0) or math.isnan(self.mtbi_s):
            raise ValueError(f"mtbi_s must be > 0 seconds (inf = no failures), got {self.mtbi_s!r}")
        if not isinstance(self.chips_per_slice, int) or self.chips_per_slice < 1:
            raise ValueError(f"chips_per_slice must be an int >= 1, got {self.chips_per_slice!r}")
        for name in ("detection", "reconfiguration"):
            if getattr(self, name).mean is None:
                raise ValueError(f"{name} needs a mean (only the repair time is calibrated)")
        if not (math.isfinite(self.speed_cv) and 0 <= self.speed_cv <= 1):
            raise ValueError(f"speed_cv must be in [0, 1], got {self.speed_cv!r}")
        if not (math.isfinite(self.duration_s) and self.duration_s > 0):
            raise ValueError(f"duration_s must be a finite number > 0, got {self.duration_s!r}")

    @property
    def calibrated(self) -> bool:
        return self.repair.mean is not None


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
