"""Token weights, RDA and the per-fragment merge (SPEC §4)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.merge import (MergeConfig, default_embedding_tensors, merge_fragment, rda, token_weights,
                            weighted_mean)


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
