"""Merging one round's outer gradients: token weights and radial-directional averaging (SPEC §4).

- token weight ``w_m = c_tokens * (c_tokens / c_steps)`` (amount of data times throughput),
  normalised over the round; a learner with no steps or no tokens weighs 0.
- RDA per tensor: ``(sum w |v| / sum w) * unit(sum w unit(v))`` with ``unit(0) = 0``; if the mean
  direction is numerically zero (opposite vectors), the weighted mean ``sum w v / sum w`` is used.
- embedding and output-embedding tensors always use the weighted mean (their outer gradients are
  not near-orthogonal, so RDA's norm-preserving average would overshoot).

Replay needs these results bit for bit whatever machine runs them, so: weights are computed with
exact rational arithmetic and rounded once; every reduction runs in float64 in a fixed order (a
Python loop over learners in the given order, ``np.sum`` over elements, which is numpy's fixed
pairwise sum and never a BLAS call whose blocking could depend on thread count); results are float32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from functools import partial
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

__all__ = ["MergeConfig", "default_embedding_tensors", "token_weights", "rda", "weighted_mean",
           "merge_fragment", "METHODS"]

METHODS = ("rda", "mean")

# A direction whose length is below this fraction of the total weight counts as zero (SPEC:
# "numerically zero"). The sum of weighted unit vectors has length at most sum(w), so the test is
# dimensionless: it does not depend on the scale of the gradients.
DIRECTION_EPS = 1e-12

# Module names (parts of a dotted tensor name) that denote input or output embeddings.
_EMBED_PARTS = frozenset({"wte", "wpe", "embed", "embedding", "embeddings", "tok_embeddings", "embed_tokens",
                          "word_embeddings", "position_embeddings", "token_type_embeddings", "lm_head"})
# Generic words that name the output embedding only as a top-level module ("output.weight" in
# LLaMA-style code, "head.weight" in small GPTs); deeper ("layer.0.output.dense") they are not.
_TOP_LEVEL_PARTS = frozenset({"output", "head"})


@dataclass(frozen=True)
class MergeConfig:
    """How to merge: ``method`` "rda" or "mean"; ``embedding_tensors`` always use the weighted mean."""

    method: str = "rda"
    embedding_tensors: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"merge method {self.method!r} not one of {METHODS}")
        if isinstance(self.embedding_tensors, str):
            raise ValueError(f"embedding_tensors must be a collection of names, got the string {self.embedding_tensors!r}")
        names = frozenset(self.embedding_tensors)
        bad = [n for n in names if not isinstance(n, str) or not n]
        if bad:
            raise ValueError(f"embedding tensor names must be non-empty strings, got {bad!r}")
        object.__setattr__(self, "embedding_tensors", names)


def _is_embedding(name: str) -> bool:
    parts = name.split(".")
    modules = parts[:-1] if len(parts) > 1 else parts   # the last part is the parameter ("weight")
    if len(parts) > 1 and parts[0] in _TOP_LEVEL_PARTS:
        return True
    for part in modules:
        if part in _EMBED_PARTS or part.endswith(("_embedding", "_embeddings")) or part.startswith("embed"):
            return True
    return False


def default_embedding_tensors(names: Iterable[str]) -> frozenset[str]:
    """Names that look like input/output embeddings by common conventions (GPT-2, LLaMA, HF).

    Matches a module part among wte, wpe, embed*, *_embedding(s), tok_embeddings, lm_head, and
    ``output``/``head`` as the top-level module (``output.weight``, ``head.weight``).
    """
    return frozenset(n for n in names if _is_embedding(n))


def token_weights(c_tokens: Sequence[int], c_steps: Sequence[int]) -> np.ndarray:
    """Normalised token weights (float64, sum 1 up to one rounding per entry).

    Exact: each ``t*t/s / sum(t*t/s)`` is a rational rounded once, so scaling every count by the
    same factor gives bit-identical weights. Entries with no steps or no tokens get 0.
    """
    if len(c_tokens) != len(c_steps):
        raise ValueError(f"token weights: {len(c_tokens)} token counts but {len(c_steps)} step counts")
    raw: list[Fraction] = []
    for i, (t, s) in enumerate(zip(c_tokens, c_steps)):
        for what, v in (("c_tokens", t), ("c_steps", s)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
                raise ValueError(f"token weights: entry {i} has {what}={v!r}; counts must be non-negative ints")
        raw.append(Fraction(int(t) * int(t), int(s)) if t and s else Fraction(0))
    total = sum(raw, Fraction(0))
    if total == 0:
        raise ValueError(f"token weights: every entry has zero steps or tokens "
                         f"(c_tokens={list(c_tokens)}, c_steps={list(c_steps)})")
    return np.array([float(r / total) for r in raw], dtype=np.float64)


def _check_inputs(vectors: Sequence[np.ndarray], weights) -> tuple[list[np.ndarray], np.ndarray]:
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    if len(vectors) == 0:
        raise ValueError("merge needs at least one vector")
    if len(vectors) != w.size:
        raise ValueError(f"merge: {len(vectors)} vectors but {w.size} weights")
    if not np.all(np.isfinite(w)) or np.any(w < 0) or not np.sum(w) > 0:
        raise ValueError(f"merge weights must be finite, non-negative and not all zero, got {w.tolist()}")
    vs = [np.asarray(v) for v in vectors]
    shape = vs[0].shape
    for i, v in enumerate(vs):
        if v.shape != shape:
            raise ValueError(f"merge: vector {i} has shape {v.shape}, vector 0 has {shape}")
    return vs, w


def _total(w: np.ndarray) -> float:
    return math.fsum(float(x) for x in w)


# ----------------------------------------------------------------------------- the kernels
#
# Bit for bit the straightforward float64 computation (tests/test_merge.py keeps it as the reference):
# per tensor, the norm of each input is sqrt(np.sum(v64 * v64)) over the whole float64 vector, the
# direction and the mean accumulate w * v64 in float64 in the given order, and the result is rounded
# to float32 once. The kernels go in leaves of at most _LEAF values, whose float64 temporaries stay in
# cache, and never make a float64 copy of an input (ufuncs cast float32 to float64 in their buffers).
# A whole-vector np.sum is rebuilt from the np.sum of each leaf, the leaves being nodes of numpy's own
# pairwise summation tree (a node of n > 128 values is the sum of its halves, split at
# n // 2 - (n // 2) % 8): the same additions in the same order. Jobs of about _JOB values go through
# the caller's ``map_fn`` (e.g. ``ThreadPoolExecutor.map``; numpy releases the GIL); results are
# gathered in job order, so they never depend on how many threads ran them.

_LEAF = 1 << 16
_JOB = 1 << 20
# How jobs run: ``map_fn(fn, jobs)`` yields ``fn(job)`` in order (``map``, ``ThreadPoolExecutor.map``).
MapFn = Callable[[Callable[[Any], Any], Iterable[Any]], Iterable[Any]]


def _split(n: int) -> int:
    half = n // 2
    return half - half % 8


def _leaves(n: int) -> list[tuple[int, int]]:
    """The nodes of numpy's pairwise summation tree over n values that hold at most _LEAF values."""
    out: list[tuple[int, int]] = []
    todo = [(0, n)]
    while todo:
        lo, m = todo.pop()
        if m <= _LEAF:
            out.append((lo, lo + m))
        else:   # the right half is pushed first, so the left one comes out first
            h = _split(m)
            todo += [(lo + h, m - h), (lo, h)]
    return out


def _tree_sum(n: int, leaf_sums: Sequence) -> Any:
    """np.sum over n values from the sums of its ``_leaves(n)``, added as numpy adds them."""
    it = iter(leaf_sums)

    def node(m: int) -> Any:
        if m <= _LEAF:
            return next(it)
        h = _split(m)
        left = node(h)   # the left half first: leaves come in order
        return left + node(m - h)
    return node(n)


@dataclass
class _Plan:
    """One tensor's merge: its flat inputs of non-zero weight with their weights, the total weight,
    RDA or the weighted mean, the flat float32 result, the leaves; for RDA the per-input
    coefficients w / |v| (None for a zero vector), the mean norm, the direction and its scale."""

    vs: list[np.ndarray]
    ws: list[float]
    total: float
    rda: bool
    out: np.ndarray
    leaves: list[tuple[int, int]]
    coefs: list[float | None] = field(default_factory=list)
    mean_norm: float = 0.0
    direction: np.ndarray | None = None
    scale: float = 0.0


def _plan(vs: list[np.ndarray], w: np.ndarray, rda: bool) -> _Plan:
    kept = [(np.ravel(v), wi) for v, wi in zip(vs, w) if wi]
    n = vs[0].size
    return _Plan([v for v, _ in kept], [wi for _, wi in kept], _total(w), rda, np.empty(n, np.float32),
                  _leaves(n), direction=np.empty(n, np.float64) if rda else None)


def _jobs(plans: list[_Plan], which: Iterable[int]) -> list[tuple[int, int, int]]:
    """(plan, first leaf, end leaf) for the chosen plans, about _JOB values a job, in order."""
    per = max(1, _JOB // _LEAF)
    return [(p, a, min(a + per, len(plans[p].leaves)))
            for p in which for a in range(0, len(plans[p].leaves), per)]


def _norms_job(job: tuple[int, int, int], plans: list[_Plan]) -> np.ndarray:
    """Per leaf and input: np.sum of the input's float64 squares over the leaf."""
    p, a, b = job
    plan = plans[p]
    tmp, sums = np.empty(_LEAF, np.float64), np.empty((b - a, len(plan.vs)), np.float64)
    for j, (lo, hi) in enumerate(plan.leaves[a:b]):
        sq = tmp[:hi - lo]
        for m, v in enumerate(plan.vs):
            np.square(v[lo:hi], out=sq, dtype=np.float64)
            sums[j, m] = np.sum(sq)
    return sums


def _sum_job(job: tuple[int, int, int], plans: list[_Plan]) -> np.ndarray | None:
    """RDA: the direction sum(coef * v) over the job's leaves and, per leaf, np.sum of its squares.
    Weighted mean: the result, sum(w * v) / total."""
    p, a, b = job
    plan = plans[p]
    tmp, acc = np.empty(_LEAF, np.float64), np.empty(_LEAF, np.float64)
    sums = np.empty(b - a, np.float64)
    terms = zip(plan.vs, plan.coefs) if plan.rda else zip(plan.vs, plan.ws)
    terms = [(v, c) for v, c in terms if c is not None]   # unit(0) = 0
    for j, (lo, hi) in enumerate(plan.leaves[a:b]):
        s = plan.direction[lo:hi] if plan.rda else acc[:hi - lo]
        t = tmp[:hi - lo]
        s.fill(0.0)
        for v, c in terms:
            np.multiply(v[lo:hi], c, out=t, dtype=np.float64)
            np.add(s, t, out=s)
        if plan.rda:
            np.multiply(s, s, out=t)
            sums[j] = np.sum(t)
        else:
            np.divide(s, plan.total, out=plan.out[lo:hi], casting="same_kind")
    return sums if plan.rda else None


def _scale_job(job: tuple[int, int, int], plans: list[_Plan]) -> None:
    """RDA's result: the direction times its scale, rounded to float32 once."""
    p, a, b = job
    plan = plans[p]
    lo, hi = plan.leaves[a][0], plan.leaves[b - 1][1]
    np.multiply(plan.direction[lo:hi], plan.scale, out=plan.out[lo:hi], casting="same_kind")


def _gather(jobs: list[tuple[int, int, int]], results: Iterable) -> dict[int, list]:
    per: dict[int, list] = {}
    for (p, _, _), r in zip(jobs, results):
        per.setdefault(p, []).append(r)
    return per


def _merge(plans: list[_Plan], map_fn: MapFn | None) -> None:
    """Fill every plan's ``out``: norms (RDA), then directions and means, then RDA's scaling (or the
    weighted mean where the direction is numerically zero). Three rounds of jobs."""
    run = map_fn or map
    rda = [i for i, p in enumerate(plans) if p.rda]
    jobs = _jobs(plans, rda)
    for p, parts in _gather(jobs, run(partial(_norms_job, plans=plans), jobs)).items():
        plan = plans[p]
        squares = _tree_sum(plan.out.size, [row for part in parts for row in part])
        norm_acc = 0.0
        for w, sq in zip(plan.ws, squares):
            n = math.sqrt(float(sq))
            norm_acc += w * n
            plan.coefs.append(w / n if n > 0 else None)
        plan.mean_norm = norm_acc / plan.total
    jobs = _jobs(plans, range(len(plans)))
    dnorms = {p: math.sqrt(float(_tree_sum(plans[p].out.size, np.concatenate(parts))))
              for p, parts in _gather(jobs, run(partial(_sum_job, plans=plans), jobs)).items() if plans[p].rda}
    fallback = []
    for p, dnorm in dnorms.items():
        plan = plans[p]
        if dnorm <= DIRECTION_EPS * plan.total or plan.mean_norm == 0.0:
            plan.rda, fallback = False, fallback + [p]
        else:
            plan.scale = plan.mean_norm / dnorm
    jobs = _jobs(plans, fallback) + _jobs(plans, [p for p in dnorms if plans[p].rda])
    list(run(lambda job: _sum_job(job, plans) if job[0] in fallback else _scale_job(job, plans), jobs))


def weighted_mean(vectors: Sequence[np.ndarray], weights) -> np.ndarray:
    """``sum w v / sum w`` in float64, accumulated in the given order; float32 result."""
    vs, w = _check_inputs(vectors, weights)
    plan = _plan(vs, w, rda=False)
    _merge([plan], None)
    return plan.out.reshape(vs[0].shape)


def rda(vectors: Sequence[np.ndarray], weights) -> np.ndarray:
    """Radial-directional average: the weighted mean norm along the weighted mean direction.

    Falls back to :func:`weighted_mean` when the mean direction is (numerically) zero, that is when
    its length is at most ``DIRECTION_EPS * sum(w)``. Computed in float64, returned float32.
    """
    vs, w = _check_inputs(vectors, weights)
    plan = _plan(vs, w, rda=True)
    _merge([plan], None)
    return plan.out.reshape(vs[0].shape)


def merge_fragment(grads: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float],
                   cfg: MergeConfig, *, map_fn: MapFn | None = None) -> dict[str, np.ndarray]:
    """Merge one fragment's outer gradients tensor by tensor; float32 results keyed like the inputs.

    Every map must name the same tensors with the same shapes (ValueError naming the tensor).
    ``map_fn`` runs the jobs (default: ``map``, on this thread); it never changes the results.
    """
    if not grads:
        raise ValueError("merge_fragment needs at least one gradient map")
    names = sorted(grads[0])
    for i, g in enumerate(grads):
        if set(g) != set(names):
            diff = sorted(set(g) ^ set(names))
            raise ValueError(f"merge_fragment: gradient {i} names different tensors than gradient 0: {diff}")
    plans, shapes = [], []
    for name in names:
        shape = np.shape(grads[0][name])
        for i, g in enumerate(grads):
            if np.shape(g[name]) != shape:
                raise ValueError(f"merge_fragment: tensor {name}: gradient {i} has shape {np.shape(g[name])}, "
                                 f"gradient 0 has {shape}")
        vs, w = _check_inputs([g[name] for g in grads], weights)
        plans.append(_plan(vs, w, rda=cfg.method == "rda" and name not in cfg.embedding_tensors))
        shapes.append(shape)
    _merge(plans, map_fn)
    return {name: plan.out.reshape(shape) for name, plan, shape in zip(names, plans, shapes)}
