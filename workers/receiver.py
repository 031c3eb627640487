"""The learner's background receiver (SPEC §3, §7): new fragment versions, from storage.

It listens to the syncer's announcements and polls the commit log every ``poll_s``. Either way it
only loads versions named by a commit (checked against the commit's digest), and only versions
newer than the newest it has handed over. The training thread collects them with ``take()``,
which never blocks. The newest version per fragment wins: an older unapplied one is replaced.
In a signed run a version whose commit or blob lacks the syncer's valid signature is refused
(``VersionTracker.load``): logged as ``version-refused`` with the reason, counted, never applied.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
import numpy as np

from pipeline.errors import FormatError
from pipeline.types import CommitRecord
from storage.errors import StoreError
from .bus import AnnounceListener, BusConfig
from .events import EventLog
from .versions import VersionTracker


@dataclass(frozen=True)
class Arrival:
    fragment: int
    version: int
    seq: int
    values: dict[str, np.ndarray]
    found_by: str          # "announce" or "poll"
    committed_at: float    # syncer wall time of the commit (from the record), for latency figures


class Receiver:
    def __init__(self, tracker: VersionTracker, known: dict[int, int], events: EventLog,
                 bus: BusConfig | None, poll_s: float = 0.5, curve=None):
        self.tracker, self.events, self.bus_cfg, self.poll_s, self.curve = tracker, events, bus, poll_s, curve
        self.known = dict(known)                 # fragment -> newest version handed over
        self._ready: dict[int, Arrival] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="receiver", daemon=True)
        self.errors = 0
        self.refused = 0           # versions that failed their checks (signature, digest, size)
        self.last_error = ""
        self.syncer_epoch = -1

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def take(self) -> list[Arrival]:
        with self._lock:
            out = sorted(self._ready.values(), key=lambda a: a.fragment)
            self._ready.clear()
        return out

    def _run(self) -> None:
        listener = AnnounceListener(self.bus_cfg, curve=self.curve) if self.bus_cfg is not None else None
        next_poll = 0.0
        try:
            while not self._stop.is_set():
                found_by = "poll"
                if listener is not None:
                    msg = listener.recv(min(self.poll_s, 0.2))
                    if msg is not None and msg.type == "version":
                        v = msg.fields.get("version")
                        p = msg.fields.get("fragment")
                        if isinstance(p, int) and isinstance(v, int) and v > self.known.get(p, -1):
                            found_by, next_poll = "announce", 0.0
                    elif msg is not None and msg.type == "syncer-heartbeat":
                        self.syncer_epoch = msg.fields.get("epoch", -1)
                else:
                    self._stop.wait(min(self.poll_s, 0.2))
                if time.monotonic() >= next_poll:
                    self._poll(found_by)
                    next_poll = time.monotonic() + self.poll_s
        finally:
            if listener is not None:
                listener.close()

    def _poll(self, found_by: str) -> None:
        try:
            records = self.tracker.poll()
        except (StoreError, FormatError) as exc:
            self._error(f"log poll: {exc}")
            return
        newest: dict[int, CommitRecord] = {}
        for rec in records:
            if rec.kind in ("init", "merge") and rec.version > self.known.get(rec.fragment, -1):
                newest[rec.fragment] = rec
        for p, rec in newest.items():
            try:
                values = self.tracker.load(rec)
            except FormatError as exc:
                # A version that fails its checks is never applied; a later genuine one will be.
                self.refused += 1
                self.events.emit("version-refused", fragment=p, version=rec.version, seq=rec.seq, reason=str(exc))
                self._error(f"version {rec.output_key}: {exc}")
                continue
            except StoreError as exc:
                self._error(f"version {rec.output_key}: {exc}")
                continue
            self.known[p] = rec.version
            with self._lock:
                self._ready[p] = Arrival(p, rec.version, rec.seq, values, found_by,
                                         float(rec.info.get("committed_at", 0.0)))

    def _error(self, text: str) -> None:
        self.errors += 1
        self.last_error = text
        self.events.emit("receiver-error", error=text)
