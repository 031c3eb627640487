"""The sync agent's process (workers/learner/agent.py starts it): a learner's sender and
receiver, unchanged, in a process of their own, so that their Python (encoding, sealing, the bus,
loading and verifying versions) never holds the training process's GIL.

``python -m workers.learner.agent_main --conn FD --shm FD --board FD`` (fds inherited from the
learner). The first frame on ``--conn`` is ``config`` (workers/learner/agent.py
``SyncAgent._config``); then:

* learner -> agent: ``config`` (first; since wire version 4 with ``drain_s``, how long this
  process drains when orphaned, and ``life``, 0 for the learner's first agent and n for its n-th
  replacement), ``delta`` (header, slot: the values are in the shared slot; the agent copies
  them out, submits them to its Sender and counts the slot as done on the board), ``beat`` (the
  learner's heartbeat fields; ``soon``: send one now), ``report`` (send the counters now: the
  learner is draining), ``stop_sender``, ``stop``;
* agent -> learner: ``ready``, ``stats`` (the sender's and receiver's counters and ``traffic``, this
  process's store and bus counters for the learner's accounting events; when they changed, at most
  every ``STATS_EVERY_S``, and the latest before ``sender_stopped`` and at the end; ``events``: the
  records this process logged since the last frame, when the learner's log has listeners such as its
  metrics, ``config.forward_events``; ``settled``, since wire version 4: the ids of the deltas its
  Sender made durable or dropped with a logged reason since the last frame, so the learner knows
  which ones died with a killed agent, issue 25), ``failed`` (why this process stops early),
  ``sender_stopped``, ``bye``;
* on the board (workers/learner/agent_board.py), read by the training thread at each step's start:
  the open rounds, each fragment's newest version (written into its version slot) and the delta
  slots copied out. No frame for them: a frame wakes the learner's reader thread mid-step.

Events go to the learner's own log (appended line by line, with the learner's role and id), each
delta's ``delta`` event too (written here when the delta is taken from its slot, not by the learner).

Orphaned: when the channel ends without ``stop`` (EOF: the learner died or closed it),
the frames it sent before are all handled first - each delta it handed over is taken from its
slot - and then what this process holds is made durable (acked, or spilled after the Sender's
ack timeout; at once without a bus) within ``drain_s`` before it exits: ``sync-agent-orphaned``
and ``sync-agent-drained`` events. Before, it exited at once and the learner's last deltas died.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections import deque
from functools import partial
from multiprocessing.connection import Connection, wait

from pipeline.types import DeltaHeader
from pipeline.descriptor import RunDescriptor
from storage.layout import read_descriptor
from storage.store import open_store
from workers.bus.bus import BusConfig, BusCounters, CurveKeys, drain_wake
from workers.bus.signing import Signer, seal_delta
from workers.common.cpus import pin
from workers.common.events import EventLog
from workers.common.traffic import counted
from workers.learner.agent_board import Board, BoardArrival
from workers.learner.agent_wire import Slots, pack, unpack
from workers.learner.receiver import Receiver
from workers.learner.sender import Sender, SenderConfig, delta_made
from workers.learner.shards import learner_tracker, make_receiver, make_sender

STATS_EVERY_S = 1.0     # counters go out at most this often: each frame wakes the learner's reader thread
                        # mid-step (0.25 s cost an answer step ~0.1 ms more, docs/scale.md); a draining
                        # learner asks for them (``report``). The loop wakes on a frame, news, or after this
FORWARD_MAX = 10_000    # event records held for the learner's listeners between two stats frames
PENDING_POLL_S = 0.005  # a version waiting for its slot (the learner has not copied out the one before)
# the Sender's events that end its hold on a delta (durable, or dropped with a logged reason)
SETTLED_EVENTS = frozenset({"delta-acked", "delta-spilled", "delta-superseded", "delta-evicted", "delta-rejected",
                            "delta-dropped"})


class Agent:
    def __init__(self, conn: Connection, shm_fd: int, board_fd: int, cfg: dict):
        self.conn, self.cfg = conn, cfg
        # counted: the learner's accounting events add these requests (workers/common/traffic.py)
        self.store = store = counted(open_store(cfg["store"], s3_endpoint=cfg.get("s3_endpoint"), create=False))
        # from the learner (wire v5): starting must not need storage, which may be down right now
        self.d = d = RunDescriptor.from_bytes(cfg["descriptor"], what="the learner's run descriptor") \
            if cfg.get("descriptor") else read_descriptor(store)
        self.slots = Slots(d, cfg["delta_slots"] + cfg["version_slots"], fd=shm_fd)
        if cfg["version_slots"] != 2 * d.num_fragments:
            raise ValueError(f"expected 2 version slots per fragment, got {cfg['version_slots']}")
        self.board = Board(d.num_fragments, cfg["delta_slots"], fd=board_fd)
        learner = os.getppid()       # the learner writes `consumed`; its death is reparenting
        self.board.writer_alive = lambda: os.getppid() == learner
        self.done = [0] * cfg["delta_slots"]       # deltas copied out of each delta slot
        self.gen = [0] * d.num_fragments            # newest arrival generation on the board
        self.events = EventLog(cfg.get("log"), "learner", cfg["learner"], echo=None if cfg.get("log") else sys.stdout)
        curve = CurveKeys(*(k.encode() for k in cfg["curve"])) if cfg.get("curve") else None
        seal = None
        if cfg.get("sign_secret"):
            seal = partial(_seal, learner=cfg["learner"], signer=Signer(bytes.fromhex(cfg["sign_secret"])),
                           run_id=d.run_id)
        bus = BusConfig(cfg["ingest"], cfg["announce"], counters=BusCounters()) if cfg.get("ingest") else None
        self.bus_counters = bus.counters if bus is not None else None
        self.beat = dict(cfg["heartbeat"])
        sender_cfg = SenderConfig(**cfg["sender"])
        # one Sender and one Receiver, or one of each per syncer shard (workers/learner/shards.py), as
        # the learner itself would build them
        self.sender = make_sender(store, d, bus, lambda st, b: Sender(
            st, d.codec, sender_cfg, self.events, b, cfg["learner"].encode(), lambda: self.beat, curve=curve,
            seal=seal))
        tracker = learner_tracker(store, d)
        tracker.cursor = cfg["cursor"]        # one log cursor, or a list of them: one per shard
        known = {int(p): v for p, v in cfg["known"].items()}
        # the receivers wake this loop through a pipe when a version or a round opening is new
        self._news_r, self._news_w = os.pipe()
        os.set_blocking(self._news_r, False)
        os.set_blocking(self._news_w, False)
        self.receiver = make_receiver(tracker, known, bus, lambda t, kn, b: Receiver(
            t, kn, self.events, b, cfg["poll_s"], curve=curve, on_news=self._news))
        self.submitted = 0
        self.pending = {}          # fragment -> Arrival waiting for its version slot (newest wins)
        self.sent_opened: dict | None = None
        self.sent_stats: dict | None = None
        self.stats_at = 0.0
        self.sender_stopped = False
        self.orphaned = False      # the learner's end of the channel is gone
        self.drain_s = float(cfg.get("drain_s", 30.0))
        # Deltas settled (issue 25: so the learner knows which ones a killed agent still held):
        # appended on the sender's thread, written to the board's ring at once by this loop, and
        # named in the next stats frame
        self.settled: deque[str] = deque()
        self.unreported: list[str] = []
        self.events.subscribe(self._note_settled)
        # With listeners on the learner's side (its metrics), every record this process logs goes to
        # them too, in the next ``stats`` frame (bounded: the oldest are dropped first).
        self.forwarded: deque[dict] = deque(maxlen=FORWARD_MAX)
        if cfg.get("forward_events"):
            self.events.subscribe(lambda rec: self.forwarded.append(json.loads(json.dumps(rec, default=str))))

    def _news(self) -> None:
        try:
            os.write(self._news_w, b"n")
        except (BlockingIOError, OSError):
            pass      # the pipe is full: the loop is awake already

    def _note_settled(self, rec: dict) -> None:
        if rec.get("event") in SETTLED_EVENTS and isinstance(rec.get("delta"), str):
            self.settled.append(rec["delta"])
            self._news()

    def _record_settled(self) -> None:
        """Onto the board's settled ring (what the learner reads if this process dies), then into
        the next stats frame."""
        for _ in range(len(self.settled)):
            did = self.settled.popleft()
            seq = did.rsplit("/", 1)[-1]
            if seq.isdigit():
                self.board.add_settled(int(seq))
            self.unreported.append(did)

    def send(self, kind: str, **fields) -> None:
        if self.orphaned:
            return
        try:
            self.conn.send_bytes(pack(kind, **fields))
        except OSError:
            self.orphaned = True       # the learner is gone: run() drains and exits

    def run(self) -> int:
        """Serve the learner until ``stop`` (0) or until it is gone (``orphan``'s status)."""
        self.sender.start()
        self.receiver.start()
        self.send("ready")
        try:
            while not self.orphaned:
                ready = wait([self.conn, self._news_r], PENDING_POLL_S if self.pending else STATS_EVERY_S)
                if self._news_r in ready:
                    drain_wake(self._news_r)
                while self.conn.poll():
                    if not self.handle(unpack(self.conn.recv_bytes())):
                        return 0
                for a in self.receiver.take():
                    self.pending[a.fragment] = a
                self.publish()
                self.report()
        except (EOFError, OSError):
            self.orphaned = True
        return self.orphan()

    def orphan(self) -> int:
        """The learner is gone: every frame it sent was handled, so every delta it
        handed over is in the Sender; make them durable within ``drain_s``, then stop. 0 if all are."""
        self.orphaned = True
        self.events.emit("sync-agent-orphaned", held=self.sender.undelivered(), drain_s=self.drain_s)
        drained = self.sender.drain(self.drain_s) if not self.sender_stopped else self.sender.undelivered() == 0
        if not self.sender_stopped:
            self.sender.stop()
        self.receiver.stop()
        s = self.sender.stats
        self.events.emit("sync-agent-drained", drained=drained, undelivered=self.sender.undelivered(),
                         acked=s.acked, spilled=s.spilled)
        return 0 if drained else 1

    def publish(self) -> None:
        """Write each pending version into its slot and onto the board, once the learner has copied
        out the generation that slot held before (agent_board.py)."""
        for p in list(self.pending):
            g = self.gen[p] + 1
            if self.board.consumed(p) < g - 2:
                continue                    # the learner is between steps: next wake-up
            a = self.pending.pop(p)
            slot = self.board.version_slot(p, g)
            self.slots.write(slot, p, a.values)
            self.board.write_arrival(p, BoardArrival(g, slot, a.version, a.seq, a.epoch, a.round, a.committed_at,
                                                     a.found_by))
            self.gen[p] = g

    def report(self, final: bool = False) -> None:
        self._record_settled()
        opened = self.receiver.opened()
        if opened != self.sent_opened:
            self.board.write_opened(opened, before=self.sent_opened)   # only the records that changed
            self.sent_opened = opened
        now = time.monotonic()
        if not final and now < self.stats_at + STATS_EVERY_S:
            return
        stats = self.stats()
        records = [self.forwarded.popleft() for _ in range(len(self.forwarded))]
        settled, self.unreported = self.unreported, []
        if stats != self.sent_stats or records or settled:
            self.sent_stats = stats
            self.send("stats", **stats, **({"events": records} if records else {}),
                      **({"settled": settled} if settled else {}))
        self.stats_at = now

    def stats(self) -> dict:
        r = self.receiver      # one, or one per syncer shard behind the same counters (workers/learner/shards.py)
        return {"sender": dataclasses.asdict(self.sender.stats), "undelivered": self.sender.undelivered(),
                "idle": self.sender.idle(), "submitted": self.submitted, "failed": self.sender.failed,
                "receiver": {"bytes_received": r.bytes_received, "errors": r.errors, "refused": r.refused,
                             "failed": r.failed, "awaited": r.awaited, "copy_misses": r.copy_misses,
                             "copy_wait_s": r.copy_wait_s},
                # after the sender's stats: a spill in flight counts at the store first (Learner.close)
                "traffic": {"store": self.store.snapshot().as_dict(),
                            "bus": self.bus_counters.snapshot() if self.bus_counters is not None else None}}

    def handle(self, msg: dict) -> bool:
        """One message from the learner; False: stop."""
        kind = msg["type"]
        if kind == "delta":
            header = DeltaHeader.from_dict(msg["header"])
            slot = msg["slot"]
            values = self.slots.read(slot, header.fragment)
            self.done[slot] += 1
            self.board.set_done(slot, self.done[slot])     # the learner may write the slot again
            delta_made(self.events, header)                # the learner's ``delta`` event, off its training thread
            self.sender.submit(header, values)
            self.submitted += 1
        elif kind == "beat":
            self.beat = msg["heartbeat"]
            if msg.get("soon"):
                self.sender.beat_soon()
        elif kind == "report":
            self.report(final=True)                        # the latest counters, whatever the cadence
        elif kind == "stop_sender":
            self.sender.stop()
            self.sender_stopped = True
            self.report(final=True)
            self.send("sender_stopped")
        elif kind == "stop":
            if not self.sender_stopped:
                self.sender.stop()
            self.receiver.stop()
            self.report(final=True)
            return False
        return True


def _seal(blob: bytes, learner: str, signer: Signer, run_id: str) -> bytes:
    return seal_delta(blob, learner, signer, run_id)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m workers.learner.agent_main")
    p.add_argument("--conn", type=int, required=True)
    p.add_argument("--shm", type=int, required=True)
    p.add_argument("--board", type=int, required=True)
    args = p.parse_args(argv)
    conn = Connection(args.conn)
    agent = None
    try:
        msg = unpack(conn.recv_bytes())
        if msg["type"] != "config":
            raise ValueError(f"expected a config frame first, got {msg['type']!r}")
        if msg.get("cpus"):   # LearnerConfig.agent_cpus, before the sender's and receiver's threads start
            try:
                pin(msg["cpus"])
            except OSError as exc:
                raise ValueError(f"agent_cpus {msg['cpus']}: cannot run there ({exc})") from None
        agent = Agent(conn, args.shm, args.board, msg)
        code = agent.run()
    except EOFError:
        return 1          # the learner is gone before the config: nothing to report to, nothing held
    except Exception as exc:   # noqa: BLE001 - reported to the learner, which stops loudly
        try:
            conn.send_bytes(pack("failed", error=f"{exc.__class__.__name__}: {exc}"))
        except OSError:
            pass
        raise
    finally:
        if agent is not None:
            agent.events.close()
    if not agent.orphaned:
        try:
            conn.send_bytes(pack("bye"))
        except OSError:
            pass
    time.sleep(0)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
