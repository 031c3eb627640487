"""Duration distributions of the goodput simulator (SPEC §9 knobs; docs/simulator.md).

``Dist(kind, mean, cv, shape, power)``: ``fixed`` (always ``mean``), ``exp`` (exponential),
``lognormal`` (mean and coefficient of variation ``cv``) and ``expweibull``, the exponentiated
Weibull the paper draws its recovery delays from (arXiv 2604.21428, chaos-engineering study):

    F(x) = (1 − exp(−(x/λ)^k))^α          k = ``shape`` > 0, α = ``power`` > 0

(α = 1 is a Weibull, k = α = 1 an exponential). It is parameterised by its mean, as every other
kind is: the scale λ = mean / m(k, α) with m(k, α) = ∫₀^∞ 1 − (1 − e^{−x^k})^α dx, integrated
numerically once per (k, α). ``mean=None`` marks a duration left to calibration (``calibrate.py``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

DIST_KINDS = ("fixed", "exp", "lognormal", "expweibull")


@lru_cache(maxsize=64)
def expweibull_unit_mean(shape: float, power: float) -> float:
    """Mean of the exponentiated Weibull with scale 1: ∫₀^∞ 1 − (1 − e^{−x^k})^α dx.

    Substituting x = e^u turns the integral into ∫ e^u (1 − (1 − e^{−e^{ku}})^α) du, smooth on a
    uniform grid; the integrand is below 1e-300 past x^k = 700 and tends to 0 as x → 0.
    """
    u = np.linspace(-40.0 / shape, math.log(700.0) / shape, 200_001)
    x = np.exp(u)
    surv = -np.expm1(power * np.log(-np.expm1(-(x ** shape))))  # 1 − (1 − e^{−x^k})^α, no cancellation
    return float(np.trapezoid(surv * x, u))


@dataclass(frozen=True)
class Dist:
    """A non-negative duration in seconds (see the module docstring for the kinds)."""

    kind: str
    mean: float | None
    cv: float = 0.0          # lognormal only
    shape: float = 1.0       # expweibull k
    power: float = 1.0       # expweibull α

    def __post_init__(self) -> None:
        if self.kind not in DIST_KINDS:
            raise ValueError(f"distribution kind {self.kind!r} is not one of {DIST_KINDS}")
        if self.mean is not None and not (math.isfinite(self.mean) and self.mean >= 0):
            raise ValueError(f"distribution mean must be a finite number >= 0 seconds, got {self.mean!r}")
        if not (math.isfinite(self.cv) and self.cv >= 0):
            raise ValueError(f"distribution cv must be a finite number >= 0, got {self.cv!r}")
        if self.kind == "lognormal" and self.cv == 0:
            raise ValueError("a lognormal distribution needs cv > 0 (use 'fixed' for a constant)")
        for name in ("shape", "power"):
            v = getattr(self, name)
            if not (math.isfinite(v) and 0.05 <= v <= 50):
                raise ValueError(f"expweibull {name} must be in [0.05, 50], got {v!r}")

    def with_mean(self, mean: float) -> "Dist":
        return replace(self, mean=float(mean))

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """``size`` independent draws (float64)."""
        if self.mean is None:
            raise ValueError(f"{self.kind} distribution has no mean yet (not calibrated)")
        if self.kind == "fixed" or self.mean == 0:
            return np.full(size, self.mean, dtype=np.float64)
        if self.kind == "exp":
            return rng.exponential(self.mean, size)
        if self.kind == "lognormal":
            sigma2 = math.log1p(self.cv ** 2)  # lognormal with the requested mean and cv
            return rng.lognormal(math.log(self.mean) - sigma2 / 2, math.sqrt(sigma2), size)
        scale = self.mean / expweibull_unit_mean(self.shape, self.power)
        u = rng.random(size)  # inverse CDF: x = λ (−ln(1 − u^{1/α}))^{1/k}
        return scale * (-np.log1p(-(u ** (1.0 / self.power)))) ** (1.0 / self.shape)

    def __str__(self) -> str:
        mean = "calibrated" if self.mean is None else f"{self.mean:g}"
        if self.kind == "lognormal":
            return f"lognormal:{mean}:{self.cv:g}"
        if self.kind == "expweibull":
            return f"expweibull:{mean}:{self.shape:g}:{self.power:g}"
        return f"{self.kind}:{mean}"


def parse_dist(text: str) -> Dist:
    """Parse ``kind[:mean[:...]]`` (seconds): ``fixed:30``, ``exp:60``, ``lognormal:60:0.5`` (cv),
    ``expweibull:60:1.5:0.7`` (shape k, power α; both default to 1).

    A missing or ``auto`` mean is left to calibration (only the restart time is calibrated).
    """
    parts = text.strip().split(":")
    kind = parts[0].lower()
    if not parts[0] or len(parts) > (4 if kind == "expweibull" else 3):
        raise ValueError(f"distribution {text!r} must look like kind[:mean[:cv]] (expweibull: "
                         f"expweibull:mean:shape:power), e.g. exp:60")
    try:
        mean = None if len(parts) < 2 or parts[1].lower() in ("", "auto") else float(parts[1])
        extra = [float(p) for p in parts[2:]]
    except ValueError:
        raise ValueError(f"distribution {text!r}: mean and parameters must be numbers") from None
    if kind == "expweibull":
        return Dist(kind, mean, shape=extra[0] if extra else 1.0, power=extra[1] if len(extra) > 1 else 1.0)
    return Dist(kind, mean, cv=extra[0] if extra else 0.0)
