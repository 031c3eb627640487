"""Calibrate the one unknown, the mean repair time, from SPEC §9's single point.

For non-elastic data parallel the job is down from a failure until the failed slice is repaired and
the job has restarted, i.e. for L = detection + repair + restart (one reconfiguration). Slice failures
form (almost exactly) a Poisson process of rate λ = S / (MTBF_slice + E[detection] + E[repair]) (a
slice under repair cannot fail again), and outages that overlap merge. The job runs at time t iff no
outage started in the preceding L, so (M/G/∞ empty probability, insensitive to the distribution of L)

    goodput_dp = efficiency(N) · exp(−λ · E[L]).

Setting it to 72% at N = 150k, MTBI = 1 year and solving for E[repair] has a closed form. The
simulator is then checked against this formula (tests/test_simulator.py); nothing else is fitted.
"""
from __future__ import annotations

import math
from dataclasses import replace

from .config import (CALIBRATION_CHIPS, CALIBRATION_GOODPUT, CALIBRATION_MTBI_S, ModelConfig,
                     num_slices)
from .speed import lockstep_efficiency


def dp_goodput_analytic(model: ModelConfig, chips: int) -> float:
    """Stationary goodput of non-elastic data parallel under ``model`` (needs a calibrated repair)."""
    if model.repair.mean is None:
        raise ValueError("repair time not calibrated yet; call calibrate(model) first")
    if math.isinf(model.mtbi_s):
        return lockstep_efficiency(chips, model.speed_cv)
    slices = num_slices(chips, model.chips_per_slice)
    mtbf_slice = model.mtbi_s * slices / chips
    det, rep, rc = model.detection.mean, model.repair.mean, model.reconfiguration.mean
    rate = slices / (mtbf_slice + det + rep)
    return lockstep_efficiency(chips, model.speed_cv) * math.exp(-rate * (det + rep + rc))


def solve_repair_mean(model: ModelConfig, chips: int = CALIBRATION_CHIPS,
                      mtbi_s: float = CALIBRATION_MTBI_S, goodput: float = CALIBRATION_GOODPUT) -> float:
    """Mean repair time (s) that gives non-elastic DP ``goodput`` at (``chips``, ``mtbi_s``).

    Solves S·(a + x)/(b + x) = c for x, with a = E[det] + E[restart], b = MTBF_slice + E[det],
    c = −ln(goodput / efficiency). Raises ValueError when no non-negative repair time fits.
    """
    if not (0 < goodput < 1):
        raise ValueError(f"calibration goodput must be in (0, 1), got {goodput}")
    eff = lockstep_efficiency(chips, model.speed_cv)
    if goodput >= eff:
        raise ValueError(f"speed variance alone already limits {chips}-chip data parallel to "
                         f"{eff:.3f} goodput, below the calibration target {goodput}")
    slices = num_slices(chips, model.chips_per_slice)
    mtbf_slice = mtbi_s * slices / chips
    a = model.detection.mean + model.reconfiguration.mean
    b = mtbf_slice + model.detection.mean
    c = -math.log(goodput / eff)
    if slices <= c:
        raise ValueError(f"{slices} slices cannot produce a goodput as low as {goodput}")
    x = (c * b - slices * a) / (slices - c)
    if x < 0:
        raise ValueError(f"detection ({model.detection.mean:g} s) + restart ({model.reconfiguration.mean:g} s) "
                         f"with lock-step efficiency {eff:.3f} already push data parallel below "
                         f"{goodput:.0%} goodput at {chips} chips; no repair time fits the calibration point")
    return x


def calibrate(model: ModelConfig) -> ModelConfig:
    """Return ``model`` with the repair mean filled in from the calibration point (unchanged if set)."""
    if model.repair.mean is not None:
        return model
    cal = replace(model, mtbi_s=CALIBRATION_MTBI_S)
    return replace(model, repair=model.repair.with_mean(solve_repair_mean(cal)))
