"""The sweep: every system at every cluster size, repeated over seeds until the 95% confidence
intervals of goodput and uptime are within ±``target_ci`` (1 point by default) or ``max_seeds``.

All systems at one (size, seed) share one failure trace (common random numbers). Seeds are derived
from (base seed, repetition, size), so a point's result does not depend on which other points ran.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from . import systems
from .calibrate import calibrate
from .config import ModelConfig, SweepConfig
from .events import FailureTrace, generate_trace

# two-sided 95% Student-t quantiles for 1..30 degrees of freedom
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042)


def t95(df: int) -> float:
    """Two-sided 95% Student-t quantile (table, then the Cornish-Fisher expansion beyond 30)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(_T95):
        return _T95[df - 1]
    z = 1.959964
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


def half_width(samples: list[float]) -> float | None:
    """95% CI half-width of the mean of ``samples`` (None with fewer than two)."""
    n = len(samples)
    if n < 2:
        return None
    return t95(n - 1) * float(np.std(samples, ddof=1)) / math.sqrt(n)


@dataclass(frozen=True)
class Row:
    """One system at one cluster size: means over ``seeds`` repetitions."""

    system: str
    chips: int
    learners: int
    quorum: int
    goodput: float
    uptime: float
    goodput_ci: float | None
    uptime_ci: float | None
    seeds: int
    pool_waits: float = 0.0   # mean fraction of replacements that waited for a repaired slice

    @property
    def ci(self) -> float | None:
        """The wider of the two 95% CI half-widths (one number per row, as a fraction)."""
        if self.goodput_ci is None or self.uptime_ci is None:
            return None
        return max(self.goodput_ci, self.uptime_ci)

    def to_json(self) -> dict:
        return {"system": self.system, "chips": self.chips, "learners": self.learners,
                "quorum": self.quorum, "goodput": self.goodput, "uptime": self.uptime, "ci": self.ci}


def point_rng(base_seed: int, repetition: int, chips: int) -> np.random.Generator:
    return np.random.default_rng([base_seed, repetition, chips])


def simulate_point(model: ModelConfig, trace: FailureTrace, learners: tuple[int, ...],
                   quorum: int) -> dict[tuple[str, int, int], systems.Outcome]:
    """All systems on one trace, keyed by (system, learners, quorum)."""
    out = {("dp", 1, 1): systems.dp(trace, model), ("elastic_dp", 1, 1): systems.elastic_dp(trace, model)}
    for m in learners:
        out[("decoupled", m, quorum)] = systems.decoupled(trace, model, m, quorum).outcome
    return out


@dataclass(frozen=True)
class SweepResult:
    rows: tuple[Row, ...]
    model: ModelConfig      # with the calibrated restart mean
    wall_s: float


def run_sweep(cfg: SweepConfig, progress: Callable[[str], None] | None = None) -> SweepResult:
    """Simulate every point of ``cfg``; the restart time is calibrated first if it has no mean."""
    start = time.perf_counter()
    model = calibrate(cfg.model)
    rows: list[Row] = []
    for chips in cfg.chips:
        samples: dict[tuple[str, int, int], list[systems.Outcome]] = {}
        for rep in range(cfg.max_seeds):
            trace = generate_trace(model, chips, point_rng(cfg.seed, rep, chips))
            for key, outcome in simulate_point(model, trace, cfg.learners, cfg.quorum).items():
                samples.setdefault(key, []).append(outcome)
            if rep + 1 >= cfg.min_seeds and _converged(samples, cfg.target_ci):
                break
        for (system, m, k), outs in samples.items():
            g = [o.goodput for o in outs]
            u = [o.uptime for o in outs]
            rows.append(Row(system, chips, m, k, float(np.mean(g)), float(np.mean(u)),
                            half_width(g), half_width(u), len(outs),
                            float(np.mean([o.pool_waits for o in outs]))))
        if progress:
            progress(f"{chips} chips: {len(next(iter(samples.values())))} seeds")
    return SweepResult(tuple(rows), model, time.perf_counter() - start)


def _converged(samples: dict[tuple[str, int, int], list[systems.Outcome]], target: float) -> bool:
    for outs in samples.values():
        for values in ([o.goodput for o in outs], [o.uptime for o in outs]):
            hw = half_width(values)
            if hw is None or hw > target:
                return False
    return True
