"""Fragment layouts (SPEC §5), offsets and due fragments (SPEC §2), extract/assign."""
from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from pipeline.fragment import (
    STRATEGIES, assign, balanced_layout, due_fragments, extract, fragment_bytes, fragment_offsets,
    layerwise_layout, layout_stats, make_layout, roundrobin_layout, specs_from_arrays,
)
from pipeline.types import TensorSpec

FAST = settings(max_examples=60, deadline=None)


def _specs(sizes: list[int]) -> list[TensorSpec]:
    return [TensorSpec(f"t{i:02d}", (n,)) for i, n in enumerate(sizes)]


def _check_partition(specs, layout, P):
    assert len(layout) == P
    placed = [n for f in layout for n in f]
    assert sorted(placed) == sorted(s.name for s in specs), "every tensor exactly once"
    assert all(f for f in layout), "no empty fragment"
    assert all(f == sorted(f) for f in layout)


def _optimal_makespan(sizes: list[int], P: int) -> int:
    best = sum(sizes)
    for assignment in itertools.product(range(P), repeat=len(sizes)):
        loads = [0] * P
        for s, p in zip(sizes, assignment):
            loads[p] += s
        best = min(best, max(loads))
    return best


# ------------------------------------------------------------------------------ balanced

@FAST
@given(st.lists(st.integers(0, 1000), min_size=1, max_size=7), st.integers(1, 3))
def test_balanced_within_four_thirds_of_brute_force_optimum(sizes, P):
    P = min(P, len(sizes))
    specs = _specs(sizes)
    layout = balanced_layout(specs, P)
    _check_partition(specs, layout, P)
    got = max(fragment_bytes(specs, layout))
    opt = 4 * _optimal_makespan(sizes, P)  # float32: 4 bytes per element
    assert got * 3 <= opt * 4


@FAST
@given(st.lists(st.integers(1, 10_000), min_size=1, max_size=200), st.integers(1, 64))
def test_balanced_lpt_invariant_against_lower_bound(sizes, P):
    P = min(P, len(sizes))
    specs = _specs(sizes)
    layout = balanced_layout(specs, P)
    _check_partition(specs, layout, P)
    size = {s.name: s.nbytes for s in specs}
    loads = fragment_bytes(specs, layout)
    lower = max(max(size.values()), sum(loads) / P)
    for f, load in zip(layout, loads):
        if len(f) > 1:
            # The last tensor put into f (its smallest) went to the then-lightest fragment.
            assert load - min(size[n] for n in f) <= min(loads)
    heaviest = layout[loads.index(max(loads))]
    assert max(loads) <= lower + (min(size[n] for n in heaviest) if len(heaviest) > 1 else 0)


@FAST
@given(st.lists(st.integers(0, 50), min_size=2, max_size=30), st.integers(1, 8), st.randoms())
def test_balanced_is_independent_of_input_order(sizes, P, rnd):
    P = min(P, len(sizes))
    specs = _specs(sizes)
    shuffled = list(specs)
    rnd.shuffle(shuffled)
    assert balanced_layout(specs, P) == balanced_layout(shuffled, P)


def test_balanced_tie_rules_and_zero_sized_tensors():
    specs = [TensorSpec("b", (4,)), TensorSpec("a", (4,)), TensorSpec("c", (2,)), TensorSpec("d", (2,))]
    # a (tie with b, name first) -> 0; b -> 1; c -> 0 (tie, lowest index); d -> 1
    assert balanced_layout(specs, 2) == [["a", "c"], ["b", "d"]]
    zeros = [TensorSpec(f"z{i}", (0,)) for i in range(5)]
    _check_partition(zeros, balanced_layout(zeros, 3), 3)


# ------------------------------------------------------------------- a real transformer

class _Block(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln_1 = torch.nn.LayerNorm(d)
        self.attn = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.ln_2 = torch.nn.LayerNorm(d)
        self.fc = torch.nn.Linear(d, 4 * d)
        self.fc_out = torch.nn.Linear(4 * d, d)


class _GPT(torch.nn.Module):
    def __init__(self, vocab=1000, ctx=128, d=64, layers=6):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, d)
        self.wpe = torch.nn.Embedding(ctx, d)
        self.h = torch.nn.ModuleList(_Block(d) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(d)
        self.lm_head = torch.nn.Linear(d, vocab, bias=False)


@pytest.fixture(scope="module")
def gpt_specs():
    torch.manual_seed(0)
    return specs_from_arrays(_GPT().state_dict())


@pytest.mark.parametrize("P", [3, 6, 8, 12])
def test_balanced_beats_roundrobin_on_a_transformer(gpt_specs, P):
    stats = {s: layout_stats(gpt_specs, make_layout(gpt_specs, P, s)) for s in STRATEGIES}
    for s in STRATEGIES:
        _check_partition(gpt_specs, make_layout(gpt_specs, P, s), P)
    assert stats["balanced"]["max_bytes"] < stats["roundrobin"]["max_bytes"]
    assert stats["balanced"]["max_bytes"] <= stats["layerwise"]["max_bytes"]
    lower = max(max(s.nbytes for s in gpt_specs), sum(s.nbytes for s in gpt_specs) / P)
    assert stats["balanced"]["max_bytes"] <= 4 / 3 * lower


def test_layerwise_groups_consecutive_layers(gpt_specs):
    layout = layerwise_layout(gpt_specs, 3)
    layers_of = [sorted({int(n.split(".")[1]) for n in f if n.startswith("h.")}) for f in layout]
    assert layers_of == [[0, 1], [2, 3], [4, 5]]
    assert {"wte.weight", "wpe.weight"} <= set(layout[0])
    assert {"ln_f.weight", "lm_head.weight"} <= set(layout[2])
    # 6 layers, P = 4: layer counts differ by at most one and stay in order
    counts = [len({n.split(".")[1] for n in f if n.startswith("h.")}) for f in layerwise_layout(gpt_specs, 4)]
    assert sorted(counts) == [1, 1, 2, 2] and sum(counts) == 6


def test_layerwise_falls_back_to_tensor_runs_with_few_layers():
    specs = [TensorSpec(n, (3,)) for n in ("emb", "layers.0.w", "layers.0.b", "layers.1.w", "head")]
    assert layerwise_layout(specs, 2) == [["emb", "layers.0.b", "layers.0.w"], ["head", "layers.1.w"]]
    layout = layerwise_layout(specs, 4)  # 2 layers < 4 fragments: runs of 2,1,1,1 tensors in model order
    assert layout == [["emb", "layers.0.w"], ["layers.0.b"], ["layers.1.w"], ["head"]]


def test_roundrobin_is_model_order_modulo_p():
    specs = _specs([1, 2, 3, 4, 5])
    assert roundrobin_layout(specs, 2) == [["t00", "t02", "t04"], ["t01", "t03"]]


# ---------------------------------------------------------------------------- validation

def test_layout_validation_messages():
    specs = _specs([1, 2, 3])
    with pytest.raises(ValueError, match=r"P=4 .* only 3 tensors"):
        balanced_layout(specs, 4)
    with pytest.raises(ValueError, match=r"P must be an int >= 1, got 0"):
        make_layout(specs, 0, "layerwise")
    with pytest.raises(ValueError, match=r"strategy 'zigzag'"):
        make_layout(specs, 2, "zigzag")
    with pytest.raises(ValueError, match=r"duplicate tensor name 't00'"):
        roundrobin_layout(specs + [TensorSpec("t00", (1,))], 2)
    with pytest.raises(ValueError, match=r"fragment 1 names tensor 'nope'"):
        fragment_bytes(specs, [["t00"], ["nope"]])


def test_layout_stats():
    specs = _specs([3, 1, 2])
    stats = layout_stats(specs, [["t00"], ["t01", "t02"]])
    assert stats == {"max_bytes": 12, "min_bytes": 12, "mean_bytes": 12.0, "imbalance": 1.0, "fragments": 2}
    assert layout_stats(specs, [["t00", "t01"], ["t02"]])["imbalance"] == pytest.approx(16 / 12)


# ------------------------------------------------------------------------- offsets, due

@FAST
@given(st.integers(1, 64), st.integers(1, 64), st.integers(0, 10_000))
def test_offsets_distinct_and_each_fragment_due_once_per_window(P, H, start):
    if P > H:
        with pytest.raises(ValueError, match=f"P={P} .* H={H}"):
            fragment_offsets(P, H)
        return
    offsets = fragment_offsets(P, H)
    assert len(set(offsets)) == P and all(0 <= t < H for t in offsets)
    assert offsets == sorted(offsets)
    gaps = [b - a for a, b in zip(offsets, offsets[1:] + [offsets[0] + H])]
    assert max(gaps) - min(gaps) <= 1, "evenly spread"
    due = [p for step in range(start, start + H) for p in due_fragments(step, H, offsets)]
    assert sorted(due) == list(range(P))


def test_default_p_equals_h_is_one_fragment_per_step():
    assert fragment_offsets(4, 4) == [0, 1, 2, 3]
    assert [due_fragments(s, 4, [0, 1, 2, 3]) for s in range(6)] == [[0], [1], [2], [3], [0], [1]]
    assert fragment_offsets(2, 5) == [0, 2]


# --------------------------------------------------------------------- extract / assign

def test_extract_assign_round_trip_numpy():
    state = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, dtype=np.float64)}
    got = extract(state, ["a", "b"])
    assert got["b"].dtype == np.float32 and np.array_equal(got["a"], state["a"])
    got["a"] += 1  # a copy, not a view
    assert state["a"][0, 0] == 0
    assign(state, {"a": got["a"], "b": np.full(4, 2.5, np.float32)})
    assert state["a"][0, 0] == 1 and state["b"].dtype == np.float64 and (state["b"] == 2.5).all()


def test_extract_assign_round_trip_torch():
    torch.manual_seed(1)
    model = _GPT(vocab=50, ctx=8, d=8, layers=2)
    state = model.state_dict()
    names = sorted(state)
    values = extract(state, names)
    assert all(v.dtype == np.float32 for v in values.values())
    before = values["wte.weight"].copy()
    with torch.no_grad():
        model.wte.weight.add_(1.0)  # a live view would change with it
    assert np.array_equal(values["wte.weight"], before)
    assign(state, {"wte.weight": before})  # default path: dst.new_tensor
    assert torch.equal(model.wte.weight, torch.from_numpy(before))
    assign(state, {"h.0.fc.bias": np.zeros(32, np.float32)}, from_numpy=torch.from_numpy)
    assert not model.h[0].fc.bias.any()
    half = {"w": torch.zeros(3, dtype=torch.bfloat16)}
    assign(half, {"w": np.array([1.0, 1.00390625, 3.0], np.float32)})
    assert half["w"].dtype == torch.bfloat16 and half["w"][2].item() == 3.0


def test_assign_checks_everything_before_writing():
    state = {"a": np.zeros(3, np.float32), "b": np.zeros((2, 2), np.float32)}
    with pytest.raises(ValueError, match=r"tensor b: shape mismatch, state has \(2, 2\), value has \(4,\)"):
        assign(state, {"a": np.ones(3, np.float32), "b": np.ones(4, np.float32)})
    assert not state["a"].any(), "nothing written on a failed assign"
    with pytest.raises(ValueError, match=r"'c' is not in the state"):
        assign(state, {"c": np.ones(1)})
    with pytest.raises(ValueError, match=r"'c' is not in the state"):
        extract(state, ["c"])
    with pytest.raises(ValueError, match="duplicate"):
        extract(state, ["a", "a"])


def test_specs_from_arrays_names_dtypes_without_torch_import():
    specs = specs_from_arrays({"x": torch.zeros(2, 3, dtype=torch.bfloat16), "y": np.zeros(4, np.float64),
                               "z": torch.zeros((), dtype=torch.float16)})
    assert specs == [TensorSpec("x", (2, 3), "bfloat16"), TensorSpec("y", (4,), "float64"),
                     TensorSpec("z", (), "float16")]
    with pytest.raises(ValueError, match=r"tensor i: dtype 'int64'"):
        specs_from_arrays({"i": np.zeros(2, np.int64)})


def test_layouts_are_identical_across_calls_and_processes_inputs():
    specs = _specs([random.Random(7).randint(1, 99) for _ in range(40)])
    for s in STRATEGIES:
        assert make_layout(specs, 5, s) == make_layout(list(specs), 5, s)
