"""The outer Nesterov step against torch.optim.SGD(nesterov=True), and the exact FMA it relies on."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

import numpy as np
import pytest
import torch

from pipeline.outer import fma32, nesterov_step


def _ulps(a: np.ndarray, b: np.ndarray) -> int:
    """Largest distance in float32 units in the last place (same-sign finite values)."""
    ia = a.view(np.int32).astype(np.int64)
    ib = b.view(np.int32).astype(np.int64)
    ia = np.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = np.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return int(np.max(np.abs(ia - ib), initial=0))


@pytest.mark.parametrize("lr,mu", [(0.7, 0.9), (0.1, 0.5), (1.0, 0.0)])
def test_nesterov_matches_torch_sgd_over_100_steps(lr, mu):
    rng = np.random.default_rng(0)
    shapes = {"w": (37, 53), "b": (7,), "e": (3, 1, 129), "s": ()}   # odd sizes exercise torch's scalar tails
    p = {k: np.asarray(rng.standard_normal(s), np.float32) for k, s in shapes.items()}
    b = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    tp = {k: torch.nn.Parameter(torch.from_numpy(v.copy())) for k, v in p.items()}
    opt = torch.optim.SGD(list(tp.values()), lr=lr, momentum=mu, nesterov=mu > 0, foreach=False)
    for _ in range(100):
        g = {k: np.asarray(rng.standard_normal(s) * 10.0 ** rng.uniform(-3, 1), np.float32) for k, s in shapes.items()}
        for k in tp:
            tp[k].grad = torch.from_numpy(g[k].copy())
        opt.step()
        p, b = nesterov_step(p, b, g, lr, mu)
    for k in shapes:
        ours, theirs = p[k], tp[k].detach().numpy()
        assert ours.dtype == np.float32 and ours.shape == theirs.shape
        # How close: bit-exact on x86 CPUs (torch's vectorised add-with-alpha is an FMA, which fma32
        # reproduces). A torch build without FMA kernels rounds twice; allow 64 ulps after 100 steps there.
        assert _ulps(ours, theirs) <= 64, k
        if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
            assert ours.tobytes() == theirs.tobytes(), f"{k}: max abs diff {np.abs(ours - theirs).max()}"


def test_nesterov_is_pure_and_validates():
    p = {"a": np.ones(3, np.float32)}
    b = {"a": np.zeros(3, np.float32)}
    g = {"a": np.full(3, 2.0, np.float32)}
    p2, b2 = nesterov_step(p, b, g, 0.5, 0.9)
    assert np.array_equal(p["a"], np.ones(3)) and np.array_equal(b["a"], np.zeros(3))     # inputs untouched
    np.testing.assert_allclose(b2["a"], 2.0)
    np.testing.assert_allclose(p2["a"], 1 - 0.5 * (2 + 0.9 * 2), rtol=1e-6)
    with pytest.raises(ValueError, match="outer momentum must lie in"):
        nesterov_step(p, b, g, 0.5, 1.0)
    with pytest.raises(ValueError, match="outer lr must be a finite number"):
        nesterov_step(p, b, g, float("nan"), 0.9)
    with pytest.raises(ValueError, match="name different tensors"):
        nesterov_step(p, b, {"z": g["a"]}, 0.5, 0.9)
    with pytest.raises(ValueError, match="tensor a: shapes differ"):
        nesterov_step(p, b, {"a": np.zeros(4, np.float32)}, 0.5, 0.9)


def _correctly_rounded(a: float, b: float, c: float) -> np.float32:
    exact = Fraction(a) + Fraction(b) * Fraction(c)
    r = np.float32(float(exact))                 # candidate; check its neighbours
    cands = [r, np.nextafter(r, np.float32(np.inf)), np.nextafter(r, np.float32(-np.inf))]
    dist = [abs(Fraction(float(x)) - exact) for x in cands]
    best = min(dist)
    winners = [x for x, d in zip(cands, dist) if d == best]
    return min(winners, key=lambda x: int(np.array(x).view(np.int32)) & 1)   # ties to even


def test_fma32_rounds_once():
    rng = np.random.default_rng(3)
    a = rng.standard_normal(2000).astype(np.float32)
    b = (rng.standard_normal(2000) * 10.0 ** rng.uniform(-8, 2, 2000)).astype(np.float32)
    got = fma32(a, b, 0.9)
    c = float(np.float32(0.9))
    want = np.array([_correctly_rounded(float(x), float(y), c) for x, y in zip(a, b)], np.float32)
    assert got.tobytes() == want.tobytes()


def test_fma32_double_rounding_midpoint():
    # a + b*c = 1 + 2^-24 + 4688 * 2^-70: float64 rounds it onto the float32 midpoint 1 + 2^-24, whose
    # tie-to-even is 1.0; the single rounding of a real FMA gives 1 + 2^-23.
    m1, m2 = 2**23 + 2896, 2**23 - 2895
    b, c = np.float32(m1 * 2.0**-47), np.float32(m2 * 2.0**-23)
    a = np.array([1.0, -1.0], np.float32)
    naive = (a.astype(np.float64) + float(b) * float(c) * np.array([1, -1])).astype(np.float32)
    assert naive[0] == np.float32(1.0)
    got = fma32(a, np.array([b, -b], np.float32), c)
    assert got[0] == np.float32(1 + 2**-23) and got[1] == np.float32(-(1 + 2**-23))


# ------------------------------------------------------------------ issue 15: the fast outer step

def _ref_nesterov(p, b, g, lr, mu):
    """The outer step as it was before issue 15 (whole tensors, the generic fma32)."""
    new_p, new_b = {}, {}
    for k in sorted(p):
        buf = (b[k] * np.float32(mu)).astype(np.float32) + g[k]
        new_b[k] = buf
        new_p[k] = fma32(p[k], fma32(g[k], buf, mu), -lr)
    return new_p, new_b


def _hard_values(rng, n):
    """Gaussian values over many magnitudes, with subnormals, zeros, huge ones and exact midpoints."""
    x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-40, 37, n)).astype(np.float32)
    x[rng.integers(0, n, n // 50)] = 0.0
    x[rng.integers(0, n, n // 50)] = np.float32(1e-42)
    return x


def test_nesterov_equals_the_reference_on_hard_values_and_any_thread_count():
    rng = np.random.default_rng(11)
    shapes = {"big": (1_100_003,), "w": (300, 301), "s": (), "e": (0,)}
    p = {k: _hard_values(rng, int(np.prod(s))).reshape(s) for k, s in shapes.items()}
    b = {k: _hard_values(rng, int(np.prod(s))).reshape(s) for k, s in shapes.items()}
    g = {k: _hard_values(rng, int(np.prod(s))).reshape(s) for k, s in shapes.items()}
    # the double-rounding example of test_fma32_double_rounding_midpoint inside a big tensor: with
    # mu = 0, g2 = g and p' = 1 - lr * g = 1 + m1 * m2 * 2**-70, which float64 rounds onto a midpoint
    m1, m2 = 2**23 + 2896, 2**23 - 2895
    p["big"][5], g["big"][5], b["big"][5] = 1.0, np.float32(-m1 * 2.0**-47), 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for lr, mu in [(0.7, 0.9), (float(np.float32(m2 * 2.0**-23)), 0.0), (1e30, 0.5)]:
            want_p, want_b = _ref_nesterov(p, b, g, lr, mu)
            got_p, got_b = nesterov_step(p, b, g, lr, mu)
            with ThreadPoolExecutor(3) as pool:
                par_p, par_b = nesterov_step(p, b, g, lr, mu, map_fn=pool.map)
            for k in shapes:
                assert got_p[k].shape == shapes[k] and got_p[k].dtype == np.float32
                for got in (got_p[k], par_p[k]):
                    assert got.tobytes() == want_p[k].tobytes(), k
                for got in (got_b[k], par_b[k]):
                    assert got.tobytes() == want_b[k].tobytes(), k
