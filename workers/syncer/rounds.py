"""The syncer's round book (SPEC §2-4, the paper's Algorithm 2): the global step, the open round of
every fragment, and the pace of the live learners that drives them.

The syncer owns one; everything runs on its loop thread. Pure decisions live in
pipeline/schedule.py (the clock) and pipeline/policy.py (when a round closes); this part keeps the
state between calls and measures the learners' pace:

* from heartbeats (``step_time_s`` = a learner's step-to-step period), and
* from the deltas themselves (their ``learner_step`` against arrival times), so that learners
  without a bus - bucket-only, other regions - set the pace too.

A learner counts as live while it was heard within ``live_timeout_s``. With nobody live the clock
keeps its last pace: openings nobody answers cost nothing, and a learner that comes back finds
rounds open.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

from pipeline.policy import Ewma
from pipeline.schedule import ClockRecord, RoundClock
from pipeline.types import RunDescriptor


@dataclass(frozen=True)
class OpenRound:
    round: int          # the global step it opened at: its id
    opened_at: float    # syncer monotonic time


@dataclass
class _Pace:
    heard: float                 # last time anything was heard from the learner
    period_s: float = 0.0        # its step-to-step period (0: unknown)
    ref: tuple[int, float] | None = None   # (learner step, arrival) of an earlier delta, for the period
    lag_s: float | None = None   # smoothed time from a round opening to this learner's answer arriving


class RoundBook:
    def __init__(self, descriptor: RunDescriptor, live_timeout_s: float, initial_step_s: float,
                 start_step: int = 0, owned: Sequence[int] | None = None):
        if initial_step_s <= 0:
            raise ValueError(f"initial_step_s must be > 0, got {initial_step_s}")
        self.clock = RoundClock(descriptor.schedule.sync_every, descriptor.schedule.offsets, step=start_step)
        self.open: list[OpenRound | None] = [None] * descriptor.num_fragments
        self.live_timeout_s = live_timeout_s
        self.initial_step_s = initial_step_s
        self.learners: dict[str, _Pace] = {}
        self.period = Ewma(0.2)
        self.published: ClockRecord | None = None
        # A syncer shard opens rounds only for its own fragments (issue 15); its clock still
        # counts every global step, so each shard's round ids are the run's global steps.
        self.owned = frozenset(range(descriptor.num_fragments) if owned is None else owned)
        # (fragment, round) -> when it opened, the last few per fragment: an answer's lag is
        # measured against its own round's opening even after that round closed (late answers).
        self.opened_at: dict[tuple[int, int], float] = {}

    # -- the learners' pace ----------------------------------------------------------------------
    def heartbeat(self, learner: str, period_s: float, now: float) -> None:
        pace = self.learners.setdefault(learner, _Pace(now))
        pace.heard = now
        if period_s > 0:
            pace.period_s = period_s

    def delta_arrived(self, learner: str, learner_step: int, now: float) -> None:
        """A delta is a sign of life, and two of them far enough apart give the learner's period
        (when it has no bus to send heartbeats on)."""
        pace = self.learners.setdefault(learner, _Pace(now))
        pace.heard = now
        if pace.ref is None or learner_step < pace.ref[0]:
            pace.ref = (learner_step, now)
        elif learner_step - pace.ref[0] >= 8 and now > pace.ref[1]:
            sample = (now - pace.ref[1]) / (learner_step - pace.ref[0])
            pace.period_s = sample if pace.period_s <= 0 else 0.5 * (pace.period_s + sample)
            pace.ref = (learner_step, now)

    def answered(self, learner: str, fragment: int, round_id: int, now: float) -> None:
        """A delta answering round ``round_id`` of ``fragment`` arrived at ``now``: a sample of how
        long the learner's answers take after a round opens (hearing it, the step boundary, the
        way back; issue 14: a learner across a link answers a round trip later)."""
        opened = self.opened_at.get((fragment, round_id))
        if opened is None or now < opened:
            return
        pace = self.learners.setdefault(learner, _Pace(now))
        lag = now - opened
        pace.lag_s = lag if pace.lag_s is None else pace.lag_s + 0.2 * (lag - pace.lag_s)

    def answer_spread(self, now: float) -> float:
        """How much later the slowest live learner's answers arrive than the fastest's (0 with
        fewer than two measured), at most a quarter of a round period (H steps): pipeline/policy.py
        widens the grace window by it. Why a quarter: an answer that misses its round waits a
        whole period for the next; a round that waits for it delays everyone's version by at most
        this much - and a straggler or a learner whose answers spill holds no round for long."""
        lags = [self.learners[m].lag_s for m in self.live(now) if self.learners[m].lag_s is not None]
        if len(lags) < 2:
            return 0.0
        period = self.clock.H * (self.period.value or self.initial_step_s)
        return min(max(lags) - min(lags), period / 4)

    def live(self, now: float) -> list[str]:
        return sorted(m for m, p in self.learners.items() if now - p.heard < self.live_timeout_s)

    def step_time(self, now: float) -> float | None:
        """Smoothed median period of the live learners (None before any was measured)."""
        periods = [self.learners[m].period_s for m in self.live(now) if self.learners[m].period_s > 0]
        if periods:
            self.period = self.period.update(statistics.median(periods))
        return self.period.value

    # -- rounds ----------------------------------------------------------------------------------
    def tick(self, now: float) -> list[tuple[int, int]]:
        """Advance the global step at the pace last measured by ``step_time`` (the syncer measures
        once per loop); open (and return) the rounds that fall due. A round still open when its
        fragment's next one opens is replaced: its answers are then late (SPEC §4)."""
        opened = [(r, p) for r, p in self.clock.advance(now, self.period.value or self.initial_step_s)
                  if p in self.owned]
        for r, p in opened:
            self.open[p] = OpenRound(r, now)
            self.opened_at[(p, r)] = now
        while len(self.opened_at) > 4 * len(self.open):
            del self.opened_at[next(iter(self.opened_at))]     # the oldest opening (insertion order)
        return opened

    def close(self, fragment: int) -> None:
        self.open[fragment] = None

    def clock_record(self, epoch: int, wall: float) -> ClockRecord | None:
        """A new clock record to publish, or None when the published one is still good (same
        epoch, pace within 10%, younger than 10 s): bus-less learners poll it, it costs one PUT."""
        period = self.period.value or self.initial_step_s
        old = self.published
        if old is not None and old.epoch == epoch and abs(old.period_s - period) <= 0.1 * old.period_s \
                and wall - old.at < 10.0:
            return None
        # The step ticked now is clock.step - 1; its wall time is about now.
        rec = ClockRecord(epoch, max(0, self.clock.step - 1), wall, period, self.clock.H, self.clock.offsets)
        self.published = rec
        return rec
