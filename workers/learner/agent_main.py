"""The sync agent's process (issue 15; workers/learner/agent.py starts it): a learner's sender and
receiver, unchanged, in a process of their own, so that their Python (encoding, sealing, the bus,
loading and verifying versions) never holds the training process's GIL.

``python -m workers.learner.agent_main --conn FD --shm FD`` (both fds inherited from the learner).
The first frame on ``--conn`` is ``config`` (workers/learner/agent.py ``SyncAgent._config``); then:

* learner -> agent: ``delta`` (header, slot: the values are in the shared slot; the agent copies
  them out and submits them to its Sender; the slot goes back in the ``freed`` field of the next
  frame it sends, or in a ``dfree`` frame within ``STATS_EVERY_S``: a frame of its own at once would
  wake the learner's reader thread in the middle of the answer step), ``vfree`` (version slots handed
  back), ``beat`` (the learner's heartbeat fields; ``soon``: send one now), ``stop_sender``,
  ``stop``;
* agent -> learner (any frame may carry ``freed``: delta slots handed back): ``ready``, ``dfree``,
  ``arrival`` (a version in a slot, with the Arrival's fields), ``opened`` (the open rounds), ``stats`` (the sender's and receiver's counters, whenever
  they change), ``failed`` (why this process stops early), ``bye``.

Events go to the learner's own log (appended line by line, with the learner's role and id).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from functools import partial
from multiprocessing.connection import Connection, wait

from pipeline.types import DeltaHeader
from storage.layout import read_descriptor
from storage.store import open_store
from workers.bus.bus import BusConfig, BusCounters, CurveKeys, drain_wake
from workers.bus.signing import Signer, seal_delta
from workers.common.events import EventLog
from workers.common.versions import VersionTracker
from workers.learner.agent_wire import Slots, pack, unpack
from workers.learner.receiver import Receiver
from workers.learner.sender import Sender, SenderConfig

STATS_EVERY_S = 0.25    # counters go out at most this often (each frame costs the learner's reader thread
                        # the GIL); the loop wakes on a frame, on the receiver's news, or after this


class Agent:
    def __init__(self, conn: Connection, shm_fd: int, cfg: dict):
        self.conn, self.cfg = conn, cfg
        store = open_store(cfg["store"], s3_endpoint=cfg.get("s3_endpoint"), create=False)
        self.d = d = read_descriptor(store)
        self.slots = Slots(d, cfg["delta_slots"] + cfg["version_slots"], fd=shm_fd)
        self.free_v = list(range(cfg["delta_slots"], cfg["delta_slots"] + cfg["version_slots"]))
        self.events = EventLog(cfg.get("log"), "learner", cfg["learner"], echo=None if cfg.get("log") else sys.stdout)
        curve = CurveKeys(*(k.encode() for k in cfg["curve"])) if cfg.get("curve") else None
        seal = None
        if cfg.get("sign_secret"):
            seal = partial(_seal, learner=cfg["learner"], signer=Signer(bytes.fromhex(cfg["sign_secret"])),
                           run_id=d.run_id)
        bus = BusConfig(cfg["ingest"], cfg["announce"], counters=BusCounters()) if cfg.get("ingest") else None
        self.beat = dict(cfg["heartbeat"])
        self.sender = Sender(store, d.codec, SenderConfig(**cfg["sender"]), self.events, bus,
                             cfg["learner"].encode(), lambda: self.beat, curve=curve, seal=seal)
        tracker = VersionTracker(store, d)
        tracker.cursor = cfg["cursor"]
        known = {int(p): v for p, v in cfg["known"].items()}
        # the receiver wakes this loop through a pipe when a version or a round opening is new
        self._news_r, self._news_w = os.pipe()
        os.set_blocking(self._news_r, False)
        os.set_blocking(self._news_w, False)
        self.receiver = Receiver(tracker, known, self.events, bus, cfg["poll_s"], curve=curve, on_news=self._news)
        self.submitted = 0
        self.freed: list[int] = []   # delta slots copied out, not yet handed back
        self.pending = {}          # fragment -> Arrival waiting for a free version slot (newest wins)
        self.sent_opened: dict | None = None
        self.sent_stats: dict | None = None
        self.stats_at = 0.0
        self.sender_stopped = False

    def _news(self) -> None:
        try:
            os.write(self._news_w, b"n")
        except (BlockingIOError, OSError):
            pass      # the pipe is full: the loop is awake already

    def send(self, kind: str, **fields) -> None:
        if self.freed:
            fields["freed"], self.freed = self.freed, []
        self.conn.send_bytes(pack(kind, **fields))

    def run(self) -> None:
        self.sender.start()
        self.receiver.start()
        self.send("ready")
        while True:
            ready = wait([self.conn, self._news_r], STATS_EVERY_S)
            if self._news_r in ready:
                drain_wake(self._news_r)
            while self.conn.poll():
                if not self.handle(unpack(self.conn.recv_bytes())):
                    return
            for a in self.receiver.take():
                self.pending[a.fragment] = a
            while self.pending and self.free_v:
                a = self.pending.pop(next(iter(self.pending)))
                slot = self.free_v.pop()
                self.slots.write(slot, a.fragment, a.values)
                self.send("arrival", slot=slot, fragment=a.fragment, version=a.version, seq=a.seq,
                          found_by=a.found_by, committed_at=a.committed_at, epoch=a.epoch, round=a.round)
            self.report()

    def report(self, final: bool = False) -> None:
        opened = {str(p): list(v) for p, v in self.receiver.opened().items()}
        if opened != self.sent_opened:
            self.sent_opened = opened
            self.send("opened", rounds=opened)
        now = time.monotonic()
        if not final and now < self.stats_at + STATS_EVERY_S:
            return
        stats = self.stats()
        if stats != self.sent_stats:
            self.sent_stats = stats
            self.send("stats", **stats)
        elif self.freed:
            self.send("dfree")
        self.stats_at = now

    def stats(self) -> dict:
        r = self.receiver
        return {"sender": dataclasses.asdict(self.sender.stats), "undelivered": self.sender.undelivered(),
                "idle": self.sender._idle.is_set(), "submitted": self.submitted, "failed": self.sender.failed,
                "receiver": {"bytes_received": r.bytes_received, "errors": r.errors, "refused": r.refused,
                             "failed": r.failed, "awaited": r.awaited, "copy_misses": r.copy_misses,
                             "copy_wait_s": r.copy_wait_s}}

    def handle(self, msg: dict) -> bool:
        """One message from the learner; False: stop."""
        kind = msg["type"]
        if kind == "delta":
            header = DeltaHeader.from_dict(msg["header"])
            values = self.slots.read(msg["slot"], header.fragment)
            self.freed.append(msg["slot"])
            self.sender.submit(header, values)
            self.submitted += 1
        elif kind == "vfree":
            self.free_v.extend(msg["slots"])
        elif kind == "beat":
            self.beat = msg["heartbeat"]
            if msg.get("soon"):
                self.sender.beat_soon()
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
    args = p.parse_args(argv)
    conn = Connection(args.conn)
    agent = None
    try:
        msg = unpack(conn.recv_bytes())
        if msg["type"] != "config":
            raise ValueError(f"expected a config frame first, got {msg['type']!r}")
        agent = Agent(conn, args.shm, msg)
        agent.run()
    except EOFError:
        return 1          # the learner is gone: nothing to report to
    except Exception as exc:   # noqa: BLE001 - reported to the learner, which stops loudly
        try:
            conn.send_bytes(pack("failed", error=f"{exc.__class__.__name__}: {exc}"))
        except OSError:
            pass
        raise
    finally:
        if agent is not None:
            agent.events.close()
    try:
        conn.send_bytes(pack("bye"))
    except OSError:
        pass
    time.sleep(0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
