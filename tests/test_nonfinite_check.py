"""The learner's gradient check (workers/learner/nonfinite.py ``grads_finite``; issue 11 item 2,
issue 15): the fused CPU path refuses exactly what the total-norm path refuses - every non-finite
entry, every entry of magnitude >= 2^42, every step whose norm overflows - and leaves an accepted
step's gradients bit for bit as they were."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from workers.learner import nonfinite
from workers.learner.nonfinite import grads_finite

BIG = 2.0 ** 42


def params_with(grads: list[np.ndarray]) -> list[torch.nn.Parameter]:
    out = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros(g.shape, dtype=torch.float32))
        p.grad = torch.from_numpy(np.array(g, dtype=np.float32))
        out.append(p)
    return out


def awkward_grads(seed: int) -> list[np.ndarray]:
    """Finite gradients with the values scaling could spoil: subnormals, -0.0, the float32 min
    normal, entries just below 2^42, plus ordinary ones."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((17, 5)).astype(np.float32)
    b = (rng.standard_normal(33) * 1e-3).astype(np.float32)
    special = np.array([-0.0, 0.0, 1e-45, -1e-45, 1.17549435e-38, 3e-39, -2.5e-42,
                        np.nextafter(np.float32(BIG), np.float32(0)), -np.nextafter(np.float32(BIG), np.float32(0)),
                        1e12, 65504.0], dtype=np.float32)
    c = rng.standard_normal((3, 4, 2)).astype(np.float32)
    return [a, b, special, c]


CASES = {   # name -> (where, value): one entry of tensor ``where`` set to ``value``
    "nan first": (0, np.nan), "nan last": (3, np.nan), "+inf": (1, np.inf), "-inf": (2, -np.inf),
    "2^42": (1, BIG), "-2^42": (3, -BIG), "1e30": (0, 1e30), "float32 max": (2, np.finfo(np.float32).max),
}


def with_case(grads: list[np.ndarray], where: int, value: float) -> list[np.ndarray]:
    out = [g.copy() for g in grads]
    out[where].reshape(-1)[len(out[where].reshape(-1)) // 2] = value
    return out


@pytest.fixture(params=["fused", "norm"])
def path(request, monkeypatch):
    if request.param == "norm":      # every gradient set above the fused path's limit: the norm decides
        monkeypatch.setattr(nonfinite, "_MAX_FUSED", 0)
    return request.param


@pytest.mark.parametrize("seed", range(5))
def test_finite_gradients_pass_and_stay_bit_for_bit(seed, path):
    grads = awkward_grads(seed)
    params = params_with(grads)
    assert grads_finite(params)
    for g, p in zip(grads, params):
        assert np.array_equal(p.grad.numpy().view(np.uint32), g.view(np.uint32)), "a gradient's bits changed"


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_non_finite_or_huge_entry_is_refused(case, path):
    where, value = CASES[case]
    assert not grads_finite(params_with(with_case(awkward_grads(0), where, value)))


def test_both_paths_agree_around_the_bound(monkeypatch):
    below = float(np.nextafter(np.float32(BIG), np.float32(0)))
    for value in (below, BIG, -below, -BIG, 1e11, 1e13, np.inf, np.nan):
        grads = with_case(awkward_grads(1), 2, value)
        fused = grads_finite(params_with(grads))
        monkeypatch.setattr(nonfinite, "_MAX_FUSED", 0)
        norm = grads_finite(params_with(grads))
        monkeypatch.undo()
        assert fused == norm == (math.isfinite(value) and abs(value) < BIG), value


def test_whatever_the_old_norm_check_refused_is_refused():
    """The check before issue 15: refuse when the float32 total norm is not finite (it overflows
    at ~1.8e19 for one entry, less for many large ones)."""
    rng = np.random.default_rng(7)
    for scale in (1e3, 1e10, 1e15, 1e19, 1e20, 1e25):
        grads = [(rng.standard_normal(64) * scale).astype(np.float32) for _ in range(3)]
        params = params_with(grads)
        old_refused = not bool(torch.isfinite(torch.nn.utils.get_total_norm([p.grad for p in params])))
        if old_refused:
            assert not grads_finite(params_with(grads)), scale


def test_other_dtypes_and_no_gradients_take_the_norm_path():
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    p.grad = torch.tensor([1.0, 2.0, float("nan"), 0.0], dtype=torch.bfloat16)
    assert not grads_finite([p])
    p.grad = torch.tensor([1.0, 2.0, 3.0, 0.0], dtype=torch.bfloat16)
    assert grads_finite([p])
    assert grads_finite([torch.nn.Parameter(torch.zeros(3))])      # no gradient at all
