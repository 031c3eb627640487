"""Issue 25, defect 3: the quorum K is a minimum (SPEC §4, §11 progress invariant (e)).

No merge has fewer than K distinct learners; answers of fewer are held (bounded) or recorded as
dropped ``below-quorum`` (never-merged work, counted lost) - and a run whose K exceeds its
learners is refused before anything starts. The syncer-level tests drive a real Syncer on an
injected clock (no bus, no sleeps); the last two run real processes.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pipeline.codec import CodecConfig, encode
from pipeline.commit import BELOW_QUORUM, RECORDED_REASONS
from pipeline.envelope import digest
from pipeline.policy import (Decision, Pending, PolicyConfig, Timing, Verdict, decide, expire_late,
                             late_answers)
from pipeline.types import CommitRecord, DeltaHeader
from storage.log import CommitLog
from storage.store import open_store
from workers.bus.bus import Message
from workers.launch import RunSettings, Schedule, check_quorum, create_run
from workers.syncer.syncer import Syncer, SyncerConfig
from workers.tools.logview import token_figures
from workers.common.refold import rebuild

from runhelpers import ManualClock, TinyRun, last_step, wait_for

pytestmark = pytest.mark.timeout(300)


# -- the pure policy ------------------------------------------------------------------------------

def _p(learner: str, t: float, rnd: int, seq: int = 0, steps: int = 4, tokens: int = 100) -> Pending:
    return Pending(f"{learner}/1/{seq}", learner, (1, seq), t, steps, tokens, rnd)


def test_only_answers_of_closed_or_replaced_rounds_are_late():
    pend = [_p("a", 0.0, 3), _p("b", 1.0, 7, seq=1), _p("c", 2.0, 9, seq=2)]
    assert [p.delta_id for p in late_answers(pend, 7)] == ["a/1/0"]     # 7 is open: b and c answer it or later
    assert [p.delta_id for p in late_answers(pend, None)] == ["a/1/0", "b/1/1", "c/1/2"]   # none open: all late


def test_expired_late_answers_merge_only_with_K_learners():
    k2 = PolicyConfig(quorum=2)
    d = expire_late([_p("a", 0.0, 3), _p("b", 5.0, 7)], k2, 7)          # a late, b on the open round: 2 learners
    assert d.reason is Verdict.LATE_EXPIRED and d.merge == ("a/1/0", "b/1/0") and d.dropped == ()
    d = expire_late([_p("a", 0.0, 3), _p("a", 5.0, 7, seq=1)], k2, 7)   # one learner, however many answers
    assert d.reason is Verdict.BELOW_QUORUM and d.merge == ()
    assert d.dropped == ("a/1/0",)                                       # its answer to the open round waits
    assert expire_late([_p("a", 0.0, 3), _p("b", 0.1, 5)], k2, None).dropped == ()   # 2 late learners: merged
    d = expire_late([_p("a", 0.0, 3, steps=0), _p("b", 0.0, 3, tokens=0)], k2, None)
    assert d.reason is Verdict.LATE_EXPIRED and d.merge == ("a/1/0", "b/1/0")   # no work: the fold says why
    assert expire_late([_p("a", 0.0, 3)], PolicyConfig(quorum=1), 7).merge == ("a/1/0",)   # K = 1 as before
    with pytest.raises(ValueError, match="dropped and merge overlap"):
        Decision(("x",), (), None, None, None, Verdict.BELOW_QUORUM, dropped=("x",))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcde"), st.floats(0, 10), st.integers(0, 3), st.integers(0, 2),
                          st.sampled_from([0, 5]), st.sampled_from([0, 100])), max_size=12),
       st.integers(1, 4), st.one_of(st.none(), st.integers(0, 6)), st.one_of(st.none(), st.integers(0, 3)),
       st.floats(0, 20))
def test_no_decision_merges_fewer_than_K_learners_with_work(rows, k, live, round_id, now):
    """Whatever is pending and however few learners are live (the all-reported path included),
    a decision that merges has K distinct learners whose answers to the round carry work."""
    pend = [Pending(f"{m}/1/{s}", m, (1, s), t, steps, tokens, r) for m, t, s, r, steps, tokens in rows]
    pend = list({p.delta_id: p for p in pend}.values())
    cfg = PolicyConfig(quorum=k)
    d = decide(pend, now, cfg, Timing(step_time_s=1.0), live_learners=live, round_id=round_id)
    if d.merge:
        counted = {p.learner for p in pend if p.c_steps > 0 and p.c_tokens > 0
                   and (round_id is None or p.round >= round_id)}
        assert len(counted) >= k, (d, counted)
    e = expire_late(pend, cfg, round_id)
    working = {p.learner for p in pend if p.c_steps > 0 and p.c_tokens > 0}
    assert bool(e.merge) == bool(pend and (len(working) >= k or not working)) and not (e.merge and e.dropped)
    assert set(e.dropped) == ({p.delta_id for p in late_answers(pend, round_id)} if not e.merge and pend else set())


def test_a_quorum_above_the_learners_is_refused():
    check_quorum(3, 3)
    with pytest.raises(ValueError, match=r"quorum K=5 exceeds the 4 learner\(s\) M"):
        check_quorum(5, 4)
    with pytest.raises(ValueError, match="quorum K must be an int >= 1, got 0"):
        check_quorum(0, 4)


def test_below_quorum_is_a_recorded_decision():
    assert BELOW_QUORUM == "below-quorum" and BELOW_QUORUM in RECORDED_REASONS


# -- a real syncer on an injected clock -----------------------------------------------------------

def _run(tmp_path, quorum: int):
    store = open_store(str(tmp_path / "s"))
    rng = np.random.default_rng(0)
    init = {"a.weight": rng.normal(0, 0.02, size=(8, 4)).astype(np.float32),
            "b.weight": rng.normal(0, 0.02, size=(16,)).astype(np.float32)}
    desc = create_run(store, init, RunSettings(schedule=Schedule(fragments=1, sync_every=2),
                                               policy=PolicyConfig(quorum=quorum)), embedding_tensors=())
    return store, desc


def _syncer(store, clock: ManualClock) -> tuple[Syncer, list[tuple[str, dict]]]:
    syncer = Syncer(store, SyncerConfig(spill_poll_s=0.1), bus=None, clock=clock, wall=clock, sleep=lambda s: None)
    seen: list[tuple[str, dict]] = []
    emit = syncer.events.emit
    syncer.events.emit = lambda event, **f: (seen.append((event, f)), emit(event, **f))[-1]
    syncer.recover()
    return syncer, seen


def _answer(syncer: Syncer, desc, learner: str, seq: int, rnd: int, fill: float = 0.01, scheme: str = "int8") -> str:
    """What the bus loop does with learner ``learner``'s answer to round ``rnd`` of fragment 0."""
    h = DeltaHeader(learner, 1, seq, 0, 0, 4, 400, seq, rnd)
    tensors = {n: np.full(desc.spec(n).shape, fill, np.float32) for n in desc.layout.fragments[0]}
    blob = encode("delta", h.to_dict(), tensors, CodecConfig(scheme=scheme))
    syncer.ingest.bus_delta(b"peer", Message("delta", {"header": h.to_dict(), "checksum": digest(blob)}, blob))
    return h.id


def _next_round(syncer: Syncer, clock: ManualClock) -> int:
    """Tick the global clock (0.1 s steps, the initial pace) until fragment 0's round is replaced."""
    before = syncer.rounds.open[0].round
    for _ in range(100):
        clock.t += 0.05
        syncer._tick_rounds()
        if syncer.rounds.open[0].round != before:
            return syncer.rounds.open[0].round
    raise AssertionError("fragment 0's round was never replaced")


def _commits(store) -> list[CommitRecord]:
    return [r for r in CommitLog(store).read_range(0) if r.kind in ("merge", "drop")]


def _learners(rec: CommitRecord) -> set[str]:
    return {i.learner for i in rec.inputs}


def test_an_open_round_below_quorum_is_held_then_dropped_never_merged_alone(tmp_path):
    """The issue's reproduction at the syncer: one answer to a K=2 round, held past the late
    deadline (2H steps). It used to be merged on its own (``late-expired``); now it waits while
    its round is open, and once the round is replaced it is recorded as dropped ``below-quorum``."""
    store, desc = _run(tmp_path, quorum=2)
    clock = ManualClock()
    syncer, seen = _syncer(store, clock)
    syncer._tick_rounds()                                  # round 0 of fragment 0 opens
    assert syncer.rounds.open[0].round == 0
    did = _answer(syncer, desc, "l0", 0, rnd=0)
    clock.t += 10.0                                        # 2H steps at 0.1 s are 0.4 s: long past
    syncer.close_rounds()
    assert _commits(store) == [] and did in syncer.pending[0]   # held: its round is merely below quorum
    assert _next_round(syncer, clock) > 0                  # the next round of fragment 0 replaces round 0
    syncer.close_rounds()
    (rec,) = _commits(store)
    assert rec.kind == "drop" and rec.inputs == () and rec.round == -1 and rec.quorum == 0
    assert [(d.delta_id, d.reason.split(":")[0]) for d in rec.dropped] == [(did, BELOW_QUORUM)]
    assert rec.dropped[0].reason == "below-quorum: K=2, 1 learner(s) answered in 4 steps"
    assert rec.info["decided"] == "below-quorum" and syncer.pending[0] == {}
    assert syncer.rounds.open[0] is not None               # a drop closes no round
    syncer.io.shutdown(wait=True)
    # Replay takes the decision from the record (its bytes alone would make a merge).
    rebuild(store, desc, CommitLog(store).tail(), use_checkpoint=False)
    figures = token_figures(CommitLog(store).read_range(0), desc.num_fragments)
    assert figures["deltas_lost"] == 1 and figures["drop_reasons"] == {BELOW_QUORUM: 1}


def test_K_answers_to_a_round_are_merged(tmp_path):
    store, desc = _run(tmp_path, quorum=2)
    clock = ManualClock()
    syncer, _ = _syncer(store, clock)
    syncer._tick_rounds()
    ids = [_answer(syncer, desc, m, 0, rnd=0) for m in ("l0", "l1")]
    syncer.close_rounds()                                  # both live learners answered: at once
    (rec,) = _commits(store)
    assert rec.kind == "merge" and [i.delta_id for i in rec.inputs] == ids and rec.quorum == 2 and rec.round == 0
    syncer.io.shutdown(wait=True)


def test_a_late_answer_and_an_answer_to_the_open_round_make_K_together(tmp_path):
    store, desc = _run(tmp_path, quorum=2)
    clock = ManualClock()
    syncer, _ = _syncer(store, clock)
    syncer._tick_rounds()
    late = _answer(syncer, desc, "l0", 0, rnd=0)
    rnd = _next_round(syncer, clock)                       # round 0 replaced: l0's answer is late
    syncer.close_rounds()
    assert _commits(store) == []                           # one learner: nothing yet
    now = _answer(syncer, desc, "l1", 0, rnd=rnd)
    syncer.close_rounds()
    assert _commits(store) == []                           # l1 alone is below the open round's quorum
    clock.t += 10.0                                        # l0's answer expires: with l1 that is K learners
    syncer.close_rounds()
    (rec,) = _commits(store)
    assert rec.kind == "merge" and {i.delta_id for i in rec.inputs} == {late, now} and rec.info["decided"] == \
        "late-expired"
    syncer.io.shutdown(wait=True)
    rebuild(store, desc, CommitLog(store).tail(), use_checkpoint=False)


def test_a_fold_that_leaves_fewer_than_K_learners_commits_only_its_drops(tmp_path):
    """l1's answer is a norm outlier (above the guard's cap): the commit drops it. Merging l0 alone would be a merge of 1 < K;
    the drop is committed, l0's answer stays pending and merges with l1's next answer."""
    store, desc = _run(tmp_path, quorum=2)
    clock = ManualClock()
    syncer, seen = _syncer(store, clock)
    syncer._tick_rounds()
    good = _answer(syncer, desc, "l0", 0, rnd=0)
    bad = _answer(syncer, desc, "l1", 0, rnd=0, fill=100.0)   # norm ~690, cap ~69
    syncer.close_rounds()
    (rec,) = _commits(store)
    assert rec.kind == "drop" and [(d.delta_id, d.reason) for d in rec.dropped] == [(bad, "norm-outlier")]
    assert rec.info["decided"] == "fold-below-quorum" and good in syncer.pending[0]
    assert any(e == "merge-below-quorum" and f["learners"] == ["l0"] for e, f in seen)
    again = _answer(syncer, desc, "l1", 1, rnd=0)
    syncer.close_rounds()
    merges = [r for r in _commits(store) if r.kind == "merge"]
    assert len(merges) == 1 and {i.delta_id for i in merges[0].inputs} == {good, again}
    syncer.io.shutdown(wait=True)
    rebuild(store, desc, CommitLog(store).tail(), use_checkpoint=False)


def test_the_syncer_warns_when_K_exceeds_every_learner_it_heard_of(tmp_path):
    store, desc = _run(tmp_path, quorum=3)
    clock = ManualClock()
    syncer, seen = _syncer(store, clock)
    syncer._tick_rounds()
    _answer(syncer, desc, "l0", 0, rnd=0)

    def warnings() -> list[dict]:
        return [f for e, f in seen if e == "quorum-unreachable"]
    syncer.close_rounds()
    assert warnings() == []                                # not for a while yet (2H steps)
    clock.t += 10.0
    syncer.close_rounds()
    syncer.close_rounds()
    assert [(w["quorum"], w["learners_heard"]) for w in warnings()] == [(3, 1)]   # once per count
    assert "K=3" in warnings()[0]["detail"]
    _answer(syncer, desc, "l1", 0, rnd=0)
    syncer.close_rounds()
    assert [w["learners_heard"] for w in warnings()] == [1, 2]
    _answer(syncer, desc, "l2", 0, rnd=0)
    clock.t += 10.0
    syncer.close_rounds()
    assert len(warnings()) == 2
    assert all(len(_learners(r)) >= 3 for r in _commits(store) if r.kind == "merge")
    syncer.io.shutdown(wait=True)


# -- real processes ---------------------------------------------------------------------------------

def test_ddiloco_run_refuses_a_quorum_above_its_learners(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "workers.cli", "run", "--plain", "--steps", "100", "--learners", "2",
           "--quorum", "3", "--out", str(out)]
    done = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "policy.quorum 3 with run.learners 2" in done.stderr and "exceeds" in done.stderr, done.stderr[-2000:]
    assert not out.exists()                                # refused before anything started


def test_a_real_K2_run_with_a_learner_killed_never_merges_fewer_than_K(tmp_path):
    """3 learners, K = 2, l2 killed mid-run: learners start and finish at different times and one
    dies, so rounds answered by one learner occur at both ends - every merge still has 2. Steps
    are padded (``--pace``) so that l0 and l1 train side by side for seconds on a loaded machine."""
    run = TinyRun(str(tmp_path / "store"), tmp_path, dict(os.environ, OMP_NUM_THREADS="1"), steps=160,
                  learners=3, secure=False)
    run.create(policy=PolicyConfig(quorum=2))
    try:
        run.syncer()
        for m in range(3):
            run.learner(f"l{m}", extra=["--pace", "0.05"])
        wait_for(lambda: last_step(run, "l2") >= 20, 150, "l2 to train")
        os.killpg(run.procs["l2"].pid, signal.SIGKILL)
        for m in (0, 1):
            assert run.wait(f"l{m}", 200) == 0, run.stderr(f"l{m}")
        assert run.wait_inbox_empty(90), run.drain_status
    finally:
        run.stop_all()
    records = list(CommitLog(run.store).read_range(0))
    merges = [r for r in records if r.kind == "merge"]
    assert {i.learner for r in merges for i in r.inputs} >= {"l0", "l1"}, "the survivors' work was never merged"
    small = [(r.seq, sorted(_learners(r))) for r in merges if len(_learners(r)) < 2]
    assert not small, small
    assert all(r.info.get("decided") != "late-expired" or len(_learners(r)) >= 2 for r in merges)
    rebuild(run.store, run.descriptor, records[-1].seq, use_checkpoint=False)
