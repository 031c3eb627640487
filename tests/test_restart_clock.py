"""Issue 25, defect 1: after a syncer restart the global clock must not run away, and learners must
never silently stop answering. Unit tests on injected clocks (the real-process reproduction is
tests/test_restart_repro.py).

* the syncer's pace (workers/syncer/rounds.py): an inbox backlog admitted in one listing is no pace
  sample; heartbeats set a learner's pace; a bus-less learner is measured between bursts of its
  deltas; one sample moves a period by at most PACE_FACTOR;
* the clock's bounds (pipeline/schedule.py): periods in [MIN_PERIOD_S, MAX_PERIOD_S], clock records
  extrapolated at most EXTRAPOLATE_MAX_S;
* the receiver (workers/learner/receiver.py): a same-epoch announcement replaces a round guessed
  from the storage clock, even a lower one;
* the learner (workers/learner/learner.py): it answers such a replaced round, never a round twice.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from pipeline.envelope import pack_record
from pipeline.errors import FormatError
from pipeline.fragment import FragmentLayout
from pipeline.schedule import (CLOCK_KIND, CLOCK_VERSION, EXTRAPOLATE_MAX_S, MAX_PERIOD_S, MIN_PERIOD_S, ClockRecord,
                               RoundClock, ScheduleConfig)
from pipeline.descriptor import RunDescriptor
from pipeline.types import TensorSpec
from storage.layout import CLOCK_KEY
from storage.store import open_store
from workers.syncer.rounds import DELTA_SPAN_S, PACE_FACTOR, RoundBook, bounded_period
from runhelpers import rounds_learner

H = 16


def _book(initial_step_s: float = 0.1, start_step: int = 0) -> RoundBook:
    names = [f"t{p}" for p in range(4)]
    desc = RunDescriptor(run_id="r", layout=FragmentLayout(tuple(TensorSpec(n, (2,)) for n in names),
                                                           tuple((n,) for n in names)),
                         schedule=ScheduleConfig(H, (0, 4, 8, 12)))
    return RoundBook(desc, live_timeout_s=5.0, initial_step_s=initial_step_s, start_step=start_step)


def _listing(book: RoundBook, learner: str, steps, at: float) -> None:
    """One loop turn that admits ``steps`` of ``learner`` from one inbox listing (read 0.1 ms apart)."""
    book.step_time(at)
    for k, s in enumerate(steps):
        book.delta_arrived(learner, s, at + k * 1e-4)


def _run_loop(book: RoundBook, t0: float, t1: float, turn_s: float = 0.001) -> list[tuple[int, int]]:
    """The syncer's loop from t0 to t1, one turn every ``turn_s``: measure the pace, tick."""
    opened, t = [], t0
    while t < t1:
        book.step_time(t)
        opened += book.tick(t)
        t += turn_s
    return opened


# ------------------------------------------------------------------ the syncer's pace

def test_an_inbox_backlog_admitted_in_one_listing_is_no_pace_sample_and_the_clock_holds():
    book = _book(initial_step_s=0.1, start_step=273)          # a restarted syncer: after round 272
    _listing(book, "l0", range(200, 284, 4), 10.0)            # the outage's spilled deltas, 84 steps
    _listing(book, "l1", range(201, 285, 4), 10.0)
    assert book.learners["l0"].period_s == 0 and book.learners["l1"].period_s == 0
    opened = _run_loop(book, 10.0, 11.0)
    # Before the fix: a 0.25 ms period and a tick every loop turn (about 1000 steps in this second).
    assert book.clock.step - 273 <= 1.0 / 0.1 + 1, book.clock.step
    assert all(273 <= r < 273 + 12 for r, _ in opened)
    rec = book.clock_record(epoch=2, wall=1000.0)
    assert rec.period_s == pytest.approx(0.1) and rec.step < 273 + 12


def test_heartbeats_set_the_pace_and_deltas_do_not_override_them():
    book = _book()
    book.heartbeat("l0", 0.05, 0.0)
    _listing(book, "l0", range(0, 10), 0.0)
    _listing(book, "l0", range(10, 200), 1.5)                 # deltas alone would say 8 ms
    for k in range(40):
        book.step_time(1.5 + k * 0.01)
    assert book.period.value == pytest.approx(0.05)
    assert book.learners["l0"].period(1.5, book.live_timeout_s) == pytest.approx(0.05)
    # Heartbeats that stopped (a bus down) give way to the deltas' measurement.
    assert book.learners["l0"].period(10.0, book.live_timeout_s) == book.learners["l0"].delta_s > 0


def test_a_bus_less_learner_is_measured_between_listings_even_after_a_backlog():
    book = _book()
    period = 0.05
    _listing(book, "l9", range(200, 281), 20.0)               # the backlog: 81 steps in one listing
    step, t = 280, 20.0
    for _ in range(12):                                        # then a listing every 0.5 s, 10 new steps each
        t += 0.5
        _listing(book, "l9", range(step + 1, step + 11), t)
        step += 10
        got = book.learners["l9"].period_s
        assert got == 0 or got >= period * 0.95, got          # never faster than the learner: no runaway
    assert book.learners["l9"].period_s == pytest.approx(period, rel=0.05)
    assert book.live(t) == ["l9"]


def test_a_sample_spans_at_least_two_bursts_a_second_apart():
    book = _book()
    _listing(book, "l9", range(0, 5), 0.0)
    _listing(book, "l9", range(5, 30), DELTA_SPAN_S / 2)       # half a second later: too close
    assert book.learners["l9"].period_s == 0
    _listing(book, "l9", range(30, 45), DELTA_SPAN_S)
    # newest step 4 to 44; a first sample is bounded too, from the clock's pace (0.1 s here): an
    # anchor listed after an outage can hold a stale newest step (issue 25, the simulation)
    first = bounded_period(0.1, DELTA_SPAN_S / 40)
    assert book.learners["l9"].period_s == pytest.approx(first, rel=0.01)
    _listing(book, "l9", [0, 1], DELTA_SPAN_S + 5)             # steps went back: a new life, measured afresh
    _listing(book, "l9", [40], 2 * DELTA_SPAN_S + 5.0999)
    assert book.learners["l9"].period_s == pytest.approx(bounded_period(first, 1.1 * DELTA_SPAN_S / 39),
                                                         rel=0.01)   # from step 1 to 40


def test_one_delta_sample_moves_a_period_by_at_most_the_pace_factor():
    assert bounded_period(0.05, 1e-6) == pytest.approx(0.5 * (0.05 + 0.05 / PACE_FACTOR))
    assert bounded_period(0.05, 10.0) == pytest.approx(0.5 * (0.05 + 0.05 * PACE_FACTOR))
    assert bounded_period(0.05, 0.06) == pytest.approx(0.055)
    assert bounded_period(0.0, 1e-6) == MIN_PERIOD_S            # a first sample: within the clock's bounds
    assert bounded_period(0.0, 1e9) == MAX_PERIOD_S
    book = _book()
    book.heartbeat("l0", 1e-7, 0.0)                              # a heartbeat's period is bounded too
    assert book.learners["l0"].period_s == MIN_PERIOD_S
    with pytest.raises(ValueError, match="initial_step_s"):
        _book(initial_step_s=1e-5)


# ------------------------------------------------------------------ the clock's bounds

def test_a_restarted_syncer_resumes_the_pace_its_predecessor_published():
    """Issue 25: a new syncer (restart, takeover) starts at the stored clock's pace, not the
    initial 0.1 s (5x slow at 20 ms steps: a fragment waited ~30 steps for its next round)."""
    book = _book(initial_step_s=0.1)
    assert book.resume_pace(ClockRecord(3, 400, 1000.0, 0.02, H, (0, 4, 8, 12)))
    opened = _run_loop(book, 0.0, 0.64)             # 32 global steps of 20 ms: an opening every 4
    assert 7 <= len(opened) <= 9, opened
    assert len(_run_loop(_book(initial_step_s=0.1), 0.0, 0.64)) <= 2     # at the initial 0.1 s
    # another schedule's clock, or a pace already measured, is not taken
    assert not _book().resume_pace(ClockRecord(3, 400, 1000.0, 0.02, H, (0, 1, 2, 3)))
    assert not _book().resume_pace(None)
    measured = _book()
    measured.heartbeat("l0", 0.05, 0.0)
    measured.step_time(0.0)
    assert not measured.resume_pace(ClockRecord(3, 400, 1000.0, 0.02, H, (0, 4, 8, 12)))
    assert measured.period.value == pytest.approx(0.05)


def test_clock_periods_are_bounded_and_old_records_still_read():
    c = RoundClock(H, (0, 4))
    with pytest.raises(ValueError, match="clock period"):
        c.advance(0.0, MIN_PERIOD_S / 4)
    with pytest.raises(ValueError, match="clock period"):
        c.advance(0.0, MAX_PERIOD_S * 2)
    with pytest.raises(ValueError, match="period_s"):
        ClockRecord(epoch=1, step=0, at=0.0, period_s=0.00025, H=H, offsets=(0, 4))
    good = {"epoch": 2, "step": 272, "at": 1000.0, "period_s": 0.05, "H": H, "offsets": [0, 4]}
    rec = ClockRecord.from_bytes(pack_record(CLOCK_KIND, CLOCK_VERSION, good))   # round-clock v1, unchanged
    assert (rec.epoch, rec.step, rec.period_s) == (2, 272, 0.05)
    bogus = dict(good, period_s=0.00025)                       # what the runaway syncer published
    with pytest.raises(FormatError, match="period_s"):
        ClockRecord.from_bytes(pack_record(CLOCK_KIND, CLOCK_VERSION, bogus))


def test_a_clock_record_is_extrapolated_at_most_its_horizon():
    rec = ClockRecord(epoch=2, step=272, at=1000.0, period_s=0.05, H=H, offsets=(0, 4))
    assert rec.step_at(1001.01) == 292
    horizon = 272 + int(EXTRAPOLATE_MAX_S // 0.05)
    assert rec.step_at(1000.0 + EXTRAPOLATE_MAX_S) == horizon
    assert rec.step_at(1000.0 + 100 * EXTRAPOLATE_MAX_S) == horizon    # a dead syncer's record: frozen
    assert rec.round_at(1, 1e9) <= horizon


# ------------------------------------------------------------------ the receiver

class _Time:
    def __init__(self):
        self.mono, self.wall = 100.0, 1000.0


def _receiver(tmp_path, t: _Time):
    from tests.runhelpers import Recorder
    from workers.learner.receiver import Receiver
    store = open_store(str(tmp_path / "store"))
    tracker = SimpleNamespace(store=store, bytes_loaded=0, cursor=-1)
    news = []
    r = Receiver(tracker, {0: 0, 1: 0}, Recorder(), None, clock=lambda: t.mono, wall=lambda: t.wall,
                 on_news=lambda: news.append(1))
    return r, store, news


def _put_clock(store, epoch: int, step: int, at: float, period_s: float) -> None:
    store.put(CLOCK_KEY, ClockRecord(epoch, step, at, period_s, H, (0, 4)).to_bytes())


def test_a_same_epoch_announcement_replaces_a_round_guessed_from_the_storage_clock(tmp_path):
    t = _Time()
    r, store, news = _receiver(tmp_path, t)
    _put_clock(store, epoch=2, step=272, at=t.wall, period_s=0.002)     # a clock far too fast
    t.wall += 30.0
    r._poll_clock()                                                      # no bus heard: guess from it
    guessed = r.opened()[0]
    assert guessed[0] == 2 and guessed[1] > 10_000
    r._open(2, 0, 3600)                                                  # the syncer's real round
    assert r.opened()[0] == (2, 3600)
    r._open(2, 0, 3584)                                                  # an older announcement: ignored
    assert r.opened()[0] == (2, 3600)
    t.mono += 10.0                                                       # bus silent: the clock again
    r._poll_clock()
    assert r.opened()[0] == guessed                                      # a guess only ever moves it up ...
    _put_clock(store, epoch=2, step=3610, at=t.wall, period_s=0.05)      # ... until a newer record replaces it
    r._poll_clock()
    assert r.opened()[0] == (2, 3600) and r.opened()[1] == (2, 3604)
    r._open(1, 0, 99_999)                                                # an older syncer epoch never wins
    assert r.opened()[0] == (2, 3600)
    r._open(3, 0, 16)                                                    # a newer one always does
    assert r.opened()[0] == (3, 16)
    assert len(news) >= 5


def test_a_bus_round_is_not_replaced_by_a_lower_guess(tmp_path):
    t = _Time()
    r, store, _ = _receiver(tmp_path, t)
    r._open(2, 1, 3604)
    t.mono += 10.0
    _put_clock(store, epoch=2, step=3500, at=t.wall, period_s=0.05)
    r._poll_clock()
    assert r.opened()[1] == (2, 3604)                                    # the guess is older: kept
    t.wall += 1.01                                                       # step 3520: round 3508, still older
    r._poll_clock()
    assert r.opened()[1] == (2, 3604)
    t.wall += 10.0                                                       # step 3720: round 3716, newer
    r._poll_clock()
    assert r.opened()[1] == (2, 3716)


# ------------------------------------------------------------------ the learner

def _learner(tmp_path):
    learner, _, step, _ = rounds_learner(tmp_path)
    return learner, step


def _answers(tmp_path) -> list[int]:
    from workers.common.events import read_events
    return [e["round"] for e in read_events(tmp_path / "l0.jsonl") if e.get("event") == "delta"]


def test_the_learner_answers_the_real_round_after_a_bogus_guess_and_never_a_round_twice(tmp_path):
    learner, step = _learner(tmp_path)
    try:
        step()
        learner.receiver.rounds = {0: (2, 30288)}              # guessed from a runaway clock
        step()
        learner.receiver.rounds = {0: (2, 3600)}               # the syncer's real round replaces it
        step()
        learner.receiver.rounds = {0: (2, 3604)}
        step()
        assert _answers(tmp_path) == [30288, 3600, 3604]       # it keeps answering (it stopped before)
        learner.receiver.rounds = {0: (2, 3600)}               # a round it answered: never twice
        step()
        learner.receiver.rounds = {0: (1, 5000)}               # an older syncer epoch: not answered
        step()
        assert _answers(tmp_path) == [30288, 3600, 3604]
    finally:
        learner.close(flush=False)


def test_rounds_answered_as_guesses_ahead_are_answered_again_when_they_open_for_real(tmp_path):
    """A learner whose wall clock reads ahead of the syncer's guesses rounds before they open; when
    the syncer's real (lower) round replaces the guess, the rounds answered ahead are still to come.
    Remembered as answered, they went unanswered when they opened (fault simulation, clock-skew)."""
    learner, step = _learner(tmp_path)
    try:
        step()
        for guess in (100, 106):                          # guessed 25 s ahead, answered
            learner.receiver.rounds = {0: (2, guess)}
            step()
        for real in (94, 100, 106):                       # the syncer's clock, same epoch
            learner.receiver.rounds = {0: (2, real)}
            step()
        assert _answers(tmp_path) == [100, 106, 94, 100, 106]
        learner.receiver.rounds = {0: (2, 106)}           # the same opening again: not twice
        step()
        assert _answers(tmp_path) == [100, 106, 94, 100, 106]
    finally:
        learner.close(flush=False)


def test_a_round_open_before_any_work_is_answered_at_the_first_step_that_has_some(tmp_path):
    """A learner (re)started while a round was open has nothing to say yet: it answers that round
    once it has trained on it, instead of counting it answered with nothing (in a K = 3 run the
    round then waited for it in vain and the fragment froze: fault simulation seed 934)."""
    learner, step = _learner(tmp_path)
    try:
        learner.receiver.rounds = {0: (2, 40)}        # open before the first step
        step()                                        # the boundary comes before the step's work
        assert _answers(tmp_path) == []
        step()                                        # one step trained on it: answered now
        assert _answers(tmp_path) == [40]
        step()
        assert _answers(tmp_path) == [40]             # and only once
    finally:
        learner.close(flush=False)


def test_a_version_of_an_unanswered_round_below_a_guess_is_answered_before_it_overwrites(tmp_path):
    import numpy as np
    from workers.learner.receiver import Arrival
    learner, step = _learner(tmp_path)
    try:
        step()
        learner.receiver.rounds = {0: (2, 30288)}              # a bogus guess, answered
        step()
        step()
        values = {n: v.astype(np.float32) for n, v in learner.base[0].items()}
        learner.receiver.arrivals = [Arrival(0, 1, 11, values, "announce", 0.0, 2, 3604)]   # closed without us
        step()
        assert _answers(tmp_path) == [30288, 3604]             # the steps since went out before the overwrite
        assert learner.base_version[0] == 1
        learner.receiver.arrivals = [Arrival(0, 2, 12, values, "announce", 0.0, 2, 3604)]   # answered now
        step()
        assert _answers(tmp_path) == [30288, 3604]
    finally:
        learner.close(flush=False)
