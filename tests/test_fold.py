"""The syncer's fold: drops, staleness, exactly-once, determinism, checkpoints and replay checks."""
from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.envelope import seal
from pipeline.errors import FormatError
from pipeline.fold import (FoldResult, ReplayMismatch, RoundInput, SyncerState, check_commit, fold, fold_fence,
                           initial_state, published)
from pipeline.checksum import tensor_digest
from pipeline.merge import MergeConfig, merge_fragment, token_weights
from pipeline.outer import OuterConfig, nesterov_step
from pipeline.descriptor import RunDescriptor, VersionsConfig
from pipeline.fragment import FragmentLayout
from pipeline.schedule import ScheduleConfig
from pipeline.types import DeltaHeader, TensorSpec

SHAPES = {"wte.weight": (4, 3), "h.0.w": (5,), "h.1.w": (6,)}


def make_layout(shapes=SHAPES) -> FragmentLayout:
    return FragmentLayout(tuple(TensorSpec(n, s) for n, s in shapes.items()), (("h.0.w", "wte.weight"), ("h.1.w",)))


def make_desc(method: str = "rda", **kw) -> RunDescriptor:
    # fp32 versions, one high-water mark, momentum 0.9: the exact arithmetic these tests spell out
    base = dict(run_id="run-1", layout=make_layout(), schedule=ScheduleConfig(2, (0, 1)),
                merge=MergeConfig(method, frozenset({"wte.weight"})), versions=VersionsConfig("fp32", 3, marks=1),
                outer=OuterConfig(0.7, 0.9))
    base.update(kw)
    return RunDescriptor(**base)


def init_model(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}


def delta(rng, names=("h.0.w", "wte.weight"), scale=0.01) -> dict[str, np.ndarray]:
    return {n: (rng.standard_normal(SHAPES[n]) * scale).astype(np.float32) for n in names}


def inp(learner, seq, tensors, *, base=0, steps=10, tokens=1000, inc=0, frag=0, reject="") -> RoundInput:
    h = DeltaHeader(learner, inc, seq, frag, base, steps, tokens, learner_step=seq * 2)
    return RoundInput(h, f"deltas/{learner}/{inc}/{seq}", f"sum-{learner}-{inc}-{seq}", tensors, reject)


def run(state, desc, inputs, frag=0, **kw) -> FoldResult:
    return fold(state, desc, frag, inputs, seq=state.last_seq + 1, epoch=1,
                output_key=f"versions/{frag}/{state.last_seq + 1}", **kw)


# ------------------------------------------------------------------ merge semantics

def test_fresh_delta_merges_as_the_outer_gradient_exactly():
    desc = make_desc(method="mean")
    s0 = initial_state(desc, init_model())
    d = delta(np.random.default_rng(1))
    res = run(s0, desc, [inp("a", 0, d)])
    p, b = nesterov_step(s0.fragments[0].params, s0.fragments[0].momentum, d, 0.7, 0.9)
    for n in p:
        assert res.state.fragments[0].params[n].tobytes() == p[n].tobytes()
        assert res.state.fragments[0].momentum[n].tobytes() == b[n].tobytes()
    assert res.record.kind == "merge" and res.record.version == 1 and res.record.fragment == 0
    assert res.record.inputs[0].weight == 1.0 and res.record.inputs[0].staleness == 0
    assert res.record.output_checksum == tensor_digest(res.published)
    assert sorted(res.state.fragments[0].history) == [0, 1]
    assert res.state.fragments[1] is s0.fragments[1]             # untouched fragment shared


def test_stale_delta_is_reconstructed_against_the_current_version():
    desc = make_desc(method="mean")
    rng = np.random.default_rng(2)
    s0 = initial_state(desc, init_model())
    s1 = run(s0, desc, [inp("a", 0, delta(rng))]).state
    d_b = delta(rng)
    res = run(s1, desc, [inp("b", 0, d_b, base=0)])             # b trained from version 0
    h = s1.fragments[0].history
    theta_b = {n: h[0][n] - d_b[n] for n in d_b}                  # b's parameters
    v = {n: (h[1][n].astype(np.float64) - theta_b[n].astype(np.float64)).astype(np.float32) for n in d_b}
    p, _ = nesterov_step(s1.fragments[0].params, s1.fragments[0].momentum, v, 0.7, 0.9)
    for n in p:
        np.testing.assert_allclose(res.state.fragments[0].params[n], p[n], rtol=0, atol=1e-6)
        # far from treating the stale delta as if it were fresh
        assert np.abs(v[n] - d_b[n]).max() > 1e-3
    assert res.record.inputs[0].staleness == 1 and res.record.version == 2


def test_weights_rda_and_embedding_mean_in_a_round():
    desc = make_desc()
    rng = np.random.default_rng(3)
    s0 = initial_state(desc, init_model())
    ds = [delta(rng) for _ in range(3)]
    res = run(s0, desc, [inp("c", 0, ds[2], tokens=500), inp("a", 0, ds[0], tokens=1000),
                         inp("b", 0, ds[1], tokens=1000, steps=20)])
    w = token_weights([1000, 1000, 500], [10, 20, 10])
    assert [i.delta_id for i in res.record.inputs] == ["a/0/0", "b/0/0", "c/0/0"]
    assert [i.weight for i in res.record.inputs] == list(w)
    g = merge_fragment(ds, w, MergeConfig("rda", frozenset({"wte.weight"})))
    p, _ = nesterov_step(s0.fragments[0].params, s0.fragments[0].momentum, g, 0.7, 0.9)
    for n in p:
        assert res.state.fragments[0].params[n].tobytes() == p[n].tobytes()


def test_fold_never_mutates_its_input_state():
    desc = make_desc()
    s0 = initial_state(desc, init_model())
    before = s0.to_bytes()
    res = run(s0, desc, [inp("a", 0, delta(np.random.default_rng(4)))])
    assert s0.to_bytes() == before and s0.last_seq == -1 and s0.high_water == [{}, {}]
    assert res.state.last_seq == 0
    with pytest.raises(ValueError, match="read-only"):
        res.state.fragments[0].params["h.0.w"][0] = 1.0


def test_seq_must_follow_the_last_one():
    desc = make_desc()
    s0 = initial_state(desc, init_model())
    with pytest.raises(ValueError, match="commit seq 3 does not follow the last folded seq -1"):
        fold(s0, desc, 0, [], seq=3, epoch=1, output_key="x")
    with pytest.raises(ValueError, match="fragment 5 out of range"):
        fold(s0, desc, 5, [], seq=0, epoch=1, output_key="x")


# ------------------------------------------------------------------ drops

def test_every_drop_reason_is_recorded():
    desc = make_desc(versions=VersionsConfig(retain=2))
    rng = np.random.default_rng(5)
    s = initial_state(desc, init_model())
    s = run(s, desc, [inp("h", 3, delta(rng))]).state             # v1; h's high water (0, 3)
    s = run(s, desc, [inp("h", 4, delta(rng), base=1)]).state     # v2; history {1, 2}
    bad_shape = delta(rng)
    bad_shape["h.0.w"] = np.zeros(4, np.float32)
    extra = dict(delta(rng), **{"h.1.w": np.zeros(6, np.float32)})
    nan = delta(rng)
    nan["wte.weight"][1, 2] = np.nan
    inputs = [
        inp("a", 0, delta(rng), base=2, reject="bad-signature"),
        inp("b", 0, None, base=2),
        inp("c", 0, delta(rng), base=2, frag=1),
        inp("d", 0, bad_shape, base=2),
        inp("d2", 0, extra, base=2),
        inp("e", 0, nan, base=2),
        inp("f", 0, delta(rng), base=2, steps=0),
        inp("h", 4, delta(rng), base=2),                          # already merged
        inp("i", 0, delta(rng), base=3),
        inp("j", 0, delta(rng), base=0),
        inp("k", 0, delta(rng), base=2), inp("k", 1, delta(rng), base=2),
    ]
    res = run(s, desc, inputs)
    reasons = {d.delta_id: d.reason for d in res.record.dropped}
    assert reasons == {"a/0/0": "bad-signature", "b/0/0": "undecodable", "c/0/0": "wrong-fragment",
                       "d/0/0": "shape-mismatch: h.0.w", "d2/0/0": "shape-mismatch: h.1.w", "e/0/0": "non-finite",
                       "f/0/0": "zero-steps", "h/0/4": "duplicate", "i/0/0": "base-from-future",
                       "j/0/0": "base-too-old", "k/0/0": "superseded"}
    assert [i.delta_id for i in res.record.inputs] == ["k/0/1"]
    d = next(x for x in res.record.dropped if x.delta_id == "a/0/0")
    assert (d.key, d.checksum, d.c_tokens) == ("deltas/a/0/0", "sum-a-0-0", 1000)
    assert res.record.high_water == {"h": [0, 4], "k": [0, 1]}


def test_round_with_no_survivors_is_a_drop_commit():
    desc = make_desc()
    s0 = initial_state(desc, init_model())
    res = run(s0, desc, [inp("a", 0, None), inp("b", 0, delta(np.random.default_rng(6)), steps=0)])
    assert res.published is None and res.record.kind == "drop" and res.record.version == 0
    assert res.record.output_checksum == "" and len(res.record.dropped) == 2
    assert res.state.last_seq == 0 and res.state.fragments[0] is s0.fragments[0]


def test_high_water_dedupes_across_rounds_and_copies():
    desc = make_desc()
    rng = np.random.default_rng(7)
    s = initial_state(desc, init_model())
    d5 = delta(rng)
    r1 = run(s, desc, [inp("a", 5, d5), inp("b", 0, delta(rng))])
    assert r1.record.high_water == {"a": [0, 5], "b": [0, 0]}
    # the same delta again (resent, or via spill), an older one, and a newer one with its own duplicate copy
    d6 = delta(rng)
    late = [inp("a", 5, d5, base=0), inp("a", 4, delta(rng)), inp("a", 6, d6, base=1),
            dataclasses.replace(inp("a", 6, d6, base=1), key="spill/a/0/6")]
    r2 = run(r1.state, desc, late)
    assert [i.delta_id for i in r2.record.inputs] == ["a/0/6"]
    assert sorted((d.delta_id, d.reason, d.key) for d in r2.record.dropped) == [
        ("a/0/4", "duplicate", "deltas/a/0/4"), ("a/0/5", "duplicate", "deltas/a/0/5"),
        ("a/0/6", "duplicate", "spill/a/0/6")]
    assert r2.record.high_water == {"a": [0, 6], "b": [0, 0]}
    # a new incarnation starts again at seq 0 and is newer
    r3 = run(r2.state, desc, [inp("a", 0, delta(rng), base=2, inc=1)])
    assert r3.record.kind == "merge" and r3.record.high_water["a"] == [1, 0]


def test_history_is_trimmed_to_retain_versions():
    desc = make_desc(versions=VersionsConfig(retain=2))
    rng = np.random.default_rng(8)
    s = initial_state(desc, init_model())
    for v in range(4):
        s = run(s, desc, [inp("a", v, delta(rng), base=v)]).state
    assert sorted(s.fragments[0].history) == [3, 4] and s.fragments[0].version == 4


# ------------------------------------------------------------------ determinism

_RNG = np.random.default_rng(9)
_DESC = make_desc()
_S1 = run(initial_state(_DESC, init_model()), _DESC, [inp("z", 0, delta(_RNG))]).state
_INPUTS = [inp("a", 0, delta(_RNG), tokens=900), inp("b", 0, delta(_RNG), base=0, steps=7),
           inp("b", 1, delta(_RNG), base=1), inp("c", 0, delta(_RNG), base=1, tokens=3000, steps=30),
           inp("d", 0, None), inp("e", 2, delta(_RNG, scale=1.0), base=1, tokens=10)]
_REF = run(_S1, _DESC, _INPUTS)


@settings(max_examples=25, deadline=None)
@given(st.permutations(list(range(len(_INPUTS)))))
def test_fold_is_bit_identical_under_any_input_order(perm):
    res = run(_S1, _DESC, [_INPUTS[i] for i in perm])
    assert res.record == _REF.record
    for n in _REF.published:
        assert res.published[n].tobytes() == _REF.published[n].tobytes()
        assert res.state.fragments[0].momentum[n].tobytes() == _REF.state.fragments[0].momentum[n].tobytes()


def test_bf16_versions_publish_rounded_values():
    codec = pytest.importorskip("pipeline.codec")
    desc = make_desc(versions=VersionsConfig("bf16", 3))
    s0 = initial_state(desc, init_model())
    res = run(s0, desc, [inp("a", 0, delta(np.random.default_rng(10)))])
    for n, a in res.published.items():
        np.testing.assert_array_equal(a, codec.round_to_bf16(res.state.fragments[0].params[n]))
        assert not np.array_equal(a, res.state.fragments[0].params[n])   # params stay exact fp32
    assert published(s0.fragments[0].params, "fp32")["h.0.w"].tobytes() == s0.fragments[0].params["h.0.w"].tobytes()
    with pytest.raises(ValueError, match="fp16"):
        published(s0.fragments[0].params, "fp16")


# ------------------------------------------------------------------ checkpoints

def _two_rounds():
    desc = make_desc()
    rng = np.random.default_rng(11)
    s = initial_state(desc, init_model())
    s = run(s, desc, [inp("a", 0, delta(rng)), inp("b", 0, delta(rng))]).state
    s = run(s, desc, [inp("c", 0, delta(rng, names=("h.1.w",)), frag=1)], frag=1).state
    s = fold_fence(s, s.last_seq + 1, 2).state
    return desc, s, rng


def test_checkpoint_round_trip_continues_identically():
    desc, s, rng = _two_rounds()
    blob = s.to_bytes()
    t = SyncerState.from_bytes(blob, desc)
    assert t.to_bytes() == blob and t.last_seq == 2 and t.high_water == s.high_water and t.run_id == "run-1"
    for fa, fb in zip(s.fragments, t.fragments):
        assert fa.version == fb.version and sorted(fa.history) == sorted(fb.history)
        for n in fa.params:
            assert fa.params[n].tobytes() == fb.params[n].tobytes()
            assert fa.momentum[n].tobytes() == fb.momentum[n].tobytes()
    nxt = [inp("a", 1, delta(rng), base=1)]
    assert run(s, desc, nxt).record == run(t, desc, nxt).record


def test_damaged_checkpoints_raise_format_error():
    desc, s, _ = _two_rounds()
    blob = bytearray(s.to_bytes())
    blob[len(blob) // 2] ^= 0xFF
    with pytest.raises(FormatError, match="checksum mismatch|not a valid envelope"):
        SyncerState.from_bytes(bytes(blob), desc)
    with pytest.raises(FormatError, match="truncated"):
        SyncerState.from_bytes(s.to_bytes()[:-100], desc)
    with pytest.raises(FormatError, match="not of run 'other'"):
        SyncerState.from_bytes(s.to_bytes(), make_desc(run_id="other"))
    other_shape = make_desc(layout=make_layout({n: (7,) if n == "h.1.w" else sh for n, sh in SHAPES.items()}))
    with pytest.raises(FormatError, match=r"tensor h.1.w: shape \[6\] but the descriptor says \[7\]"):
        SyncerState.from_bytes(s.to_bytes(), other_shape)
    # well-sealed bodies with wrong contents
    body = msgpack.unpackb(msgpack.unpackb(s.to_bytes())[3], raw=False)

    def reseal(b):
        return seal("syncer-checkpoint", 1, msgpack.packb(b, use_bin_type=True))

    b = msgpack.unpackb(msgpack.packb(body), raw=False)
    b["fragments"][0]["params"]["h.0.w"]["data"] = b"\0" * 8
    with pytest.raises(FormatError, match=r"params tensor h.0.w: 8 bytes for shape \[5\]"):
        SyncerState.from_bytes(reseal(b), desc)
    b = msgpack.unpackb(msgpack.packb(body), raw=False)
    b["fragments"][1]["history"] = b["fragments"][1]["history"][:-1]
    with pytest.raises(FormatError, match="fragment 1: version 1 with history"):
        SyncerState.from_bytes(reseal(b), desc)
    b = msgpack.unpackb(msgpack.packb(body), raw=False)
    b["high_water"][0]["a"] = [0, -1]
    with pytest.raises(FormatError, match="bad high-water entry 'a'"):
        SyncerState.from_bytes(reseal(b), desc)
    b = msgpack.unpackb(msgpack.packb(body), raw=False)
    del b["last_seq"]
    with pytest.raises(FormatError, match="missing field 'last_seq'"):
        SyncerState.from_bytes(reseal(b), desc)
    with pytest.raises(FormatError, match="is a 'commit' object"):
        SyncerState.from_bytes(seal("commit", 1, b"x"), desc)


# ------------------------------------------------------------------ replay checks

def _recorded():
    desc = make_desc()
    rng = np.random.default_rng(12)
    s = initial_state(desc, init_model())
    inputs = [inp("a", 0, delta(rng)), inp("b", 0, delta(rng), tokens=700), inp("c", 0, None)]
    return desc, s, inputs, run(s, desc, inputs)


def test_check_commit_accepts_the_recorded_commit():
    desc, s, inputs, res = _recorded()
    again = check_commit(s, desc, res.record, list(reversed(inputs)))
    assert again.record == res.record and again.state.to_bytes() == res.state.to_bytes()
    fence = fold_fence(res.state, 1, 2, {"syncer": "s2"}).record
    assert check_commit(res.state, desc, fence, []).state.last_seq == 1


def test_check_commit_detects_an_altered_weight():
    desc, s, inputs, res = _recorded()
    ins = list(res.record.inputs)
    ins[1] = dataclasses.replace(ins[1], weight=ins[1].weight + 1e-9)
    with pytest.raises(ReplayMismatch, match=r"input 1 \(b/0/0\): weight recorded") as e:
        check_commit(s, desc, dataclasses.replace(res.record, inputs=tuple(ins)), inputs)
    assert e.value.seq == 0 and e.value.fragment == 0 and e.value.max_abs_diff == pytest.approx(1e-9)


def test_check_commit_detects_an_altered_input_and_names_the_tensor():
    desc, s, inputs, res = _recorded()
    changed = {n: a.copy() for n, a in inputs[0].tensors.items()}
    changed["wte.weight"][2, 1] += 0.5
    altered = [dataclasses.replace(inputs[0], tensors=changed)] + inputs[1:]
    with pytest.raises(ReplayMismatch, match="output checksum recorded") as e:
        check_commit(s, desc, res.record, altered, recorded_output=res.published)
    assert e.value.tensor == "wte.weight" and e.value.max_abs_diff > 0.01
    # a different header is named by its fields
    hdr = dataclasses.replace(inputs[1].header, c_tokens=701)
    with pytest.raises(ReplayMismatch, match=r"input 1 \(b/0/0\).*c_tokens"):
        check_commit(s, desc, res.record, [inputs[0], dataclasses.replace(inputs[1], header=hdr), inputs[2]])
    # a merged input missing from the replay
    with pytest.raises(ReplayMismatch, match="recorded 2 merged inputs"):
        check_commit(s, desc, res.record, inputs[:1] + inputs[2:])


def test_check_commit_detects_an_altered_output_checksum_and_drops():
    desc, s, inputs, res = _recorded()
    with pytest.raises(ReplayMismatch, match="output checksum") as e:
        check_commit(s, desc, dataclasses.replace(res.record, output_checksum="0" * 64), inputs)
    assert e.value.tensor == "" and e.value.max_abs_diff is None
    dropped = (dataclasses.replace(res.record.dropped[0], reason="non-finite"),)
    with pytest.raises(ReplayMismatch, match="dropped deltas differ"):
        check_commit(s, desc, dataclasses.replace(res.record, dropped=dropped), inputs)
    with pytest.raises(ReplayMismatch, match="recorded version 7"):
        check_commit(s, desc, dataclasses.replace(res.record, version=7), inputs)
    assert isinstance(e.value, FormatError)


def test_initial_state_validation():
    desc = make_desc()
    m = init_model()
    with pytest.raises(ValueError, match=r"missing \['h.1.w'\]"):
        initial_state(desc, {n: a for n, a in m.items() if n != "h.1.w"})
    with pytest.raises(ValueError, match="initial tensor h.0.w has shape"):
        initial_state(desc, dict(m, **{"h.0.w": np.zeros(3, np.float32)}))
    s = initial_state(desc, m)
    assert [f.version for f in s.fragments] == [0, 0] and s.last_seq == -1
    assert all(not a.any() for f in s.fragments for a in f.momentum.values())
