"""A learner's sync agent, its child process and its replacement (workers/learner/agent.py).

``_Child`` is one agent process (workers/learner/agent_main.py) and what it shares with the
learner: its socket, its slots (workers/learner/agent_wire.py) and its board
(workers/learner/agent_board.py). ``ChildRecovery`` holds the methods of ``SyncAgent`` that replace
a dead child and recover what died with it; ``_add_counters`` adds up the counters of the dead
children and the live one.

Faults: the learner outlives its agent. When the child dies (SIGKILL, OOM), the reader
thread starts a new one on fresh shared memory, resuming from the versions the learner holds, and
the training thread moves to it at its next call (``swap_if_replaced``): deltas handed over that
the dead child never copied out are handed to the new one from the old slots; deltas it took but
never settled (its ``stats`` frames name the settled ones since wire version 4, and its board's
settled ring up to its death since board version 2) died with it: the learner answers again for
their fragment when its parameters still hold their steps (same fragment and base: the old one is
``delta-superseded``, as a threaded Sender logs it), else they are ``delta-evicted`` (lost work).
Only ``RESPAWN_LIMIT`` children in a row that die without making a delta durable are replaced;
then, as for a child that reports its own failure, the learner stops loudly. A delta held back
while every slot was in flight and replaced by a newer one of its lineage is logged as made and
superseded too (it used to be counted as never durable: exit 4 on a clean close).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

from pipeline.errors import FormatError
from pipeline.descriptor import RunDescriptor
from pipeline.types import DeltaHeader
from storage.layout import shard_owner
from workers.learner.agent_board import Board
from workers.learner.agent_wire import Slots, unpack

DELTA_SLOTS = 4
START_TIMEOUT_S = 60.0
RESPAWN_LIMIT = 3         # children in a row that die without making a delta durable: replaced; one more is not
RESPAWN_HEALTHY_S = 60.0  # a child that ran this long was healthy, whatever it settled (an idle learner's)
LOST_REASON = "sync agent died"


class _Child:
    """One agent process and what it shares with the learner: its socket, slots and board. A
    replacement gets fresh ones: the dead child may have died writing any of them."""

    def __init__(self, d: RunDescriptor, version_slots: int, life: int):
        self.life = life
        self.slots = Slots(d, DELTA_SLOTS + version_slots)
        self.board = Board(d.num_fragments, DELTA_SLOTS)
        ours, theirs = socket.socketpair()
        self.conn = Connection(ours.detach())
        child_fd = theirs.detach()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "workers.learner.agent_main", "--conn", str(child_fd), "--shm",
                 str(self.slots.fd), "--board", str(self.board.fd)],
                pass_fds=(child_fd, self.slots.fd, self.board.fd), stdin=subprocess.DEVNULL)
        finally:
            os.close(child_fd)
        self.board.writer_alive = self.alive     # a record its death tore is not waited for
        self._send_lock = threading.Lock()
        self.ready, self.done, self.sender_stopped = threading.Event(), threading.Event(), threading.Event()
        self.ready_at: float | None = None   # when its ``ready`` came
        self.failed: str | None = None       # its own ``failed`` frame: it stopped itself (never replaced)
        self.said_bye = False
        self.stats: dict = {}
        self.settled = 0                      # deltas it reported durable or dropped: its progress
        self.closed = False

    def send(self, frame: bytes) -> bool:
        """False when the child is gone (the reader thread sees its EOF and replaces it)."""
        with self._send_lock:
            try:
                self.conn.send_bytes(frame)
                return True
            except OSError:
                return False

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ended(self) -> None:
        """Its channel ended: nobody waits for it any more."""
        for e in (self.done, self.ready, self.sender_stopped):
            e.set()

    def close(self, timeout_s: float) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.conn.close()
        self.slots.close()
        self.board.close()


class ChildRecovery:
    """``SyncAgent``'s methods that replace a dead child (on the reader thread) and move the
    training thread to its replacement. They use the agent's state: ``d``, ``setup``, ``events``,
    ``version_slots``, ``_lock``, ``_children``, ``child``, ``_live``, ``_next``, ``failed``,
    ``reanswer``, ``inflight``, ``held``, ``retired``, ``own``, ``respawns``, ``_deaths``,
    ``queued``, ``handed``, ``slot_header``, and its ``_config``, ``_handle``, ``_hand_over`` and
    ``_reset_view``."""

    # -- the reader thread: a dead child's replacement -------------------------------------------
    def _replaceable(self, child: _Child) -> bool:
        """A child that died after it started is replaced; one that stopped itself (``failed``),
        never started or said ``bye`` is not: ``failed`` then says why the learner stops."""
        if child.failed is None and child.ready_at is not None and not child.said_bye:
            return True
        if not child.said_bye:
            code = child.proc.poll()
            self.failed = self.failed or child.failed or f"sync agent exited ({code if code is not None else 'EOF'})"
        return False

    def _respawn(self, dead: _Child) -> _Child | None:
        """A new child in place of ``dead``, once it is ready; None when none may or
        could be started (``failed`` says why)."""
        code = _exit_code(dead.proc)
        healthy = dead.settled > 0 or time.monotonic() - dead.ready_at >= RESPAWN_HEALTHY_S
        self._deaths = 1 if healthy else self._deaths + 1
        if self._deaths > RESPAWN_LIMIT:
            self.failed = (f"sync agent exited ({code}), {self._deaths} times in a row without making a delta "
                           "durable: not started again")
            return None
        self.respawns += 1
        self.events.emit("sync-agent-lost", pid=dead.proc.pid, exit_code=code, life=dead.life, respawn=self.respawns)
        began = time.monotonic()
        try:
            child = _Child(self.d, self.version_slots, self.respawns)
        except OSError as exc:
            self.failed = f"sync agent exited ({code}); a new one could not be started: {exc}"
            return None
        with self._lock:
            self._children.append(child)
        child.send(self._config(*self._resume_point(), child.life))
        if not self._await_ready(child):
            self.failed = (f"sync agent exited ({code}); its replacement did not start: "
                           f"{child.failed or 'no answer in time'}")
            child.proc.kill()
            return None
        with self._lock:
            self.retired = _add_counters(self.retired, dead.stats)
            self._live = self._next = child
        self.events.emit("sync-agent-respawned", pid=child.proc.pid, life=child.life,
                         start_s=round(time.monotonic() - began, 3))
        return child

    def _await_ready(self, child: _Child) -> bool:
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while child.ready_at is None and child.failed is None:
                left = deadline - time.monotonic()
                if left <= 0 or not child.conn.poll(left):
                    return False
                self._handle(child, unpack(child.conn.recv_bytes()))
        except (EOFError, OSError):
            return False
        return child.failed is None

    def _resume_point(self) -> tuple[int | list[int], dict[int, int]]:
        """(log cursor, known versions) for a replacement: the versions the learner took, and per
        log the oldest of their commits (a fragment not updated since the start: the start
        cursor), so that the new child finds every newer version again."""
        start = self.setup.cursor
        starts = list(start) if isinstance(start, list) else [start]
        cursor: list[int | None] = [None] * len(starts)
        held = dict(self.held)
        for p, (_, seq) in held.items():
            s = shard_owner(p, len(starts))
            at = starts[s] if seq is None else seq
            cursor[s] = at if cursor[s] is None else min(cursor[s], at)
        out = [c if c is not None else s for c, s in zip(cursor, starts)]
        return (out if isinstance(start, list) else out[0]), {p: v for p, (v, _) in held.items()}

    # -- the training thread: moving to the replacement ------------------------------------------
    def swap_if_replaced(self) -> None:
        """Move to the child the reader thread started in place of a dead one: hand it
        the deltas the dead one never copied out (still in the old slots), forget the ones its
        board says it settled (its last reports may be missing) and recover the rest (``_recover``).
        Reading the dead board's settled ring costs ~2 ms, once per fault."""
        if self._next is None:
            return
        with self._lock:
            new, self._next = self._next, None
            old, self.child = self.child, new
            inflight = dict(self.inflight)
        again = [(slot, h) for slot, h in enumerate(self.slot_header)
                 if h is not None and not self._copied_out(old, slot)]
        self._reset_view()
        for slot, h in again:
            new.slots.write(slot, h.fragment, old.slots.views(slot, h.fragment))
            self._hand_over(slot, h)
        resent = {h.id for _, h in again}
        settled = old.board.settled()       # reported or not: its frames lag, its board does not
        with self._lock:
            for did in [did for did, h in inflight.items() if h.seq in settled and did not in resent]:
                self.inflight.pop(did, None)
        self._recover([h for did, h in inflight.items() if did not in resent and h.seq not in settled],
                      {(h.fragment, h.base_version) for _, h in again})
        with self._lock:
            gone = [c for c in self._children if c is not self.child and c is not self._live and not c.alive()]
            self._children = [c for c in self._children if c not in gone]
        for c in gone:
            c.close(1.0)

    def _copied_out(self, old: _Child, slot: int) -> bool:
        try:
            return old.board.done(slot) >= self.handed[slot]
        except FormatError:        # torn by the kill: the child died before it took that delta
            return False

    def _recover(self, lost: list[DeltaHeader], alive: set[tuple[int, int]]) -> None:
        """Deltas the dead child took and never settled (not on its board's settled ring) died
        with it. A newer delta of the same lineage (fragment, base) carries their steps, as in
        ``Sender.submit``: one still to be sent, or the learner's answer again now; then they are
        superseded, else lost work (evicted)."""
        alive = alive | set(self.queued)
        for h in sorted(lost, key=lambda h: h.seq, reverse=True):     # the newest of a lineage first
            with self._lock:
                self.inflight.pop(h.id, None)
            lineage = (h.fragment, h.base_version)
            if lineage not in alive and self.reanswer is not None and self.reanswer(h):
                alive.add(lineage)
            self._forget(h, "delta-superseded" if lineage in alive else "delta-evicted", reason=LOST_REASON)

    def _forget(self, h: DeltaHeader, event: str, **why) -> None:
        """A delta no child will make durable, logged and counted as ``Sender._forget`` does."""
        key = "superseded" if event == "delta-superseded" else "evicted"
        self.own[key] += 1
        self.own[key + "_tokens"] += h.c_tokens
        self.events.emit(event, delta=h.id, fragment=h.fragment, base=h.base_version, tokens=h.c_tokens, **why)


def _exit_code(proc: subprocess.Popen) -> int:
    """The exit status of a child whose channel ended (it closed its end: it exits)."""
    try:
        return proc.wait(5.0)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


_LATEST = frozenset({"copy_wait_s", "failed", "last_error"})   # not counts: the later child's (if it has one)


def _add(a: dict, b: dict) -> dict:
    """Two children's counters as one: counts add up, peaks take the larger, the rest is ``b``'s."""
    out = dict(a)
    for k, v in b.items():
        old = out.get(k)
        if k in _LATEST or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (old, v)):
            out[k] = v if v or old is None or k == "failed" else old
        else:
            out[k] = max(old, v) if k.startswith("peak_") else old + v
    return out


def _add_counters(a: dict, b: dict) -> dict:
    """The ``sender``, ``receiver`` and ``traffic`` parts of two ``stats`` frames, added up."""
    ta, tb = a.get("traffic") or {}, b.get("traffic") or {}
    return {"sender": _add(a.get("sender") or {}, b.get("sender") or {}),
            "receiver": _add(a.get("receiver") or {}, b.get("receiver") or {}),
            "traffic": {"store": _add(ta.get("store") or {}, tb.get("store") or {}) or None,
                        "bus": _add(ta.get("bus") or {}, tb.get("bus") or {}) or None}}

