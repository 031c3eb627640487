"""A learner's sync agent (issue 15): its sender and receiver in a child process.

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
its ``TrafficMeter``), with one GET more than the threads make: the child reads the descriptor.
"""
from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import threading
import time
from functools import partial
from multiprocessing.connection import Connection
from typing import Callable

import numpy as np

from pipeline.fragment import extract
from pipeline.types import DeltaHeader, RunDescriptor
from workers.bus.bus import BusConfig
from workers.common.events import EventLog
from workers.learner.agent_board import Board
from workers.learner.agent_wire import Slots, pack, unpack
from workers.learner.receiver import Arrival
from workers.learner.sender import SenderConfig, SenderStats

DELTA_SLOTS = 4
START_TIMEOUT_S = 60.0
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
                       sign_secret=keys.own.sign_secret.hex() if keys is not None else None)
    agent = SyncAgent(d, setup, learner._heartbeat, learner.events)
    if learner.traffic is not None:   # the child's store is this learner's region's store (its URI)
        learner.traffic.extra = partial(agent.traffic, learner.traffic.region)
    return AgentSender(agent), AgentReceiver(agent)


class SyncAgent:
    """The child process, the channel to it, and the reader thread that takes its frames."""

    def __init__(self, d: RunDescriptor, setup: AgentSetup, heartbeat: Callable[[], dict],
                 events: EventLog):
        self.d, self.setup, self.heartbeat, self.events = d, setup, heartbeat, events
        self.version_slots = 2 * d.num_fragments          # two per fragment (agent_board.py)
        self.slots = Slots(d, DELTA_SLOTS + self.version_slots)
        self.board = Board(d.num_fragments, DELTA_SLOTS)
        ours, theirs = socket.socketpair()
        self.conn = Connection(ours.detach())
        child_fd = theirs.detach()
        self._send_lock = threading.Lock()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "workers.learner.agent_main", "--conn", str(child_fd), "--shm", str(self.slots.fd),
             "--board", str(self.board.fd)],
            pass_fds=(child_fd, self.slots.fd, self.board.fd), stdin=subprocess.DEVNULL)
        os.close(child_fd)
        self.failed: str | None = None
        # the training thread's own view of the board (only it reads the board and hands deltas over)
        self.handed = [0] * DELTA_SLOTS                     # deltas handed over per delta slot
        self.consumed = [0] * d.num_fragments               # newest arrival generation copied out
        self._opened: tuple[int, dict[int, tuple[int, int]]] = (-1, {})   # (generation seq word, rounds)
        self._arrivals_gen = -1                             # the generation seq word at the last take()
        self._arrival_seqs = [-1] * d.num_fragments         # each arrival record's seq word then
        self._opened_seqs = [-1] * d.num_fragments          # each opened record's seq word at its last read
        self.stats: dict = {}
        self.queued: dict[tuple[int, int], tuple[DeltaHeader, dict]] = {}   # waiting for a delta slot
        self.submitted = 0
        self._views: dict[int, tuple[dict, dict[str, np.ndarray], list[int]]] = {}   # _param_views
        self.sender_stopped = threading.Event()
        self.ready = threading.Event()
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._read, name="sync-agent", daemon=True)

    def _config(self) -> bytes:
        s = self.setup
        return pack("config", store=s.store_uri, s3_endpoint=s.s3_endpoint, learner=s.learner, log=s.log,
                    ingest=s.bus.ingest if s.bus else None, announce=s.bus.announce if s.bus else None,
                    sender=dataclasses.asdict(s.sender), poll_s=s.poll_s, cursor=s.cursor,
                    known={str(p): v for p, v in s.known.items()}, heartbeat=s.heartbeat, curve=s.curve,
                    sign_secret=s.sign_secret, delta_slots=DELTA_SLOTS, version_slots=self.version_slots,
                    cpus=list(s.cpus) if s.cpus is not None else None, forward_events=s.forward_events)

    def start(self) -> None:
        self.send_frame(self._config())
        self._thread.start()
        if not self.ready.wait(START_TIMEOUT_S) or self.failed:
            self.close()
            raise RuntimeError(f"the learner's sync agent did not start: {self.failed or 'no answer in time'}")

    def send_frame(self, frame: bytes) -> None:
        with self._send_lock:
            self.conn.send_bytes(frame)

    def send(self, kind: str, **fields) -> None:
        try:
            self.send_frame(pack(kind, **fields))
        except OSError as exc:
            self.failed = self.failed or f"sync agent unreachable: {exc}"

    # -- the reader thread -----------------------------------------------------------------------
    def _read(self) -> None:
        next_beat = 0.0
        beat_s = self.setup.sender.heartbeat_s / 2
        try:
            while True:
                if self.conn.poll(beat_s):
                    self._handle(unpack(self.conn.recv_bytes()))
                    if self.done.is_set():
                        return
                if time.monotonic() >= next_beat:     # the child's Sender sends the newest it was given
                    self.send("beat", heartbeat=self.heartbeat())
                    next_beat = time.monotonic() + beat_s
        except (EOFError, OSError) as exc:
            code = self.proc.poll()
            self.failed = self.failed or f"sync agent exited ({code if code is not None else exc})"
        except Exception as exc:   # noqa: BLE001 - a bad frame: stop loudly
            self.failed = self.failed or f"sync agent channel: {exc.__class__.__name__}: {exc}"
        finally:
            self.done.set()
            self.ready.set()
            self.sender_stopped.set()

    def _handle(self, msg: dict) -> None:
        kind = msg["type"]
        if kind == "stats":
            records = msg.pop("events", None)
            self.stats = msg
            for rec in records or ():       # the child's event records, for this process's listeners (metrics)
                self.events.notify(rec)
        elif kind == "ready":
            self.ready.set()
        elif kind == "sender_stopped":
            self.sender_stopped.set()
        elif kind == "failed":
            self.failed = msg.get("error", "failed")
        elif kind == "bye":
            self.done.set()

    def traffic(self, region: str) -> dict:
        """The child's store (``region``'s) and bus counters as of its last ``stats`` frame, in the
        shape of ``TrafficMeter.extra`` (workers/common/traffic.py). After ``close`` they are the
        child's totals: its last frame comes before ``bye``."""
        t = self.stats.get("traffic") or {}
        return {"stores": {region: t["store"]} if t.get("store") else {}, "bus": t.get("bus")}

    # -- called by the proxies, on the training thread -------------------------------------------
    def _free_slot(self) -> int | None:
        for slot in range(DELTA_SLOTS):
            if self.board.done(slot) == self.handed[slot]:   # the agent copied out all we handed over
                return slot
        return None

    def _hand_over(self, slot: int, header: DeltaHeader) -> None:
        self.handed[slot] += 1
        self.send("delta", header=header.to_dict(), slot=slot)

    def submit(self, header: DeltaHeader, values: dict[str, np.ndarray]) -> None:
        slot = None if self.queued else self._free_slot()
        if slot is None:         # every slot in flight: hold the newest of its lineage (flush_queued); one it
            # replaces never reached the agent, so it is never logged as made: its steps are in the newer one
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
        if self.proc.poll() is None:
            self.send("stop")
            self.done.wait(timeout_s)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.done.set()
        if self._thread.is_alive():
            self._thread.join(1.0)
        self.conn.close()
        self.slots.close()
        self.board.close()


class AgentSender:
    """The Learner's view of the child's Sender (the same methods it calls on ``Sender``)."""

    logs_deltas = True     # the child writes each delta's ``delta`` event when it takes it (sender.delta_made)

    def __init__(self, agent: SyncAgent):
        self.agent = agent
        self.submitted = 0

    def start(self) -> None:
        self.agent.start()

    @property
    def failed(self) -> str | None:
        return self.agent.failed or self.agent.stats.get("failed")

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
        s = self.agent.stats
        behind = self.submitted - s.get("submitted", 0)     # handed over, not yet in the child's Sender
        return behind + s.get("undelivered", 0)

    def drain(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        asked = -1.0
        while time.monotonic() < deadline:
            self.agent.flush_queued()
            if self.undelivered() == 0 and self.agent.stats.get("idle"):
                return True
            if self.failed is not None:
                break
            if time.monotonic() >= asked + REPORT_EVERY_S:   # the child's counters now, not at its next report
                self.agent.send("report")
                asked = time.monotonic()
            time.sleep(0.02)
        return self.undelivered() == 0

    def stop(self) -> None:
        self.agent.send("stop_sender")
        self.agent.sender_stopped.wait(15.0)


class AgentReceiver:
    """The Learner's view of the child's Receiver; ``stop`` ends the child."""

    def __init__(self, agent: SyncAgent):
        self.agent = agent

    def start(self) -> None:
        pass          # the agent started with the sender

    def stop(self) -> None:
        self.agent.close()

    def take(self) -> list[Arrival]:
        return self.agent.take()

    def opened(self) -> dict[int, tuple[int, int]]:
        return self.agent.opened()

    def __getattr__(self, name: str):
        if name in ("bytes_received", "errors", "refused", "failed", "awaited", "copy_misses", "copy_wait_s"):
            return self.__dict__["agent"].stats.get("receiver", {}).get(name, 0 if name != "failed" else None)
        raise AttributeError(name)
