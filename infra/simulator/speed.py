"""Chip speed variance: how much a lock-step job loses to its slowest chip (SPEC §9 knob).

Model (*choice*, docs/simulator.md): every chip's time for one step is an independent lognormal draw
with mean 1 and coefficient of variation ``cv``; a lock-step job of n chips finishes a step when its
slowest chip does, so it runs at efficiency ``E[t] / E[max of n draws]``. Decoupled DiLoCo's learners
are lock-step only inside themselves and never wait for each other, so they pay this for N/M chips,
not N. The expectation is a one-dimensional integral, evaluated on a fixed grid (deterministic).
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

_Z = np.linspace(-9.0, 9.0, 36001)  # standard-normal grid; the max of 1e7 draws sits near z = 5.3
_LOG_CDF = np.log(np.maximum(0.5 * np.frompyfunc(math.erfc, 1, 1)(-_Z / math.sqrt(2)).astype(np.float64),
                             1e-300))
_PDF = np.exp(-0.5 * _Z ** 2) / math.sqrt(2 * math.pi)


@lru_cache(maxsize=256)
def lockstep_efficiency(chips: int, cv: float) -> float:
    """Fraction of nominal speed a lock-step job of ``chips`` chips keeps (1.0 when cv = 0 or one chip)."""
    if chips < 1:
        raise ValueError(f"chips must be >= 1, got {chips}")
    if not (0 <= cv <= 1):
        raise ValueError(f"speed cv must be in [0, 1], got {cv}")
    if cv == 0 or chips == 1:
        return 1.0
    sigma = math.sqrt(math.log1p(cv * cv))
    # density of the max of n standard normals: n * Phi(z)^(n-1) * phi(z)
    dens = chips * np.exp((chips - 1) * _LOG_CDF) * _PDF
    e_max = float(np.trapezoid(np.exp(sigma * _Z - sigma * sigma / 2) * dens, _Z))
    return 1.0 / e_max
