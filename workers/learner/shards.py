"""A learner in a sharded run (docs/protocol.md "Sharded syncer"): one sender and one
receiver per syncer shard, behind the interface the learner already uses.

Shard i of N owns the fragments p with ``p % N == i`` (storage/layout.py ``shard_owner``), so

* fragment p's delta goes to shard ``p % N`` only: over that shard's bus link (its ingest
  endpoint), or spilled to that shard's inbox (``shards/s<i>/spill/...``). Every link sends the
  learner's heartbeats, so each shard measures the learners' pace for its own round clock;
* versions come from every shard: one ``Receiver`` per shard listens to that shard's
  announcements and polls that shard's log, its head hint and its round clock, and hands over
  only the fragments the shard owns.

A sharded learner's ``--ingest``/``--announce`` hold N comma-separated endpoints, in shard order
(``split_bus``). With N = 1 nothing here is used: the learner builds one Sender and one Receiver
on the run's store, as always.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import numpy as np

from pipeline.descriptor import RunDescriptor
from pipeline.types import DeltaHeader
from storage.layout import shard_owner
from storage.shards import owned_fragments, shard_stores
from storage.store import ObjectStore
from workers.bus.bus import BusConfig
from workers.common.versions import VersionTracker

from .io import no_difference
from .receiver import Arrival, Receiver
from .sender import Sender, SenderStats


def split_bus(bus: BusConfig | None, syncers: int) -> list[BusConfig | None]:
    """One bus config per shard from endpoints listed comma-separated in shard order (ValueError
    when the count differs from the run's shard count). Every shard's sockets count their traffic
    in the same counters."""
    if bus is None:
        return [None] * syncers
    ingest, announce = bus.ingest.split(","), bus.announce.split(",")
    if len(ingest) != syncers or len(announce) != syncers:
        raise ValueError(f"the run has {syncers} syncer shards: give {syncers} comma-separated ingest and "
                         f"announce endpoints in shard order (got {len(ingest)} and {len(announce)})")
    return [dataclasses.replace(bus, ingest=i, announce=a) for i, a in zip(ingest, announce)]


class ShardedTracker:
    """The learner's start-up view of every shard's log: the newest version of each fragment from
    its owner's log."""

    def __init__(self, store: ObjectStore, descriptor: RunDescriptor):
        self.descriptor = descriptor
        self.trackers = [VersionTracker(s, descriptor) for s in shard_stores(store, descriptor)]

    def load_all(self) -> tuple[dict[str, np.ndarray], dict[int, int]]:
        values: dict[str, np.ndarray] = {}
        versions: dict[int, int] = {}
        for t in self.trackers:     # a shard's tracker loads the fragments its shard owns
            part, vs = t.load_all()
            values.update(part)
            versions.update(vs)
        return values, versions

    def next_incarnation(self, learner: str) -> int:
        return max(t.next_incarnation(learner) for t in self.trackers)

    @property
    def cursor(self) -> list[int]:
        """Each shard's log cursor, in shard order (what a sync agent resumes from)."""
        return [t.cursor for t in self.trackers]

    @cursor.setter
    def cursor(self, cursors: list[int]) -> None:
        if len(cursors) != len(self.trackers):
            raise ValueError(f"{len(self.trackers)} shard cursors expected, got {len(cursors)}")
        for t, c in zip(self.trackers, cursors):
            t.cursor = c


class ShardedSender:
    """One ``Sender`` per shard; a delta goes to its fragment's owner (a ``DeltaSender``)."""

    logs_deltas = False
    writes_difference = False
    submit_difference = no_difference("ShardedSender")

    def __init__(self, senders: Sequence[Sender]):
        self.senders = list(senders)

    def start(self) -> None:
        for s in self.senders:
            s.start()

    def stop(self) -> None:
        for s in self.senders:
            s.stop()

    def submit(self, header: DeltaHeader, tensors: dict[str, np.ndarray]) -> None:
        self.senders[shard_owner(header.fragment, len(self.senders))].submit(header, tensors)

    def beat_soon(self) -> None:
        for s in self.senders:
            s.beat_soon()

    def held(self) -> tuple[int, int]:
        got = [s.held() for s in self.senders]
        return sum(g[0] for g in got), sum(g[1] for g in got)

    def drain(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        return all([s.drain(max(0.0, deadline - time.monotonic())) for s in self.senders])

    def undelivered(self) -> int:
        return sum(s.undelivered() for s in self.senders)

    def idle(self) -> bool:
        return all(s.idle() for s in self.senders)

    @property
    def failed(self) -> str | None:
        bad = [f"shard {i}: {s.failed}" for i, s in enumerate(self.senders) if s.failed is not None]
        return "; ".join(bad) or None

    @property
    def stats(self) -> SenderStats:
        """The shards' counters added up (peaks and ack waits: the largest; last_error: the last
        shard's that has one)."""
        out = SenderStats()
        for s in self.senders:
            for f in dataclasses.fields(SenderStats):
                a, b = getattr(out, f.name), getattr(s.stats, f.name)
                if f.name == "last_error":
                    setattr(out, f.name, b or a)
                elif f.name.startswith("peak_") or f.name in ("ack_wait_s", "longest_ack_s"):
                    setattr(out, f.name, max(a, b))
                else:
                    setattr(out, f.name, a + b)
        return out


class ShardedReceiver:
    """One ``Receiver`` per shard, each knowing only the fragments its shard owns."""

    def __init__(self, receivers: Sequence[Receiver]):
        self.receivers = list(receivers)

    def start(self) -> None:
        for r in self.receivers:
            r.start()

    def stop(self) -> None:
        for r in self.receivers:
            r.stop()

    def take(self) -> list[Arrival]:
        return sorted((a for r in self.receivers for a in r.take()), key=lambda a: a.fragment)

    def opened(self) -> dict[int, tuple[int, int]]:
        out: dict[int, tuple[int, int]] = {}
        for r in self.receivers:
            out.update(r.opened())     # fragments are disjoint: each comes from its owner only
        return out

    @property
    def failed(self) -> str | None:
        bad = [f"shard {i}: {r.failed}" for i, r in enumerate(self.receivers) if r.failed is not None]
        return "; ".join(bad) or None

    @property
    def errors(self) -> int:
        return sum(r.errors for r in self.receivers)

    @property
    def refused(self) -> int:
        return sum(r.refused for r in self.receivers)

    @property
    def bytes_received(self) -> int:
        return sum(r.bytes_received for r in self.receivers)

    @property
    def awaited(self) -> int:
        return sum(r.awaited for r in self.receivers)

    @property
    def copy_misses(self) -> int:
        return sum(r.copy_misses for r in self.receivers)

    @property
    def copy_wait_s(self) -> float:
        """The mean over every shard's waits (not a mean of the shards' means)."""
        count = sum(r._copy_wait.count for r in self.receivers)
        return sum(r._copy_wait.total for r in self.receivers) / count if count else 0.0


def learner_tracker(store: ObjectStore, descriptor: RunDescriptor) -> VersionTracker | ShardedTracker:
    """What a starting learner loads the global model through: the run's log, or every shard's."""
    return VersionTracker(store, descriptor) if descriptor.syncers == 1 else ShardedTracker(store, descriptor)


def make_sender(store: ObjectStore, descriptor: RunDescriptor, bus: BusConfig | None,
                build: Callable[[ObjectStore, BusConfig | None], Sender]) -> Sender | ShardedSender:
    """``build(store, bus)`` once (unsharded) or once per shard, on that shard's view and bus."""
    if descriptor.syncers == 1:
        return build(store, bus)
    return ShardedSender([build(s, b) for s, b in zip(shard_stores(store, descriptor),
                                                      split_bus(bus, descriptor.syncers))])


def make_receiver(tracker: VersionTracker | ShardedTracker, versions: dict[int, int], bus: BusConfig | None,
                  build: Callable[[VersionTracker, dict[int, int], BusConfig | None], Receiver]) -> Receiver | ShardedReceiver:
    """``build(tracker, known, bus)`` once (unsharded) or once per shard, with only the versions of
    the fragments that shard owns as ``known``."""
    if isinstance(tracker, VersionTracker):
        return build(tracker, versions, bus)
    d = tracker.descriptor
    return ShardedReceiver([
        build(t, {p: versions[p] for p in owned_fragments(t.store, d)}, b)
        for t, b in zip(tracker.trackers, split_bus(bus, d.syncers))])
