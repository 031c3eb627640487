"""The learner's background sender (SPEC §3, §7): bus first, spill to storage when that fails.

A delta is forgotten only once it is *durable*: acked ``durable`` by the syncer (which acks only
after writing it to the inbox) or written by us to the spill location. The training thread only
ever calls ``submit``, which never blocks and never does I/O; everything else happens on this
thread, which also owns the DEALER socket and sends heartbeats.

Bounded memory: however slow or dead storage and the syncer are, what this
sender holds is bounded. ``submit`` (and the thread taking new deltas) supersedes: a newer delta of
the same fragment *and the same base version* replaces an older one that is not durable yet - never
sent, or sent and not acked (a learner's delta is cumulative
since its base, SPEC §3, so the newer one carries all of the older one's progress: nothing is
lost). Beyond that, at most ``max_pending`` deltas and ``max_held_bytes`` bytes are held (raw
queued deltas plus encoded pending ones); when a new delta would exceed either, the oldest one is
evicted and counted as lost work (``delta-evicted``, ``stats.evicted_tokens``). A delta on
another base is never superseded: its progress is not in any newer delta.

A delta that cannot be encoded (non-finite values, issue 11 item 2) is dropped with a
``delta-dropped`` event; it never stops this thread. A spill that fails (store down, disk full)
is retried with backoff; failures are reported as ``spill-failed`` events (the 1st, 2nd, 4th ...
in a row) and in ``stats.spill_errors`` / ``stats.last_error``.

In a signed run ``seal`` wraps every encoded delta in the learner's signature (workers/bus/signing.py)
before it is sent or spilled, so the stored object verifies itself wherever it ends up.
"""
from __future__ import annotations

import os
import select
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from pipeline.ack_wait import AckWait, AckWaitConfig
from pipeline.codec import CodecConfig, encode
from pipeline.envelope import digest
from pipeline.types import DeltaHeader
from storage.errors import AlreadyExists, StoreError
from storage.layout import spill_key
from storage.store import ObjectStore
from workers.bus.bus import ZMQ, BusConfig, LearnerLink, Message, Transport, drain_wake
from workers.common.events import EventLog
from .io import no_difference

DELTA_KIND = "delta"
LEAVING_LINGER_S = 0.5   # how long a stopping learner's leaving heartbeat may take to go out


@dataclass(frozen=True)
class SenderConfig:
    ack_timeout_s: float = 2.0       # no ack by then: spill (the least wait: it follows the acks, pipeline/ack_wait.py)
    max_ack_wait_s: float = 30.0     # the longest wait for an ack, however slow the syncer's rounds
    connect_s: float = 0.5           # a new link refusing sends this long is down, not connecting (issue 25)
    max_pending: int = 16            # deltas held in memory at most (queued + pending)
    max_held_bytes: int = 256 << 20  # bytes held at most (raw queued deltas + encoded pending ones)
    heartbeat_s: float = 1.0
    retry_s: float = 1.0             # pause before retrying a failed spill (doubles while it keeps failing)
    max_retry_s: float = 2.0         # longest pause between spill retries (15 s kept deltas unspilled up to
                                     # 12 s after the store was back, issue 25: a PUT every 2 s costs nothing)
    bus_enabled: bool = True
    encode_threads: int = 1          # threads encoding one delta: 1 encodes on the sender thread

    def __post_init__(self) -> None:
        if self.ack_timeout_s <= 0 or self.heartbeat_s <= 0 or self.retry_s <= 0 or self.connect_s <= 0:
            raise ValueError("sender timeouts must be positive")
        if not isinstance(self.encode_threads, int) or isinstance(self.encode_threads, bool) \
                or not 1 <= self.encode_threads <= 256:
            raise ValueError(f"encode_threads must be an int in 1..256, got {self.encode_threads!r}")
        if self.max_ack_wait_s < self.ack_timeout_s:
            raise ValueError(f"max_ack_wait_s ({self.max_ack_wait_s}) must be >= ack_timeout_s ({self.ack_timeout_s})")
        if self.max_retry_s < self.retry_s:
            raise ValueError(f"max_retry_s ({self.max_retry_s}) must be >= retry_s ({self.retry_s})")
        if self.max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {self.max_pending}")
        if self.max_held_bytes < 1:
            raise ValueError(f"max_held_bytes must be >= 1, got {self.max_held_bytes}")


@dataclass
class _Pending:
    header: DeltaHeader
    tensors: dict[str, np.ndarray] | Any | None   # Any: a workers.learner.device_quant.DeviceDelta
    size: int = 0                  # bytes held: raw tensors until encoded, then the blob
    blob: bytes | None = None
    checksum: str = ""
    sent_at: float | None = None   # when it was sent, or found unsendable (then spill_after = sent_at)
    on_bus_at: float | None = None # when the bus took it (its ack latency is measured from here)
    spill_after: float = 0.0
    # The spill deadline of the sent, unacked delta of this lineage that this one superseded: the
    # lineage has waited for an ack since then, and a newer answer must not restart that wait.
    inherited_spill_after: float | None = None

    @property
    def lineage(self) -> tuple[int, int]:
        """Deltas of one lineage measure the same progress; the newest carries all of it."""
        return self.header.fragment, self.header.base_version


@dataclass
class SenderStats:
    submitted: int = 0
    acked: int = 0
    spilled: int = 0
    superseded: int = 0            # not durable: a newer delta of the same fragment and base replaced it (harmless)
    superseded_tokens: int = 0
    evicted: int = 0               # dropped to bound memory: lost work
    evicted_tokens: int = 0
    nonfinite: int = 0             # dropped: its values were not finite (could not be encoded)
    rejected: int = 0
    bytes_sent: int = 0
    bytes_spilled: int = 0         # bytes this sender's spills wrote (a spill found already stored wrote none)
    spill_found: int = 0           # spills that found the delta already stored (counted in ``spilled`` too)
    spill_errors: int = 0          # failed spill attempts (each is retried)
    last_error: str = ""
    peak_held: int = 0             # most deltas held at once
    peak_held_bytes: int = 0
    ack_wait_s: float = 0.0        # the current wait for an ack before spilling (pipeline/ack_wait.py)
    longest_ack_s: float = 0.0     # the longest recent ack latency it follows


def delta_made(events: EventLog, header: DeltaHeader) -> None:
    """The ``delta`` event: one per delta a learner produced, so that a run's ledger can account for
    each (docs/chaos.md). Written by the learner, or with ``sync_process`` by its agent when it
    takes the delta from its slot (workers/learner/agent_main.py): off the training thread."""
    events.emit("delta", delta=header.id, fragment=header.fragment, base=header.base_version,
                steps=header.c_steps, tokens=header.c_tokens, step=header.learner_step, round=header.round)


class Sender:
    """A ``DeltaSender`` (workers/learner/io.py) on threads of the learner's own process."""

    logs_deltas = False          # the learner writes each delta's event
    writes_difference = False    # takes computed deltas only
    submit_difference = no_difference("Sender")

    def __init__(self, store: ObjectStore, codec: CodecConfig, cfg: SenderConfig, events: EventLog,
                 bus: BusConfig | None, identity: bytes, heartbeat: Callable[[], dict],
                 clock: Callable[[], float] = time.monotonic, curve=None, seal: Callable[[bytes], bytes] | None = None,
                 sleep: Callable[[float], None] = time.sleep, threads: bool = True, transport: Transport = ZMQ,
                 target=None):
        self.store, self.codec, self.cfg, self.events, self.seal = store, codec, cfg, events, seal
        # ``target``: a discovered syncer (workers/bus/discovery.py BusTarget); the link follows it
        self._target, self._target_gen = target, 0
        self.transport = transport   # what builds the bus link (ZeroMQ; the fault simulation's own)
        self.bus_cfg, self.identity, self.heartbeat, self.clock, self.curve = bus, identity, heartbeat, clock, curve
        # ``threads=False``: no thread; the caller drives ``turn`` (the fault simulation, on simulated
        # time: infra/faultsim, issue 25) and ``drain`` turns and waits with ``clock`` and ``sleep``.
        self.sleep, self.threads = sleep, threads
        # Everything held lives in ``queue`` (submitted, not yet taken by this thread; keyed by
        # lineage) or ``pending`` (taken: being sent, awaiting an ack or a spill). One lock guards
        # both and the byte count; no I/O or encoding happens under it.
        self._lock = threading.Lock()
        self.queue: dict[tuple[int, int], _Pending] = {}
        self.pending: dict[str, _Pending] = {}
        self._held_bytes = 0
        self._ack_wait = AckWait(AckWaitConfig(floor_s=cfg.ack_timeout_s, cap_s=cfg.max_ack_wait_s))
        self.stats = SenderStats(ack_wait_s=cfg.ack_timeout_s)
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sender", daemon=True)
        self._last_heard = -1e9
        self._link: LearnerLink | None = None
        self._link_since = 0.0             # when the link was opened (ZeroMQ connects in the background)
        self._spill_failures = 0           # consecutive failed spills (for backoff and event thinning)
        self._map_fn = None                # the encode pool's map while the thread runs (encode_threads > 1)
        self.failed: str | None = None     # set if the thread died; the training loop then stops loudly
        # submit() wakes the sender thread through this pipe, so an answer leaves at once instead of
        # after the thread's next poll timeout (latency is what rounds lose work to, SPEC §3).
        self._beat_soon = threading.Event()   # the learner's pace is first known: tell the syncer now
        self._next_beat = 0.0
        self._pool: ThreadPoolExecutor | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    # -- training thread -------------------------------------------------------------------------
    def start(self) -> None:
        if self.threads:
            self._thread.start()
        else:
            self._open()

    def submit(self, header: DeltaHeader, tensors: dict[str, np.ndarray] | Any) -> None:
        """Hand over a delta; never blocks on I/O. Supersedes and evicts here, so that memory stays
        bounded even while this thread is stuck in a slow spill (module docstring)."""
        # ``tensors``: arrays, or a delta already quantised on the model's device (its host bytes;
        # workers/learner/device_quant.py), which this thread seals once its copy has completed
        size = tensors.nbytes if hasattr(tensors, "seal_blob") else sum(int(a.nbytes) for a in tensors.values())
        item = _Pending(header, tensors, size=size)
        with self._lock:
            self.stats.submitted += 1
            self._idle.clear()
            old = self.queue.pop(item.lineage, None)
            if old is not None:
                self._forget(old, "delta-superseded")
            self.queue[item.lineage] = item
            self._held_bytes += item.size
            self._evict_queued(keep=item)
            self._note_peak()
        try:
            os.write(self._wake_w, b"w")
        except (BlockingIOError, OSError):
            pass     # the pipe is full: the thread is awake already

    def beat_soon(self) -> None:
        """Send a heartbeat at once (the syncer's round clock follows the learners' pace, SPEC §2)."""
        self._beat_soon.set()
        try:
            os.write(self._wake_w, b"b")
        except (BlockingIOError, OSError):
            pass

    def held(self) -> tuple[int, int]:
        """(deltas, bytes) held right now: queued plus pending."""
        with self._lock:
            return len(self.queue) + len(self.pending), self._held_bytes

    def idle(self) -> bool:
        """The sender thread has nothing in hand (it is waiting for work)."""
        return self._idle.is_set()

    def drain(self, timeout_s: float) -> bool:
        """Wait until every submitted delta is durable (or ``timeout_s``). True if all are."""
        if not self.threads:
            return self._drain_turning(timeout_s)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.undelivered() == 0 and self.idle():
                return True
            if self.failed is not None or not self._thread.is_alive():
                break
            time.sleep(0.02)
        return self.undelivered() == 0

    def _drain_turning(self, timeout_s: float) -> bool:
        """``drain`` without a thread: turn, then wait on the injected clock until the next turn is due."""
        deadline = self.clock() + timeout_s
        while True:
            due = self.turn()
            if self.undelivered() == 0 and self.idle():
                return True
            now = self.clock()
            if now >= deadline:
                return self.undelivered() == 0
            self.sleep(min(max(due if due is not None else 0.02, 0.02), deadline - now))

    def undelivered(self) -> int:
        """Deltas not (yet) durable."""
        with self._lock:
            return len(self.queue) + len(self.pending)

    def stop(self) -> None:
        self._stop.set()
        try:
            os.write(self._wake_w, b"s")
        except (BlockingIOError, OSError):
            pass
        if self.threads:
            self._thread.join(timeout=10)
        else:
            self._close()
        if not self._thread.is_alive():   # the wake pipe is ours again: close it (no fd leak per learner life)
            fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1   # a late write: EBADF, ignored
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass

    # -- bookkeeping (under the lock) ------------------------------------------------------------
    def _forget(self, p: _Pending, event: str) -> None:
        """Drop a held delta that is not durable: ``delta-superseded`` (harmless: a newer delta of
        its lineage carries its progress) or ``delta-evicted`` (lost work, to bound memory)."""
        self._held_bytes -= p.size
        if event == "delta-superseded":
            self.stats.superseded += 1
            self.stats.superseded_tokens += p.header.c_tokens
        else:
            self.stats.evicted += 1
            self.stats.evicted_tokens += p.header.c_tokens
        self.events.emit(event, delta=p.header.id, fragment=p.header.fragment, base=p.header.base_version,
                         tokens=p.header.c_tokens)

    def _over(self) -> bool:
        return (len(self.queue) + len(self.pending) > self.cfg.max_pending
                or self._held_bytes > self.cfg.max_held_bytes)

    def _evict_queued(self, keep: _Pending) -> None:
        """Oldest queued deltas go first; the newest one is always kept (it carries the most)."""
        while self._over():
            victim = next((k for k, p in self.queue.items() if p is not keep), None)
            if victim is None:
                return
            self._forget(self.queue.pop(victim), "delta-evicted")

    def _note_peak(self) -> None:
        n = len(self.queue) + len(self.pending)
        self.stats.peak_held = max(self.stats.peak_held, n)
        self.stats.peak_held_bytes = max(self.stats.peak_held_bytes, self._held_bytes)

    def _release(self, did: str) -> _Pending | None:
        with self._lock:
            p = self.pending.pop(did, None)
            if p is not None:
                self._held_bytes -= p.size
            return p

    # -- sender thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:   # a bug here must not leave the learner training into the void
            self.failed = f"{exc.__class__.__name__}: {exc}"
            self.events.emit("sender-failed", error=self.failed)
            raise

    def _loop(self) -> None:
        self._open()
        try:
            while not self._stop.is_set():
                self.turn(None)
        finally:
            self._close()

    def _open(self) -> None:
        """The bus link (with its hello) and the encode pool, before the first turn."""
        if self._target is not None:
            self._target_gen, self.bus_cfg = self._target.generation, self._target.config
        self._connect()
        # The codec's jobs run on this pool (numpy releases the GIL): the same bytes at any count.
        self._pool = ThreadPoolExecutor(self.cfg.encode_threads, thread_name_prefix="sender-encode") \
            if self.cfg.encode_threads > 1 else None
        self._map_fn = self._pool.map if self._pool is not None else None

    def _connect(self) -> None:
        if self.bus_cfg is not None and self.cfg.bus_enabled:
            self._link = self.transport.learner(self.bus_cfg, self.identity, curve=self.curve, wake_fd=self._wake_r)
            self._link_since = self.clock()
            self._link.send(Message("hello", {"learner": self.identity.decode(), "incarnation": 0}))

    def _follow_target(self) -> None:
        """The discovered syncer moved: drop the old link, connect to the new endpoints (deltas sent
        on the old link and not acked spill when their deadline comes, as on any lost link)."""
        if self._target is None or self._target.generation == self._target_gen:
            return
        self._target_gen, self.bus_cfg = self._target.generation, self._target.config
        if self._link is not None:
            self._link.close()
            self._link = None
        self._connect()
        self._next_beat = 0.0        # say hello with a heartbeat at once: the new syncer counts it live

    def _close(self) -> None:
        if self._pool is not None:
            self._map_fn = None
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._link is not None:
            if self._stop.is_set() and self.failed is None:
                # A clean stop says so: the syncer stops counting this learner live at once instead
                # of waiting out its liveness timeout, closing every round after a grace window for
                # an answer that never comes (the last learner's utilisation fell 0.84 -> 0.71).
                self._link.send(Message("heartbeat", {**self.heartbeat(), "leaving": True}))
            self._link.close(linger_s=LEAVING_LINGER_S)
            self._link = None

    def turn(self, wait_s: float | None = 0.0) -> float | None:
        """One turn of the sender: take new deltas, heartbeat, send, read acks (waiting up to
        ``wait_s``; None: the thread's own short wait), spill what is overdue. Returns the seconds
        until a turn has work again without a new ``submit`` (None: nothing held, no bus)."""
        self._take_new()
        self._follow_target()
        now = self.clock()
        if self._link is not None and (now >= self._next_beat or self._beat_soon.is_set()):
            self._beat_soon.clear()
            if self._link.send(Message("heartbeat", self.heartbeat())) or not self._connecting(now):
                self._next_beat = now + self.cfg.heartbeat_s   # else: again next turn, once connected
        self._send_unsent(now)
        self._read_acks(wait_s if wait_s is not None else (0.02 if self.pending else 0.05))
        now = self.clock()
        self._spill_overdue(now)
        with self._lock:
            if not self.queue and not self.pending:
                self._idle.set()
            dues = [p.spill_after for p in self.pending.values() if p.sent_at is not None]
            if self.queue or any(p.sent_at is None for p in self.pending.values()):
                dues.append(now)
        if self._link is not None:
            dues.append(self._next_beat)
        return max(0.0, min(dues) - now) if dues else None

    def _take_new(self) -> None:
        """Move queued deltas to pending. A pending delta of the same lineage that is not durable
        yet - never sent, or sent and not acked - is superseded: the new one carries its progress,
        and if the old one reaches the syncer after all it is merged like any late answer. Beyond
        the bounds the oldest never-sent pending delta is evicted (lost work).

        Why sent ones too: while the store was down the syncer could not make bus deltas
        durable, so nothing was acked, spills failed, and the 16 held unacked deltas of a few
        lineages filled the bound; every new answer was then *evicted* - 46 deltas, all of a learner's
        work for the rest of its run - although each one held the progress of those it could have
        replaced. The newer one keeps the older one's spill deadline: answers that supersede each
        other faster than ``ack_timeout_s`` must not postpone the spill forever."""
        with self._lock:
            items, self.queue = list(self.queue.values()), {}
            for item in items:
                for did, old in list(self.pending.items()):
                    if old.lineage == item.lineage:
                        # a sent one's deadline already holds what it inherited (_send_unsent)
                        carried = old.spill_after if old.sent_at is not None else old.inherited_spill_after
                        if carried is not None:
                            item.inherited_spill_after = min(carried, item.inherited_spill_after or carried)
                        self._forget(self.pending.pop(did), "delta-superseded")
                self.pending[item.header.id] = item
            while self._over():
                # Sent ones may already be durable at the syncer: evict the oldest never-sent first.
                unsent = [d for d, p in self.pending.items() if p.sent_at is None]
                did = unsent[0] if unsent else next(iter(self.pending))
                if len(self.pending) == 1:
                    break
                self._forget(self.pending.pop(did), "delta-evicted")

    def _encode(self, p: _Pending) -> bool:
        """Encode (and seal) once. False: the delta cannot be encoded (non-finite values) and was
        dropped with an event; the learner keeps training."""
        if p.blob is not None:
            return True
        try:
            if hasattr(p.tensors, "seal_blob"):   # waits for the device's copy here, never in step()
                blob = p.tensors.seal_blob(DELTA_KIND, p.header.to_dict(), self.codec, map_fn=self._map_fn)
            else:
                blob = encode(DELTA_KIND, p.header.to_dict(), p.tensors, self.codec, map_fn=self._map_fn)
        except ValueError as exc:
            if self._release(p.header.id) is not None:
                self.stats.nonfinite += 1
                self.events.emit("delta-dropped", delta=p.header.id, fragment=p.header.fragment,
                                 tokens=p.header.c_tokens, reason="non-finite", error=str(exc))
            return False
        if self.seal is not None:
            blob = self.seal(blob)
        with self._lock:
            p.blob, p.checksum, p.tensors = blob, digest(blob), None   # the blob is all we need from now on
            if p.header.id in self.pending:
                self._held_bytes += len(blob) - p.size
            p.size = len(blob)
        return True

    def _syncer_alive(self, now: float) -> bool:
        # A link just opened counts as heard: a fresh learner or respawned agent uploaded every
        # delta it sent in its first second a second time, before its first ack came (issue 31).
        heard = max(self._last_heard, self._link_since if self._link is not None else -1e9)
        return now - heard < max(3 * self._ack_wait.wait_s(), 3 * self.cfg.heartbeat_s)

    def _connecting(self, now: float) -> bool:
        """The link is new and nothing came over it yet: its connect may still be under way (the
        link refuses to queue until it is connected), for ``connect_s`` at most: a loopback connect
        takes milliseconds, one across regions a few round trips, and a bus that is really down
        must not hold the first answers back from the spill for long (every one waits that long)."""
        return self._last_heard < self._link_since and now - self._link_since < self.cfg.connect_s

    def _send_unsent(self, now: float) -> None:
        for p in list(self.pending.values()):
            if p.sent_at is not None or not self._encode(p):
                continue
            if self._link is None:
                p.sent_at = p.spill_after = now       # no bus: spill straight away
                continue
            msg = Message("delta", {"header": p.header.to_dict(), "checksum": p.checksum}, p.blob)
            if not self._link.send(msg):
                if self._connecting(now):
                    # A sync agent spilled the first delta it was handed 7 ms after it came up (busy
                    # machine, issue 25) instead of sending it: a link still connecting is not a
                    # fast path that is down. Sent at a later turn, or spilled once it is overdue.
                    continue
                p.sent_at = p.spill_after = now       # would block (disconnected / high-water mark)
                continue
            self.stats.bytes_sent += len(p.blob)
            p.sent_at = p.on_bus_at = now
            p.spill_after = now + self._ack_wait.wait_s()
            if p.inherited_spill_after is not None:
                # Answers of one lineage superseded one another faster than ack_timeout_s while the
                # bus was blackholed: each restarted the wait, so nothing spilled until the syncer
                # was given up for dead (3 x ack_timeout_s; 4 s without a commit in the chaos suite).
                p.spill_after = min(p.spill_after, max(now, p.inherited_spill_after))
            if not self._syncer_alive(now):
                p.spill_after = now   # nobody acks lately: make it durable ourselves now

    def _read_acks(self, timeout_s: float) -> None:
        if self._link is None:
            if select.select([self._wake_r], [], [], timeout_s)[0]:
                drain_wake(self._wake_r)
            return
        msg = self._link.recv(timeout_s)
        while msg is not None:
            self._last_heard = self.clock()
            if msg.type == "ack":
                did = msg.fields.get("delta_id")
                p = self._release(did) if isinstance(did, str) else None
                if p is not None:
                    if msg.fields.get("status") == "durable":
                        if p.on_bus_at is not None:   # acks of deltas the bus took measure the round
                            self._ack_seen(self._last_heard - p.on_bus_at)
                        self.stats.acked += 1
                        self.events.emit("delta-acked", delta=did)
                    else:
                        self.stats.rejected += 1
                        self.events.emit("delta-rejected", delta=did, reason=msg.fields.get("reason", ""))
            msg = self._link.recv(0)

    def _ack_seen(self, latency_s: float) -> None:
        self._ack_wait.observe(latency_s)
        self.stats.ack_wait_s, self.stats.longest_ack_s = self._ack_wait.wait_s(), self._ack_wait.longest_s

    def _spill_overdue(self, now: float) -> None:
        for did, p in list(self.pending.items()):
            if p.sent_at is None or now < p.spill_after or self._stop.is_set():
                continue
            if not self._encode(p):
                continue
            key = spill_key(p.header.learner, p.header.incarnation, p.header.seq)
            wrote = True
            try:
                self.store.put_if_absent(key, p.blob)
            except AlreadyExists:
                # The syncer (it writes a bus delta under this key before acking: an ack slower than
                # ack_timeout_s) or an earlier try of ours already made it durable there. Durable, so
                # it counts as spilled; but this learner wrote no bytes (its store counts none either).
                wrote = False
            except StoreError as exc:
                self._spill_failed(p, exc, now)
                return   # the store is failing: do not block on every other delta too
            if self._spill_failures:
                self.events.emit("spill-recovered", after_failures=self._spill_failures)
                self._spill_failures = 0
            if self._release(did) is not None:
                self.stats.spilled += 1
                self.stats.bytes_spilled += len(p.blob) if wrote else 0
                self.stats.spill_found += 0 if wrote else 1
                self.events.emit("delta-spilled", delta=did, fragment=p.header.fragment, bytes=len(p.blob) if wrote else 0,
                                 **({} if wrote else {"found": True}))

    def _spill_failed(self, p: _Pending, exc: StoreError, now: float) -> None:
        """Keep the delta (bounded by the caps) and retry with backoff; report the 1st, 2nd, 4th...
        consecutive failure so that a long outage does not flood the log."""
        self._spill_failures += 1
        self.stats.spill_errors += 1
        self.stats.last_error = str(exc)
        backoff = min(self.cfg.retry_s * 2 ** min(self._spill_failures - 1, 16), self.cfg.max_retry_s)
        for q in list(self.pending.values()):
            if q.sent_at is not None:
                q.spill_after = max(q.spill_after, now + backoff)
        n = self._spill_failures
        if n & (n - 1) == 0:
            self.events.emit("spill-failed", delta=p.header.id, error=str(exc), consecutive=n,
                             retryable=exc.retryable, retry_in_s=round(backoff, 3),
                             undelivered=self.undelivered())
