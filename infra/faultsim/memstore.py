"""An in-memory ``ObjectStore`` on simulated time, with injected faults (docs/faultsim.md).

The contract is storage/store.py's (the S3 semantics every backend keeps): ``put_if_absent`` is
atomic create-if-absent (``AlreadyExists``), ``put`` overwrites, ``list`` returns keys in byte
order strictly after ``start_after``, at most ``limit``, ``delete`` of a missing key is no error,
and keys and prefixes are checked by the same ``check_key``/``check_prefix``. One process, one
thread: nothing here locks.

Faults are windows of simulated time (:class:`StoreFault`), judged at each request:

* ``down`` - every request raises ``Unavailable`` (an S3 outage);
* ``full`` - writes raise ``Unavailable`` as a full disk does (``LocalStore`` maps ENOSPC so);
  reads, lists and deletes still work;
* ``slow`` - every request costs its caller ``latency_s`` of simulated time (``Sim.charge``: the
  request lands at once, and the calling thread's next turn starts that much later);
* ``lag`` - an object written in the window is read at once (S3's read-after-write) but shows in a
  ``list`` only ``latency_s`` after its write: a listing that lags, as a replicated or
  eventually-consistent bucket's does. Objects written after the window show at once, so they
  can overtake the lagging ones.

Outside faults every request costs ``request_s`` (default 2 ms, a local S3 server's round trip):
requests made one after another are seen apart on the caller's clock (``Sim.clock``), as on real
processes - a restarted syncer's backlog arrives spread over its listing's reads, which is what
made the pre-issue-25 syncer read a bogus pace from one listing.

Every request is counted per simulated thread (``ops``): the training loop must make none
(SPEC §3: no learner step waits on storage), which the invariants check.
"""
from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from storage.errors import AlreadyExists, NotFound, Unavailable
from storage.store import ObjectInfo, check_key, check_limit, check_prefix

from .clock import Sim

FAULT_KINDS = ("down", "full", "slow", "lag")
REQUEST_S = 0.002          # what one request costs its caller outside faults (module docstring)
WRITES = ("put", "put_if_absent")


@dataclass(frozen=True)
class StoreFault:
    """The store is ``kind`` from ``start`` for ``duration`` simulated seconds (``latency_s``: slow
    and lag only: a request's cost, a listing's delay)."""

    kind: str
    start: float
    duration: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"store fault kind must be one of {FAULT_KINDS}, got {self.kind!r}")
        if not self.start >= 0 or not self.duration > 0:
            raise ValueError(f"store fault {self.kind}: start must be >= 0 and duration > 0, "
                             f"got {self.start} and {self.duration}")
        if (self.kind in ("slow", "lag")) != (self.latency_s > 0):
            raise ValueError(f"store fault {self.kind}: latency_s must be > 0 for 'slow' and 'lag' and 0 otherwise, "
                             f"got {self.latency_s}")

    def active(self, now: float) -> bool:
        return self.start <= now < self.start + self.duration


class MemoryStore:
    """An ``ObjectStore`` in a dict, faulted by ``faults`` on ``sim``'s clock (module docstring)."""

    def __init__(self, sim: Sim, faults: Sequence[StoreFault] = (), uri: str = "mem://faultsim",
                 request_s: float = REQUEST_S):
        if not (isinstance(request_s, (int, float)) and 0 <= request_s < 1):
            raise ValueError(f"request_s must be a number of seconds in [0, 1), got {request_s!r}")
        self.sim, self.faults, self.uri, self.request_s = sim, tuple(faults), uri, float(request_s)
        self._objects: dict[str, bytes] = {}
        self._keys: list[str] = []            # sorted: listing is a bisect
        self._listed_from: dict[str, float] = {}   # key -> when a list shows it (written under ``lag``)
        self.ops: Counter = Counter()         # (thread label, op) -> requests
        self.refused = 0                      # requests a fault refused

    def __repr__(self) -> str:
        return f"MemoryStore({self.uri!r}, {len(self._keys)} objects)"

    # -- faults ----------------------------------------------------------------------------------
    def state(self, now: float) -> dict[str, StoreFault]:
        """The faults active at ``now``, by kind."""
        return {f.kind: f for f in self.faults if f.active(now)}

    def refuses_writes(self, now: float) -> bool:
        """Whether a write at ``now`` would fail (down or full): a supervisor waits before a restart."""
        active = self.state(now)
        return "down" in active or "full" in active

    def _request(self, op: str, key: str) -> None:
        thread = self.sim.current
        self.ops[(thread.name if thread is not None else "-", op)] += 1
        active = self.state(self.sim.now)
        if "down" in active or ("full" in active and op in WRITES):
            self.refused += 1
            what = "store unavailable (injected outage)" if "down" in active else \
                "no space left on device (injected disk full)"
            raise Unavailable(what, uri=self.uri, key=key or None)

    def _wait(self) -> None:
        """The request has landed; its caller pays the time it took (a slow store's, or the usual)."""
        slow = self.state(self.sim.now).get("slow")
        self.sim.charge(slow.latency_s if slow is not None else self.request_s)

    # -- the ObjectStore protocol ---------------------------------------------------------------------
    def get(self, key: str) -> bytes:
        check_key(key, self.uri)
        self._request("get", key)
        data = self._objects.get(key)
        self._wait()
        if data is None:
            raise NotFound("no such object", uri=self.uri, key=key)
        return data

    def head(self, key: str) -> ObjectInfo:
        check_key(key, self.uri)
        self._request("head", key)
        data = self._objects.get(key)
        self._wait()
        if data is None:
            raise NotFound("no such object", uri=self.uri, key=key)
        return ObjectInfo(key=key, size=len(data), etag=f"{len(data):x}")

    def exists(self, key: str) -> bool:
        check_key(key, self.uri)
        self._request("exists", key)
        found = key in self._objects
        self._wait()
        return found

    def put_if_absent(self, key: str, data: bytes) -> None:
        check_key(key, self.uri)
        blob = _bytes(data)
        self._request("put_if_absent", key)
        if key in self._objects:
            self._wait()
            raise AlreadyExists("object exists (create-if-absent refused)", uri=self.uri, key=key)
        self._store(key, blob)
        self._wait()

    def put(self, key: str, data: bytes) -> None:
        check_key(key, self.uri)
        blob = _bytes(data)
        self._request("put", key)
        self._store(key, blob)
        self._wait()

    def list(self, prefix: str = "", start_after: str | None = None, limit: int | None = None) -> list[str]:
        check_prefix(prefix, self.uri)
        if start_after is not None:
            check_prefix(start_after, self.uri, "start_after")
        check_limit(limit, self.uri)
        self._request("list", prefix)
        lo = bisect.bisect_left(self._keys, prefix)
        if start_after is not None:
            lo = max(lo, bisect.bisect_right(self._keys, start_after))
        out = []
        now = self.sim.now
        for key in self._keys[lo:]:
            if not key.startswith(prefix) or (limit is not None and len(out) >= limit):
                break
            if self._listed_from.get(key, now) <= now:
                out.append(key)
        self._wait()
        return out

    def delete(self, key: str) -> None:
        check_key(key, self.uri)
        self._request("delete", key)
        if self._objects.pop(key, None) is not None:
            del self._keys[bisect.bisect_left(self._keys, key)]
            self._listed_from.pop(key, None)
        self._wait()

    # -- helpers ---------------------------------------------------------------------------------
    def _store(self, key: str, blob: bytes) -> None:
        if key not in self._objects:
            bisect.insort(self._keys, key)
            lag = self.state(self.sim.now).get("lag")
            if lag is not None:
                self._listed_from[key] = self.sim.now + lag.latency_s
        self._objects[key] = blob

    def plant(self, key: str, data: bytes) -> None:
        """Write ``key`` as someone outside the run would (bad input): no fault, no thread counted."""
        self._store(check_key(key, self.uri), _bytes(data))

    def peek(self, key: str) -> bytes:
        """An object's bytes for the harness (outside simulated time: no fault, not counted)."""
        return self._objects[key]

    def keys(self, prefix: str = "") -> list[str]:
        """Every key under ``prefix`` (for the checks, outside simulated time: no fault, not counted)."""
        lo = bisect.bisect_left(self._keys, prefix)
        out = []
        for key in self._keys[lo:]:
            if not key.startswith(prefix):
                break
            out.append(key)
        return out


def _bytes(data) -> bytes:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"object data must be bytes, got {type(data).__name__}")
    return bytes(data)
