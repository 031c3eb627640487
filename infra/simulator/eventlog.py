"""The ``--events`` log: when each simulated learner stops and resumes training (SPEC §9).

A later ``ddiloco chaos event-log`` replays it as a fault schedule on a local run: ``fail`` = stop
(SIGKILL) that learner, ``recover`` = start it again (the simulated learner's recovery begins then;
it trains one reconfiguration later, as a restarted process does after its start-up), after
``scale``-ing the times down to the local run's length. Format (docs/simulator.md): one file holding one envelope (pipeline/envelope.py) of
kind ``sim-events``, version 1, whose msgpack body is a map

    {"meta": {...simulation parameters...}, "learners": M, "duration_s": T,
     "time_s": [float...], "learner": [int...], "event": ["fail" | "recover", ...]}

(columns, not rows: compact and quick to check). The envelope carries the checksum. Readers check
that columns have equal length, times are finite, within [0, duration_s] and non-decreasing,
learners are in [0, M), and each learner alternates fail, recover, fail, ... starting with fail.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence


from pipeline.envelope import pack_record, unpack_record
from pipeline.errors import FormatError

KIND = "sim-events"
VERSION = 1
EVENTS = ("fail", "recover")
MAX_BYTES = 256 << 20


@dataclass(frozen=True)
class Event:
    """Learner ``learner`` stops (``fail``) or resumes (``recover``) training at ``time_s``."""

    time_s: float
    learner: int
    event: str

    def __post_init__(self) -> None:
        if self.event not in EVENTS:
            raise ValueError(f"event must be one of {EVENTS}, got {self.event!r}")
        if not isinstance(self.learner, int) or self.learner < 0:
            raise ValueError(f"learner must be an int >= 0, got {self.learner!r}")
        if not math.isfinite(self.time_s) or self.time_s < 0:
            raise ValueError(f"time_s must be finite and >= 0, got {self.time_s!r}")


@dataclass(frozen=True)
class EventLog:
    meta: dict[str, Any]
    learners: int
    duration_s: float
    events: tuple[Event, ...]


def events_from_stalls(stalls: Sequence[Sequence[tuple[float, float, float]]], horizon: float,
                       stop_at_end: bool = False) -> list[Event]:
    """Each learner's stalls (``engine.JobRecord.stalls``: stop, recovery begins, training again)
    as fail/recover events, sorted by (time, learner, fail before recover).

    ``fail`` is when the learner stops training; ``recover`` is when its recovery *begins*: the
    restart of a learner that lost every slice (a replacement is at hand), or the reconfiguration
    that lets a shrunken learner train again. It trains again one reconfiguration later, so a
    replay that restarts a real process at ``recover`` pays the process's own start-up there.
    ``stop_at_end``: a last ``fail`` at ``horizon`` for every learner not already down, so that a
    replay ends with the simulated window.
    """
    rows: list[tuple[float, int, int]] = []
    for m, learner in enumerate(stalls):
        down = False
        for stop, begin, _ in learner:
            if stop >= horizon:
                continue
            rows.append((float(stop), m, 0))
            down = not begin < horizon
            if not down:
                rows.append((float(max(begin, stop)), m, 1))
        if stop_at_end and not down:
            rows.append((float(horizon), m, 0))
    rows.sort(key=lambda r: (r[0], r[1], r[2]))
    return [Event(t, m, EVENTS[e]) for t, m, e in rows]


def scale(events: Iterable[Event], factor: float) -> list[Event]:
    """Multiply every event time by ``factor`` (e.g. 1/600 replays 10 simulated minutes per second)."""
    if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
        raise ValueError(f"scale factor must be a finite number > 0, got {factor!r}")
    return [Event(e.time_s * factor, e.learner, e.event) for e in events]


def validate(events: Sequence[Event], learners: int, duration_s: float, what: str = "event log") -> None:
    """Raise FormatError naming the first event that breaks the schedule's rules."""
    last_t = 0.0
    state = ["up"] * learners
    for i, e in enumerate(events):
        if not 0 <= e.learner < learners:
            raise FormatError(f"{what}: event {i} names learner {e.learner}, outside [0, {learners})")
        if e.time_s < last_t or e.time_s > duration_s:
            raise FormatError(f"{what}: event {i} at {e.time_s} s is out of order or past {duration_s} s")
        want = "fail" if state[e.learner] == "up" else "recover"
        if e.event != want:
            raise FormatError(f"{what}: event {i} is {e.event!r} for learner {e.learner}, expected {want!r}")
        state[e.learner] = "down" if e.event == "fail" else "up"
        last_t = e.time_s


def write_events(path: str | os.PathLike, events: Sequence[Event], meta: dict[str, Any]) -> None:
    """Write the log atomically (temporary file, then rename). ``meta`` must hold ``learners`` and
    ``duration_s`` plus any other JSON/msgpack-able simulation parameters."""
    learners, duration = meta.get("learners"), meta.get("duration_s")
    if not isinstance(learners, int) or learners < 1:
        raise ValueError(f"meta['learners'] must be an int >= 1, got {learners!r}")
    if not isinstance(duration, (int, float)) or not duration > 0:
        raise ValueError(f"meta['duration_s'] must be a number > 0, got {duration!r}")
    events = list(events)
    try:
        validate(events, learners, float(duration), what="events to write")
    except FormatError as exc:
        raise ValueError(str(exc)) from None
    blob = pack_record(KIND, VERSION, {
        "meta": dict(meta), "learners": learners, "duration_s": float(duration),
        "time_s": [e.time_s for e in events], "learner": [e.learner for e in events],
        "event": [e.event for e in events]})
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(blob)
    os.replace(tmp, path)


def read_event_log(path: str | os.PathLike) -> EventLog:
    """Read and check a log written by ``write_events``; raises FormatError if it is damaged."""
    what = str(path)
    _, body = unpack_record(Path(path).read_bytes(), KIND, VERSION, max_bytes=MAX_BYTES, what=what)
    learners, duration = body.get("learners"), body.get("duration_s")
    if not isinstance(learners, int) or isinstance(learners, bool) or learners < 1:
        raise FormatError(f"{what}: field 'learners' must be an int >= 1, got {learners!r}")
    if not isinstance(duration, (int, float)) or isinstance(duration, bool) or not duration > 0:
        raise FormatError(f"{what}: field 'duration_s' must be a number > 0, got {duration!r}")
    cols = [body.get(name) for name in ("time_s", "learner", "event")]
    if not all(isinstance(c, list) for c in cols) or len({len(c) for c in cols}) != 1:
        raise FormatError(f"{what}: columns time_s, learner, event must be lists of equal length")
    if not isinstance(body.get("meta"), dict):
        raise FormatError(f"{what}: field 'meta' must be a map")
    events = []
    for i, (t, m, e) in enumerate(zip(*cols)):
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise FormatError(f"{what}: event {i} has a bad time {t!r}")
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise FormatError(f"{what}: event {i} has a bad learner {m!r}")
        if e not in EVENTS:
            raise FormatError(f"{what}: event {i} has unknown kind {e!r} (expected one of {EVENTS})")
        events.append(Event(float(t), m, e))
    validate(events, learners, float(duration), what=what)
    return EventLog(body["meta"], learners, float(duration), tuple(events))


def read_events(path: str | os.PathLike) -> list[Event]:
    """The events of a log written by ``write_events`` (see ``read_event_log`` for its metadata)."""
    return list(read_event_log(path).events)
