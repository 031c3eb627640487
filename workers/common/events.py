"""JSONL event logs: every process appends one JSON object per line (``t``, ``v``, ``role``, ``id``,
``event`` and fields). The launcher tails them for live progress and the summary; users grep them.
Thread-safe; each line is flushed so a killed process leaves a readable log. Never log secrets.

``v`` is the line format's version (docs/formats.md "Event logs"): 1. Lines written
before it existed have none and read as version 1; readers skip a line of a version they do not
know rather than guess at its fields (an event's own fields may carry their own version, as the
``accounting`` event's ``format`` does).
"""
from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, TextIO

EVENT_LOG_VERSION = 1
EVENT_LOG_READS = (1,)


class EventLog:
    def __init__(self, path: str | Path | None, role: str, ident: str,
                 clock: Callable[[], float] = time.time, echo: TextIO | None = None):
        self.role, self.ident, self.clock = role, ident, clock
        self._lock = threading.Lock()
        self._fh: TextIO | None = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(path, "a", buffering=1)
        self._echo = echo
        self._listeners: list[Callable[[dict], None]] = []

    def subscribe(self, listener: Callable[[dict], None]) -> None:
        """Also hand every later event's record to ``listener`` (after it is written), on the emitting
        thread: it must be quick and catch its own errors (workers/common/metrics.py)."""
        self._listeners.append(listener)

    def emit(self, event: str, **fields: Any) -> None:
        rec = {"t": round(self.clock(), 4), "v": EVENT_LOG_VERSION, "role": self.role, "id": self.ident,
               "event": event, **fields}
        line = json.dumps(rec, default=str, separators=(",", ":"))
        with self._lock:
            if self._fh is not None:
                self._fh.write(line + "\n")
            if self._echo is not None:
                self._echo.write(line + "\n")
                self._echo.flush()
        for listener in self._listeners:
            listener(rec)

    def has_listeners(self) -> bool:
        return bool(self._listeners)

    def notify(self, rec: dict) -> None:
        """Hand ``rec``, a record another process already wrote to this same log (a learner's sync
        agent, workers/learner/agent_main.py), to this process's listeners; nothing is written."""
        for listener in self._listeners:
            listener(rec)

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None


def readable(rec: Any) -> bool:
    """Whether a decoded line is an event of a line format this build reads (no ``v``: version 1)."""
    return isinstance(rec, dict) and rec.get("v", 1) in EVENT_LOG_READS


def read_events(path: str | Path) -> list[dict]:
    """All complete lines of a log (a torn last line from a killed process is skipped, and so is a
    line of a newer format version)."""
    out = []
    try:
        with open(path) as fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if readable(rec):
                    out.append(rec)
    except FileNotFoundError:
        pass
    return out


class Tail:
    """Incrementally read new complete lines of a growing JSONL file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._pos = 0
        self._buf = ""

    def read(self) -> list[dict]:
        try:
            with open(self.path) as fh:
                fh.seek(self._pos)
                chunk = fh.read()
                self._pos = fh.tell()
        except FileNotFoundError:
            return []
        self._buf += chunk
        lines = self._buf.split("\n")
        self._buf = lines.pop()
        out = []
        for line in lines:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                print(f"skipping unreadable log line in {self.path}", file=sys.stderr)
                continue
            if readable(rec):
                out.append(rec)
            else:
                what = f"v={rec.get('v')!r}" if isinstance(rec, dict) else f"a {type(rec).__name__}, not a map"
                print(f"skipping a log line of another format in {self.path} ({what}; this build reads "
                      f"v {list(EVENT_LOG_READS)})", file=sys.stderr)
        return out
