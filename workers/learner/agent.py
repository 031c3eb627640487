"""A learner's sync agent: its sender and receiver in a child process.

``LearnerConfig.sync_process`` (``ddiloco learner --sync-process``) moves everything the learner's
background threads do - encoding, sealing and sending deltas, spilling, heartbeats, listening for
announcements, loading and verifying versions - into one child process
(workers/learner/agent_main.py). The training thread then shares its GIL with nothing but one
small reader thread: in the default job every answer step cost ~2.5 ms more with the threads
(GIL contention with ~2-3 ms of background Python per answer, docs/scale.md), which no thread
setting removed.

What crosses (workers/learner/agent_wire.py): a delta's float32 values go into a shared slot and
a ``delta`` frame names it; a version comes back in a shared slot too, but named on the board
(workers/learner/agent_board.py), as are the open rounds and the delta slots handed back: the
training thread reads the board at each step's start, so in the steady state no frame from the
agent wakes the reader thread mid-step (each did cost ~0.1 ms of training). ``AgentSender`` and
``AgentReceiver`` give the Learner the interface of ``Sender`` and ``Receiver`` (submit, drain,
stats, take, opened ...), so the Learner's logic, the deltas' bytes and the versions applied are
the same either way: the child runs the same Sender and Receiver code on values copied exactly.
The child also writes each delta's ``delta`` event to the learner's log as it takes the delta from
its slot (``AgentSender.logs_deltas``): ~70 us of a cold JSON line off the answer step.

In a sharded run the child builds one sender and one receiver per syncer shard, as the learner's
threads would (workers/learner/shards.py). Limits: Linux (``memfd``), a store the child can open
again from its URI (a directory or s3://; not an in-memory store). The child's store
requests and bus bytes are in the learner's ``accounting`` events (``SyncAgent.traffic``, added by
its ``TrafficMeter``). The child gets the run descriptor in its ``config`` frame, so it starts
without storage (a replacement may start during an outage).

Faults: the learner outlives its agent. When the child dies, a new one replaces it and
the deltas that died with it are answered again or logged as lost (workers/learner/agent_child.py:
the child process, its replacement and the recovery). This file holds the agent's setup
(``AgentSetup``, ``agent_for``), the ``SyncAgent`` (its reader thread and the training thread's
side of the channel and board) and the proxies ``AgentSender`` and ``AgentReceiver``.
"""
from __future__ import annotations

import dataclasses
import subprocess
import threading
import time
from functools import partial
from typing import Callable

import numpy as np

from pipeline.errors import FormatError
from pipeline.fragment import extract
from pipeline.descriptor import RunDescriptor
from pipeline.types import DeltaHeader
from workers.bus.bus import BusConfig
from workers.common.events import EventLog
from workers.learner.agent_board import Board
from workers.learner.agent_child import (DELTA_SLOTS, LOST_REASON, RESPAWN_HEALTHY_S, RESPAWN_LIMIT,  # noqa: F401
                                         START_TIMEOUT_S, ChildRecovery, _add_counters, _Child)
from workers.learner.agent_wire import Slots, pack, unpack
from workers.learner.receiver import Arrival
from workers.learner.sender import SenderConfig, SenderStats, delta_made

REPORT_EVERY_S = 0.1      # a draining learner asks the child for its counters this often


@dataclasses.dataclass(frozen=True)
class AgentSetup:
    """What the child needs (besides the shared memory): sent as the ``config`` frame."""
    store_uri: str
    s3_endpoint: str | None
    learner: str
    log: str | None
    bus: BusConfig | None
    sender: SenderConfig
    poll_s: float
    cursor: int | list[int]                   # the log cursor the versions were loaded at (one per syncer shard)
    known: dict[int, int]
    heartbeat: dict
    cpus: tuple[int, ...] | None = None       # LearnerConfig.agent_cpus
    forward_events: bool = False              # the learner's log has listeners (metrics): send them the child's
    curve: tuple[str, str, str] | None = dataclasses.field(default=None, repr=False)
    sign_secret: str | None = dataclasses.field(default=None, repr=False)
    drain_s: float = 30.0                     # LearnerConfig.drain_s: how long an orphaned child drains

    def __post_init__(self) -> None:
        if not isinstance(self.drain_s, (int, float)) or isinstance(self.drain_s, bool) or not self.drain_s >= 0:
            raise ValueError(f"AgentSetup.drain_s must be a number >= 0, got {self.drain_s!r}")


def agent_for(learner, d: RunDescriptor, cursor: int | list[int], known: dict[int, int], curve) -> tuple:
    """(AgentSender, AgentReceiver) for ``learner`` (a started ``Learner``'s state: its store,
    bus, keys, events and the log cursor its versions were loaded at)."""
    store = learner.store
    inner = getattr(store, "inner", store)
    fh = getattr(learner.events, "_fh", None)
    keys = learner.cfg.keys if d.security is not None else None
    setup = AgentSetup(store.uri, getattr(inner, "endpoint", None), learner.id, getattr(fh, "name", None),
                       learner.bus, learner.cfg.sender, learner.cfg.poll_s, cursor, dict(known), learner._heartbeat(),
                       cpus=learner.cfg.agent_cpus, forward_events=learner.events.has_listeners(),
                       curve=tuple(k.decode() for k in (curve.public, curve.secret, curve.server_public))
                       if curve is not None else None,
                       sign_secret=keys.own.sign_secret.hex() if keys is not None else None,
                       drain_s=learner.cfg.drain_s)
    agent = SyncAgent(d, setup, learner._heartbeat, learner.events)
    agent.reanswer = partial(_answer_again, learner)
    if learner.traffic is not None:   # the child's store is this learner's region's store (its URI)
        learner.traffic.extra = partial(agent.traffic, learner.traffic.region)
    return AgentSender(agent), AgentReceiver(agent)


def _answer_again(learner, lost: DeltaHeader) -> bool:
    """Answer ``lost``'s round again from the parameters now, when they still hold its steps (the
    same base version, no fewer steps): the delta died with the sync agent. False: a
    version of its fragment was applied since, and its steps with it."""
    p = lost.fragment
    if learner.base_version.get(p) != lost.base_version or learner.c_steps[p] < max(lost.c_steps, 1):
        return False
    learner._emit_delta(p, lost.round)
    return True


class SyncAgent(ChildRecovery):
    """The child process (replaced when it dies, issue 25), the channel to it, and the reader
    thread that takes its frames."""

    def __init__(self, d: RunDescriptor, setup: AgentSetup, heartbeat: Callable[[], dict],
                 events: EventLog):
        self.d, self.setup, self.heartbeat, self.events = d, setup, heartbeat, events
        self.version_slots = 2 * d.num_fragments          # two per fragment (agent_board.py)
        self._lock = threading.Lock()     # inflight, the children and their retired counters: both threads
        self._children = [_Child(d, self.version_slots, 0)]
        # the training thread's child, and the reader thread's (the newest): they differ from a
        # child's death until the training thread moves to its replacement (swap_if_replaced)
        self.child = self._live = self._children[0]
        self._next: _Child | None = None
        self._closing = threading.Event()
        self.failed: str | None = None
        self.reanswer: Callable[[DeltaHeader], bool] | None = None   # agent_for: the Learner answers again
        self.inflight: dict[str, DeltaHeader] = {}   # handed over, not yet reported settled by a child
        # fragment -> (version, its commit's log seq) the learner took: where a replacement resumes
        self.held: dict[int, tuple[int, int | None]] = {int(p): (v, None) for p, v in setup.known.items()}
        self.retired: dict = {}           # dead children's counters, added up
        self.own = dict.fromkeys(("superseded", "superseded_tokens", "evicted", "evicted_tokens"), 0)
        self.respawns = 0
        self._deaths = 0                  # children in a row that died without progress
        self.queued: dict[tuple[int, int], tuple[DeltaHeader, dict]] = {}   # waiting for a delta slot
        self._views: dict[int, tuple[dict, dict[str, np.ndarray], list[int]]] = {}   # _param_views
        self._reset_view()
        self._thread = threading.Thread(target=self._read, name="sync-agent", daemon=True)

    def _reset_view(self) -> None:
        """The training thread's own view of its child's board (only it reads the board and hands
        deltas over), as for a new board."""
        self.handed = [0] * DELTA_SLOTS                     # deltas handed over per delta slot
        self.slot_header: list[DeltaHeader | None] = [None] * DELTA_SLOTS   # the last one in each
        self.consumed = [0] * self.d.num_fragments          # newest arrival generation copied out
        self._opened: tuple[int, dict[int, tuple[int, int]]] = (-1, {})   # (generation seq word, rounds)
        self._arrivals_gen = -1                             # the generation seq word at the last take()
        self._arrival_seqs = [-1] * self.d.num_fragments    # each arrival record's seq word then
        self._opened_seqs = [-1] * self.d.num_fragments     # each opened record's seq word at its last read

    @property
    def board(self) -> Board:
        return self.child.board

    @property
    def slots(self) -> Slots:
        return self.child.slots

    @property
    def proc(self) -> subprocess.Popen:
        """The newest child's process."""
        return self._live.proc

    @property
    def live_stats(self) -> dict:
        """The newest child's last ``stats`` frame (cheap: no adding up)."""
        return self._live.stats

    @property
    def stats(self) -> dict:
        """The counters in the shape of a ``stats`` frame: the newest child's plus the dead ones'
        and the deltas this side superseded or lost."""
        live = self._live.stats
        if not self.retired and not any(self.own.values()):
            return live
        with self._lock:
            out = {**live, **_add_counters(self.retired, live)}
        out["sender"] = {**out["sender"], **{k: out["sender"].get(k, 0) + n for k, n in self.own.items()}}
        return out

    def _config(self, cursor: int | list[int], known: dict[int, int], life: int) -> bytes:
        s = self.setup
        return pack("config", store=s.store_uri, s3_endpoint=s.s3_endpoint, learner=s.learner, log=s.log,
                    ingest=s.bus.ingest if s.bus else None, announce=s.bus.announce if s.bus else None,
                    sender=dataclasses.asdict(s.sender), poll_s=s.poll_s, cursor=cursor,
                    known={str(p): v for p, v in known.items()}, heartbeat=self.heartbeat() if life else s.heartbeat,
                    curve=s.curve, sign_secret=s.sign_secret, delta_slots=DELTA_SLOTS,
                    version_slots=self.version_slots, cpus=list(s.cpus) if s.cpus is not None else None,
                    forward_events=s.forward_events, drain_s=float(s.drain_s), life=life,
                    # the descriptor itself: a replacement started while storage is down must not
                    # need a GET to come up (issue 25: an S3 outage during a respawn killed the learner)
                    descriptor=self.d.to_bytes())

    def start(self) -> None:
        child = self.child
        child.send(self._config(self.setup.cursor, self.setup.known, 0))
        self._thread.start()
        if not child.ready.wait(START_TIMEOUT_S) or child.ready_at is None or self.failed:
            reason = self.failed or child.failed or "no answer in time"
            self.close()
            raise RuntimeError(f"the learner's sync agent did not start: {reason}")

    def send(self, kind: str, **fields) -> None:
        self._live.send(pack(kind, **fields))      # a dead child: its replacement gets what matters

    # -- the reader thread -----------------------------------------------------------------------
    def _read(self) -> None:
        child = self._live
        try:
            while True:
                self._serve(child)
                if self._closing.is_set() or not self._replaceable(child):
                    return
                new = self._respawn(child)
                child.ended()
                if new is None:
                    return
                child = new
                if self._closing.is_set():     # close() came during the respawn: stop this one too
                    child.send(pack("stop"))
        except Exception as exc:   # noqa: BLE001 - a bad frame: stop loudly
            self.failed = self.failed or f"sync agent channel: {exc.__class__.__name__}: {exc}"
        finally:
            child.ended()

    def _serve(self, child: _Child) -> None:
        """Take ``child``'s frames and send it the learner's heartbeat until its channel ends."""
        next_beat = 0.0
        beat_s = self.setup.sender.heartbeat_s / 2
        try:
            while True:
                if child.conn.poll(beat_s):
                    self._handle(child, unpack(child.conn.recv_bytes()))
                    if child.said_bye:
                        return
                if time.monotonic() >= next_beat:     # the child's Sender sends the newest it was given
                    child.send(pack("beat", heartbeat=self.heartbeat()))
                    next_beat = time.monotonic() + beat_s
        except (EOFError, OSError):
            pass

    def _handle(self, child: _Child, msg: dict) -> None:
        kind = msg["type"]
        if kind == "stats":
            records = msg.pop("events", None)
            settled = msg.pop("settled", None)
            child.stats = msg
            if settled:
                self._settle(child, settled)
            for rec in records or ():       # the child's event records, for this process's listeners (metrics)
                self.events.notify(rec)
        elif kind == "ready":
            child.ready_at = time.monotonic()
            child.ready.set()
        elif kind == "sender_stopped":
            child.sender_stopped.set()
        elif kind == "failed":
            child.failed = msg.get("error", "failed")
        elif kind == "bye":
            child.said_bye = True
            child.done.set()

    def _settle(self, child: _Child, ids: list) -> None:
        """Deltas the child made durable or dropped with a logged reason: no longer the learner's."""
        with self._lock:
            for did in ids:
                if self.inflight.pop(did, None) is not None:
                    child.settled += 1

    def traffic(self, region: str) -> dict:
        """The children's store (``region``'s) and bus counters as of their last ``stats`` frames,
        in the shape of ``TrafficMeter.extra`` (workers/common/traffic.py). After ``close`` they
        are the totals: a child's last frame comes before ``bye``."""
        t = self.stats.get("traffic") or {}
        return {"stores": {region: t["store"]} if t.get("store") else {}, "bus": t.get("bus")}

    # -- called by the proxies, on the training thread -------------------------------------------
    def undelivered(self) -> int:
        """Deltas not (yet) reported durable: held here, or handed over and not settled."""
        return len(self.queued) + len(self.inflight)

    def stop_sender(self) -> None:
        self._closing.set()           # the learner is closing: a child that dies now is not replaced
        live = self._live
        if live.send(pack("stop_sender")):
            live.sender_stopped.wait(15.0)

    def _free_slot(self) -> int | None:
        for slot in range(DELTA_SLOTS):
            try:
                done = self.board.done(slot)
            except FormatError:
                if self.child.alive():
                    raise
                return None           # torn by the child's kill: hold the delta for its replacement
            if done == self.handed[slot]:   # the agent copied out all we handed over
                return slot
        return None

    def _hand_over(self, slot: int, header: DeltaHeader) -> None:
        self.handed[slot] += 1
        self.slot_header[slot] = header
        with self._lock:
            self.inflight[header.id] = header
        self.child.send(pack("delta", header=header.to_dict(), slot=slot))   # a dead child: resent (swap)

    def submit(self, header: DeltaHeader, values: dict[str, np.ndarray]) -> None:
        slot = None if self.queued else self._free_slot()
        if slot is None:         # every slot in flight: hold the newest of its lineage (flush_queued)
            old = self.queued.pop((header.fragment, header.base_version), None)
            if old is not None:  # it never reached the child: logged here, as made and superseded
                delta_made(self.events, old[0])
                self._forget(old[0], "delta-superseded")
            self.queued[(header.fragment, header.base_version)] = (header, values)
            return
        self.slots.write(slot, header.fragment, values)
        self._hand_over(slot, header)

    def submit_difference(self, header: DeltaHeader, base: dict[str, np.ndarray], params: dict) -> None:
        """``submit(header, {n: base[n] - params[n]})``, the subtraction written straight into the
        slot (the same float32 operation, so the same values) when the parameters are CPU float32."""
        current = self._param_views(params)
        if current is None:
            current = extract(params, list(params))
        slot = None if self.queued else self._free_slot()
        if slot is None:
            self.submit(header, {n: base[n] - current[n] for n in current})
            return
        for name, view in self.slots.views(slot, header.fragment).items():
            np.subtract(base[name], current[name], out=view)
        self._hand_over(slot, header)

    def _param_views(self, params: dict) -> dict[str, np.ndarray] | None:
        """float32 numpy views of ``params`` (CPU tensors; None otherwise), kept per ``params`` dict
        (the Learner passes the same one for a fragment each time) and built again if a tensor's
        storage moved (``param.data = ...``): cold, ``detach().numpy()`` per tensor costs the
        answer step tens of microseconds."""
        held = self._views.get(id(params))
        if held is not None and held[0] is params and all(
                t.data_ptr() == ptr for t, ptr in zip(params.values(), held[2])):
            return held[1]
        try:
            views = {n: t.detach().numpy() for n, t in params.items()}   # views, no copies
        except (AttributeError, TypeError, RuntimeError):
            return None
        if any(a.dtype != np.float32 for a in views.values()):
            return None
        self._views[id(params)] = (params, views, [t.data_ptr() for t in params.values()])
        return views

    def flush_queued(self) -> None:
        """Hand over held deltas, oldest first, as slots come back."""
        self.swap_if_replaced()
        while self.queued:
            slot = self._free_slot()
            if slot is None:
                return
            header, values = self.queued.pop(next(iter(self.queued)))
            self.slots.write(slot, header.fragment, values)
            self._hand_over(slot, header)

    def opened(self) -> dict[int, tuple[int, int]]:
        """The open rounds: the same dict object (not to be changed) until the board has news, so a
        caller can tell "nothing new" by identity (Learner.answer_rounds)."""
        gen = self.board.generation_seq()       # one word when nothing is new
        if gen == self._opened[0]:
            return self._opened[1]
        rounds = self._opened[1]
        for p in range(self.d.num_fragments):   # then one word per fragment, a record only where it moved
            seq = self.board.opened_seq(p)
            if seq == self._opened_seqs[p]:
                continue
            self._opened_seqs[p] = seq
            now = self.board.opened_round(p)
            if now != rounds.get(p):
                rounds = {q: r for q, r in rounds.items() if q != p} | ({p: now} if now is not None else {})
        self._opened = (gen, rounds)            # the same object while no round changed
        return rounds

    def take(self) -> list[Arrival]:
        """The versions that arrived since the last call (the newest per fragment), copied out."""
        if self.queued:
            self.flush_queued()
        gen = self.board.generation_seq()
        if gen == self._arrivals_gen:
            return []
        self._arrivals_gen = gen                # read before the records: a later write bumps it again
        out = []
        for p in range(self.d.num_fragments):
            seq = self.board.arrival_seq(p)     # the same word as at the last read: no new arrival
            if seq == self._arrival_seqs[p]:
                continue
            self._arrival_seqs[p] = seq
            a = self.board.arrival(p)
            if a is None or a.gen <= self.consumed[p]:
                continue
            values = self.slots.read(a.slot, p)
            self.board.set_consumed(p, a.gen)   # the slot may be written again from now on
            self.consumed[p] = a.gen
            out.append(Arrival(p, a.version, a.seq, values, a.found_by, a.committed_at, a.epoch, a.round))
        return out

    def close(self, timeout_s: float = 15.0) -> None:
        """Stop the child (its sender and receiver stop as they would in-process) and wait for it."""
        self._closing.set()
        live = self._live
        if live.alive():
            live.send(pack("stop"))
            if self._thread.is_alive():
                live.done.wait(timeout_s)
        if self._thread.is_alive():
            self._thread.join(timeout_s)   # after a respawn under way: it stops the new child itself
        with self._lock:
            children = list(self._children)
        for c in children:
            c.close(timeout_s)


class AgentSender:
    """The Learner's view of the child's Sender: a ``DeltaSender`` (workers/learner/io.py)."""

    logs_deltas = True     # the child writes each delta's ``delta`` event when it takes it (sender.delta_made)
    writes_difference = True   # the training thread subtracts straight into a shared slot

    def __init__(self, agent: SyncAgent):
        self.agent = agent
        self.submitted = 0

    def start(self) -> None:
        self.agent.start()

    @property
    def failed(self) -> str | None:
        return self.agent.failed or self.agent.live_stats.get("failed")

    @property
    def stats(self) -> SenderStats:
        return SenderStats(**self.agent.stats.get("sender", {}))

    def submit(self, header: DeltaHeader, tensors: dict[str, np.ndarray]) -> None:
        self.submitted += 1
        self.agent.submit(header, tensors)

    def submit_difference(self, header: DeltaHeader, base: dict[str, np.ndarray], params: dict) -> None:
        self.submitted += 1
        self.agent.submit_difference(header, base, params)

    def beat_soon(self) -> None:
        self.agent.send("beat", heartbeat=self.agent.heartbeat(), soon=True)

    def undelivered(self) -> int:
        return self.agent.undelivered()

    def drain(self, timeout_s: float) -> bool:
        """Until every delta is reported settled (durable, or dropped with a logged reason)."""
        deadline = time.monotonic() + timeout_s
        asked = -1.0
        while time.monotonic() < deadline:
            self.agent.flush_queued()         # and moves to a replacement child
            if self.agent.undelivered() == 0:
                return True
            if self.failed is not None:
                break
            if time.monotonic() >= asked + REPORT_EVERY_S:   # the child's counters now, not at its next report
                self.agent.send("report")
                asked = time.monotonic()
            time.sleep(0.02)
        return self.agent.undelivered() == 0

    def stop(self) -> None:
        self.agent.stop_sender()


class AgentReceiver:
    """The Learner's view of the child's Receiver (a ``VersionReceiver``); ``stop`` ends the child."""

    def __init__(self, agent: SyncAgent):
        self.agent = agent

    def start(self) -> None:
        pass          # the agent started with the sender

    def stop(self) -> None:
        self.agent.close()

    def take(self) -> list[Arrival]:
        agent = self.agent
        agent.swap_if_replaced()
        try:
            got = agent.take()
        except FormatError:
            if agent.child.alive():
                raise
            return []            # a record torn by the child's kill: its replacement publishes again
        for a in got:            # where a replacement resumes (SyncAgent._resume_point)
            if a.version > agent.held[a.fragment][0]:
                agent.held[a.fragment] = (a.version, a.seq)
        return got

    def opened(self) -> dict[int, tuple[int, int]]:
        agent = self.agent
        agent.swap_if_replaced()
        try:
            return agent.opened()
        except FormatError:
            if agent.child.alive():
                raise
            return agent._opened[1]

    def _counter(self, name: str, default=0):
        return self.agent.stats.get("receiver", {}).get(name, default)

    # the child's receiver counters, from its last counters frame
    failed = property(lambda self: self._counter("failed", None))
    errors = property(lambda self: self._counter("errors"))
    refused = property(lambda self: self._counter("refused"))
    bytes_received = property(lambda self: self._counter("bytes_received"))
    awaited = property(lambda self: self._counter("awaited"))
    copy_misses = property(lambda self: self._counter("copy_misses"))
    copy_wait_s = property(lambda self: self._counter("copy_wait_s", 0.0))
