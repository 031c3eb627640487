"""Issue 25, defect 4: an answer overtaken by its learner's newer merged answer is merged, not
dropped as a "duplicate" counted harmless (pipeline/marks.py, docs/algorithm.md "The fold").

A learner's answer on base v that arrives after its answer on base v+1 was merged is below the
learner's high-water mark but was never merged. Runs with ``versions.marks = 2`` (every new run)
keep merged marks per lineage (learner, incarnation, base) and merge it like any late answer;
older runs keep the issue-11 rule, and replay them bit for bit.
"""
from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.codec import CodecConfig, encode
from pipeline.descriptor import RunDescriptor, VersionsConfig
from pipeline.envelope import digest, seal
from pipeline.errors import FormatError
from pipeline.fold import RoundInput, SyncerState, fold, initial_state, merged_before
from pipeline.fragment import FragmentLayout
from pipeline.marks import MergedMarks, prior_verdict
from pipeline.outer import nesterov_step
from pipeline.policy import Decision, Pending, Timing, decide
from pipeline.schedule import ScheduleConfig
from pipeline.types import DeltaHeader, TensorSpec
from storage.log import CommitLog
from storage.store import open_store
from workers.bus.bus import Message
from workers.launch import RunSettings, Schedule, create_run
from workers.syncer.syncer import Syncer, SyncerConfig
from workers.tools.logview import LogTotals
from workers.common.refold import rebuild
from runhelpers import ManualClock

pytestmark = pytest.mark.timeout(120)

SHAPES = {"w": (5,), "v": (3,)}


def _desc(marks: int = 2, retain: int = 4, dtype: str = "int4") -> RunDescriptor:
    layout = FragmentLayout(tuple(TensorSpec(n, s) for n, s in SHAPES.items()), (("w",), ("v",)))
    return RunDescriptor(run_id="run-o", layout=layout, schedule=ScheduleConfig(2, (0, 1)),
                         versions=VersionsConfig(dtype, retain=retain, marks=marks))


def _state(desc: RunDescriptor) -> SyncerState:
    rng = np.random.default_rng(0)
    return initial_state(desc, {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()})


def _inp(learner: str, seq: int, base: int, *, inc: int = 0, fill: float | None = None) -> RoundInput:
    h = DeltaHeader(learner, inc, seq, 0, base, 4, 400, learner_step=seq)
    value = 0.01 * (seq + 1) if fill is None else fill
    return RoundInput(h, f"deltas/{learner}/{inc}/{seq}", f"sum-{learner}-{inc}-{seq}",
                      {"w": np.full(5, value, np.float32)})


def _fold(state: SyncerState, desc: RunDescriptor, inputs):
    return fold(state, desc, 0, inputs, seq=state.last_seq + 1, epoch=1, output_key=f"v/{state.last_seq + 1}")


def _overtaken(desc: RunDescriptor):
    """l1 merges v1 while l0's answer A (seq 0, base 0) is on its way; l0's next answer (seq 1,
    base 1) is merged as v2; then A arrives."""
    s = _state(desc)
    s = _fold(s, desc, [_inp("l1", 0, 0)]).state
    s = _fold(s, desc, [_inp("l0", 1, 1)]).state
    return s, _fold(s, desc, [_inp("l0", 0, 0)])


# -- the fold ----------------------------------------------------------------------------------------

def test_an_overtaken_answer_is_merged_exactly_once_against_the_current_version():
    desc = _desc()
    s2, res = _overtaken(desc)
    rec = res.record
    assert rec.kind == "merge" and [i.delta_id for i in rec.inputs] == ["l0/0/0"] and not rec.dropped
    assert rec.inputs[0].staleness == 2 and rec.version == 3
    assert rec.high_water == {"l0": [0, 1], "l1": [0, 0]}          # the record's field, unchanged in meaning
    # reconstructed like any stale delta (SPEC §4): v = (P[2] - P[0]) + delta, in float64
    h = s2.fragments[0].history
    v = {"w": (h[2]["w"].astype(np.float64) - h[0]["w"] + np.float32(0.01)).astype(np.float32)}
    p, _ = nesterov_step(s2.fragments[0].params, s2.fragments[0].momentum, v, desc.outer.lr, desc.outer.momentum)
    assert res.state.fragments[0].params["w"].tobytes() == p["w"].tobytes()
    # once: the same delta again, alone or with its copy in one round, is a duplicate
    again = _fold(res.state, desc, [_inp("l0", 0, 0), _inp("l0", 0, 0)]).record
    assert again.kind == "drop" and [d.reason for d in again.dropped] == ["duplicate", "duplicate"]


def test_old_runs_keep_the_issue_11_rule():
    desc = _desc(marks=1, dtype="bf16")          # the runs before issues 25 and 31
    s2, res = _overtaken(desc)
    assert res.record.kind == "drop" and [d.reason for d in res.record.dropped] == ["duplicate"]
    assert s2.marks is None and res.state.marks is None
    assert SyncerState.from_bytes(res.state.to_bytes(), desc).to_bytes()[:64] == res.state.to_bytes()[:64]
    assert msgpack.unpackb(res.state.to_bytes())[2] == 1                 # checkpoint v1, as before


def test_true_duplicates_and_superseded_deltas_stay_harmless():
    desc = _desc()
    s = _state(desc)
    one = _fold(s, desc, [_inp("l0", 0, 0), _inp("l0", 1, 0)])           # one lineage: seq 0 superseded
    assert [i.delta_id for i in one.record.inputs] == ["l0/0/1"]
    assert [(d.delta_id, d.reason) for d in one.record.dropped] == [("l0/0/0", "superseded")]
    later = _fold(one.state, desc, [_inp("l0", 0, 0), _inp("l0", 1, 0)]).record
    assert [(d.delta_id, d.reason) for d in later.dropped] == [
        ("l0/0/0", "superseded: seq 1 of its lineage was merged"), ("l0/0/1", "duplicate")]
    # a never-merged delta of an older life is still stale (lost); a merged one of it a duplicate
    s = _fold(one.state, desc, [_inp("l0", 0, 1, inc=1)]).state
    rec = _fold(s, desc, [_inp("l0", 1, 0), _inp("l0", 2, 0)]).record
    assert [d.reason for d in rec.dropped] == ["duplicate", "stale-incarnation: incarnation 1 of l0 was merged since"]


def test_an_overtaken_answer_whose_base_left_the_history_is_base_too_old():
    desc = _desc(retain=2)
    s = _state(desc)
    s = _fold(s, desc, [_inp("l1", 0, 0)]).state
    s = _fold(s, desc, [_inp("l0", 1, 1)]).state                        # history {1, 2}: base 0 gone
    rec = _fold(s, desc, [_inp("l0", 0, 0)]).record
    assert [d.reason for d in rec.dropped] == ["base-too-old"]            # lost, and named so
    assert merged_before(s, desc, _inp("l0", 0, 0).header) == "base-too-old"
    assert merged_before(s, desc, _inp("l0", 1, 1).header) == "duplicate"
    assert s.marks[0].seqs == {("l0", 0, 1): 1}                            # l1's mark on base 0 was pruned


def test_the_recovery_floor_makes_unknown_deltas_unaccounted_never_merged_twice():
    marks = MergedMarks({("l0", 0, 3): 5}).raised_floor({"l0": [0, 9]})
    assert prior_verdict("l0", 0, 4, 3, (0, 9), marks, {3}) == ("superseded", "seq 5 of its lineage was merged")
    cat, detail = prior_verdict("l0", 0, 7, 4, (0, 9), marks, {3, 4})
    assert cat == "unaccounted" and "recovery floor [0, 9]" in detail
    assert prior_verdict("l0", 0, 7, 2, (0, 9), marks, {3, 4}) == ("", "")   # base gone: the fold says base-too-old
    assert prior_verdict("l0", 0, 10, 4, (0, 9), marks, {4}) == ("", "")     # above the mark: new


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 2), min_size=1, max_size=10), st.lists(st.integers(0, 9), min_size=1, max_size=24))
def test_every_delta_is_merged_at_most_once_and_harmless_only_when_carried(bases, arrivals):
    """Deltas of one learner (seq i on the i-th smallest base: a learner applies versions in order)
    arrive in any order, any number of times, one per round: none is merged twice, and one dropped
    as harmless had itself or a newer delta of its lineage merged."""
    deltas = list(enumerate(sorted(bases)))
    desc = _desc(retain=16)
    s = _state(desc)
    s = _fold(s, desc, [_inp("l1", 0, 0)]).state
    s = _fold(s, desc, [_inp("l1", 1, 1)]).state                          # versions 0..2 exist
    merged: dict[str, int] = {}
    newest: dict[int, int] = {}
    for k in arrivals:
        seq, base = deltas[k % len(deltas)]
        res = _fold(s, desc, [_inp("l0", seq, base)])
        for i in res.record.inputs:
            merged[i.delta_id] = merged.get(i.delta_id, 0) + 1
            if i.learner == "l0":
                newest[i.base_version] = max(newest.get(i.base_version, -1), i.seq)
        for d in res.record.dropped:
            assert d.reason.split(":")[0] in ("duplicate", "superseded"), d.reason
            assert d.delta_id in merged or newest.get(base, -1) > seq
        s = res.state
    assert all(n == 1 for n in merged.values()), merged


# -- the checkpoint and the descriptor ---------------------------------------------------------------

def test_checkpoint_v2_round_trips_the_marks_and_v1_still_loads():
    desc = _desc(dtype="bf16")          # an int4 run's history holds links: v3 (tests/test_checkpoint_v3.py)
    _, res = _overtaken(desc)
    blob = res.state.to_bytes()
    assert msgpack.unpackb(blob)[2] == 2
    back = SyncerState.from_bytes(blob, desc)
    assert back.to_bytes() == blob and back.marks == res.state.marks
    assert back.marks[0].seqs == {("l0", 0, 0): 0, ("l0", 0, 1): 1, ("l1", 0, 0): 0}
    nxt = [_inp("l0", 0, 0), _inp("l0", 2, 3)]
    assert _fold(back, desc, nxt).record == _fold(res.state, desc, nxt).record
    old_desc = _desc(marks=1, dtype="bf16")
    v1 = _overtaken(old_desc)[1].state.to_bytes()
    assert SyncerState.from_bytes(v1, old_desc).to_bytes() == v1
    with pytest.raises(FormatError, match="a version 1 checkpoint, but the run's descriptor has versions.marks 2"):
        SyncerState.from_bytes(v1, desc)
    with pytest.raises(FormatError, match="a version 2 checkpoint, but the run's descriptor has versions.marks 1"):
        SyncerState.from_bytes(blob, old_desc)


def test_checkpoint_v2_refuses_malformed_marks():
    desc = _desc(dtype="bf16")
    body = msgpack.unpackb(msgpack.unpackb(_overtaken(desc)[1].state.to_bytes())[3], raw=False)

    def load(b):
        return SyncerState.from_bytes(seal("syncer-checkpoint", 2, msgpack.packb(b, use_bin_type=True)), desc)
    bad = dict(body, marks=body["marks"][:1])
    with pytest.raises(FormatError, match="field 'marks' must be a list of 2 merged-mark maps"):
        load(bad)
    bad = dict(body, marks=[{"seqs": [["l0", 0, 9, 1]], "floor": {}}, body["marks"][1]])
    with pytest.raises(FormatError, match=r"fragment 0: merged mark \['l0', 0, 9, 1\] is repeated or its base"):
        load(bad)
    bad = dict(body, marks=[{"seqs": [["l0", -1, 0, 1]], "floor": {}}, body["marks"][1]])
    with pytest.raises(FormatError, match="bad merged mark"):
        load(bad)
    bad = dict(body, marks=[{"seqs": [], "floor": {"l0": [1]}}, body["marks"][1]])
    with pytest.raises(FormatError, match="bad floor entry 'l0'"):
        load(bad)
    with pytest.raises(ValueError, match="the state lacks merged marks, but the run's versions.marks is 2"):
        _fold(_state(_desc(marks=1)), desc, [])


def test_the_marks_rule_is_written_only_by_new_runs():
    old, new = _desc(marks=1), _desc()
    assert "marks" not in old.to_dict()["versions"] and new.to_dict()["versions"]["marks"] == 2
    assert RunDescriptor.from_bytes(new.to_bytes()).versions.marks == 2
    assert RunDescriptor.from_bytes(old.to_bytes()).to_bytes() == old.to_bytes()
    d = old.to_dict()
    d["versions"]["marks"] = 1
    with pytest.raises(FormatError, match="versions.marks: 1 is written by leaving the field out"):
        RunDescriptor.from_dict(d)
    d["versions"]["marks"] = 3
    with pytest.raises(FormatError, match="descriptor versions.marks: versions marks must be 1 or 2, got 3"):
        RunDescriptor.from_dict(d)
    with pytest.raises(ValueError, match="versions marks must be 1 or 2, got True"):
        VersionsConfig(marks=True)
    assert RunSettings().versions.marks == 2


# -- the syncer ----------------------------------------------------------------------------------------

def _syncer_run(tmp_path, marks: int):
    store = open_store(str(tmp_path / "s"))
    rng = np.random.default_rng(0)
    init = {"a.weight": rng.normal(0, 0.02, size=(8, 4)).astype(np.float32),
            "b.weight": rng.normal(0, 0.02, size=(16,)).astype(np.float32)}
    desc = create_run(store, init, RunSettings(schedule=Schedule(fragments=1, sync_every=2),
                                               versions=VersionsConfig(marks=marks)), embedding_tensors=())
    clock = ManualClock()
    syncer = Syncer(store, SyncerConfig(spill_poll_s=0.1), bus=None, clock=clock)
    syncer.recover()
    return store, desc, syncer, clock


def _offer(syncer: Syncer, desc, h: DeltaHeader) -> None:
    tensors = {n: np.full(desc.spec(n).shape, 0.01 * (h.seq + 1), np.float32) for n in desc.layout.fragments[0]}
    blob = encode("delta", h.to_dict(), tensors, CodecConfig(scheme="int8"))
    syncer.ingest.bus_delta(b"peer", Message("delta", {"header": h.to_dict(), "checksum": digest(blob)}, blob))


def _pending(syncer: Syncer) -> list[Pending]:
    return [Pending(h.header.id, h.header.learner, h.header.order, h.arrived_at, h.header.c_steps, h.header.c_tokens)
            for h in syncer.pending[0].values() if h.candidate]


def _merge(syncer: Syncer) -> None:
    pend = syncer.pending[0]
    syncer.merge(0, list(pend), Decision(tuple(k for k, h in pend.items() if h.candidate), (), 0.0, None, None,
                                         "all-reported"))


def _late_answer_after_the_newer_one(syncer, desc, clock):
    """l1 answers on v0 (merged: v1); l0's answer on v0 is slow; l0 answers on v1 (merged: v2);
    then the slow one arrives. Returns the syncer's verdict on it."""
    _offer(syncer, desc, DeltaHeader("l1", 1, 0, 0, 0, 4, 400, 4))
    _merge(syncer)
    clock.t += 1.0
    _offer(syncer, desc, DeltaHeader("l0", 1, 1, 0, 1, 4, 400, 8))
    _merge(syncer)
    assert syncer.state.high_water[0]["l0"] == (1, 1)
    clock.t += 1.0
    _offer(syncer, desc, DeltaHeader("l0", 1, 0, 0, 0, 4, 400, 4))      # the answer on base 0, late
    return next(h for h in syncer.pending[0].values() if h.header.id == "l0/1/0")   # held out: keyed by content


def test_the_syncer_counts_and_merges_an_answer_overtaken_by_its_newer_one(tmp_path):
    store, desc, syncer, clock = _syncer_run(tmp_path, marks=2)
    held = _late_answer_after_the_newer_one(syncer, desc, clock)
    assert held.candidate and held.arrived_at == 102.0                  # not held out below the mark
    d = decide(_pending(syncer), clock(), syncer.policy, Timing())
    assert d.merge == ("l0/1/0",) and d.quorum_met_at == 102.0          # it counts toward the quorum
    _merge(syncer)
    _offer(syncer, desc, DeltaHeader("l0", 1, 1, 0, 1, 4, 400, 8))      # a copy of the one at the mark: tidied
    assert not syncer.pending[0] and syncer.ingest.stats.duplicates == 1
    _offer(syncer, desc, DeltaHeader("l0", 1, 0, 0, 0, 4, 400, 4))      # a copy of the overtaken one, merged now
    assert [h.reason for h in syncer.pending[0].values()] == ["below-high-water"]   # held out, recorded next
    _merge(syncer)
    syncer.io.shutdown(wait=True)
    commits = list(CommitLog(store).read_range(0))
    merges = [r for r in commits if r.kind == "merge"]
    assert [[i.delta_id for i in r.inputs] for r in merges] == [["l1/1/0"], ["l0/1/1"], ["l0/1/0"]]
    assert merges[-1].inputs[0].staleness == 2
    assert [(d.delta_id, d.reason) for r in commits for d in r.dropped] == [("l0/1/0", "duplicate")]
    rebuild(store, desc, CommitLog(store).tail(), use_checkpoint=False)   # replays bit for bit
    totals = LogTotals(fragments=1)
    for r in commits:
        totals.add(r)
    t = totals.to_dict()
    assert (t["deltas_merged"], t["deltas_harmless"], t["deltas_lost"]) == (3, 1, 0)
    assert t["per_learner"]["l0"]["tokens_merged"] == 800.0


def test_a_rule_1_syncer_still_holds_it_out_as_a_duplicate(tmp_path):
    store, desc, syncer, clock = _syncer_run(tmp_path, marks=1)
    held = _late_answer_after_the_newer_one(syncer, desc, clock)
    assert not held.candidate and held.reason == "below-high-water"
    assert decide(_pending(syncer), clock(), syncer.policy, Timing()).reason == "empty"
    _merge(syncer)
    syncer.io.shutdown(wait=True)
    commits = list(CommitLog(store).read_range(0))
    assert [(d.delta_id, d.reason) for r in commits for d in r.dropped] == [("l0/1/0", "duplicate")]
    rebuild(store, desc, CommitLog(store).tail(), use_checkpoint=False)


def test_logview_counts_a_cross_commit_superseded_delta_harmless_without_lost_tokens():
    desc = _desc()
    s = _state(desc)
    a = _fold(s, desc, [_inp("l0", 1, 0)])
    b = _fold(a.state, desc, [_inp("l0", 0, 0)])
    totals = LogTotals(fragments=1)
    for r in (a.record, b.record):
        totals.add(r)
    t = totals.to_dict()["per_learner"]["l0"]
    assert b.record.dropped[0].reason == "superseded: seq 1 of its lineage was merged"
    assert (t["deltas_harmless"], t["deltas_lost"], t["tokens_dropped"], t["tokens_merged"]) == (1, 0, 0.0, 400.0)


def test_a_salvaging_recovery_never_merges_what_it_cannot_account_for(tmp_path):
    from test_hardening_syncer_recovery import _done, _grown
    run, cp = _grown(tmp_path)
    victim = next(r for r in _commits_of(run.store) if r.kind == "merge" and r.seq > cp)
    run.store.delete(victim.inputs[0].key)                            # that commit no longer re-folds
    s = run.syncer()
    p = victim.fragment
    marks, hw = s.state.marks[p], s.state.high_water[p]
    assert marks.floor and all(marks.floor[m] >= hw[m] for m in hw)   # adopted: the floor is at least the marks
    fs = s.state.fragments[p]
    unknown = DeltaHeader("l0", 1, hw["l0"][1] - 1, p, fs.version, 3, 300, 0)   # below the mark, no lineage mark
    assert ("l0", 1, fs.version) not in marks.seqs
    assert merged_before(s.state, run.desc, unknown).startswith("unaccounted: at or below l0's recovery floor")
    # without the floor it would pass for an overtaken answer and could be merged a second time
    assert prior_verdict("l0", 1, unknown.seq, fs.version, hw["l0"], MergedMarks(marks.seqs), fs.history) == ("", "")
    _done(s)


def _commits_of(store):
    return list(CommitLog(store).read_range(0))
