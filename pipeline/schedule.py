"""The syncer's global step and its rounds (SPEC §2-4, the paper's Algorithm 2).

The syncer, not the learners, decides when fragment p is synced: it keeps a global step that
advances one tick per smoothed inner step time of the live learners, and at global step t it opens
the round for every fragment p with ``t mod H == t_p``. The round's id is that global step, so
round ids grow with the run and, with the syncer's epoch, order every opening ever made.

Learners hear an opening over ZeroMQ, or compute it from the :class:`ClockRecord` the syncer keeps
in storage (bucket-only learners, other regions): ``round_at`` gives the round of p open at a wall
time. Both are pure and deterministic here; the caller supplies the time and the step period.

Bounds: a period lies in [MIN_PERIOD_S, MAX_PERIOD_S] - the clock ticks at most 1000 times
a second, whatever a pace measurement says - and a clock record predicts rounds for at most
EXTRAPOLATE_MAX_S past its own time: a live syncer rewrites it every <= 10 s, so an older one
belongs to a syncer that is gone, and rounds extrapolated from it would only be guesses.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from .envelope import pack_record, unpack_record
from .errors import FormatError

__all__ = ["ScheduleConfig", "DRIVERS", "RoundClock", "ClockRecord", "latest_round", "CLOCK_KIND", "CLOCK_VERSION",
           "MIN_PERIOD_S", "MAX_PERIOD_S", "EXTRAPOLATE_MAX_S", "check_period", "clamp_period", "join_gap",
           "JoinStagger"]

CLOCK_KIND, CLOCK_VERSION = "round-clock", 1
MIN_PERIOD_S = 1e-3        # the global clock's fastest tick (issue 25: a bogus 0.25 ms pace ran it away)
MAX_PERIOD_S = 3600.0      # its slowest (a heartbeat's step_time_s above this is refused at ingest)
EXTRAPOLATE_MAX_S = 60.0   # how far past its time a clock record predicts rounds (a live syncer rewrites it <= 10 s)
DRIVERS = ("syncer", "learner")     # who opens rounds; "learner": runs made before syncer-driven rounds


@dataclass(frozen=True)
class ScheduleConfig:
    """When fragments sync (the run descriptor's ``schedule``): fragment p falls due at steps t with
    ``t mod sync_every == offsets[p]`` (H and t_p, SPEC §2); ``driver`` says who opens rounds (SPEC
    §3-4: the syncer; "learner" only replays old logs with their rules, pipeline/fold.py)."""

    sync_every: int
    offsets: tuple[int, ...]
    driver: str = "syncer"

    def __post_init__(self) -> None:
        object.__setattr__(self, "offsets", tuple(self.offsets))
        H = self.sync_every
        if not isinstance(H, int) or isinstance(H, bool) or H < 1:
            raise ValueError(f"schedule sync_every (H) must be an int >= 1, got {H!r}")
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < H for t in self.offsets):
            raise ValueError(f"schedule offsets {list(self.offsets)} must lie in 0..{H - 1}")
        if self.driver not in DRIVERS:
            raise ValueError(f"schedule driver {self.driver!r} not one of {DRIVERS}")


def check_period(period_s: float, what: str = "clock period") -> float:
    """``period_s`` if it is a finite number in [MIN_PERIOD_S, MAX_PERIOD_S]; ValueError naming
    ``what`` otherwise."""
    if not (isinstance(period_s, (int, float)) and not isinstance(period_s, bool) and math.isfinite(period_s)
            and MIN_PERIOD_S <= period_s <= MAX_PERIOD_S):
        raise ValueError(f"{what} must be a finite number of seconds in [{MIN_PERIOD_S:g}, {MAX_PERIOD_S:g}], "
                         f"got {period_s!r}")
    return float(period_s)


def clamp_period(period_s: float) -> float:
    """A measured period brought into [MIN_PERIOD_S, MAX_PERIOD_S] (a measurement, not an input:
    it is bounded rather than refused)."""
    return min(max(float(period_s), MIN_PERIOD_S), MAX_PERIOD_S)


def _check_offsets(H: int, offsets: Sequence[int]) -> None:
    if not isinstance(H, int) or isinstance(H, bool) or H < 1:
        raise ValueError(f"H must be an int >= 1, got {H!r}")
    if len(set(offsets)) != len(offsets) or any(not 0 <= t < H for t in offsets):
        raise ValueError(f"offsets {list(offsets)} must be distinct and lie in 0..{H - 1}")


def latest_round(step: int, H: int, offset: int) -> int:
    """The newest global step <= ``step`` at which the round of a fragment with ``offset`` opened
    (-1 if none yet)."""
    r = step - ((step - offset) % H)
    return r if r >= 0 else -1


@dataclass
class RoundClock:
    """The global step. ``advance(now, period)`` ticks as many steps as ``period`` seconds fit
    since the last tick and returns the ``(round, fragment)`` openings they bring, oldest first.

    After a pause longer than H periods (a stalled syncer) it skips the missed steps - counted, not
    opened - instead of bursting through them: the openings missed would only be replaced at once,
    and each would cost every learner an answer. Shorter delays are caught up, so the pace holds on
    average.
    """

    H: int
    offsets: tuple[int, ...]
    step: int = 0                     # the next global step to tick
    next_at: float | None = None      # when it ticks (None: at the next call)
    _by_offset: dict[int, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        _check_offsets(self.H, self.offsets)
        if not isinstance(self.step, int) or self.step < 0:
            raise ValueError(f"clock step must be an int >= 0, got {self.step!r}")
        self._by_offset = {t: p for p, t in enumerate(self.offsets)}

    def advance(self, now: float, period_s: float) -> list[tuple[int, int]]:
        check_period(period_s)
        if self.next_at is None:
            self.next_at = now
        elif now - self.next_at > self.H * period_s:
            # The learners stepped on while this loop stalled (a commit retrying against a store
            # that is down, a paused process): the global step skips the missed steps instead of
            # staying behind, so that it agrees with what learners extrapolate from the published
            # clock. Behind, it reopened rounds the learners had already answered from that
            # extrapolation, which they do not answer twice: a round lost per stall (issue 25,
            # found by the fault simulation). The skipped openings would be replaced at once.
            missed = int((now - self.next_at) // period_s)
            self.step += missed
            self.next_at += missed * period_s
        opened = []
        while self.next_at <= now:
            p = self._by_offset.get(self.step % self.H)
            if p is not None:
                opened.append((self.step, p))
            self.step += 1
            self.next_at += period_s
        return opened

    def wait_s(self, now: float) -> float:
        """Seconds until the next tick (0 when due, or before the first)."""
        return 0.0 if self.next_at is None else max(0.0, self.next_at - now)


@dataclass(frozen=True)
class ClockRecord:
    """What the syncer publishes in storage so that learners without the bus find rounds: global
    step ``step`` ticked at syncer wall time ``at``, one tick per ``period_s``; ``epoch`` orders
    syncers. Envelope kind ``round-clock`` v1 (docs/formats.md); ``period_s`` within the clock's
    bounds (a record outside them is refused as a FormatError when read, issue 25)."""

    epoch: int
    step: int
    at: float
    period_s: float
    H: int
    offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_offsets(self.H, self.offsets)
        if self.epoch < 0 or self.step < 0:
            raise ValueError(f"clock epoch/step must be >= 0, got {self.epoch}/{self.step}")
        if not math.isfinite(self.at):
            raise ValueError(f"clock at must be a finite wall time, got {self.at}")
        check_period(self.period_s, "clock record period_s")

    def step_at(self, wall: float) -> int:
        """The global step at wall time ``wall``: never before the recorded one, and extrapolated at
        most EXTRAPOLATE_MAX_S past it (issue 25: beyond that the record's syncer is gone, and the
        step stays where the horizon put it until a newer record or announcement comes)."""
        ahead = min(max(0.0, wall - self.at), EXTRAPOLATE_MAX_S)
        return self.step + int(ahead // self.period_s)

    def round_at(self, fragment: int, wall: float) -> int:
        """The round of ``fragment`` open at ``wall`` (-1: none yet)."""
        return latest_round(self.step_at(wall), self.H, self.offsets[fragment])

    def to_bytes(self) -> bytes:
        return pack_record(CLOCK_KIND, CLOCK_VERSION, {"epoch": self.epoch, "step": self.step, "at": self.at,
                                                       "period_s": self.period_s, "H": self.H,
                                                       "offsets": list(self.offsets)})

    @classmethod
    def from_bytes(cls, blob: bytes, what: str = "round clock") -> "ClockRecord":
        _, d = unpack_record(blob, CLOCK_KIND, CLOCK_VERSION, what=what)
        try:
            return cls(int(d["epoch"]), int(d["step"]), float(d["at"]), float(d["period_s"]), int(d["H"]),
                       tuple(int(t) for t in d["offsets"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"{what}: {exc.__class__.__name__}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "step": self.step, "at": self.at, "period_s": self.period_s}


def join_gap(H: int, num_fragments: int) -> int:
    """Steps between a learner's first answers to the fragments in one life (issue 31): the spacing
    of the schedule's own rounds, H // P (at least 1)."""
    _check_offsets(H, [])
    if not isinstance(num_fragments, int) or isinstance(num_fragments, bool) or num_fragments < 1:
        raise ValueError(f"num_fragments must be an int >= 1, got {num_fragments!r}")
    return max(1, H // num_fragments)


@dataclass
class JoinStagger:
    """A learner that comes up finds a round open for every fragment (the syncer's clock ran while
    it loaded, or it joins a running run) and, answering them all at its first step, sent the whole
    model at once and then applied P versions at once: at 101M its first two steps took ~18 s.
    Its first answer to each fragment is therefore spaced ``gap`` steps from the previous first
    answer (``join_gap``), oldest round first, as the schedule spaces every later round; a learner
    that starts with the run answers each round as it opens, ``gap`` apart anyway, and waits for
    nothing. Answers to a fragment already answered in this life are never held back."""

    gap: int
    last: int | None = None        # the step of the last first answer sent (None: none yet)
    seen: set[int] = field(default_factory=set)   # fragments answered in this life

    def is_first(self, fragment: int) -> bool:
        return fragment not in self.seen

    def may_answer_first(self, step: int) -> bool:
        return self.last is None or step - self.last >= self.gap

    def answered(self, fragment: int, step: int, sent: bool) -> None:
        """``fragment``'s round was answered at ``step`` (``sent``: with a delta; an answer without
        one, a version that closed the round before any work, spaces nothing)."""
        if fragment not in self.seen and sent:
            self.last = step
        self.seen.add(fragment)
