"""Replication of the authoritative log to every other region (issue 14, docs/regions.md
"Replication"): after each commit the syncer tells the ``Replicator`` the new tail; a background
thread copies each commit record and the version it published from the home store to every
non-home region's store, in log order, version before record (storage/regions.py).

Why a cursor per region rather than a queue of copy jobs: a region that is down for an hour
would otherwise pile up an hour of jobs. Each region keeps only ``next`` (the first seq it lacks)
and the syncer only raises one high-water mark, so memory is bounded by the number of regions
whatever the outage, and a region that comes back catches up from the home log (reads in the
home region: no transfer cost), never from memory. A failing region is retried with backoff and
never delays a commit or another region. Advisory objects (the round clock, the head hint) are
latest-wins slots: only the newest is written when a region is reachable again.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Mapping

from pipeline.errors import FormatError
from storage.accounting import CountingStore
from storage.errors import NotFound, StoreError
from storage.layout import HEAD_HINT_KEY, pack_head_hint
from storage.log import CommitLog
from pipeline.types import RunDescriptor
from storage.regions import RegionConflict, open_region, prune_versions, replicate_commit, replicate_static
from storage.store import ObjectStore
from workers.common.aggregate import RunningMean
from workers.common.events import EventLog

__all__ = ["ReplicatorConfig", "Replicator", "region_stores", "replication"]

NOTED_KEEP = 4096   # recent commits whose noting time is kept for the replication delay


@dataclass(frozen=True)
class ReplicatorConfig:
    retry_s: float = 0.5          # first pause after a region failed (doubles while it keeps failing)
    max_retry_s: float = 10.0     # longest pause between attempts on a failing region
    static_every_s: float = 5.0   # how often membership records are copied again (learners join)
    prune_every_s: float = 60.0   # how often a region's old versions follow the home retention
    batch: int = 64               # commits copied to one region before the others get a turn
    drain_s: float = 10.0         # how long a stopping syncer waits for the regions to catch up

    def __post_init__(self) -> None:
        if not (0 < self.retry_s <= self.max_retry_s) or self.static_every_s <= 0 or self.batch < 1:
            raise ValueError(f"need 0 < retry_s <= max_retry_s, static_every_s > 0 and batch >= 1, got {self}")


@dataclass
class _Region:
    name: str
    store: ObjectStore
    next: int | None = None       # first seq this region lacks (None: not read from its log yet)
    retry_at: float = 0.0
    failures: int = 0             # consecutive failed attempts
    static_at: float = -1e18      # when the descriptor and members were last copied
    pruned_at: float = 0.0        # when its old versions were last pruned (the first prune: one period in)
    pruned: int = 0               # version objects deleted to follow home's retention
    delay: RunningMean = field(default_factory=RunningMean)   # commit noted -> record copied, seconds
    copied: int = 0               # commits copied
    bytes: int = 0                # bytes written to this region
    slots: dict[str, bytes] = field(default_factory=dict)   # advisory objects still to write


class Replicator:
    """Copies the home log to ``regions`` (name -> store, home excluded) in one daemon thread.

    ``committed(seq, epoch)`` and ``advisory(key, blob)`` never block and never touch a store;
    ``lag()`` says how many commits each region is behind; ``stop()`` ends the thread."""

    def __init__(self, home: ObjectStore, regions: Mapping[str, ObjectStore], events: EventLog,
                 cfg: ReplicatorConfig = ReplicatorConfig(), clock: Callable[[], float] = time.monotonic):
        self.home, self.events, self.cfg, self.clock = home, events, cfg, clock
        self.regions = [_Region(name, store, pruned_at=clock()) for name, store in regions.items()]
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._latest = -1
        self._epoch = 0
        # When each recent commit was noted, for the replication delay; bounded (commits noted
        # longer ago than NOTED_KEEP commits are not timed: a region that far behind is reported by lag()).
        self._noted: OrderedDict[int, float] = OrderedDict()
        self._thread = threading.Thread(target=self._run, name="replicate", daemon=True)

    # -- the syncer's side (its loop thread) -----------------------------------------------------
    def start(self, tail: int | None = None) -> "Replicator":
        """Start copying (again, after ``stop``); ``tail`` the home log's last seq (None: read it here)."""
        self.committed(CommitLog(self.home).tail() if tail is None else tail, 0)
        if not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="replicate", daemon=True)
            self._thread.start()
        return self

    def committed(self, seq: int, epoch: int) -> None:
        now = self.clock()
        with self._lock:
            for s in range(max(self._latest + 1, seq - NOTED_KEEP + 1), seq + 1):
                self._noted[s] = now
            while len(self._noted) > NOTED_KEEP:
                self._noted.popitem(last=False)
            if seq > self._latest:
                self._latest, self._epoch = seq, max(self._epoch, epoch)
        self._wake.set()

    def advisory(self, key: str, blob: bytes) -> None:
        with self._lock:
            for r in self.regions:
                r.slots[key] = blob
        self._wake.set()

    def lag(self) -> dict[str, int]:
        """Commits each region lacks (the whole log + 1 before its first pass)."""
        with self._lock:
            return {r.name: self._latest + 1 - (r.next or 0) for r in self.regions}

    def stats(self) -> dict[str, dict]:
        """Per region: the next seq it lacks, commits and bytes copied, failures in a row, and (when
        its store is a CountingStore) every request the syncer made to it: ingest and replication."""
        with self._lock:
            out = {r.name: {"next": r.next, "copied": r.copied, "bytes": r.bytes, "failures": r.failures,
                            "pruned": r.pruned, "delay_s_mean": round(r.delay.mean, 4),
                            "delay_s_max": round(r.delay.high, 4) if r.delay else 0.0} for r in self.regions}
        for r in self.regions:
            if isinstance(r.store, CountingStore):
                out[r.name]["requests"] = dataclasses.asdict(r.store.snapshot())
        return out

    def stop(self, drain_s: float = 0.0) -> bool:
        """Stop the thread, after waiting up to ``drain_s`` for every region to catch up; True if
        they all had."""
        deadline = self.clock() + drain_s
        while drain_s > 0 and any(self.lag().values()) and self.clock() < deadline:
            self._wake.set()
            time.sleep(0.02)
        caught_up = not any(self.lag().values())
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        return caught_up

    # -- the thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            busy = False
            for r in self.regions:
                if self._stop.is_set():
                    return
                if self.clock() >= r.retry_at:
                    busy |= self._attempt(r)
            if not busy:
                waits = [r.retry_at - self.clock() for r in self.regions if r.retry_at > self.clock()]
                self._wake.wait(min([0.5, *waits]))

    def _attempt(self, r: _Region) -> bool:
        """One turn for region ``r``; True when it has more to copy right away."""
        try:
            more = self._copy(r)
        except (StoreError, FormatError, RegionConflict) as exc:
            r.failures += 1
            r.retry_at = self.clock() + min(self.cfg.retry_s * 2 ** (r.failures - 1), self.cfg.max_retry_s)
            if r.failures & (r.failures - 1) == 0:   # the 1st, 2nd, 4th ... failure in a row
                self.events.emit("replicate-error", region=r.name, next=r.next, failures=r.failures,
                                 conflict=isinstance(exc, RegionConflict), error=str(exc)[:300])
            return False
        if r.failures:
            self.events.emit("replicate-recovered", region=r.name, after_failures=r.failures, next=r.next)
            r.failures = 0
        return more

    def _copy(self, r: _Region) -> bool:
        now = self.clock()
        if now - r.static_at >= self.cfg.static_every_s:
            r.bytes += replicate_static(self.home, r.store)
            r.static_at = now
        if r.next is None:   # resume where the region's own copy ends (copies are in log order)
            r.next = CommitLog(r.store).tail() + 1
        with self._lock:
            latest, epoch = self._latest, self._epoch
        copied = 0
        while r.next <= latest and copied < self.cfg.batch and not self._stop.is_set():
            try:
                n = replicate_commit(self.home, r.store, r.next)
            except NotFound:
                break          # noted before home's write is visible to this reader: next turn
            with self._lock:
                noted = self._noted.get(r.next)
                if noted is not None:
                    r.delay.append(self.clock() - noted)
                r.next += 1
                r.copied += 1
                r.bytes += n
            copied += 1
        if copied:
            with self._lock:
                r.slots[HEAD_HINT_KEY] = pack_head_hint(r.next - 1, epoch)
        self._flush_slots(r)
        if now - r.pruned_at >= self.cfg.prune_every_s:
            r.pruned += prune_versions(self.home, r.store)
            r.pruned_at = now
        return r.next <= latest and copied > 0

    def _flush_slots(self, r: _Region) -> None:
        with self._lock:
            slots, r.slots = r.slots, {}
        for i, (key, blob) in enumerate(slots.items()):
            try:
                r.store.put(key, blob)
                r.bytes += len(blob)
            except StoreError:
                with self._lock:   # keep what was not written unless a newer value arrived meanwhile
                    for k, b in list(slots.items())[i:]:
                        r.slots.setdefault(k, b)
                raise


def region_stores(home: ObjectStore, desc: RunDescriptor,
                  given: Mapping[str, ObjectStore] | None = None) -> dict[str, ObjectStore]:
    """Every region's store by name, the home region's being ``home`` (the store the syncer was
    given): ``given`` overrides any other (tests wrap them), the rest are opened from the descriptor
    (created if missing: the syncer is who fills a new region). Empty for a single-region run."""
    if desc.regions is None:
        if given:
            raise ValueError(f"run {desc.run_id} has no regions section, but region stores {sorted(given)} were given")
        return {}
    given = dict(given or {})
    if desc.regions.home in given:
        raise ValueError(f"region {desc.regions.home!r} is the home region: its store is the syncer's own "
                         "(pass it as the syncer's store, not in regions=)")
    unknown = sorted(set(given) - {r.name for r in desc.regions.regions})
    if unknown:
        raise ValueError(f"region stores {unknown} were given, but run {desc.run_id}'s regions are "
                         f"{[r.name for r in desc.regions.regions]}")
    out = {}
    for spec in desc.regions.regions:
        if spec.name == desc.regions.home:
            out[spec.name] = home      # the authoritative log is where the syncer commits, always
        else:
            out[spec.name] = given[spec.name] if spec.name in given else open_region(spec, create=True)
    return out


def replication(home: ObjectStore, desc: RunDescriptor, events: EventLog,
                given: Mapping[str, ObjectStore] | None = None) -> tuple[list[ObjectStore], "Replicator | None"]:
    """What the syncer needs for a run's regions: the inboxes it ingests (every region's store,
    home first; just ``home`` in a single-region run) and the replicator to the other regions
    (None: there are none)."""
    stores = region_stores(home, desc, given)
    # Counted: every request the syncer makes to another region crosses regions (docs/regions.md
    # "Request and byte accounting"); Replicator.stats() reports them per region.
    others = {n: CountingStore(s) for n, s in stores.items() if s is not home}
    inboxes = [home, *others.values()]
    return inboxes, (Replicator(home, others, events) if others else None)
