"""Syncer-driven rounds (SPEC §2-4, issue "Rounds"): the global clock, the clock record learners
read from storage, round-aware closing, lineage superseding in the fold, and the round book."""
from __future__ import annotations

import numpy as np
import pytest

from pipeline.descriptor import RunDescriptor, migrate_v1
from pipeline.errors import FormatError
from pipeline.fold import RoundInput, fold, initial_state
from pipeline.policy import Pending, PolicyConfig, Timing, decide, late_deadline
from pipeline.fragment import FragmentLayout
from pipeline.merge import MergeConfig
from pipeline.schedule import ClockRecord, RoundClock, ScheduleConfig, latest_round
from pipeline.types import CommitRecord, DeltaHeader, InputRecord, TensorSpec
from workers.syncer.rounds import RoundBook
from runhelpers import rounds_learner


# ------------------------------------------------------------------ the global clock

def test_clock_opens_each_fragment_once_per_H_ticks_at_its_offset():
    c = RoundClock(8, (0, 2, 4, 6))
    opened = c.advance(0.0, 0.1)                 # the first call ticks step 0 at once
    assert opened == [(0, 0)]
    opened += c.advance(0.75, 0.1)               # steps 1..7 are due by t=0.7
    assert opened == [(0, 0), (2, 1), (4, 2), (6, 3)]
    assert c.advance(0.79, 0.1) == []            # step 8 ticks at t=0.8
    assert c.advance(0.81, 0.1) == [(8, 0)] and c.step == 9


def test_clock_catches_up_short_delays_but_not_long_pauses():
    c = RoundClock(4, (0, 1, 2, 3))
    c.advance(0.0, 1.0)
    assert [r for r, _ in c.advance(3.0, 1.0)] == [1, 2, 3]        # a late call catches up
    # after a pause > H periods: the missed steps are skipped, counted but not opened, so the global
    # step stays where learners extrapolating the published clock put it (issue 25)
    assert c.advance(100.0, 1.0) == [(100, 0)]
    assert c.wait_s(100.5) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="period"):
        c.advance(101.0, 0.0)
    with pytest.raises(ValueError, match="distinct"):
        RoundClock(4, (0, 0))


def test_latest_round_and_clock_record_round_trip():
    assert latest_round(0, 4, 1) == -1 and latest_round(1, 4, 1) == 1 and latest_round(6, 4, 1) == 5
    rec = ClockRecord(epoch=2, step=40, at=1000.0, period_s=0.5, H=8, offsets=(0, 4))
    back = ClockRecord.from_bytes(rec.to_bytes())
    assert back == rec
    assert rec.step_at(999.0) == 40 and rec.step_at(1001.0) == 42
    assert rec.round_at(0, 1001.0) == 40 and rec.round_at(1, 1003.0) == 44
    blob = bytearray(rec.to_bytes())
    blob[-1] ^= 1
    with pytest.raises(FormatError):
        ClockRecord.from_bytes(bytes(blob))


# ------------------------------------------------------------------ closing a round

def P(learner, t, rnd, seq=0, steps=4, tokens=100):
    return Pending(f"{learner}/0/{seq}", learner, (0, seq), t, steps, tokens, rnd)


CFG = PolicyConfig(quorum=1, overlap=2, gamma=0.5)
TIMING = Timing(step_time_s=1.0, sync_time_s=0.0)


def test_only_answers_to_the_open_round_count_toward_its_quorum():
    late = [P("a", 0.0, rnd=3)]
    d = decide(late, 10.0, CFG, TIMING, live_learners=2, round_id=7)
    assert d.merge == () and d.reason == "quorum-not-met"          # a late answer never closes a round
    both = late + [P("b", 5.0, rnd=7)]
    d = decide(both, 5.5, CFG, TIMING, live_learners=2, round_id=7)
    assert d.reason == "grace" and d.merge == ()
    d = decide(both, 7.0, CFG, TIMING, live_learners=2, round_id=7)
    assert d.reason == "grace-expired" and set(d.merge) == {"a/0/0", "b/0/0"}   # the late one is merged too


def test_round_closes_at_once_when_every_live_learner_answered():
    d = decide([P("a", 1.0, 7), P("b", 1.2, 7, seq=1)], 1.2, CFG, TIMING, live_learners=2, round_id=7)
    assert d.reason == "all-reported"
    # An answer without tokens does not count (it would weigh 0 and crash nothing, but proves nothing).
    d = decide([P("a", 1.0, 7), P("b", 1.2, 7, tokens=0)], 1.2, CFG, TIMING, live_learners=2, round_id=7)
    assert d.reason == "grace"


def test_late_deadline_is_two_round_periods():
    assert late_deadline(10.0, 0.5, 8) == pytest.approx(18.0)
    with pytest.raises(ValueError):
        late_deadline(10.0, 0.5, 0)


# ------------------------------------------------------------------ lineage in the fold

SHAPES = {"w": (6,)}


def _desc(schedule="syncer") -> RunDescriptor:
    return RunDescriptor(run_id="r", layout=FragmentLayout((TensorSpec("w", (6,)),), (("w",),)),
                         schedule=ScheduleConfig(1, (0,), schedule), merge=MergeConfig("mean"))


def _inp(seq, base, rnd, scale, learner="a"):
    h = DeltaHeader(learner, 1, seq, 0, base, 4, 400, seq, rnd)
    return RoundInput(h, f"deltas/{learner}/{seq}", f"c{learner}{seq}", {"w": np.full(6, scale, np.float32)})


def _state_at_version_1(desc):
    s0 = initial_state(desc, {"w": np.zeros(6, np.float32)})
    return fold(s0, desc, 0, [_inp(0, 0, 0, 0.1, learner="z")], seq=0, epoch=1, output_key="v1").state


def test_a_late_answer_on_an_older_base_is_merged_beside_the_newer_one():
    desc = _desc()
    s1 = _state_at_version_1(desc)
    # learner a answered round 3 late (base 0), applied version 1, then answered round 5 (base 1):
    res = fold(s1, desc, 0, [_inp(1, 0, 3, 0.2), _inp(2, 1, 5, 0.3)], seq=1, epoch=1, output_key="v2", round_id=5)
    rec = res.record
    assert [i.delta_id for i in rec.inputs] == ["a/1/1", "a/1/2"] and rec.dropped == ()
    assert [i.round for i in rec.inputs] == [3, 5] and rec.round == 5
    assert [i.staleness for i in rec.inputs] == [1, 0]


def test_a_newer_answer_on_the_same_base_supersedes_the_older():
    desc = _desc()
    s1 = _state_at_version_1(desc)
    res = fold(s1, desc, 0, [_inp(1, 1, 3, 0.2), _inp(2, 1, 5, 0.3)], seq=1, epoch=1, output_key="v2", round_id=5)
    assert [i.delta_id for i in res.record.inputs] == ["a/1/2"]
    assert [(d.delta_id, d.reason) for d in res.record.dropped] == [("a/1/1", "superseded")]


def test_learner_driven_logs_replay_with_their_own_rule():
    desc = _desc("learner")
    s1 = _state_at_version_1(desc)
    res = fold(s1, desc, 0, [_inp(1, 0, -1, 0.2), _inp(2, 1, -1, 0.3)], seq=1, epoch=1, output_key="v2")
    assert [i.delta_id for i in res.record.inputs] == ["a/1/2"]      # one delta per learner, as they were made


def test_records_without_rounds_still_load_and_old_descriptors_are_learner_driven():
    v1 = {"run_id": "r", "tensors": [{"name": "w", "shape": [6], "dtype": "float32"}], "fragments": [["w"]],
          "offsets": [0], "sync_every": 1, "merge": "mean"}              # a v1 document, without "schedule"
    assert RunDescriptor.from_dict(migrate_v1(v1)).schedule.driver == "learner"
    h = DeltaHeader("a", 1, 2, 0, 0, 1, 1, 0).to_dict()
    del h["round"]
    assert DeltaHeader.from_dict(h).round == -1
    rec = CommitRecord(seq=1, epoch=1, kind="merge", round=9).to_dict()
    del rec["round"]
    assert CommitRecord.from_dict(rec).round == -1
    i = InputRecord("a/1/2", "a", 1, 2, "k", "c", 0, 1, 1, 0, 1.0, 0).to_dict()
    del i["round"]
    assert InputRecord.from_dict(i).round == -1
    with pytest.raises(ValueError, match="round"):
        DeltaHeader("a", 1, 2, 0, 0, 1, 1, 0, round=-2)


# ------------------------------------------------------------------ the syncer's round book

def test_round_book_follows_the_live_learners_pace_and_replaces_unclosed_rounds():
    desc = RunDescriptor(run_id="r", layout=FragmentLayout((TensorSpec("a", (2,)), TensorSpec("b", (2,))),
                                                           (("a",), ("b",))), schedule=ScheduleConfig(4, (0, 2)))
    book = RoundBook(desc, live_timeout_s=5.0, initial_step_s=1.0)
    assert book.tick(0.0) == [(0, 0)]                       # before any pace: the initial step time
    book.heartbeat("l0", 0.1, 0.1)
    book.heartbeat("l1", 0.1, 0.1)
    assert book.step_time(0.1) == pytest.approx(0.1)
    assert book.tick(1.05) == []                             # step 1 (no fragment at offset 1)
    assert book.tick(1.25) == [(2, 1)]                       # now at the learners' 0.1 s pace
    assert book.open[0].round == 0
    assert book.tick(1.45) == [(4, 0)]
    assert book.open[0].round == 4                           # p's next opening replaced the unclosed round
    book.close(1)
    assert book.open[1] is None
    assert book.live(6.0) == []                             # unheard for live_timeout_s: not live
    # Deltas alone (no bus, no heartbeats) give a learner's pace and liveness.
    book.delta_arrived("l9", 10, 20.0)
    book.delta_arrived("l9", 30, 22.0)
    assert book.live(22.0) == ["l9"] and book.learners["l9"].period_s == pytest.approx(0.1)


def test_a_learner_that_says_it_is_not_stepping_does_not_pace_the_clock():
    """Issue 29's SLURM run: two learners held at a gate kept reporting their old 1 ms period and
    the clock followed them. A heartbeat with step_time_s 0 after a period takes it out of the
    median until it reports a period again; before any period, 0 still means "none yet"."""
    desc = RunDescriptor(run_id="r", layout=FragmentLayout((TensorSpec("a", (2,)),), (("a",),)),
                         schedule=ScheduleConfig(4, (0,)))
    book = RoundBook(desc, live_timeout_s=5.0, initial_step_s=1.0)
    for m, p in (("l0", 0.1), ("l1", 0.001), ("l2", 0.001)):
        book.heartbeat(m, p, 0.0)
    assert book.learners["l1"].period(0.0, 5.0) == pytest.approx(0.001)
    book.heartbeat("l1", 0.0, 1.0)                       # held: not stepping
    book.heartbeat("l2", 0.0, 1.0)
    assert book.live(1.0) == ["l0", "l1", "l2"]           # still live (heard) ...
    assert book.learners["l1"].period(1.0, 5.0) == 0.0    # ... but pacing nothing
    for _ in range(40):
        book.step_time(1.0)
    assert book.period.value == pytest.approx(0.1, rel=0.01)   # l0's pace, not the held ones' 1 ms
    book.heartbeat("l1", 0.002, 2.0)                      # stepping again: it paces again
    assert book.learners["l1"].period(2.0, 5.0) == pytest.approx(0.002)
    book.heartbeat("l9", 0.0, 2.0)                        # a newcomer without a period yet
    assert book.learners["l9"].still_at == float("-inf")


def test_a_learner_not_stepping_reports_no_period(tmp_path):
    from workers.learner.figures import STILL_FACTOR, STILL_MIN_S
    learner, _, step, _ = rounds_learner(tmp_path)
    now = [100.0]
    learner.clock = lambda: now[0]      # noqa: E731  (the heartbeat reads the learner's clock)
    try:
        for _ in range(5):
            step()
            now[0] += 0.01
        assert learner._heartbeat()["step_time_s"] == pytest.approx(0.01)
        assert STILL_MIN_S > STILL_FACTOR * 0.01                # so STILL_MIN_S is the bound here
        now[0] += STILL_MIN_S - 0.02
        assert learner._heartbeat()["step_time_s"] == pytest.approx(0.01)   # a slow step is no hold
        now[0] += 0.02
        assert learner._heartbeat()["step_time_s"] == 0.0       # held: says it is not stepping
        step()                                                  # steps again: its period again
        now[0] += 0.01
        assert learner._heartbeat()["step_time_s"] == pytest.approx(0.01)
    finally:
        learner.close()


# ------------------------------------------------------------------ the learner's side

def _deltas(tmp_path):
    from workers.common.events import read_events
    return [e for e in read_events(tmp_path / "l0.jsonl") if e.get("event") == "delta"]


def test_learner_answers_each_opened_round_once_at_the_next_step(tmp_path):
    learner, _, step, events = rounds_learner(tmp_path)
    try:
        step()
        assert _deltas(tmp_path) == []                       # nobody asked: the learner never sends on its own
        learner.receiver.rounds = {0: (1, 5)}
        step()
        step()
        d = _deltas(tmp_path)
        assert [(e["round"], e["steps"]) for e in d] == [(5, 1)]     # answered once, with the step before it
        learner.receiver.rounds = {0: (1, 9)}
        step()
        assert [(e["round"], e["steps"]) for e in _deltas(tmp_path)] == [(5, 1), (9, 3)]
    finally:
        learner.close()


def _arrival(learner, version, rnd, scale=0.0):
    from workers.learner.receiver import Arrival
    values = {n: (learner.base[0][n] + scale).astype(np.float32) for n in learner.base[0]}
    return Arrival(0, version, 10 + version, values, "announce", 0.0, 1, rnd)


def test_a_version_for_an_unanswered_round_is_answered_before_it_overwrites(tmp_path):
    learner, model, step, _ = rounds_learner(tmp_path)
    try:
        step()
        step()
        learner.receiver.arrivals = [_arrival(learner, 1, rnd=7)]     # round 7 closed without our answer
        step()
        d = _deltas(tmp_path)
        assert [(e["round"], e["steps"], e["base"]) for e in d] == [(7, 2, 0)]   # the two steps went out first
        assert learner.base_version[0] == 1 and learner.c_steps[0] == 1
    finally:
        learner.close()


def test_keep_progress_carries_the_steps_since_the_answer(tmp_path):
    import torch
    learner, model, step, _ = rounds_learner(tmp_path, keep_progress=True)
    try:
        step()
        learner.receiver.rounds = {0: (1, 3)}
        step()                                    # answers round 3 (1 step), then trains a 2nd step
        step()                                    # a 3rd step
        at_answer = learner._at_answer[0][0]
        now = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
        arrival = _arrival(learner, 1, rnd=3, scale=0.5)
        learner.receiver.arrivals = [arrival]
        learner.apply_arrivals()
        for n, p in model.named_parameters():
            want = torch.from_numpy(arrival.values[n]) + (torch.from_numpy(now[n]) - torch.from_numpy(at_answer[n]))
            assert torch.equal(p.detach(), want)
        assert learner.c_steps[0] == 2 and learner.base_version[0] == 1   # the two steps since the answer
    finally:
        learner.close()


def test_a_leaving_learner_flushes_the_steps_since_its_last_answer(tmp_path):
    learner, _, step, _ = rounds_learner(tmp_path)
    step()
    learner.receiver.rounds = {0: (1, 5)}
    step()
    step()
    learner.close()
    d = _deltas(tmp_path)
    assert [(e["round"], e["steps"]) for e in d] == [(5, 1), (5, 3)]   # the last two steps were not lost
    learner2, _, step2, _ = rounds_learner(tmp_path / "second")
    step2()
    learner2.receiver.rounds = {0: (1, 5)}
    step2()                                                       # answers round 5 with 1 step
    step2()                                                       # and trains one more
    learner2.close(flush=False)
    assert [(e["round"], e["steps"]) for e in _deltas(tmp_path / "second")] == [(5, 1)]
