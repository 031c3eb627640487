"""Calibrate the one fitted number, the mean restart time, from SPEC §9's single point.

Non-elastic data parallel is a renewal process (``engine.RestartJob``): it computes for a time R
until the next interruption (exponential, mean μ = MTBI / N, since all N chips compute), keeps the
progress up to its last checkpoint (one every C seconds of progress), then is down for detection +
restart (the pool is assumed never to run dry at the calibration point; the sweep reports when it
does). By the renewal-reward theorem

    goodput_dp = efficiency(N) · E[C·⌊R/C⌋] / (μ + E[detection] + E[restart])
    E[C·⌊R/C⌋] = C·q / (1 − q),  q = e^{−C/μ}        (→ μ as C → 0)

which does not depend on the shapes of the distributions. Setting it to 72% at N = 150k, MTBI = 1
year gives E[restart] in closed form. The simulator is checked against this formula at other sizes
(tests/test_simulator.py); nothing else is fitted.
"""
from __future__ import annotations

import math
from dataclasses import replace

from .config import CALIBRATION_CHIPS, CALIBRATION_GOODPUT, CALIBRATION_MTBI_S, ModelConfig
from .speed import lockstep_efficiency

CALIBRATED = ("restart",)   # the parameters calibrate() may fill in


def kept_per_run(mtbf_s: float, checkpoint_s: float) -> float:
    """E[C·⌊R/C⌋] for R exponential with mean ``mtbf_s``: progress a run keeps up to its last checkpoint."""
    if checkpoint_s == 0:
        return mtbf_s
    q = math.exp(-checkpoint_s / mtbf_s)
    return checkpoint_s * q / -math.expm1(-checkpoint_s / mtbf_s)


def dp_goodput_analytic(model: ModelConfig, chips: int) -> float:
    """Stationary goodput of non-elastic data parallel with an ample spare pool (needs a restart mean)."""
    if model.restart.mean is None:
        raise ValueError("restart time not calibrated yet; call calibrate(model) first")
    eff = lockstep_efficiency(chips, model.speed_cv)
    if math.isinf(model.mtbi_s):
        return eff
    mu = model.mtbi_s / chips
    return eff * kept_per_run(mu, model.checkpoint_s) / (mu + model.detection.mean + model.restart.mean)


def solve_restart_mean(model: ModelConfig, chips: int = CALIBRATION_CHIPS,
                       mtbi_s: float = CALIBRATION_MTBI_S, goodput: float = CALIBRATION_GOODPUT) -> float:
    """Mean restart time (s) that gives non-elastic DP ``goodput`` at (``chips``, ``mtbi_s``).

    Raises ValueError when no non-negative restart time fits (detection, checkpoint losses and
    speed variance alone already cost more than the target allows).
    """
    if not (0 < goodput < 1):
        raise ValueError(f"calibration goodput must be in (0, 1), got {goodput}")
    eff = lockstep_efficiency(chips, model.speed_cv)
    if goodput >= eff:
        raise ValueError(f"speed variance alone already limits {chips}-chip data parallel to "
                         f"{eff:.3f} goodput, below the calibration target {goodput}")
    mu = mtbi_s / chips
    kept = kept_per_run(mu, model.checkpoint_s)
    x = eff * kept / goodput - mu - model.detection.mean
    if x < 0:
        raise ValueError(f"detection ({model.detection.mean:g} s), checkpoints every {model.checkpoint_s:g} s "
                         f"and lock-step efficiency {eff:.3f} already push data parallel below {goodput:.0%} "
                         f"goodput at {chips} chips; no restart time fits the calibration point")
    return x


def calibrate(model: ModelConfig) -> ModelConfig:
    """Return ``model`` with the restart mean filled in from the calibration point (unchanged if set)."""
    if model.restart.mean is not None:
        return model
    cal = replace(model, mtbi_s=CALIBRATION_MTBI_S)
    return replace(model, restart=model.restart.with_mean(solve_restart_mean(cal)))


def calibration_note(given: ModelConfig, used: ModelConfig) -> str:
    """One line naming what was calibrated (SPEC §9: exactly one calibration point)."""
    if given.restart.mean is not None:
        return f"calibrated: nothing (restart {used.restart} s given)"
    return (f"calibrated: restart mean = {used.restart.mean:.2f} s, so that non-elastic data parallel at "
            f"{CALIBRATION_CHIPS:,} chips, MTBI {CALIBRATION_MTBI_S / (365 * 86400):g} y has "
            f"{CALIBRATION_GOODPUT:.0%} goodput; every other parameter is set, not fitted")
