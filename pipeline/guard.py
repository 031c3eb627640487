"""Norm guard: drop a delta whose norm is far out of line (issue 11 item 2, issue 25).

On by default for new runs (``create_run`` writes the descriptor's ``guard`` section, a
NormGuardConfig: ``{"factor": F, "window": W, "min_history": N, "cap": C, "enabled": E, "version": V}``;
new runs write ``NEW_RUN_VERSION``, 3). A delta of fragment p is dropped with reason ``norm-outlier`` when either

- its L2 norm exceeds ``C * max(|Theta_p|, sqrt(n_p))`` (``|Theta_p|`` the norm of the fragment's
  current exact parameters, ``n_p`` its number of values: the cap never collapses to 0 for a
  fragment of zeros). This holds from the very first round, before any history exists, and stops
  a finite "value bomb" (a delta filled with 1e4) outright; or
- at least N merged norms of p are known and its norm exceeds ``F`` times the median of the last
  W of them (a median of 0 gives no verdict).

Version 3 (issue 25, SPEC §11: a guard "judges each delta by what it is per step of work, and
never turns a whole round's agreement into a drop") changes the median rule only:

- it compares *per-step norms*, ``norm / sqrt(max(c_steps, 1))`` (``per_step_norm``), and the
  window holds the per-step norms of merged inputs. A delta of 300 steps made during an outage is
  then judged against 8-step deltas by its size per step: measured with the demo GPT under AdamW,
  raw norms grow like c^0.3-0.9, so 256-3000-step answers reached 14-103x the window raw (every
  one dropped, the fragment frozen) but at most 5.9x per step (docs/algorithm.md "Norm guard");
- **round agreement**: when every input of a round that the median rule judges (finite, under the
  cap) would be a median outlier, and they come from at least two learners, none is dropped by
  the median rule - the window is stale, not the learners. One learner alone is no agreement,
  and a normal input in the round keeps every outlier a drop.

The cap stays on the raw norm in every version: it is the one rule that trusts nothing the
learner says (``c_steps`` is the learner's own word), so a member lying about its steps gains
nothing past it, and measured, a 3,000-step delta is at most 12% of it (docs/algorithm.md).
Versions 1 and 2 keep exactly their rules (raw norms, no agreement), so stored runs replay as
they were written.

It bounds how far one signed-but-wrong learner (a bug, a bit flip, a compromised key) can push a
fragment in one round; RDA already bounds the merged norm by the weighted mean of the inputs'
norms (SPEC §4), so without the guard one huge delta moves the fragment by a weighted share of it.
Descriptors without a guard (runs made before it was on by default, hand-built ones) and guards with
``enabled: false`` have no guard; version-1 guards (maps written without a ``version`` key) have no
cap, as before.

Deterministic, so replay reaches the same verdicts (SPEC §7 'Replay'): the median comes from the
norms the syncer *recorded* in earlier merge commits (``CommitRecord.norms``, the raw L2 norm of
each merged input, in record order, in every version; a version-3 window divides each by the
square root of that input's recorded ``c_steps``, one correctly rounded IEEE division, so replay
and recovery rebuild the same bits; pipeline/commit.py keeps the window); the cap from the state
before the commit; and every norm is bit-stable whatever the BLAS thread count:
float32 values are squared exactly in float64, summed per fixed chunk of ``CHUNK`` values with
numpy's pairwise sum (never ``np.dot``/BLAS, whose blocking depends on its thread count), and the
chunk sums are added with ``math.fsum`` (correctly rounded, so independent of order).
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
GUARD_MAP_VERSION = 2     # norms of totals, with the cap: the rules of every run before issue 25
PER_STEP_VERSION = 3      # per-step norms and round agreement
NEW_RUN_VERSION = PER_STEP_VERSION   # the dataclass default: what create_run writes (workers/launch.py)
MAP_VERSIONS = (1, GUARD_MAP_VERSION, PER_STEP_VERSION)
CHUNK = 1 << 16           # values per pairwise-summed chunk (fixed: part of the replayed format)
_SLAB = 64 * CHUNK        # values squared at a time (bounds the float64 scratch memory)


@dataclass(frozen=True)
class NormGuardConfig:
    factor: float = 10.0          # drop when the norm exceeds factor x the recent median
    window: int = 32              # recent merged deltas per fragment that make the median
    min_history: int = 8          # no median verdict until this many merged deltas are known
    cap: float | None = 10.0      # drop when the norm exceeds cap x max(|Theta_p|, sqrt(n_p)); None: no cap
    enabled: bool = True          # False: the run has no guard (recorded, so replay knows)
    version: int = NEW_RUN_VERSION     # 1: maps written before the cap (np.dot norms, no cap); 2: totals; 3: per step

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
        if not isinstance(self.version, int) or isinstance(self.version, bool) or self.version not in MAP_VERSIONS:
            raise ValueError(f"norm guard map version {self.version!r} not one of {', '.join(map(str, MAP_VERSIONS))}")
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
    """``norm-outlier`` or "" for one delta by the version-1/2 rules (non-finite norms are left to
    the fold, which says ``non-finite``). ``limit``: the absolute cap (``cap_limit``), checked from
    the first round on. Version 3 judges a round at once: ``round_verdicts``."""
    if not math.isfinite(norm):
        return ""
    if limit is not None and norm > limit:
        return OUTLIER
    return OUTLIER if _median_outlier(norm, history, cfg) else ""


def _median_outlier(value: float, history: Sequence[float], cfg: NormGuardConfig) -> bool:
    """Whether ``value`` exceeds ``factor`` x the median of ``history`` (no verdict before
    ``min_history`` values, or against a median of 0)."""
    if len(history) < cfg.min_history:
        return False
    m = median(history)
    return m > 0 and value > cfg.factor * m


def per_step_norm(norm: float, c_steps: int) -> float:
    """A delta's norm per step of work (guard map version 3, issue 25): ``norm / sqrt(c_steps)``
    (``c_steps`` 0 counts as 1: the fold drops such a delta anyway). The square root is what
    makes long deltas comparable with short ones for AdamW learners (docs/algorithm.md "Norm
    guard"); ``math.sqrt`` and the division are correctly rounded, so replay gets the same bits."""
    return norm / math.sqrt(max(int(c_steps), 1))


def window_values(cfg: NormGuardConfig, norms: Sequence[float], c_steps: Sequence[int]) -> tuple[float, ...]:
    """What the window records for merged inputs with these raw ``norms`` and ``c_steps`` (record
    order): the raw norms (versions 1, 2), their per-step norms (version 3)."""
    if len(norms) != len(c_steps):
        raise ValueError(f"{len(norms)} norms but {len(c_steps)} c_steps: one of each per merged input")
    if cfg.version < PER_STEP_VERSION:
        return tuple(float(n) for n in norms)
    return tuple(per_step_norm(n, c) for n, c in zip(norms, c_steps))


def round_verdicts(norms: Sequence[float], c_steps: Sequence[int], learners: Sequence[str],
                   history: Sequence[float], cfg: NormGuardConfig, limit: float | None) -> list[str]:
    """The verdict (``norm-outlier`` or "") on each judged input of one round, from its raw norm,
    ``c_steps`` and learner id. Versions 1, 2: ``verdict`` on each raw norm. Version 3 (module
    docstring, SPEC §11): the cap on the raw norm; the median rule on per-step norms against a
    window of per-step norms; and round agreement - when every finite input under the cap is a
    median outlier and they come from at least two learners, the median rule drops none."""
    if not len(norms) == len(c_steps) == len(learners):
        raise ValueError(f"round_verdicts: {len(norms)} norms, {len(c_steps)} c_steps, {len(learners)} learners")
    if cfg.version < PER_STEP_VERSION:
        return [verdict(n, history, cfg, limit) for n in norms]
    capped = [math.isfinite(n) and limit is not None and n > limit for n in norms]
    judged = [k for k, n in enumerate(norms) if math.isfinite(n) and not capped[k]]
    outliers = {k for k in judged if _median_outlier(per_step_norm(norms[k], c_steps[k]), history, cfg)}
    if judged and len(outliers) == len(judged) and len({learners[k] for k in judged}) >= 2:
        outliers = set()          # the whole round disagrees with the window: the window is stale
    return [OUTLIER if capped[k] or k in outliers else "" for k in range(len(norms))]


def apply_guard(inputs: Sequence[RoundInput], history: Sequence[float], cfg: NormGuardConfig,
                params: Mapping[str, np.ndarray] | None = None) -> tuple[list[RoundInput], dict[str, float]]:
    """Mark outliers among ``inputs`` (those not already rejected) with ``norm-outlier``
    (``round_verdicts``: the inputs of one round are judged together).

    ``params``: the fragment's current exact parameters (``FragmentState.params``), required when
    the guard has a cap. Returns the inputs (outliers replaced by copies carrying the reason) and
    every computed (raw) norm by the input's checksum, so the caller can record the merged inputs' norms.
    """
    if cfg.cap is not None and params is None:
        raise ValueError("apply_guard: this norm guard has a cap, pass the fragment's current params")
    limit = cap_limit(params, cfg) if params is not None else None
    judged = [k for k, i in enumerate(inputs) if not i.reject_reason and i.tensors is not None]
    values = [delta_norm(inputs[k].tensors) for k in judged]
    return mark_outliers(inputs, judged, values, history, cfg, limit)


def mark_outliers(inputs: Sequence[RoundInput], judged: Sequence[int], values: Sequence[float],
                  history: Sequence[float], cfg: NormGuardConfig,
                  limit: float | None) -> tuple[list[RoundInput], dict[str, float]]:
    """``inputs`` with ``norm-outlier`` set on the outliers among ``judged`` (indices, whose raw
    norms are ``values``), and those norms by checksum: the part of ``apply_guard`` after the
    norms, shared with the pooled guard (pipeline/commit.py)."""
    heads = [inputs[k].header for k in judged]
    reasons = round_verdicts(values, [h.c_steps for h in heads], [h.learner for h in heads], history, cfg, limit)
    out, norms = list(inputs), {}
    for k, n, reason in zip(judged, values, reasons):
        norms[inputs[k].checksum] = n
        if reason:
            out[k] = dataclasses.replace(inputs[k], reject_reason=reason)
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
