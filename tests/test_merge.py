"""Token weights, RDA and the per-fragment merge (SPEC §4)."""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline import merge as merge_mod
from pipeline.merge import (DIRECTION_EPS, MergeConfig, default_embedding_tensors, merge_fragment, rda,
                            token_weights, weighted_mean)


def _norm(x):
    return float(np.sqrt(np.sum(np.asarray(x, np.float64) ** 2)))


# ------------------------------------------------------------------ token weights

def test_token_weights_formula_and_zero_entries():
    w = token_weights([100, 200, 50, 0], [10, 10, 0, 5])
    # raw: 100*10 = 1000, 200*20 = 4000, no steps -> 0, no tokens -> 0
    assert w.dtype == np.float64
    np.testing.assert_array_equal(w, [0.2, 0.8, 0.0, 0.0])


def test_token_weights_slow_learner_weighs_less():
    # same steps, half the tokens per step: a quarter of the weight (tokens * throughput)
    w = token_weights([1000, 500], [10, 10])
    assert w[0] == pytest.approx(0.8) and w[1] == pytest.approx(0.2)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 10**4)), min_size=1, max_size=8),
       st.integers(2, 10**6))
def test_token_weights_invariant_to_scaling_all_counts(pairs, k):
    toks = [t for t, _ in pairs]
    steps = [s for _, s in pairs]
    if not any(toks):
        with pytest.raises(ValueError, match="zero steps or tokens"):
            token_weights(toks, steps)
        return
    a = token_weights(toks, steps)
    b = token_weights([t * k for t in toks], [s * k for s in steps])
    np.testing.assert_array_equal(a, b)             # exact rationals: bit-identical
    assert abs(a.sum() - 1.0) < 1e-12


@pytest.mark.parametrize("toks,steps,msg", [
    ([0, 0], [1, 1], "zero steps or tokens"),
    ([5], [0], "zero steps or tokens"),
    ([-1], [1], "c_tokens=-1"),
    ([1], [-2], "c_steps=-2"),
    ([1, 2], [1], "2 token counts but 1 step counts"),
])
def test_token_weights_rejects_bad_counts(toks, steps, msg):
    with pytest.raises(ValueError, match=msg):
        token_weights(toks, steps)


# ------------------------------------------------------------------ RDA

vec_lists = st.integers(1, 6).flatmap(lambda m: st.tuples(
    st.lists(st.lists(st.floats(-100, 100, allow_nan=False, width=32), min_size=5, max_size=5), min_size=m, max_size=m),
    st.lists(st.floats(0.01, 10), min_size=m, max_size=m)))


@settings(max_examples=80, deadline=None)
@given(vec_lists, st.floats(0.01, 50))
def test_rda_norm_equals_common_norm(data, radius):
    raw, w = data
    vs = [np.asarray(v, np.float64) for v in raw]
    if any(_norm(v) < 1e-3 for v in vs):
        return
    vs = [(v / _norm(v) * radius).astype(np.float32) for v in vs]
    out = rda(vs, np.asarray(w))
    assert out.dtype == np.float32
    direction = sum(wi * v.astype(np.float64) / _norm(v) for v, wi in zip(vs, w))
    if _norm(direction) <= 1e-9 * sum(w):
        return                                       # fallback case, tested separately
    common = np.mean([_norm(v) for v in vs])
    assert _norm(out) == pytest.approx(common, rel=1e-5)


@settings(max_examples=80, deadline=None)
@given(vec_lists)
def test_rda_norm_within_input_norms(data):
    raw, w = data
    vs = [np.asarray(v, np.float32) for v in raw]
    norms = [_norm(v) for v in vs]
    direction = sum(wi * v.astype(np.float64) / n for v, wi, n in zip(vs, w, norms) if n > 0)
    if np.ndim(direction) == 0 or _norm(direction) <= 1e-9 * sum(w):
        return
    out = _norm(rda(vs, np.asarray(w)))
    assert min(norms) * (1 - 1e-5) - 1e-6 <= out <= max(norms) * (1 + 1e-5) + 1e-6


def test_rda_is_norm_preserving_unlike_the_mean():
    # Orthogonal gradients: the mean shrinks by 1/sqrt(M), RDA keeps the norm (the point of RDA).
    vs = [np.eye(4, dtype=np.float32)[i] * 3 for i in range(4)]
    w = np.full(4, 0.25)
    assert _norm(rda(vs, w)) == pytest.approx(3.0, rel=1e-6)
    assert _norm(weighted_mean(vs, w)) == pytest.approx(1.5, rel=1e-6)


def test_rda_single_vector_is_that_vector():
    v = np.random.default_rng(1).standard_normal(100).astype(np.float32)
    np.testing.assert_allclose(rda([v], [1.0]), v, rtol=1e-6)


def test_rda_falls_back_to_weighted_mean_on_opposite_vectors():
    v = np.array([1.0, -2.0, 3.0], np.float32)
    out = rda([v, -v], [0.5, 0.5])
    np.testing.assert_array_equal(out, np.zeros(3, np.float32))      # the mean, not a random direction
    # unequal weights: the direction is not zero, RDA keeps the mean norm along v
    out2 = rda([v, -v], [0.75, 0.25])
    np.testing.assert_allclose(out2, v, rtol=1e-6)


def test_rda_zero_vectors_count_in_norm_but_not_direction():
    v = np.array([3.0, 4.0], np.float32)
    out = rda([v, np.zeros(2, np.float32)], [0.5, 0.5])
    np.testing.assert_allclose(out, v / 2, rtol=1e-6)                # mean norm 2.5 along unit(v)
    np.testing.assert_array_equal(rda([np.zeros(2, np.float32)] * 2, [1, 1]), np.zeros(2, np.float32))


def test_weighted_mean_values():
    out = weighted_mean([np.array([1, 2], np.float32), np.array([3, 6], np.float32)], [1.0, 3.0])
    np.testing.assert_array_equal(out, np.array([2.5, 5.0], np.float32))


@pytest.mark.parametrize("fn", [rda, weighted_mean])
def test_merge_rejects_bad_inputs(fn):
    a = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match="at least one"):
        fn([], [])
    with pytest.raises(ValueError, match="2 vectors but 1 weights"):
        fn([a, a], [1.0])
    with pytest.raises(ValueError, match="not all zero"):
        fn([a, a], [0.0, 0.0])
    with pytest.raises(ValueError, match="non-negative"):
        fn([a, a], [1.0, -1.0])
    with pytest.raises(ValueError, match=r"vector 1 has shape \(4,\)"):
        fn([a, np.zeros(4, np.float32)], [1.0, 1.0])


# ------------------------------------------------------------------ fragments and configuration

def test_merge_fragment_embeddings_use_the_mean():
    vs = [np.eye(3, dtype=np.float32)[i] for i in range(3)]
    grads = [{"wte.weight": v, "h.0.attn.weight": v} for v in vs]
    w = [1 / 3] * 3
    out = merge_fragment(grads, w, MergeConfig("rda", frozenset({"wte.weight"})))
    np.testing.assert_allclose(out["wte.weight"], np.full(3, 1 / 3, np.float32), rtol=1e-6)
    assert _norm(out["h.0.attn.weight"]) == pytest.approx(1.0, rel=1e-6)
    mean_all = merge_fragment(grads, w, MergeConfig("mean"))
    np.testing.assert_allclose(mean_all["h.0.attn.weight"], np.full(3, 1 / 3), rtol=1e-6)
    assert all(a.dtype == np.float32 for a in out.values())


def test_merge_fragment_rejects_mismatched_maps():
    a = {"x": np.zeros(2, np.float32), "y": np.zeros(3, np.float32)}
    with pytest.raises(ValueError, match=r"different tensors.*\['y'\]"):
        merge_fragment([a, {"x": a["x"]}], [1, 1], MergeConfig())
    with pytest.raises(ValueError, match="tensor y: gradient 1 has shape"):
        merge_fragment([a, {"x": a["x"], "y": np.zeros(4, np.float32)}], [1, 1], MergeConfig())


def test_merge_is_deterministic_in_given_order():
    rng = np.random.default_rng(7)
    grads = [{"t": rng.standard_normal((64, 33)).astype(np.float32)} for _ in range(5)]
    w = token_weights([100, 80, 120, 90, 10], [10, 9, 11, 10, 3])
    a = merge_fragment(grads, w, MergeConfig())["t"]
    b = merge_fragment([{"t": g["t"].copy()} for g in grads], w.copy(), MergeConfig())["t"]
    assert a.tobytes() == b.tobytes()


def test_merge_config_validation():
    with pytest.raises(ValueError, match="'sum' not one of"):
        MergeConfig("sum")
    with pytest.raises(ValueError, match="the string 'wte'"):
        MergeConfig("rda", "wte")
    assert MergeConfig("mean", ["a", "a"]).embedding_tensors == frozenset({"a"})


def test_default_embedding_tensors():
    names = ["transformer.wte.weight", "transformer.wpe.weight", "lm_head.weight", "tok_embeddings.weight",
             "output.weight", "head.weight", "model.embed_tokens.weight", "bert.embeddings.word_embeddings.weight",
             "pos_embedding", "h.0.attn.c_attn.weight", "encoder.layer.0.output.dense.weight", "h.0.mlp.head_proj",
             "layers.1.attention.wq.weight", "ln_f.weight"]
    got = default_embedding_tensors(names)
    assert got == frozenset(names[:9])


# ------------------------------------------------------------------ issue 15: the fast kernels

def _ref_weighted_mean(vs, w):
    """The merge as it was before issue 15: whole float64 vectors, straight numpy."""
    w = np.asarray(w, np.float64)
    acc = np.zeros(np.shape(vs[0]), np.float64)
    for v, wi in zip(vs, w):
        if wi:
            acc += wi * np.asarray(v).astype(np.float64)
    return (acc / math.fsum(float(x) for x in w)).astype(np.float32)


def _ref_rda(vs, w):
    w = np.asarray(w, np.float64)
    total = math.fsum(float(x) for x in w)
    norm_acc, direction = 0.0, np.zeros(np.shape(vs[0]), np.float64)
    for v, wi in zip(vs, w):
        if not wi:
            continue
        v64 = np.asarray(v).astype(np.float64)
        n = math.sqrt(float(np.sum(v64 * v64)))
        norm_acc += wi * n
        if n > 0:
            direction += (wi / n) * v64
    mean_norm = norm_acc / total
    dnorm = math.sqrt(float(np.sum(direction * direction)))
    if dnorm <= DIRECTION_EPS * total or mean_norm == 0.0:
        return _ref_weighted_mean(vs, w)
    return (direction * (mean_norm / dnorm)).astype(np.float32)


SIZES = [0, 1, 7, 8, 9, 127, 128, 129, 1000, 8193, 65_535, 65_536, 65_537, 2 * 65_536 + 7, 300_017]


@pytest.mark.parametrize("n", SIZES + [1_234_567, 2_500_001])
def test_leaf_sums_rebuild_numpys_own_sum_exactly(n):
    # the kernels' one assumption about numpy: np.sum of a vector is the pairwise tree over it
    a = np.random.default_rng(n).standard_normal(n) ** 2 * 10.0 ** np.random.default_rng(n + 1).uniform(-30, 30, n)
    leaves = merge_mod._leaves(n)
    assert leaves[0][0] == 0 and leaves[-1][1] == n and all(x[1] == y[0] for x, y in zip(leaves, leaves[1:]))
    got = merge_mod._tree_sum(n, [np.sum(a[lo:hi]) for lo, hi in leaves])
    assert float(got) == float(np.sum(a))
    assert float(got) == float(np.sum(a.reshape(-1, 1) if n else a))          # any contiguous shape


@pytest.mark.parametrize("n", SIZES)
def test_rda_and_mean_equal_the_reference_bit_for_bit(n):
    rng = np.random.default_rng(n)
    for M in (1, 2, 5):
        vs = [(rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 3)).astype(np.float32) for _ in range(M)]
        if n:
            vs[0][rng.integers(0, n, max(1, n // 3))] = -0.0
        w = list(rng.uniform(0, 2, M))
        if M > 2:
            w[1] = 0.0                                                 # a learner of no weight
            vs[2][:] = 0.0                                             # a zero vector: no direction
        assert rda(vs, w).tobytes() == _ref_rda(vs, w).tobytes()
        assert weighted_mean(vs, w).tobytes() == _ref_weighted_mean(vs, w).tobytes()


def test_special_cases_equal_the_reference():
    rng = np.random.default_rng(3)
    v = rng.standard_normal(20_000).astype(np.float32)
    w64 = rng.standard_normal((37, 300))                               # float64 inputs, 2-D
    cases = [([v, -v], [0.5, 0.5]), ([v, -v], [0.75, 0.25]), ([np.zeros(9, np.float32)] * 2, [1, 1]),
             ([w64, w64[::-1].copy()], [1.0, 2.0]), ([v[::2], v[1::2]], [1.0, 1.0])]   # strided views
    for vs, w in cases:
        assert rda(vs, w).tobytes() == _ref_rda(vs, w).tobytes()
        assert weighted_mean(vs, w).tobytes() == _ref_weighted_mean(vs, w).tobytes()


def test_the_sign_of_zero_inputs_changes_no_merge():
    # pipeline/fold.py passes a delta against the current version as it is, where the straight
    # formula (0 + delta) would turn -0.0 into +0.0: no merge may see the difference.
    rng = np.random.default_rng(4)
    vs = [rng.standard_normal(5000).astype(np.float32) for _ in range(3)]
    for v in vs:
        v[rng.integers(0, 5000, 2000)] = -0.0
    plus = [(v.astype(np.float64) + 0.0).astype(np.float32) for v in vs]
    assert not any(np.signbit(p[p == 0]).any() for p in plus) and any(np.signbit(v[v == 0]).any() for v in vs)
    for method in ("rda", "mean"):
        a = merge_fragment([{"t": v} for v in vs], [1, 2, 3], MergeConfig(method))["t"]
        b = merge_fragment([{"t": p} for p in plus], [1, 2, 3], MergeConfig(method))["t"]
        assert a.tobytes() == b.tobytes()


def _fragment(rng, M):
    shapes = {"big": (1_300_001,), "mat": (700, 1500), "wte.weight": (5000, 64), "b": (3,), "z": (0,)}
    return [{k: (rng.standard_normal(s) * 1e-2).astype(np.float32) for k, s in shapes.items()} for _ in range(M)]


def test_merge_fragment_is_bit_identical_at_any_thread_count_and_equals_the_reference():
    rng = np.random.default_rng(9)
    grads = _fragment(rng, 4)
    w = token_weights([100, 80, 120, 90], [10, 9, 11, 10])
    cfg = MergeConfig("rda", frozenset({"wte.weight"}))
    alone = merge_fragment(grads, w, cfg)
    for threads in (2, 3):
        with ThreadPoolExecutor(threads) as pool:
            got = merge_fragment(grads, w, cfg, map_fn=pool.map)
        assert all(got[k].tobytes() == alone[k].tobytes() and got[k].shape == alone[k].shape for k in alone)
    for k in ("mat", "b", "z", "big"):
        assert alone[k].tobytes() == _ref_rda([g[k] for g in grads], w).tobytes()
    assert alone["wte.weight"].tobytes() == _ref_weighted_mean([g["wte.weight"] for g in grads], w).tobytes()
