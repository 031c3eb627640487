"""Norm guard: drop a delta whose norm is far out of line (issue "Security", issue 11 item 2).

On by default for new runs (``create_run`` writes the descriptor's ``guard`` section, a
NormGuardConfig: ``{"factor": F, "window": W, "min_history": N, "cap": C, "enabled": E, "version": 2}``).
A delta of fragment p is dropped with reason ``norm-outlier`` when either

- its L2 norm exceeds ``C * max(|Theta_p|, sqrt(n_p))`` (``|Theta_p|`` the norm of the fragment's
  current exact parameters, ``n_p`` its number of values: the cap never collapses to 0 for a
  fragment of zeros). This holds from the very first round, before any history exists, and stops
  a finite "value bomb" (a delta filled with 1e4) outright; or
- at least N merged norms of p are known and its norm exceeds ``F`` times the median of the last
  W of them (a median of 0 gives no verdict).

It bounds how far one signed-but-wrong learner (a bug, a bit flip, a compromised key) can push a
fragment in one round; RDA already bounds the merged norm by the weighted mean of the inputs'
norms (SPEC §4), so without the guard one huge delta moves the fragment by a weighted share of it.
Descriptors without a guard (runs made before it was on by default, hand-built ones) and guards with
``enabled: false`` have no guard; version-1 guards (maps written without a ``version`` key) have no
cap, as before.

Deterministic, so replay reaches the same verdicts (SPEC §7 'Replay'): the median comes from the
norms the syncer *recorded* in earlier merge commits (``CommitRecord.norms``, one per merged
input, in record order; pipeline/commit.py keeps the window); the cap from the state before the
commit; and every norm is bit-stable whatever the BLAS thread count (issue 11 item 3): float32 values are squared exactly in float64, summed per
fixed chunk of ``CHUNK`` values with numpy's pairwise sum (never ``np.dot``/BLAS, whose blocking
depends on its thread count), and the chunk sums are added with ``math.fsum`` (correctly rounded,
so independent of order).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

if TYPE_CHECKING:      # annotations only: the descriptor imports NormGuardConfig from here
    from .descriptor import RunDescriptor
    from .fold import RoundInput

OUTLIER = "norm-outlier"
GUARD_MAP_VERSION = 2
CHUNK = 1 << 16           # values per pairwise-summed chunk (fixed: part of the replayed format)
_SLAB = 64 * CHUNK        # values squared at a time (bounds the float64 scratch memory)


@dataclass(frozen=True)
class NormGuardConfig:
    factor: float = 10.0          # drop when the norm exceeds factor x the recent median
    window: int = 32              # recent merged deltas per fragment that make the median
    min_history: int = 8          # no median verdict until this many merged deltas are known
    cap: float | None = 10.0      # drop when the norm exceeds cap x max(|Theta_p|, sqrt(n_p)); None: no cap
    enabled: bool = True          # False: the run has no guard (recorded, so replay knows)
    version: int = GUARD_MAP_VERSION   # 1: maps written before the cap (np.dot norms, no cap)

    def __post_init__(self) -> None:
        if not isinstance(self.factor, (int, float)) or isinstance(self.factor, bool) \
                or not math.isfinite(self.factor) or self.factor <= 1.0:
            raise ValueError(f"norm guard factor must be a finite number > 1, got {self.factor!r}")
        for name in ("window", "min_history"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"norm guard {name} must be an int >= 1, got {v!r}")
        if self.min_history > self.window:
            raise ValueError(f"norm guard min_history {self.min_history} exceeds window {self.window}")
        if self.cap is not None and (not isinstance(self.cap, (int, float)) or isinstance(self.cap, bool)
                                     or not math.isfinite(self.cap) or self.cap <= 0):
            raise ValueError(f"norm guard cap must be None or a finite number > 0, got {self.cap!r}")
        if not isinstance(self.enabled, bool):
            raise ValueError(f"norm guard enabled must be a bool, got {self.enabled!r}")
        if self.version not in (1, GUARD_MAP_VERSION):
            raise ValueError(f"norm guard map version {self.version!r} not one of 1, {GUARD_MAP_VERSION}")
        if self.version == 1 and self.cap is not None:
            raise ValueError("a version-1 norm guard map has no cap")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if self.version == 1:            # written exactly as before the cap existed
            return {k: d[k] for k in ("factor", "window", "min_history")}
        return d


def guard_config(descriptor: "RunDescriptor") -> NormGuardConfig | None:
    """The run's norm guard, or None when it has none (no ``guard`` section, or ``enabled: false``).
    The descriptor validated the section when it was read (pipeline/descriptor.py)."""
    cfg = descriptor.guard
    return cfg if cfg is not None and cfg.enabled else None


def _sumsq_parts(a: np.ndarray) -> list[float]:
    """Sums of squares of fixed ``CHUNK``-value chunks of ``a`` (C order), in float64."""
    x = np.asarray(a).ravel()
    parts: list[float] = []
    for lo in range(0, x.size, _SLAB):
        s = np.asarray(x[lo:lo + _SLAB], dtype=np.float64)
        s = s * s                                     # exact for float32 values
        full = s.size - s.size % CHUNK
        if full:
            parts.extend(s[:full].reshape(-1, CHUNK).sum(axis=1).tolist())
        if full < s.size:
            parts.append(float(s[full:].sum()))
    return parts


def delta_norm(tensors: Mapping[str, np.ndarray]) -> float:
    """L2 norm over all tensors, bit-stable (see the module docstring): inf or nan if a value is
    not finite."""
    parts: list[float] = []
    for name in sorted(tensors):
        parts.extend(_sumsq_parts(tensors[name]))
    if any(math.isnan(p) for p in parts):
        return math.nan
    if any(math.isinf(p) for p in parts):
        return math.inf
    return math.sqrt(math.fsum(parts))


def cap_limit(params: Mapping[str, np.ndarray], cfg: NormGuardConfig) -> float | None:
    """The absolute norm cap for a fragment whose current exact parameters are ``params``."""
    if cfg.cap is None:
        return None
    n = sum(int(np.size(a)) for a in params.values())
    return cfg.cap * max(delta_norm(params), math.sqrt(n))


def median(values: Sequence[float]) -> float:
    h = sorted(values)
    return h[len(h) // 2] if len(h) % 2 else 0.5 * (h[len(h) // 2 - 1] + h[len(h) // 2])


def verdict(norm: float, history: Sequence[float], cfg: NormGuardConfig, limit: float | None = None) -> str:
    """``norm-outlier`` or "" (non-finite norms are left to the fold, which says ``non-finite``).
    ``limit``: the absolute cap (``cap_limit``), checked from the first round on."""
    if not math.isfinite(norm):
        return ""
    if limit is not None and norm > limit:
        return OUTLIER
    if len(history) < cfg.min_history:
        return ""
    m = median(history)
    return OUTLIER if m > 0 and norm > cfg.factor * m else ""


def apply_guard(inputs: Sequence[RoundInput], history: Sequence[float], cfg: NormGuardConfig,
                params: Mapping[str, np.ndarray] | None = None) -> tuple[list[RoundInput], dict[str, float]]:
    """Mark outliers among ``inputs`` (those not already rejected) with ``norm-outlier``.

    ``params``: the fragment's current exact parameters (``FragmentState.params``), required when
    the guard has a cap. Returns the inputs (outliers replaced by copies carrying the reason) and
    every computed norm by the input's checksum, so the caller can record the merged inputs' norms.
    """
    if cfg.cap is not None and params is None:
        raise ValueError("apply_guard: this norm guard has a cap, pass the fragment's current params")
    limit = cap_limit(params, cfg) if params is not None else None
    out, norms = [], {}
    for inp in inputs:
        if inp.reject_reason or inp.tensors is None:
            out.append(inp)
            continue
        n = delta_norm(inp.tensors)
        norms[inp.checksum] = n
        reason = verdict(n, history, cfg, limit)
        out.append(dataclasses.replace(inp, reject_reason=reason) if reason else inp)
    return out, norms


def norms_agree(recorded: Sequence[float], computed: Sequence[float | None], cfg: NormGuardConfig) -> bool:
    """Whether recomputed norms match the recorded ones: bit for bit, except for version-1 maps,
    whose norms came from ``np.dot`` (BLAS, thread-count dependent) and may differ in the last bits."""
    if cfg.version >= 2:
        return list(recorded) == list(computed)
    return len(recorded) == len(computed) and all(
        c is not None and math.isclose(r, c, rel_tol=1e-9, abs_tol=0.0) for r, c in zip(recorded, computed))


@dataclass(frozen=True)
class NormWindow:
    """The recent merged norms of every fragment (what ``verdict`` compares against), as a value:
    ``pushed``/``prepended`` return a new window, so a commit that is never appended (fenced, a
    failed write) leaves the window it started from untouched."""

    cfg: NormGuardConfig
    recent: tuple[tuple[float, ...], ...]

    @classmethod
    def empty(cls, fragments: int, cfg: NormGuardConfig) -> "NormWindow":
        if not isinstance(fragments, int) or fragments < 1:
            raise ValueError(f"a norm window needs at least one fragment, got {fragments!r}")
        return cls(cfg, tuple(() for _ in range(fragments)))

    @property
    def fragments(self) -> int:
        return len(self.recent)

    def history(self, fragment: int) -> list[float]:
        return list(self.recent[fragment])

    def full(self, fragment: int) -> bool:
        return len(self.recent[fragment]) >= self.cfg.window

    def pushed(self, fragment: int, norms: Sequence[float]) -> "NormWindow":
        """The window after ``norms`` (newer than every norm in it) were merged into ``fragment``."""
        return self._with(fragment, self.recent[fragment] + tuple(float(n) for n in norms))

    def prepended(self, fragment: int, norms: Sequence[float]) -> "NormWindow":
        """The window with older norms added (when filling it backwards from a starting point)."""
        return self._with(fragment, tuple(float(n) for n in norms) + self.recent[fragment])

    def _with(self, fragment: int, norms: tuple[float, ...]) -> "NormWindow":
        recent = list(self.recent)
        recent[fragment] = norms[-self.cfg.window:]     # the newest ``window`` norms decide
        return NormWindow(self.cfg, tuple(recent))
