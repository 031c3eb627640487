"""Norm guard: drop a delta whose norm is far beyond the recent median (issue "Security").

Optional and off by default; a run turns it on at creation with
``RunDescriptor.extra["norm_guard"] = {"factor": F, "window": W, "min_history": N}``. A delta of
fragment p is dropped with reason ``norm-outlier`` when its L2 norm exceeds F times the median
norm of the last W deltas merged into p (no verdict before N of them exist). It bounds how far
one signed-but-wrong learner (a bug, a bit flip, a compromised key) can push a fragment in one
round; RDA already bounds the merged norm by the weighted mean of the inputs' norms (SPEC §4),
so without the guard one huge delta moves the fragment by a weighted share of its norm.

Deterministic, so replay reaches the same verdicts: the median comes from the norms the syncer
*recorded* in earlier merge commits (``info["norms"]``, one per merged input, in record order),
and the norm of a new delta is a float64 sum over its tensors in sorted name order.
"""
from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from .errors import FormatError
from .fold import RoundInput
from .types import RunDescriptor

OUTLIER = "norm-outlier"


@dataclass(frozen=True)
class NormGuardConfig:
    factor: float = 10.0      # drop when the norm exceeds factor x the recent median
    window: int = 32          # recent merged deltas per fragment that make the median
    min_history: int = 8      # no verdict until this many merged deltas are known

    def __post_init__(self) -> None:
        if not isinstance(self.factor, (int, float)) or not math.isfinite(self.factor) or self.factor <= 1.0:
            raise ValueError(f"norm guard factor must be a finite number > 1, got {self.factor!r}")
        for name in ("window", "min_history"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"norm guard {name} must be an int >= 1, got {v!r}")
        if self.min_history > self.window:
            raise ValueError(f"norm guard min_history {self.min_history} exceeds window {self.window}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def guard_config(descriptor: RunDescriptor) -> NormGuardConfig | None:
    """The run's norm guard, or None when it is off (the default)."""
    d = descriptor.extra.get("norm_guard")
    if d is None:
        return None
    if not isinstance(d, dict) or not set(d) <= {"factor", "window", "min_history"}:
        raise FormatError(f"run {descriptor.run_id}: norm_guard must be a map of factor, window, min_history")
    try:
        return NormGuardConfig(**d)
    except (TypeError, ValueError) as exc:
        raise FormatError(f"run {descriptor.run_id}: {exc}") from None


def delta_norm(tensors: Mapping[str, np.ndarray]) -> float:
    """L2 norm over all tensors (float64, sorted names): inf or nan if any value is not finite."""
    total = 0.0
    for name in sorted(tensors):
        a = np.asarray(tensors[name], dtype=np.float64).ravel()
        total += float(np.dot(a, a))
    return math.sqrt(total) if math.isfinite(total) else total


def verdict(norm: float, history: Sequence[float], cfg: NormGuardConfig) -> str:
    """``norm-outlier`` or "" (non-finite norms are left to the fold, which says ``non-finite``)."""
    if not math.isfinite(norm) or len(history) < cfg.min_history:
        return ""
    h = sorted(history)
    median = h[len(h) // 2] if len(h) % 2 else 0.5 * (h[len(h) // 2 - 1] + h[len(h) // 2])
    return OUTLIER if norm > cfg.factor * median else ""


def apply_guard(inputs: Sequence[RoundInput], history: Sequence[float],
                cfg: NormGuardConfig) -> tuple[list[RoundInput], dict[str, float]]:
    """Mark outliers among ``inputs`` (those not already rejected) with ``norm-outlier``.

    Returns the inputs (outliers replaced by copies carrying the reason) and every computed norm
    by the input's checksum, so the caller can record the merged inputs' norms.
    """
    out, norms = [], {}
    for inp in inputs:
        if inp.reject_reason or inp.tensors is None:
            out.append(inp)
            continue
        n = delta_norm(inp.tensors)
        norms[inp.checksum] = n
        reason = verdict(n, history, cfg)
        out.append(dataclasses.replace(inp, reject_reason=reason) if reason else inp)
    return out, norms


class NormWindow:
    """The recent merged norms of every fragment (what ``verdict`` compares against)."""

    def __init__(self, fragments: int, cfg: NormGuardConfig):
        self.cfg = cfg
        self._recent = [deque(maxlen=cfg.window) for _ in range(fragments)]

    def history(self, fragment: int) -> list[float]:
        return list(self._recent[fragment])

    def push(self, fragment: int, norms: Sequence[float]) -> None:
        self._recent[fragment].extend(float(n) for n in norms)

    def full(self, fragment: int) -> bool:
        return len(self._recent[fragment]) >= self.cfg.window

    def prepend(self, fragment: int, norms: Sequence[float]) -> None:
        """Add older norms (when filling the window backwards from a checkpoint)."""
        keep = list(norms) + list(self._recent[fragment])
        self._recent[fragment] = deque(keep[-self.cfg.window:], maxlen=self.cfg.window)


def recorded_norms(info: Mapping[str, Any], count: int, what: str) -> list[float]:
    """The ``norms`` a merge commit recorded for its ``count`` inputs (FormatError if absent or malformed)."""
    norms = info.get("norms")
    if not isinstance(norms, list) or len(norms) != count or \
            not all(isinstance(n, float) and math.isfinite(n) and n >= 0 for n in norms):
        raise FormatError(f"{what}: the run has a norm guard but the commit records no valid norms for its "
                          f"{count} inputs")
    return norms
