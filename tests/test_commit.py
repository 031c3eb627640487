"""pipeline/commit.py: one commit decided in one place - guard, fold, recorded norms, norm window
(SPEC §4, §7 'Replay'; issue 12 "Architecture step")."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from pipeline.commit import (CommitMeta, PENDING_OVERFLOW, apply_commit, backfill_window, initial_window,
                             verify_commit, window_after, with_recorded_decisions)
from pipeline.envelope import pack_record
from pipeline.errors import FormatError
from pipeline.fold import ReplayMismatch, RoundInput, fold, initial_state
from pipeline.guard import NormGuardConfig, NormWindow, delta_norm
from pipeline.descriptor import RunDescriptor, VersionsConfig
from pipeline.fragment import FragmentLayout
from pipeline.merge import MergeConfig
from pipeline.outer import OuterConfig
from pipeline.schedule import ScheduleConfig
from pipeline.types import CommitRecord, DeltaHeader, DroppedRecord, TensorSpec

SHAPES = {"wte.weight": (4, 3), "h.0.w": (5,), "h.1.w": (6,)}
GUARD = NormGuardConfig(factor=4.0, window=4, min_history=2, version=2)   # norms of whole deltas


def make_desc(guard: NormGuardConfig | None = GUARD, **kw) -> RunDescriptor:
    layout = FragmentLayout(tuple(TensorSpec(n, s) for n, s in SHAPES.items()), (("h.0.w", "wte.weight"), ("h.1.w",)))
    base = dict(run_id="run-c", layout=layout, schedule=ScheduleConfig(2, (0, 1)),
                merge=MergeConfig("rda", frozenset({"wte.weight"})), versions=VersionsConfig("fp32", 3, marks=1),
                outer=OuterConfig(0.7, 0.9), guard=guard)
    base.update(kw)
    return RunDescriptor(**base)


def init_model(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}


def delta(rng, scale=0.01, names=("h.0.w", "wte.weight")) -> dict[str, np.ndarray]:
    return {n: (rng.standard_normal(SHAPES[n]) * scale).astype(np.float32) for n in names}


def inp(learner, seq, tensors, *, base=0, reject="") -> RoundInput:
    h = DeltaHeader(learner, 0, seq, 0, base, 10, 1000, learner_step=seq)
    return RoundInput(h, f"deltas/{learner}/0/{seq}", f"sum-{learner}-{seq}", tensors, reject)


def meta(state, **kw) -> CommitMeta:
    return CommitMeta(seq=state.last_seq + 1, epoch=1, output_key=f"v/{state.last_seq + 1}", **kw)


def start(desc=None):
    desc = desc or make_desc()
    return desc, initial_state(desc, init_model()), initial_window(desc)


def reasons(rec: CommitRecord) -> dict[str, str]:
    return {d.delta_id: d.reason for d in rec.dropped}


# ------------------------------------------------------------------ the guard's verdicts

def test_an_outlier_against_the_window_is_dropped_norm_outlier_and_the_rest_merges():
    desc, s0, w0 = start()
    w = w0.pushed(0, [0.04, 0.05, 0.045])               # min_history 2 met: median 0.045
    rng = np.random.default_rng(1)
    ok, big = delta(rng), delta(rng, scale=1.0)          # big: ~2.2, far above 4 x 0.045, below the cap
    c = apply_commit(s0, w, desc, 0, [inp("a", 0, ok), inp("b", 0, big)], meta(s0))
    assert c.record.kind == "merge" and [i.delta_id for i in c.record.inputs] == ["a/0/0"]
    assert reasons(c.record) == {"b/0/0": "norm-outlier"}
    assert c.record.norms == (delta_norm(ok),)
    assert c.window.history(0) == [0.04, 0.05, 0.045, delta_norm(ok)]
    assert w.history(0) == [0.04, 0.05, 0.045]          # the window given is a value: never changed
    # Without a window (a run with no guard) the same big delta is merged.
    desc_off = make_desc(guard=None)
    c_off = apply_commit(s0, None, desc_off, 0, [inp("a", 0, ok), inp("b", 0, big)], meta(s0))
    assert len(c_off.record.inputs) == 2 and c_off.record.norms is None and "norms" not in c_off.record.info


def test_a_value_bomb_is_dropped_by_the_cap_from_the_first_round_and_the_window_does_not_move():
    desc, s0, w0 = start()
    bomb = {n: np.full(SHAPES[n], 100.0, np.float32) for n in ("h.0.w", "wte.weight")}
    c = apply_commit(s0, w0, desc, 0, [inp("x", 0, bomb)], meta(s0))
    assert c.record.kind == "drop" and reasons(c.record) == {"x/0/0": "norm-outlier"}
    assert c.record.norms is None and "norms" not in c.record.info
    assert c.window == w0 and c.published is None and c.state.last_seq == s0.last_seq + 1


def test_non_finite_deltas_are_left_to_the_fold():
    desc, s0, w0 = start()
    w = w0.pushed(0, [0.04, 0.05])
    rng = np.random.default_rng(2)
    nan, inf = delta(rng), delta(rng)
    nan["h.0.w"][1] = np.nan
    inf["wte.weight"][0, 0] = np.inf
    c = apply_commit(s0, w, desc, 0, [inp("n", 0, nan), inp("i", 0, inf)], meta(s0))
    assert reasons(c.record) == {"n/0/0": "non-finite", "i/0/0": "non-finite"}
    assert c.record.kind == "drop" and c.window == w


def test_caller_rejections_pass_through_and_are_never_judged_by_the_guard():
    desc, s0, w0 = start()
    rng = np.random.default_rng(3)
    bad = inp("s", 0, None, reject="bad-signature")
    dt = inp("d", 0, None, reject="dtype-mismatch: h.0.w")
    ok = inp("a", 0, delta(rng))
    c = apply_commit(s0, w0, desc, 0, [bad, dt, ok], meta(s0))
    assert reasons(c.record) == {"s/0/0": "bad-signature", "d/0/0": "dtype-mismatch: h.0.w"}
    assert c.record.norms == (delta_norm(ok.tensors),)


# ------------------------------------------------------------------ the window and the recorded norms

def test_norms_are_recorded_in_record_order_and_only_merges_move_the_window():
    desc, s0, w0 = start()
    rng = np.random.default_rng(4)
    dz, da, dm = delta(rng, 0.01), delta(rng, 0.02), delta(rng, 0.03)
    c1 = apply_commit(s0, w0, desc, 0, [inp("z", 0, dz), inp("a", 0, da), inp("m", 0, dm)], meta(s0))
    assert [i.learner for i in c1.record.inputs] == ["a", "m", "z"]
    assert c1.record.norms == (delta_norm(da), delta_norm(dm), delta_norm(dz))
    assert c1.record.info["norms"] == list(c1.record.norms)            # what is written, as before
    assert c1.window.history(0) == list(c1.record.norms) and c1.window.history(1) == []
    # A drop commit (only a rejected delta) merges nothing: the window stays.
    c2 = apply_commit(c1.state, c1.window, desc, 0, [inp("q", 0, None, reject="unsigned")], meta(c1.state))
    assert c2.record.kind == "drop" and c2.window == c1.window
    # The window keeps the newest ``window`` (4) norms.
    c3 = apply_commit(c2.state, c2.window, desc, 0, [inp("a", 1, delta(rng), base=1),
                                                     inp("b", 0, delta(rng), base=1)], meta(c2.state))
    assert c3.window.history(0) == (list(c1.record.norms) + list(c3.record.norms))[-4:]


def test_the_window_must_be_the_runs():
    desc, s0, w0 = start()
    rng = np.random.default_rng(5)
    with pytest.raises(ValueError, match="has a norm guard"):
        apply_commit(s0, None, desc, 0, [inp("a", 0, delta(rng))], meta(s0))
    with pytest.raises(ValueError, match="has a norm guard"):
        apply_commit(s0, NormWindow.empty(2, NormGuardConfig()), desc, 0, [], meta(s0))
    with pytest.raises(ValueError, match="no norm guard"):
        apply_commit(s0, w0, make_desc(guard=None), 0, [], meta(s0))
    with pytest.raises(ValueError, match="norms"):
        CommitMeta(seq=0, epoch=1, info={"norms": [1.0]})


def test_backfill_reads_newest_first_only_as_far_as_needed_and_skips_what_it_cannot_use():
    desc, _, w0 = start()

    def merge(seq, frag, norms):
        ins = tuple(dataclasses.replace(_input_record(k), delta_id=f"l/0/{seq}{k}") for k in range(len(norms or [0])))
        return CommitRecord(seq=seq, epoch=1, kind="merge", fragment=frag, version=seq, inputs=ins,
                            norms=None if norms is None else tuple(norms))

    log = [merge(9, 0, [5.0, 6.0]), None, merge(8, 1, [1.0]), merge(7, 0, None),
           CommitRecord(seq=6, epoch=1, kind="fence"), merge(5, 0, [3.0, 4.0]), merge(4, 1, [0.5, 0.6, 0.7, 0.8]),
           merge(3, 0, [9.0])]
    read = []

    def older():
        for r in log:
            read.append(r)
            yield r
    w = backfill_window(w0, older())
    assert w.history(0) == [3.0, 4.0, 5.0, 6.0]          # full (4): commit 3 is never needed
    assert w.history(1) == [0.6, 0.7, 0.8, 1.0]
    assert len(read) == 7                                 # stopped once every fragment was full


def test_with_recorded_decisions_takes_pending_overflow_from_the_record():
    rng = np.random.default_rng(6)
    a, b = inp("a", 0, delta(rng)), inp("b", 0, delta(rng))
    rec = CommitRecord(seq=3, epoch=1, kind="merge", fragment=0, version=1, inputs=(_input_record(0),),
                       dropped=(DroppedRecord("b/0/0", "b", b.key, b.checksum, f"{PENDING_OVERFLOW}: oldest"),))
    got = with_recorded_decisions(rec, [a, b])
    assert got[0] is a and got[1].reject_reason == f"{PENDING_OVERFLOW}: oldest" and got[1].tensors is None


# ------------------------------------------------------------------ the syncer's path and replay's

def _rounds(desc, s0, w0):
    """Three commits as the live syncer makes them (inputs in arrival order)."""
    rng = np.random.default_rng(7)
    rounds = [[inp("b", 0, delta(rng)), inp("a", 0, delta(rng))],
              [inp("c", 0, delta(rng, 2.0), base=1), inp("a", 1, delta(rng), base=1)],
              [inp("b", 1, delta(rng), base=0), inp("r", 0, None, reject="bad-signature")]]
    s, w, out = s0, w0, []
    for ins in rounds:
        c = apply_commit(s, w, desc, 0, ins, meta(s, info={"syncer": "s1"}))
        out.append((c, ins))
        s, w = c.state, c.window
    return out


def _replay_order(rec: CommitRecord, ins: list[RoundInput]) -> list[RoundInput]:
    by_key = {i.key: i for i in ins}
    return [by_key[i.key] for i in rec.inputs] + [by_key[d.key] for d in rec.dropped]


def test_replay_of_what_the_syncer_recorded_gives_the_same_states_windows_and_records():
    desc, s0, w0 = start()
    lived = _rounds(desc, s0, w0)
    assert [reasons(c.record) for c, _ in lived][1] == {"c/0/0": "norm-outlier"}
    s, w = s0, w0
    for c, ins in lived:
        rec = CommitRecord.from_bytes(c.record.to_bytes())            # as stored and read back
        got = verify_commit(s, w, desc, rec, _replay_order(rec, ins), recorded_output=c.published)
        assert got.state.to_bytes() == c.state.to_bytes() and got.window == c.window and got.record == c.record
        s, w = got.state, got.window


def test_replay_rejects_altered_or_missing_norms():
    desc, s0, w0 = start()
    (c, ins), *_ = _rounds(desc, s0, w0)
    rec = CommitRecord.from_bytes(c.record.to_bytes())
    off = rec.with_norms((rec.norms[0], math.nextafter(rec.norms[1], 1.0)))
    with pytest.raises(ReplayMismatch, match="recorded input norms"):
        verify_commit(s0, w0, desc, off, _replay_order(rec, ins))
    with pytest.raises(FormatError, match="records no valid norms"):
        verify_commit(s0, w0, desc, rec.with_norms(None), _replay_order(rec, ins))


def test_a_version_1_guard_accepts_norms_off_in_the_last_bits_and_keeps_the_recorded_ones():
    v1 = NormGuardConfig(4.0, 4, 2, cap=None, version=1)              # written before the cap existed
    desc, s0, w0 = start(make_desc(guard=v1))
    assert w0.cfg.version == 1 and w0.cfg.cap is None
    (c, ins), *_ = _rounds(desc, s0, w0)
    blas = tuple(math.nextafter(n, 0.0) for n in c.record.norms)     # what np.dot may have given
    rec = CommitRecord.from_bytes(c.record.with_norms(blas).to_bytes())
    got = verify_commit(s0, w0, desc, rec, _replay_order(rec, ins))
    assert got.record.norms == blas and got.window.history(0) == list(blas)


# ------------------------------------------------------------------ the record's typed norms

def _input_record(k: int):
    from pipeline.types import InputRecord
    return InputRecord(f"l/0/{k}", "l", 0, k, f"deltas/l/0/{k}", f"c{k}", 0, 10, 1000, k, 1.0, 0)


def test_old_records_with_info_norms_are_read_and_written_back_byte_for_byte():
    desc, s0, w0 = start()
    rng = np.random.default_rng(8)
    ins = [inp("b", 0, delta(rng)), inp("a", 0, delta(rng))]
    # The bytes the syncer wrote before norms were typed: the fold's record, then info["norms"], then "sig".
    res = fold(s0, desc, 0, ins, seq=s0.last_seq + 1, epoch=1, output_key="v/x", info={"syncer": "s1", "live": 2})
    norms = [delta_norm(i.tensors) for i in sorted(ins, key=lambda i: i.header.learner)]
    old = res.record.to_dict()
    old["info"] = {**old["info"], "norms": norms, "sig": "ab" * 32}
    blob = pack_record("commit", CommitRecord.VERSION, old)
    rec = CommitRecord.from_bytes(blob)
    assert rec.norms == tuple(norms) and rec.info["norms"] == norms and rec.to_bytes() == blob
    assert CommitRecord.from_bytes(pack_record("commit", 1, old)) == rec    # as v1 wrote it: the same record
    # The new path writes the very same bytes (norms after the other info, before the signature).
    c = apply_commit(s0, w0, desc, 0, ins, CommitMeta(seq=s0.last_seq + 1, epoch=1, output_key="v/x",
                                                      info={"syncer": "s1", "live": 2}))
    signed = dataclasses.replace(c.record, info={**c.record.info, "sig": "ab" * 32})
    assert signed.to_bytes() == blob


@pytest.mark.parametrize("norms, why", [
    ([1.0], "one norm per merged input"), (["1.0", 2.0], "finite floats"), ([1.0, float("nan")], "finite floats"),
    ([1.0, -2.0], "finite floats"), ([1, 2], "finite floats"), ("12", "finite floats")])
def test_bad_recorded_norms_are_a_format_error_naming_them(norms, why):
    d = CommitRecord(seq=3, epoch=1, kind="merge", fragment=0, version=1,
                     inputs=(_input_record(0), _input_record(1))).to_dict()
    d["info"] = {"norms": norms}
    with pytest.raises(FormatError, match=why):
        CommitRecord.from_dict(d)


def test_norms_belong_to_merge_commits_and_agree_with_info():
    drop = CommitRecord(seq=3, epoch=1, kind="drop", fragment=0).to_dict()
    drop["info"] = {"norms": []}
    with pytest.raises(FormatError, match="merge commits only"):
        CommitRecord.from_dict(drop)
    with pytest.raises(ValueError, match="differ"):
        CommitRecord(seq=3, epoch=1, kind="merge", fragment=0, version=1, inputs=(_input_record(0),),
                     norms=(1.0,), info={"norms": [2.0]})
    rec = CommitRecord(seq=3, epoch=1, kind="merge", fragment=0, version=1, inputs=(_input_record(0),),
                       norms=(1.5,), info={"syncer": "s", "sig": "00"})
    assert list(rec.info) == ["syncer", "norms", "sig"] and rec.info["norms"] == [1.5]
    assert rec.with_norms(None).info == {"syncer": "s", "sig": "00"} and rec.with_norms(None).norms is None


def test_window_after_moves_only_by_a_merge_with_norms():
    _, _, w0 = start()
    merge = CommitRecord(seq=3, epoch=1, kind="merge", fragment=1, version=1, inputs=(_input_record(0),), norms=(2.5,))
    assert window_after(w0, merge).history(1) == [2.5]
    assert window_after(w0, merge.with_norms(None)) == w0
    assert window_after(w0, CommitRecord(seq=4, epoch=1, kind="drop", fragment=1)) == w0
    assert window_after(None, merge) is None
