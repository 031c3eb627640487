"""Issue 14: the learner's wait for its region's copy of an announced commit tracks the copy time
in both directions (workers/learner/receiver.py ``_after_poll``).

It used to learn from found times only: each wait starts at the mean of earlier ones, and a find
is never earlier than the first re-read, so the mean could only grow. One slow copy (0.5 s) left
every later wait starting at ~0.5 s although copies then took 0.02 s: at 0.4 s steps r1's
learners applied versions a step late (benchmark, docs/regions.md)."""
from __future__ import annotations

from workers.common.events import EventLog
from workers.learner import receiver as receiver_mod


class _Tracker:
    cursor = 0
    bytes_loaded = 0
    store = None


def _receiver() -> receiver_mod.Receiver:
    return receiver_mod.Receiver(_Tracker(), {0: 0}, EventLog(None, "learner", "l1"), bus=None, poll_s=0.5)


def _wait(rcv, clock, copy_s: float) -> float:
    """One announced commit whose copy lands ``copy_s`` after the announcement; returns the first pause."""
    rcv._announced = rcv.tracker.cursor + 1
    start = clock[0]
    first = pause = rcv._after_poll()            # the read at the announcement missed
    while True:
        clock[0] += pause
        if clock[0] - start >= copy_s:
            rcv.tracker.cursor = rcv._announced  # this read finds it
            assert rcv._after_poll() == rcv.poll_s
            return first
        pause = rcv._after_poll()


def test_the_copy_wait_comes_back_down_after_one_slow_copy(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(receiver_mod.time, "monotonic", lambda: clock[0])
    rcv = _receiver()
    _wait(rcv, clock, 0.5)                       # one slow copy
    firsts = [_wait(rcv, clock, 0.02) for _ in range(8)]   # then fast ones
    assert firsts[-1] <= 0.1, firsts             # the first re-read is soon again (was ~0.5 s, for good)
    assert firsts == sorted(firsts, reverse=True)
    assert rcv.copy_wait_s < 0.2


def test_the_copy_wait_learns_a_steady_copy_time(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(receiver_mod.time, "monotonic", lambda: clock[0])
    rcv = _receiver()
    for _ in range(10):
        _wait(rcv, clock, 0.25)                  # a copy across the link: a few round trips
    assert 0.1 <= rcv.copy_wait_s <= 0.4, rcv.copy_wait_s
