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
from dataclasses import dataclass
from fractions import Fraction
from typing import Iterable, Mapping, Sequence

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


def _norm(x64: np.ndarray) -> float:
    # np.sum of squares: a fixed pairwise order (np.linalg.norm / np.dot may go through BLAS).
    return math.sqrt(float(np.sum(x64 * x64)))


def weighted_mean(vectors: Sequence[np.ndarray], weights) -> np.ndarray:
    """``sum w v / sum w`` in float64, accumulated in the given order; float32 result."""
    vs, w = _check_inputs(vectors, weights)
    acc = np.zeros(vs[0].shape, dtype=np.float64)
    for v, wi in zip(vs, w):
        if wi:
            acc += wi * v.astype(np.float64)
    return (acc / _total(w)).astype(np.float32)


def rda(vectors: Sequence[np.ndarray], weights) -> np.ndarray:
    """Radial-directional average: the weighted mean norm along the weighted mean direction.

    Falls back to :func:`weighted_mean` when the mean direction is (numerically) zero, that is when
    its length is at most ``DIRECTION_EPS * sum(w)``. Computed in float64, returned float32.
    """
    vs, w = _check_inputs(vectors, weights)
    total = _total(w)
    norm_acc = 0.0
    direction = np.zeros(vs[0].shape, dtype=np.float64)
    for v, wi in zip(vs, w):
        if not wi:
            continue
        v64 = v.astype(np.float64)
        n = _norm(v64)
        norm_acc += wi * n
        if n > 0:                                      # unit(0) = 0
            direction += (wi / n) * v64
    mean_norm = norm_acc / total
    dnorm = _norm(direction)
    if dnorm <= DIRECTION_EPS * total or mean_norm == 0.0:
        return weighted_mean(vs, w)
    return (direction * (mean_norm / dnorm)).astype(np.float32)


def merge_fragment(grads: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float],
                   cfg: MergeConfig) -> dict[str, np.ndarray]:
    """Merge one fragment's outer gradients tensor by tensor; float32 results keyed like the inputs.

    Every map must name the same tensors with the same shapes (ValueError naming the tensor).
    """
    if not grads:
        raise ValueError("merge_fragment needs at least one gradient map")
    names = sorted(grads[0])
    for i, g in enumerate(grads):
        if set(g) != set(names):
            diff = sorted(set(g) ^ set(names))
            raise ValueError(f"merge_fragment: gradient {i} names different tensors than gradient 0: {diff}")
    out: dict[str, np.ndarray] = {}
    for name in names:
        shape = np.shape(grads[0][name])
        for i, g in enumerate(grads):
            if np.shape(g[name]) != shape:
                raise ValueError(f"merge_fragment: tensor {name}: gradient {i} has shape {np.shape(g[name])}, "
                                 f"gradient 0 has {shape}")
        vs = [g[name] for g in grads]
        if cfg.method == "mean" or name in cfg.embedding_tensors:
            out[name] = weighted_mean(vs, weights)
        else:
            out[name] = rda(vs, weights)
    return out
