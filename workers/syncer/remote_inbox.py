"""Reading another region's spill inbox off the syncer's loop (docs/regions.md "Ingest").

Why: every request to a remote region's store crosses the link. Read on the loop, one delta at a
time (HEAD, then GET), a backlog of N spilled deltas held commits for N x ~2.5 round trips (10 s
for 40 deltas at rtt 100 ms after a partition healed). Here a region's inbox is listed and its new
objects fetched on a small pool of background threads; the loop only takes what is complete
(``take``, never blocking) and checks and admits it there as before (workers/syncer/ingest.py), then
asks for the next listing with what it now holds (``refresh``), so a key it has is not read twice.

Bounded: at most ``max_held`` objects are in flight or fetched and not yet taken (each at most the
run's delta size limit, checked with a HEAD before the GET), and one listing runs at a time. The
threads are daemons: a store that hangs holds only them, never the loop or a commit.
"""
from __future__ import annotations

import queue
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Collection

from storage.errors import StoreError
from storage.layout import SPILL_PREFIX
from storage.store import ObjectStore

__all__ = ["Fetched", "RemoteInbox"]


def _work(jobs: "queue.SimpleQueue") -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        job()
        del job          # a finished job must not keep its reader alive while this thread waits


def _end(jobs: "queue.SimpleQueue", threads: int) -> None:
    for _ in range(threads):
        jobs.put(None)


@dataclass(frozen=True)
class Fetched:
    """One inbox object read in the background: its bytes, or (``blob`` None) its size when it
    exceeds the limit (not read), or the store's error on it (``NotFound``: it went away)."""

    key: str
    blob: bytes | None = None
    size: int = -1
    error: StoreError | None = None


class RemoteInbox:
    """Lists and fetches ``store``'s inbox (``SPILL_PREFIX``) on ``threads`` daemon threads."""

    def __init__(self, store: ObjectStore, max_bytes: int, *, threads: int = 4, max_held: int = 256):
        if not 1 <= threads <= 32 or max_held < 1 or max_bytes < 1:
            raise ValueError(f"need 1 <= threads <= 32, max_held >= 1 and max_bytes >= 1, got {threads}, "
                             f"{max_held}, {max_bytes}")
        self.store, self.max_bytes, self.max_held = store, max_bytes, max_held
        self._lock = threading.Lock()
        self._ready: list[Fetched] = []
        self._inflight: set[str] = set()
        self._taken: set[str] = set()               # taken since the running listing's ``known`` was made
        self._listing = False                       # a listing is queued or running
        self._list_error: StoreError | None = None  # the last listing's failure, until taken
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=_work, args=(self._jobs,), name=f"remote-inbox-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()
        # The threads hold only the queue: once the syncer drops this reader they are told to end.
        self._finalizer = weakref.finalize(self, _end, self._jobs, threads)

    # -- the loop's side ---------------------------------------------------------------------------
    def take(self) -> tuple[list[Fetched], StoreError | None]:
        """What was fetched since the last call, and the last listing's error (None: it listed)."""
        with self._lock:
            out, self._ready = self._ready, []
            self._taken.update(f.key for f in out)
            err, self._list_error = self._list_error, None
        return out, err

    def refresh(self, known: Collection[str]) -> bool:
        """List the inbox again in the background and fetch the keys not in ``known`` (the ones the
        caller holds or refused), unless a listing is running; True if one was started."""
        with self._lock:
            if self._listing:
                return False
            self._listing = True
            self._taken.clear()     # ``known`` covers everything taken so far
        known = frozenset(known)
        self._jobs.put(lambda: self._list(known))
        return True

    def close(self, wait_s: float = 0.0) -> None:
        """Stop the threads once their current request ends (what they fetch then is dropped),
        waiting up to ``wait_s`` for them (a stopping syncer's last requests are then counted in
        its final accounting; a store that hangs delays the stop by at most ``wait_s``)."""
        self._finalizer()
        deadline = time.monotonic() + wait_s
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))

    # -- the threads -------------------------------------------------------------------------------

    def _list(self, known: frozenset[str]) -> None:
        try:
            keys = self.store.list(SPILL_PREFIX)
        except StoreError as exc:
            with self._lock:
                self._list_error, self._listing = exc, False
            return
        with self._lock:
            held = self._inflight | self._taken | {f.key for f in self._ready}
            room = self.max_held - len(self._inflight) - len(self._ready)
            todo = [k for k in keys if k not in known and k not in held][:max(0, room)]
            self._inflight.update(todo)
            self._listing = False
        for key in todo:
            self._jobs.put(lambda key=key: self._fetch(key))

    def _fetch(self, key: str) -> None:
        try:
            size = self.store.head(key).size
            # checked before reading: a planted huge object must not exhaust memory
            got = Fetched(key, size=size) if size > self.max_bytes else Fetched(key, self.store.get(key), size)
        except StoreError as exc:
            got = Fetched(key, error=exc)
        with self._lock:
            self._inflight.discard(key)
            self._ready.append(got)
