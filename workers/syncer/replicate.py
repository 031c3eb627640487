"""Replication of the authoritative log to every other region (issue 14, docs/regions.md
"Replication"): after each commit the syncer tells the ``Replicator`` the new tail (and hands it
the bytes it just wrote); one thread per region copies each commit record and the version it
published from the home store to that region's store, version before record (storage/regions.py).

Why a cursor per region rather than a queue of copy jobs: a region that is down for an hour
would otherwise pile up an hour of jobs. Each region keeps only ``next`` (the first seq it lacks)
and the syncer only raises one high-water mark, so memory is bounded by the number of regions
(plus a byte-bounded cache of the newest commits' bytes) whatever the outage, and a region that
comes back catches up from the home log (reads in the home region: no transfer cost).

Why pipelined: over a long link each create-if-absent PUT costs at least a round trip, and a
serial copy (version, then record, then the next commit) falls behind as soon as the run commits
faster than ~1 / (2 rtt). So the versions of up to ``batch`` commits are copied in parallel on the
region's own pool (``inflight`` at a time) and the records follow in log order, each only after
its own version is there, and the cursor advances only over records written: the region's log
never has a gap and never names a version it lacks (SPEC §7: data before the commit that names
it). Each region has its own thread and pool, so a region that hangs (a partition that holds
connections) or fails never delays a commit or another region. Advisory objects (the round
clock, the head hint) are latest-wins slots, written by one job at a time, off the records' path.

Why the tail is compared before resuming: a syncer started on a region's copy wrote its
own commits there (a fork). Resuming from that tail spliced home's later commits onto the fork,
silently. A region's cursor now starts only after its tail record is home's bytes
(``storage.regions.agreed_tail``); otherwise the region is in ``RegionConflict``: reported at every
backoff, never overwritten. The first pass over a region also writes its region marker and copies
home's failover records (docs/regions.md "Failover").
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Mapping

from pipeline.errors import FormatError
from pipeline.descriptor import RunDescriptor
from pipeline.types import CommitRecord
from storage.accounting import CountingStore
from storage.errors import NotFound, StoreError
from storage.layout import DESCRIPTOR_KEY, HEAD_HINT_KEY, commit_key, pack_head_hint, published_keys
from storage.log import CommitLog
from storage.regions import (PUBLISHING, RegionConflict, agreed_tail, copy_same, mark_region, open_region,
                             prune_versions, replicate_failovers, replicate_static, store_region)
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
    batch: int = 64               # commits one pass over a region takes on (versions queued at once)
    inflight: int = 4             # version copies in flight to one region (its pool's threads)
    cache_bytes: int = 256 << 20  # bytes of the newest commits kept for copying (beyond: read from home)
    drain_s: float = 10.0         # how long a stopping syncer waits for the regions to catch up

    def __post_init__(self) -> None:
        if not (0 < self.retry_s <= self.max_retry_s) or self.static_every_s <= 0 or self.batch < 1:
            raise ValueError(f"need 0 < retry_s <= max_retry_s, static_every_s > 0 and batch >= 1, got {self}")
        if not 1 <= self.inflight <= 64 or self.cache_bytes < 0:
            raise ValueError(f"need 1 <= inflight <= 64 and cache_bytes >= 0, got {self}")


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
    home_reads: int = 0           # commit records and versions read back from home (not in the cache)
    visited: bool = False         # its marker written and home's failover records copied (first pass)
    conflict: str | None = None   # the RegionConflict that stops this region, while it lasts
    slots: dict[str, bytes] = field(default_factory=dict)   # advisory objects still to write
    flushing: Future | None = None                          # the slot-writing job in flight
    wake: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    pool: ThreadPoolExecutor | None = None


class Replicator:
    """Copies the home log to ``regions`` (name -> store, home excluded), one daemon thread and
    one pool per region.

    ``committed(seq, epoch, blobs)`` and ``advisory(key, blob)`` never block and never touch a
    store; ``lag()`` says how many commits each region is behind; ``stop()`` ends the threads."""

    def __init__(self, home: ObjectStore, regions: Mapping[str, ObjectStore], events: EventLog,
                 cfg: ReplicatorConfig = ReplicatorConfig(), clock: Callable[[], float] = time.monotonic,
                 home_name: str | None = None):
        self.home, self.events, self.cfg, self.clock = home, events, cfg, clock
        self.home_name = home_name   # the region the syncer commits in (None: not named, e.g. in tests)
        self.regions = [_Region(name, store, pruned_at=clock()) for name, store in regions.items()]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._latest = -1
        self._epoch = 0
        # When each recent commit was noted, for the replication delay; bounded (commits noted
        # longer ago than NOTED_KEEP commits are not timed: a region that far behind is reported by lag()).
        self._noted: OrderedDict[int, float] = OrderedDict()
        # seq -> {key: bytes} the syncer just wrote (its record and version): copied without a read
        # back from home; bounded by cfg.cache_bytes, dropped once every region has the commit.
        self._cache: OrderedDict[int, dict[str, bytes]] = OrderedDict()
        self._cached = 0

    # -- the syncer's side (its loop thread) -----------------------------------------------------
    def start(self, tail: int | None = None) -> "Replicator":
        """Start copying (again, after ``stop``); ``tail`` the home log's last seq (None: read it here)."""
        self.committed(CommitLog(self.home).tail() if tail is None else tail, 0)
        self._stop.clear()
        for r in self.regions:
            if r.thread is None or not r.thread.is_alive():
                r.pool = ThreadPoolExecutor(self.cfg.inflight + 1, thread_name_prefix=f"replicate-{r.name}")
                r.thread = threading.Thread(target=self._run, args=(r,), name=f"replicate-{r.name}", daemon=True)
                r.thread.start()
        return self

    def committed(self, seq: int, epoch: int, blobs: Mapping[str, bytes] | None = None) -> None:
        """Commit ``seq`` is in the home log; ``blobs``: the bytes the syncer wrote for it (its
        record and version, by key), so the copy needs no read back from home."""
        now = self.clock()
        with self._lock:
            for s in range(max(self._latest + 1, seq - NOTED_KEEP + 1), seq + 1):
                self._noted[s] = now
            while len(self._noted) > NOTED_KEEP:
                self._noted.popitem(last=False)
            if seq > self._latest:
                self._latest, self._epoch = seq, max(self._epoch, epoch)
            if blobs:
                self._cache[seq] = dict(blobs)
                self._cached += sum(len(b) for b in blobs.values())
                self._trim_cache()
        for r in self.regions:
            r.wake.set()

    def advisory(self, key: str, blob: bytes) -> None:
        with self._lock:
            for r in self.regions:
                r.slots[key] = blob
        for r in self.regions:
            r.wake.set()

    def stores(self) -> dict[str, ObjectStore]:
        """Every other region's store by name, as the syncer reaches it (counted in a run)."""
        return {r.name: r.store for r in self.regions}

    def lag(self) -> dict[str, int]:
        """Commits each region lacks (the whole log + 1 before its first pass)."""
        with self._lock:
            return {r.name: self._latest + 1 - (r.next or 0) for r in self.regions}

    def stats(self) -> dict[str, dict]:
        """Per region: the next seq it lacks, commits and bytes copied, failures in a row, reads
        back from home, and (when its store is a CountingStore) every request the syncer made to
        it: ingest and replication."""
        with self._lock:
            out = {r.name: {"next": r.next, "copied": r.copied, "bytes": r.bytes, "failures": r.failures,
                            "pruned": r.pruned, "home_reads": r.home_reads, "conflict": r.conflict,
                            "delay_s_mean": round(r.delay.mean, 4),
                            "delay_s_max": round(r.delay.high, 4) if r.delay else 0.0} for r in self.regions}
        for r in self.regions:
            if isinstance(r.store, CountingStore):
                out[r.name]["requests"] = dataclasses.asdict(r.store.snapshot())
        return out

    def stop(self, drain_s: float = 0.0) -> bool:
        """Stop the threads, after waiting up to ``drain_s`` for every region to catch up; True if
        they all had."""
        deadline = self.clock() + drain_s
        while drain_s > 0 and any(self.lag().values()) and self.clock() < deadline:
            for r in self.regions:
                r.wake.set()
            time.sleep(0.02)
        caught_up = not any(self.lag().values())
        self._stop.set()
        for r in self.regions:
            r.wake.set()
        for r in self.regions:
            if r.thread is not None and r.thread.is_alive():
                r.thread.join(timeout=10)
            if r.pool is not None:
                r.pool.shutdown(wait=False, cancel_futures=True)
        return caught_up

    # -- a region's thread ----------------------------------------------------------------------
    def _run(self, r: _Region) -> None:
        while not self._stop.is_set():
            r.wake.clear()
            wait = r.retry_at - self.clock()
            if wait > 0:
                r.wake.wait(min(0.5, wait))
                continue
            if not self._attempt(r):
                r.wake.wait(0.5)

    def _attempt(self, r: _Region) -> bool:
        """One pass over region ``r``; True when it has more to copy right away."""
        try:
            more = self._copy(r)
        except (StoreError, FormatError, RegionConflict) as exc:
            r.failures += 1
            r.conflict = str(exc)[:300] if isinstance(exc, RegionConflict) else r.conflict
            r.retry_at = self.clock() + min(self.cfg.retry_s * 2 ** (r.failures - 1), self.cfg.max_retry_s)
            if r.failures & (r.failures - 1) == 0:   # the 1st, 2nd, 4th ... failure in a row
                self.events.emit("replicate-error", region=r.name, next=r.next, failures=r.failures,
                                 conflict=isinstance(exc, RegionConflict), error=str(exc)[:300])
            return False
        if r.failures:
            self.events.emit("replicate-recovered", region=r.name, after_failures=r.failures, next=r.next)
            r.failures, r.conflict = 0, None
        return more

    def _copy(self, r: _Region) -> bool:
        now = self.clock()
        if now - r.static_at >= self.cfg.static_every_s:
            r.bytes += replicate_static(self.home, r.store)
            if not r.visited:
                r.bytes += self._visit(r)
            r.static_at = now
        if r.next is None:   # resume where the region's own copy ends, if it ends in home's log
            r.next = agreed_tail(self.home, r.store, r.name) + 1
        with self._lock:
            latest, epoch = self._latest, self._epoch
        seqs = range(r.next, min(latest, r.next + self.cfg.batch - 1) + 1)
        # Versions first, in parallel; each record after its own version, in log order.
        jobs = [r.pool.submit(self._copy_version, r, seq) for seq in seqs]
        copied = 0
        try:
            for seq, job in zip(seqs, jobs):
                if self._stop.is_set():
                    break
                try:
                    key, blob, n = job.result()
                except NotFound:
                    break      # noted before home's write is visible to this reader: next pass
                n += copy_same(self.home, r.store, key, blob)
                self._advance(r, seq, n)
                copied += 1
        finally:
            for job in jobs:
                job.cancel()   # after a failure: the versions not started yet wait for the next pass
        if copied:
            with self._lock:
                r.slots[HEAD_HINT_KEY] = pack_head_hint(r.next - 1, epoch)
        self._flush_slots_async(r)
        if now - r.pruned_at >= self.cfg.prune_every_s:
            r.pruned += prune_versions(self.home, r.store)
            r.pruned_at = now
        return r.next <= latest and copied > 0

    def _visit(self, r: _Region) -> int:
        """Once per region and life: its region marker (which region's copy it is) and the failover
        records home holds (workers/syncer/home.py). Returns bytes written."""
        n = mark_region(r.store, r.name, self.home.get(DESCRIPTOR_KEY)) + replicate_failovers(self.home, r.store)
        r.visited = True
        return n

    def _advance(self, r: _Region, seq: int, n: int) -> None:
        """Commit ``seq``'s record is in region ``r``: the cursor passes it (only it: no gap)."""
        with self._lock:
            noted = self._noted.get(seq)
            delay = self.clock() - noted if noted is not None else None
            if delay is not None:
                r.delay.append(delay)
            r.next = seq + 1
            r.copied += 1
            r.bytes += n
            self._trim_cache()
        # One event per commit copied: when each commit reached each region (the benchmark's
        # version latency breakdown, infra/wan_benchmark.py), outside the lock (the log writes a line).
        self.events.emit("replicated", region=r.name, seq=seq, bytes=n,
                         delay_s=round(delay, 4) if delay is not None else None)

    def _copy_version(self, r: _Region, seq: int) -> tuple[str, bytes, int]:
        """On the region's pool: commit ``seq``'s version in region ``r`` (for a commit that
        publishes one and whose version home still keeps). Returns the record's key and bytes (to
        be written after this) and the bytes written. ``NotFound``: home has no commit ``seq``."""
        key = commit_key(seq)
        blob = self._cached_blob(r, seq, key) or self.home.get(key)
        rec = CommitRecord.from_bytes(blob, what=f"{self.home.uri}/{key}")
        n = 0
        for out in published_keys(rec) if rec.kind in PUBLISHING else ():
            try:
                n += copy_same(self.home, r.store, out, self._cached_blob(r, seq, out))
            except NotFound:
                pass   # an old commit whose version retention removed: the record alone is the log
        return key, blob, n

    def _cached_blob(self, r: _Region, seq: int, key: str) -> bytes | None:
        with self._lock:
            blob = self._cache.get(seq, {}).get(key)
            if blob is None:
                r.home_reads += 1
        return blob

    def _trim_cache(self) -> None:
        """(Under the lock.) Drop commits every region has, then the oldest beyond ``cache_bytes``."""
        done = min((r.next or 0) for r in self.regions) if self.regions else self._latest + 1
        while self._cache and (next(iter(self._cache)) < done or self._cached > self.cfg.cache_bytes):
            _, blobs = self._cache.popitem(last=False)
            self._cached -= sum(len(b) for b in blobs.values())

    def _flush_slots_async(self, r: _Region) -> None:
        """Write the advisory slots on the region's pool, one job at a time (so an older value
        never lands after a newer one); a failed write is reported on the next pass."""
        if r.flushing is not None and r.flushing.done():
            job, r.flushing = r.flushing, None
            job.result()                      # re-raises the last flush's StoreError: backoff
        with self._lock:
            if r.flushing is not None or not r.slots:
                return
            slots, r.slots = r.slots, {}
        r.flushing = r.pool.submit(self._flush, r, slots)

    def _flush(self, r: _Region, slots: dict[str, bytes]) -> None:
        for i, (key, blob) in enumerate(slots.items()):
            try:
                r.store.put(key, blob)
                with self._lock:
                    r.bytes += len(blob)
            except StoreError:
                with self._lock:   # keep what was not written unless a newer value arrived meanwhile
                    for k, b in list(slots.items())[i:]:
                        r.slots.setdefault(k, b)
                raise
            finally:
                r.wake.set()


def region_stores(home: ObjectStore, desc: RunDescriptor,
                  given: Mapping[str, ObjectStore] | None = None) -> dict[str, ObjectStore]:
    """Every region's store by name, the syncer's own region's being ``home`` (the store the syncer
    was given; which region's copy it is: ``storage.regions.store_region``, the descriptor's home
    unless its marker or location says otherwise - a failover's new home, issue 25; a store that
    is not home is refused later, by ``workers/syncer/home.py``): ``given`` overrides any other
    (tests wrap them), the rest are opened from the descriptor (created if missing: the syncer is
    who fills a new region). Empty for a single-region run."""
    if desc.regions is None:
        if given:
            raise ValueError(f"run {desc.run_id} has no regions section, but region stores {sorted(given)} were given")
        return {}
    own = store_region(home, desc).name
    given = dict(given or {})
    if own in given:
        raise ValueError(f"region {own!r} is the home region: its store is the syncer's own "
                         "(pass it as the syncer's store, not in regions=)")
    unknown = sorted(set(given) - {r.name for r in desc.regions.regions})
    if unknown:
        raise ValueError(f"region stores {unknown} were given, but run {desc.run_id}'s regions are "
                         f"{[r.name for r in desc.regions.regions]}")
    out = {}
    for spec in desc.regions.regions:
        if spec.name == own:
            out[spec.name] = home      # the log is where the syncer commits, always
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
    own = next((n for n, s in stores.items() if s is home), None)
    return inboxes, (Replicator(home, others, events, home_name=own) if others else None)
