"""The outer optimizer: SGD with Nesterov momentum per fragment, fp32 state (SPEC §4 "outer step").

    b <- mu * b + g
    Theta <- Theta - eta * (g + mu * b)

The syncer applies this to the merged outer gradient g of a round. It must replay bit for bit, so it
is written in numpy with a fixed float32 operation order, and it reproduces what
``torch.optim.SGD(lr, momentum=mu, nesterov=True)`` (single-tensor path) does on CPU:

    buf.mul_(mu).add_(g)            # two float32 roundings
    g2 = g.add(buf, alpha=mu)       # torch's vectorised add-with-alpha is a fused multiply-add
    p.add_(g2, alpha=-lr)           # idem

Fused multiply-add has one rounding; numpy has no FMA, so ``fma32`` emulates it exactly: the product
of two float32 values is exact in float64, the float64 sum is corrected by its exact rounding error
(TwoSum) where the float64 result sits on a float32 rounding midpoint (the only case where rounding
twice differs from rounding once). Pure: inputs are never mutated.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np

__all__ = ["OuterConfig", "fma32", "nesterov_step"]


def fma32(a: np.ndarray, b: np.ndarray | float, c: np.ndarray | float) -> np.ndarray:
    """``a + b * c`` rounded once to float32 (round to nearest even), like a hardware FMA.

    ``a``, ``b`` and ``c`` are float32 values (scalars are first rounded to float32, as torch does
    with a Python ``alpha``).

    Fast path: the float64 sum ``s`` rounds correctly to float32 unless it lies exactly on a
    float32 rounding midpoint - its 29 low mantissa bits read 1000...0 - or outside float32's
    normal range (subnormal results, overflow). Only those elements (rare) take the exact TwoSum
    correction, so the cost is a few vector passes and results are unchanged bit for bit.
    """
    a64 = np.asarray(a, dtype=np.float32).astype(np.float64)
    p = np.float32(b).astype(np.float64) if np.isscalar(b) else np.asarray(b, dtype=np.float32).astype(np.float64)
    p = p * (np.float32(c).astype(np.float64) if np.isscalar(c) else np.asarray(c, dtype=np.float32).astype(np.float64))
    s = np.asarray(a64 + p)            # product exact (24+24 bits); this sum rounds once to 53 bits
    r = s.astype(np.float32)           # second rounding: wrong only when s is exactly a float32 midpoint
    flat_s = s.reshape(-1)
    with np.errstate(invalid="ignore"):
        mag = np.abs(flat_s)
        suspect = ((flat_s.view(np.uint64) & _LOW29) == _MID29) | (mag < _F32_MIN_NORMAL) | ~(mag <= _F32_MAX)
    if not suspect.any():
        return r
    idx = np.flatnonzero(suspect)
    a_s = np.broadcast_to(a64, s.shape).reshape(-1)[idx]
    p_s = np.broadcast_to(p, s.shape).reshape(-1)[idx]
    fixed = _fma32_exact(a_s, p_s, flat_s[idx], r.reshape(-1)[idx])
    out = r.reshape(-1).copy()
    out[idx] = fixed
    return out.reshape(s.shape)


_LOW29 = np.uint64((1 << 29) - 1)
_MID29 = np.uint64(1 << 28)
_F32_MIN_NORMAL = float(np.finfo(np.float32).tiny)
_F32_MAX = float(np.finfo(np.float32).max)


def _fma32_exact(a64: np.ndarray, p: np.ndarray, s: np.ndarray, r: np.ndarray) -> np.ndarray:
    """The exact correction for elements whose float64 sum ``s = a64 + p`` may round twice."""
    r64 = r.astype(np.float64)
    inexact = r64 != s
    if not np.any(inexact):
        return r
    # TwoSum: err is the exact rounding error of s = a64 + p, so the true value is s + err.
    bv = s - a64
    err = (a64 - (s - bv)) + (p - bv)
    with np.errstate(invalid="ignore", over="ignore"):
        toward = np.where(s > r64, np.float32(np.inf), np.float32(-np.inf)).astype(np.float32)
        other = np.nextafter(r, toward)
        midpoint = inexact & ((r64 + other.astype(np.float64)) * 0.5 == s) & (err != 0)
        # At a midpoint the sign of err says which neighbour the exact value is nearer to.
        use_other = midpoint & ((err > 0) == (other.astype(np.float64) > r64))
    if np.any(use_other):
        r = np.where(use_other, other, r).astype(np.float32)
    return r


def _check_scalar(name: str, value: float) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class OuterConfig:
    """The run's outer optimizer: learning rate eta and Nesterov momentum mu (the descriptor's ``outer``)."""

    lr: float = 0.7
    momentum: float = 0.9

    def __post_init__(self) -> None:
        if _check_scalar("outer lr", self.lr) < 0:
            raise ValueError(f"outer lr must be >= 0, got {self.lr}")
        if not 0.0 <= _check_scalar("outer momentum", self.momentum) < 1.0:
            raise ValueError(f"outer momentum must lie in [0, 1), got {self.momentum}")


def nesterov_step(params: Mapping[str, np.ndarray], momentum: Mapping[str, np.ndarray],
                  grad: Mapping[str, np.ndarray], lr: float, mu: float
                  ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """One outer Nesterov step per tensor; returns new ``(params, momentum)`` dicts of float32 arrays.

    ``momentum`` starts as zeros (torch's first step clones g into the buffer, which is the same
    value as ``0 * mu + g``). All three maps must name the same tensors with the same shapes.
    """
    lr = _check_scalar("outer lr", lr)
    mu = _check_scalar("outer momentum", mu)
    if lr < 0:
        raise ValueError(f"outer lr must be >= 0, got {lr}")
    if not 0.0 <= mu < 1.0:
        raise ValueError(f"outer momentum must lie in [0, 1), got {mu}")
    if set(params) != set(grad) or set(params) != set(momentum):
        raise ValueError(f"params, momentum and grad name different tensors: "
                         f"{sorted(set(params) ^ set(grad) | set(params) ^ set(momentum))}")
    mu32 = np.float32(mu)
    new_p: dict[str, np.ndarray] = {}
    new_b: dict[str, np.ndarray] = {}
    for name in sorted(params):
        p = np.asarray(params[name], dtype=np.float32)
        b = np.asarray(momentum[name], dtype=np.float32)
        g = np.asarray(grad[name], dtype=np.float32)
        if not p.shape == b.shape == g.shape:
            raise ValueError(f"tensor {name}: shapes differ (params {p.shape}, momentum {b.shape}, grad {g.shape})")
        buf = (b * mu32).astype(np.float32) + g         # float32 mul then float32 add, as buf.mul_(mu).add_(g)
        g2 = fma32(g, buf, mu)                          # g + mu * buf
        new_b[name] = buf.astype(np.float32, copy=False)
        new_p[name] = fma32(p, g2, -lr)                 # p - lr * g2
    return new_p, new_b
