"""The learner's background sender (SPEC §3, §7): bus first, spill to storage when that fails.

A delta is forgotten only once it is *durable*: acked ``durable`` by the syncer (which acks only
after writing it to the inbox) or written by us to the spill location. At most ``max_pending``
deltas are held; a newer delta for a fragment supersedes an older one that was never sent. The
training thread only ever calls ``submit`` (a non-blocking queue put); everything else happens on
this thread, which also owns the DEALER socket and sends heartbeats.

In a signed run ``seal`` wraps every encoded delta in the learner's signature (workers/signing.py)
before it is sent or spilled, so the stored object verifies itself wherever it ends up.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from pipeline.codec import CodecConfig, encode
from pipeline.envelope import digest
from pipeline.types import DeltaHeader
from storage.errors import AlreadyExists, StoreError
from storage.layout import spill_key
from storage.store import ObjectStore
from .bus import BusConfig, LearnerLink, Message
from .events import EventLog

DELTA_KIND = "delta"


@dataclass(frozen=True)
class SenderConfig:
    ack_timeout_s: float = 2.0       # no ack by then: spill
    max_pending: int = 16            # deltas held in memory at most
    heartbeat_s: float = 1.0
    retry_s: float = 1.0             # pause before retrying a failed spill
    bus_enabled: bool = True

    def __post_init__(self) -> None:
        if self.ack_timeout_s <= 0 or self.heartbeat_s <= 0 or self.retry_s <= 0:
            raise ValueError("sender timeouts must be positive")
        if self.max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {self.max_pending}")


@dataclass
class _Pending:
    header: DeltaHeader
    tensors: dict[str, np.ndarray] | None
    blob: bytes | None = None
    checksum: str = ""
    sent_at: float | None = None
    spill_after: float = 0.0


@dataclass
class SenderStats:
    submitted: int = 0
    acked: int = 0
    spilled: int = 0
    superseded: int = 0            # never sent: a newer delta of the same fragment replaced it
    superseded_tokens: int = 0
    rejected: int = 0
    bytes_sent: int = 0
    bytes_spilled: int = 0
    spill_errors: int = 0
    last_error: str = ""


class Sender:
    def __init__(self, store: ObjectStore, codec: CodecConfig, cfg: SenderConfig, events: EventLog,
                 bus: BusConfig | None, identity: bytes, heartbeat: Callable[[], dict],
                 clock: Callable[[], float] = time.monotonic, curve=None, seal: Callable[[bytes], bytes] | None = None):
        self.store, self.codec, self.cfg, self.events, self.seal = store, codec, cfg, events, seal
        self.bus_cfg, self.identity, self.heartbeat, self.clock, self.curve = bus, identity, heartbeat, clock, curve
        self.inbox: queue.Queue[_Pending] = queue.Queue()
        self.pending: dict[str, _Pending] = {}
        self.stats = SenderStats()
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sender", daemon=True)
        self._last_heard = -1e9
        self._link: LearnerLink | None = None
        self.failed: str | None = None     # set if the thread died; the training loop then stops loudly

    # -- training thread -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, header: DeltaHeader, tensors: dict[str, np.ndarray]) -> None:
        """Hand over a delta; never blocks."""
        self.stats.submitted += 1
        self._idle.clear()
        self.inbox.put(_Pending(header, tensors))

    def drain(self, timeout_s: float) -> bool:
        """Wait until every submitted delta is durable (or ``timeout_s``). True if all are."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.inbox.empty() and not self.pending and self._idle.is_set():
                return True
            time.sleep(0.02)
        return self.inbox.empty() and not self.pending

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    # -- sender thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:   # a bug here must not leave the learner training into the void
            self.failed = f"{exc.__class__.__name__}: {exc}"
            self.events.emit("sender-failed", error=self.failed)
            raise

    def _loop(self) -> None:
        if self.bus_cfg is not None and self.cfg.bus_enabled:
            self._link = LearnerLink(self.bus_cfg, self.identity, curve=self.curve)
            self._link.send(Message("hello", {"learner": self.identity.decode(), "incarnation": 0}))
        next_beat = 0.0
        try:
            while not self._stop.is_set():
                self._take_new()
                now = self.clock()
                if self._link is not None and now >= next_beat:
                    self._link.send(Message("heartbeat", self.heartbeat()))
                    next_beat = now + self.cfg.heartbeat_s
                self._send_unsent(now)
                self._read_acks(0.02 if self.pending else 0.05)
                self._spill_overdue(self.clock())
                if self.inbox.empty() and not self.pending:
                    self._idle.set()
        finally:
            if self._link is not None:
                self._link.close()

    def _take_new(self) -> None:
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return
            # A never-sent older delta of the same fragment is superseded (its progress is in the new one,
            # or was overwritten by a newer version anyway).
            for did, old in list(self.pending.items()):
                if old.header.fragment == item.header.fragment and old.sent_at is None:
                    del self.pending[did]
                    self.stats.superseded += 1
                    self.stats.superseded_tokens += old.header.c_tokens
                    self.events.emit("delta-superseded", delta=did, fragment=old.header.fragment,
                                     tokens=old.header.c_tokens)
            while len(self.pending) >= self.cfg.max_pending:
                did, old = next(iter(self.pending.items()))   # oldest goes: bounded memory beats completeness
                del self.pending[did]
                self.stats.superseded += 1
                self.stats.superseded_tokens += old.header.c_tokens
                self.events.emit("delta-evicted", delta=did, fragment=old.header.fragment, tokens=old.header.c_tokens)
            self.pending[item.header.id] = item

    def _encode(self, p: _Pending) -> None:
        if p.blob is None:
            p.blob = encode(DELTA_KIND, p.header.to_dict(), p.tensors, self.codec)
            if self.seal is not None:
                p.blob = self.seal(p.blob)
            p.checksum = digest(p.blob)
            p.tensors = None   # the encoded blob is all we need from now on

    def _syncer_alive(self, now: float) -> bool:
        return now - self._last_heard < max(3 * self.cfg.ack_timeout_s, 3 * self.cfg.heartbeat_s)

    def _send_unsent(self, now: float) -> None:
        for p in list(self.pending.values()):
            if p.sent_at is not None:
                continue
            self._encode(p)
            p.sent_at = now
            p.spill_after = now + self.cfg.ack_timeout_s
            if self._link is None:
                p.spill_after = now     # no bus: spill straight away
                continue
            msg = Message("delta", {"header": p.header.to_dict(), "checksum": p.checksum}, p.blob)
            if self._link.send(msg):
                self.stats.bytes_sent += len(p.blob)
                if not self._syncer_alive(now):
                    p.spill_after = now   # nobody acks lately: make it durable ourselves now
            else:
                p.spill_after = now       # would block (not connected / high-water mark)

    def _read_acks(self, timeout_s: float) -> None:
        if self._link is None:
            time.sleep(timeout_s)
            return
        msg = self._link.recv(timeout_s)
        while msg is not None:
            self._last_heard = self.clock()
            if msg.type == "ack":
                did = msg.fields.get("delta_id")
                p = self.pending.pop(did, None)
                if p is not None:
                    if msg.fields.get("status") == "durable":
                        self.stats.acked += 1
                        self.events.emit("delta-acked", delta=did)
                    else:
                        self.stats.rejected += 1
                        self.events.emit("delta-rejected", delta=did, reason=msg.fields.get("reason", ""))
            msg = self._link.recv(0)

    def _spill_overdue(self, now: float) -> None:
        for did, p in list(self.pending.items()):
            if p.sent_at is None or now < p.spill_after:
                continue
            self._encode(p)
            key = spill_key(p.header.learner, p.header.incarnation, p.header.seq)
            try:
                self.store.put_if_absent(key, p.blob)
            except AlreadyExists:
                pass   # the syncer (or an earlier try of ours) already made it durable there
            except StoreError as exc:
                self.stats.spill_errors += 1
                self.stats.last_error = str(exc)
                p.spill_after = now + self.cfg.retry_s   # keep it; try again (bounded by max_pending)
                continue
            del self.pending[did]
            self.stats.spilled += 1
            self.stats.bytes_spilled += len(p.blob)
            self.events.emit("delta-spilled", delta=did, fragment=p.header.fragment, bytes=len(p.blob))
