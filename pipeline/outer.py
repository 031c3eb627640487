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
from functools import partial
from typing import Any, Callable, Iterable, Mapping

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
    """The run's outer optimizer: learning rate eta and Nesterov momentum mu (the descriptor's ``outer``).
    DiLoCo's 0.7/0.9 are tuned for H in the hundreds; at the demo job's H = 16, mu = 0.5 measured better
    (docs/results.md "Rounds, defaults and quality"), so that is a new run's default."""

    lr: float = 0.7
    momentum: float = 0.5

    def __post_init__(self) -> None:
        if _check_scalar("outer lr", self.lr) < 0:
            raise ValueError(f"outer lr must be >= 0, got {self.lr}")
        if not 0.0 <= _check_scalar("outer momentum", self.momentum) < 1.0:
            raise ValueError(f"outer momentum must lie in [0, 1), got {self.momentum}")


# Steps of _STEP values keep the float64 temporaries (128 KiB) in cache; jobs of _JOB values go
# through the caller's ``map_fn`` (e.g. ``ThreadPoolExecutor.map``); every value is computed alone,
# so neither changes a bit.
_STEP = 1 << 14
_JOB = 1 << 20
_NORMAL_LO = np.uint32(0x00800001)   # |r| bits - this, as uint32, exceeds _NORMAL_SPAN exactly when
_NORMAL_SPAN = np.uint32(0x7F7FFFFE - 0x00800001)   # |r| <= min normal, |r| >= max, or r is NaN
# How jobs run: ``map_fn(fn, jobs)`` yields ``fn(job)`` in order (``map``, ``ThreadPoolExecutor.map``).
MapFn = Callable[[Callable[[Any], Any], Iterable[Any]], Iterable[Any]]


class _Scratch:
    """One job's temporaries for ``_fma32_step``, sized for a step."""

    def __init__(self) -> None:
        self.s, self.bits = np.empty(_STEP, np.float64), np.empty(_STEP, np.uint64)
        self.rbits, self.g2 = np.empty(_STEP, np.uint32), np.empty(_STEP, np.float32)
        self.mid, self.edge = np.empty(_STEP, np.bool_), np.empty(_STEP, np.bool_)


def _fma32_step(a: np.ndarray, b: np.ndarray, c64: float, out: np.ndarray, t: _Scratch) -> None:
    """``out = a + b * c`` rounded once, for float32 steps ``a``, ``b`` and ``c64`` a float32 value
    as float64: :func:`fma32`'s fast path and exact correction, with the suspects found on ``r``
    (|r| <= min normal or >= max covers every |s| outside float32's normal range) - the same values."""
    n = a.size
    s, bits, rbits, mid, edge = t.s[:n], t.bits[:n], t.rbits[:n], t.mid[:n], t.edge[:n]
    np.multiply(b, c64, out=s, dtype=np.float64)      # exact: 24 x 24 bits
    np.add(s, a, out=s, dtype=np.float64)             # rounds once, to 53 bits
    with np.errstate(over="ignore"):                  # beyond float32's range: inf, as IEEE fma gives
        np.copyto(out, s, casting="same_kind")        # and to 24: wrong only on a float32 midpoint
    np.bitwise_and(s.view(np.uint64), _LOW29, out=bits)
    np.equal(bits, _MID29, out=mid)
    np.bitwise_and(out.view(np.uint32), np.uint32(0x7FFFFFFF), out=rbits)
    np.subtract(rbits, _NORMAL_LO, out=rbits)
    np.greater(rbits, _NORMAL_SPAN, out=edge)
    np.logical_or(mid, edge, out=mid)
    if mid.any():
        idx = np.flatnonzero(mid)
        p = b[idx].astype(np.float64) * c64
        out[idx] = _fma32_exact(a[idx].astype(np.float64), p, s[idx], out[idx])


def _nesterov_job(job: tuple[int, int, int], tensors: list[tuple[np.ndarray, ...]], mu: float, lr: float) -> None:
    """Values ``lo:hi`` of tensor ``i``: b' = mu b + g (two float32 roundings), g2 = fma(g, b', mu),
    p' = fma(p, g2, -lr), written into the tensor's new arrays."""
    i, lo, hi = job
    p, b, g, new_p, new_b = tensors[i]
    mu32, c_mu, c_lr, t = np.float32(mu), float(np.float32(mu)), float(np.float32(-lr)), _Scratch()
    for s in range(lo, hi, _STEP):
        e = min(s + _STEP, hi)
        buf, g2 = new_b[s:e], t.g2[:e - s]
        np.multiply(b[s:e], mu32, out=buf)           # float32 mul then float32 add, as buf.mul_(mu).add_(g)
        np.add(buf, g[s:e], out=buf)
        _fma32_step(g[s:e], buf, c_mu, g2, t)         # g + mu * buf
        _fma32_step(p[s:e], g2, c_lr, new_p[s:e], t)  # p - lr * g2


def nesterov_step(params: Mapping[str, np.ndarray], momentum: Mapping[str, np.ndarray],
                  grad: Mapping[str, np.ndarray], lr: float, mu: float, *, map_fn: MapFn | None = None
                  ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """One outer Nesterov step per tensor; returns new ``(params, momentum)`` dicts of float32 arrays.

    ``momentum`` starts as zeros (torch's first step clones g into the buffer, which is the same
    value as ``0 * mu + g``). All three maps must name the same tensors with the same shapes.
    ``map_fn`` runs the jobs (default: ``map``, on this thread); it never changes a bit.
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
    names, tensors = sorted(params), []
    for name in names:
        p = np.asarray(params[name], dtype=np.float32)
        b = np.asarray(momentum[name], dtype=np.float32)
        g = np.asarray(grad[name], dtype=np.float32)
        if not p.shape == b.shape == g.shape:
            raise ValueError(f"tensor {name}: shapes differ (params {p.shape}, momentum {b.shape}, grad {g.shape})")
        tensors.append((np.ravel(p), np.ravel(b), np.ravel(g), np.empty(p.shape, np.float32),
                        np.empty(p.shape, np.float32)))
    jobs = [(i, lo, min(lo + _JOB, t[0].size)) for i, t in enumerate(tensors) for lo in range(0, t[0].size, _JOB)]
    flat = [(p, b, g, np_.reshape(-1), nb.reshape(-1)) for p, b, g, np_, nb in tensors]
    list((map_fn or map)(partial(_nesterov_job, tensors=flat, mu=mu, lr=lr), jobs))
    return ({n: t[3] for n, t in zip(names, tensors)}, {n: t[4] for n, t in zip(names, tensors)})
