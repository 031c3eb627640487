"""The syncer's round book (SPEC §2-4, the paper's Algorithm 2): the global step, the open round of
every fragment, and the pace of the live learners that drives them.

The syncer owns one; everything runs on its loop thread. Pure decisions live in
pipeline/schedule.py (the clock) and pipeline/policy.py (when a round closes); this part keeps the
state between calls and measures the learners' pace (docs/protocol.md "Rounds"):

* from heartbeats (``step_time_s`` = a learner's own step-to-step period): while a learner's
  heartbeats come, they alone set its pace; one with ``step_time_s`` 0 after a period says it is
  not stepping (held, stalled), and it sets no pace until it steps again;
* from its deltas (their ``learner_step`` against arrival times), so that learners without a bus -
  bucket-only, other regions - set the pace too. Deltas arrive in **bursts**: one inbox listing,
  one loop turn's drain of the bus. A burst says where the learner had got to (its newest step)
  at one moment, never how fast it got there: a restarted syncer admits its whole inbox backlog in
  one listing, and the spacing of those arrivals once read as a 0.25 ms period (the clock then
  ran away, issue 25). So a sample is taken only between the newest steps of two bursts at least
  DELTA_SPAN_S and DELTA_SPAN_STEPS apart, and moves the learner's period by at most a factor
  PACE_FACTOR. Every period is kept within the clock's bounds (pipeline/schedule.py).

A learner counts as live while it was heard within ``live_timeout_s``. With nobody live the clock
keeps its last pace: openings nobody answers cost nothing, and a learner that comes back finds
rounds open.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from pipeline.policy import Ewma
from pipeline.schedule import ClockRecord, RoundClock, check_period, clamp_period
from pipeline.descriptor import RunDescriptor

BURST_GAP_S = 0.25      # arrivals of one learner in one loop turn this close together: one burst
DELTA_SPAN_S = 1.0      # a pace sample from deltas spans at least this long (two listings or more) ...
DELTA_SPAN_STEPS = 8    # ... and at least this many of the learner's steps
PACE_FACTOR = 2.0       # one delta sample changes a learner's period by at most this factor
LAG_SAMPLES = 9         # a learner's answer lag: the median of its last this many answers


@dataclass(frozen=True)
class OpenRound:
    round: int          # the global step it opened at: its id
    opened_at: float    # syncer monotonic time


@dataclass
class _Burst:
    """Deltas of one learner that arrived together (one listing, one loop turn)."""
    turn: int           # the book's loop turn it arrived in
    last: float         # its latest arrival
    step: int           # the newest learner step in it ...
    at: float           # ... and when that one arrived
    base_s: float       # the learner's delta period before this burst
    sampled: bool = False   # whether it ended a pace sample (then it is the next sample's start)


@dataclass
class _Pace:
    heard: float                 # last time anything was heard from the learner
    beat_s: float = 0.0          # the period its heartbeats report (0: none yet)
    beat_at: float = -math.inf   # when the last heartbeat with a period came
    delta_s: float = 0.0         # its period measured from its deltas (0: not yet)
    still_at: float = -math.inf  # when its heartbeats last said it is not stepping (step_time_s 0)
    anchor: tuple[int, float] | None = None   # (newest step, arrival) of the burst the next sample starts at
    burst: _Burst | None = None  # the latest burst of its deltas
    lags: deque = field(default_factory=lambda: deque(maxlen=LAG_SAMPLES))   # round opening -> its answer, s

    @property
    def lag_s(self) -> float | None:
        """How long this learner's answers take to arrive after their round opens: the median of
        its last LAG_SAMPLES (None: none yet). A median, not an average: after a store outage or a
        stalled syncer loop the few answers held meanwhile arrive seconds after their rounds opened,
        and an average of them widened the grace windows of the next dozen rounds to 70-110 ms
        (15-30 ms otherwise; 20 ms steps beside two busy loops), whose answers then carried 1-8 of
        their 12 steps: the s3-outage scenario's progress-recovery check failed. A learner across
        a link answers late every round, which moves the median within LAG_SAMPLES // 2 + 1 answers."""
        return statistics.median(self.lags) if self.lags else None

    @property
    def period_s(self) -> float:
        """Its best known step-to-step period (0: unknown): heartbeats' over the deltas'."""
        return self.beat_s or self.delta_s

    def period(self, now: float, fresh_s: float) -> float:
        """The period to follow at ``now``: its heartbeats' while they come (heard within
        ``fresh_s``), else its deltas', else the last heartbeats' (0: unknown). 0 while its latest
        heartbeat (within ``fresh_s``) says it is not stepping: a held learner does not pace the clock."""
        if now - self.still_at < fresh_s:
            return 0.0
        if self.beat_s > 0 and now - self.beat_at < fresh_s:
            return self.beat_s
        return self.delta_s or self.beat_s


def bounded_period(base_s: float, sample_s: float) -> float:
    """A learner's delta period after one more sample: the sample, within the clock's
    bounds and within PACE_FACTOR of the previous value ``base_s`` (0: none), averaged with it."""
    sample_s = clamp_period(sample_s)
    if base_s <= 0:
        return sample_s
    return 0.5 * (base_s + min(max(sample_s, base_s / PACE_FACTOR), base_s * PACE_FACTOR))


class RoundBook:
    def __init__(self, descriptor: RunDescriptor, live_timeout_s: float, initial_step_s: float,
                 start_step: int = 0, owned: Sequence[int] | None = None):
        if not initial_step_s > 0:
            raise ValueError(f"initial_step_s must be > 0, got {initial_step_s}")
        check_period(initial_step_s, "initial_step_s")
        self.clock = RoundClock(descriptor.schedule.sync_every, descriptor.schedule.offsets, step=start_step)
        self.open: list[OpenRound | None] = [None] * descriptor.num_fragments
        self.live_timeout_s = live_timeout_s
        self.initial_step_s = initial_step_s
        self.learners: dict[str, _Pace] = {}
        self.period = Ewma(0.2)
        self.published: ClockRecord | None = None
        # A syncer shard opens rounds only for its own fragments; its clock still
        # counts every global step, so each shard's round ids are the run's global steps.
        self.owned = frozenset(range(descriptor.num_fragments) if owned is None else owned)
        # (fragment, round) -> when it opened, the last few per fragment: an answer's lag is
        # measured against its own round's opening even after that round closed (late answers).
        self.opened_at: dict[tuple[int, int], float] = {}
        self.turn = 0    # loop turns (step_time calls): deltas of one turn are one burst

    # -- the learners' pace ----------------------------------------------------------------------
    def heartbeat(self, learner: str, period_s: float, now: float) -> None:
        """A heartbeat: a sign of life and, with ``period_s`` > 0, the learner's own measured
        period, which sets its pace while heartbeats come. ``period_s`` 0 from a learner that has
        paced before: it is not stepping now (held, evaluating, stalled; workers/learner/figures.py
        ``_pace``), so it does not pace the clock until a heartbeat with a period comes again
        (before its first period, 0 means "none yet", as it always did)."""
        pace = self.learners.setdefault(learner, _Pace(now))
        pace.heard = now
        if period_s > 0:
            pace.beat_s, pace.beat_at, pace.still_at = clamp_period(period_s), now, -math.inf
        elif pace.beat_s > 0:
            pace.still_at = now

    def left(self, learner: str) -> None:
        """The learner said it stopped (a leaving heartbeat): no longer live, so no round waits a
        grace window for its answer; its next heartbeat or delta (a new life) makes it live again."""
        pace = self.learners.get(learner)
        if pace is not None:
            pace.heard = -math.inf

    def delta_arrived(self, learner: str, learner_step: int, now: float) -> None:
        """A delta is a sign of life, and a pace sample for a learner without heartbeats: between
        the newest steps of two bursts of its deltas (module docstring, issue 25) - never from the
        spacing of arrivals inside one burst, such as a restarted syncer's inbox backlog."""
        pace = self.learners.setdefault(learner, _Pace(now))
        pace.heard = now
        if pace.anchor is not None and learner_step < pace.anchor[0]:
            pace.anchor = pace.burst = None           # its steps went back: a new life, measured afresh
        burst = pace.burst
        if burst is None or burst.turn != self.turn or now - burst.last > BURST_GAP_S:
            if burst is not None and (burst.sampled or pace.anchor is None):
                pace.anchor = (burst.step, burst.at)   # the burst that ended starts the next sample
            # A learner's first sample is bounded too, from the clock's own pace: an anchor burst
            # listed after an outage holds deltas made long before, so its newest step is stale and
            # the first sample read 20x fast (the fault simulation, seeds 304 and 728).
            burst = pace.burst = _Burst(self.turn, now, learner_step, now,
                                        pace.delta_s or self.period.value or self.initial_step_s)
        else:
            burst.last = now
            if learner_step > burst.step:
                burst.step, burst.at = learner_step, now
        self._sample(pace, burst)

    @staticmethod
    def _sample(pace: _Pace, burst: _Burst) -> None:
        """The pace sample from the anchor to ``burst``'s newest step, once they are far enough
        apart; recomputed (from the period before the burst) as the burst grows."""
        if pace.anchor is None:
            return
        steps, span = burst.step - pace.anchor[0], burst.at - pace.anchor[1]
        if steps >= DELTA_SPAN_STEPS and span >= DELTA_SPAN_S:
            pace.delta_s = bounded_period(burst.base_s, span / steps)
            burst.sampled = True

    def answered(self, learner: str, fragment: int, round_id: int, now: float) -> None:
        """A delta answering round ``round_id`` of ``fragment`` arrived at ``now``: a sample of how
        long the learner's answers take after a round opens (hearing it, the step boundary, the
        way back; issue 14: a learner across a link answers a round trip later)."""
        opened = self.opened_at.get((fragment, round_id))
        if opened is None or now < opened:
            return
        self.learners.setdefault(learner, _Pace(now)).lags.append(now - opened)

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
        """Smoothed median period of the live learners (None before any was measured); the
        syncer calls it once per loop turn, which also ends the turn's bursts of deltas."""
        self.turn += 1
        periods = [p for p in (self.learners[m].period(now, self.live_timeout_s) for m in self.live(now)) if p > 0]
        if periods:
            self.period = self.period.update(clamp_period(statistics.median(periods)))
        return self.period.value

    def resume_pace(self, clock: ClockRecord | None) -> bool:
        """Start from the pace an earlier syncer of this run published (its round clock in storage)
        instead of ``initial_step_s``: a restarted or second syncer otherwise ticks at the
        initial 0.1 s until its first heartbeats, 5x slow at 20 ms steps, and a fragment waited
        1-2 s (30 steps) for its next round after every restart. Only a record of this schedule
        counts; the first measurement replaces it as any sample does. True when it was taken."""
        if clock is None or clock.H != self.clock.H or tuple(clock.offsets) != tuple(self.clock.offsets) \
                or self.period.value is not None:
            return False
        self.period = self.period.update(clamp_period(clock.period_s))
        return True

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

    def clock_record(self, epoch: int, wall: float, now: float | None = None) -> ClockRecord | None:
        """A new clock record to publish, or None when the published one is still good (same
        epoch, pace within 10%, younger than 10 s): bus-less learners poll it, it costs one PUT.
        ``now``: the syncer's monotonic time with ``wall``, so that the record's ``at`` is when its
        step really ticked (``clock.next_at - period``), not when it was written: written up to a
        period later, each record (every 10 s) shifted the learners' rounds against the syncer's by
        up to a step, and the version lag - the work a learner loses per round - with them (issue 25,
        the fault simulation's post-outage utilisation)."""
        period = self.period.value or self.initial_step_s
        old = self.published
        if old is not None and old.epoch == epoch and abs(old.period_s - period) <= 0.1 * old.period_s \
                and wall - old.at < 10.0:
            return None
        # The step ticked last is clock.step - 1, at clock.next_at - period on the monotonic clock.
        at = wall
        if now is not None and self.clock.next_at is not None:
            at = wall - max(0.0, now - (self.clock.next_at - period))
        rec = ClockRecord(epoch, max(0, self.clock.step - 1), at, period, self.clock.H, self.clock.offsets)
        self.published = rec
        return rec
