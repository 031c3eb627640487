"""Where a syncer may commit: the home-region check and the explicit region failover (issue 25,
defect 5; docs/regions.md "Failover").

Why: nothing used to check that the store given to ``ddiloco syncer`` is the home region's. On
region r1's copy a syncer salvaged every merge (the copy holds no deltas or checkpoints: momentum
restarted at zero), claimed the same epoch number in r1's own ``epochs/`` and fenced r1's log; when
home came back its replicator resumed from r1's tail, and the fork was silent. Now:

* a syncer starts only in the run's *home* region: the descriptor's, or the region the newest
  failover made home. Which region's copy a store is comes from its region marker, else its
  location in the descriptor (``storage.regions.store_region``). Anything else is refused with
  ``HomeRegionError`` before the syncer writes a byte, saying what to do;
* taking over in another region is explicit (``ddiloco syncer --failover-from-region HOME``): the
  new home first adopts any commits a reachable region holds beyond its own copy (the old home's
  included), refuses when the regions' logs disagree, and claims an epoch above every epoch any
  reachable region shows (claims, log records, earlier failovers), so every learner's (epoch,
  round) order puts the new home after the old one. Its fence records the failover
  (``info["failover"]``), and a ``failovers/<epoch>`` record holding that fence's bytes (signed in
  a signed run) tells every later start where home is; the replicator copies it to each region;
* the replicator never resumes after a region's tail that is not home's bytes (``RegionConflict``,
  workers/syncer/replicate.py), so a fork that happens anyway is reported, never spliced.

Reading other regions at start never blocks a start for long: each region is asked on its own
daemon thread, and one that has not answered within ``survey_timeout_s`` is left out (unreachable).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

from pipeline.envelope import digest, pack_record, unpack_record
from pipeline.errors import FormatError
from pipeline.descriptor import RunDescriptor
from pipeline.types import CommitRecord
from storage.errors import AlreadyExists, NotFound, StoreError
from storage.layout import FAILOVER_PREFIX, commit_key, failover_key, parse_failover_key
from storage.log import CommitLog, current_epoch
from storage.regions import RegionConflict, replicate_commit, replicate_static, store_region
from storage.store import ObjectStore
from workers.common.events import EventLog
from workers.common.refold import trusted_commits

__all__ = ["FAILOVER_KIND", "FAILOVER_VERSION", "HomeRegionError", "HomeConfig", "Failover", "pack_failover",
           "read_failover", "RegionView", "survey", "HomeStart", "start_home"]

FAILOVER_KIND, FAILOVER_VERSION = "region-failover", 1
MAX_FAILOVER_BYTES = 1 << 16


class HomeRegionError(ValueError):
    """A syncer was started on a store that is not the run's home region's."""


@dataclass(frozen=True)
class HomeConfig:
    survey_timeout_s: float = 10.0   # how long a start waits for the other regions' answers

    def __post_init__(self) -> None:
        if not self.survey_timeout_s > 0:
            raise ValueError(f"HomeConfig.survey_timeout_s must be > 0, got {self.survey_timeout_s!r}")


# -- the failover record ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Failover:
    """A failover: region ``to`` took over as home from ``source`` with the fence at ``fence_seq``
    of epoch ``epoch``."""

    source: str
    to: str
    epoch: int
    fence_seq: int


def pack_failover(run_id: str, fence_blob: bytes) -> bytes:
    """The ``failovers/<epoch>`` object: kind ``region-failover`` v1 {run_id, fence: the fence
    commit's bytes}. The fence carries the failover (``info["failover"]``) and, in a signed run, the
    syncer's signature, so the record needs no signature of its own (docs/formats.md)."""
    return pack_record(FAILOVER_KIND, FAILOVER_VERSION, {"run_id": run_id, "fence": fence_blob})


def read_failover(blob: bytes, desc: RunDescriptor, epoch: int, what: str,
                  trusted: Callable[[CommitRecord], bool] | None) -> Failover:
    """The failover recorded at ``failover_key(epoch)``; ``FormatError`` naming ``what`` for a
    damaged or foreign record, one whose fence is not a failover fence of that epoch, names
    regions the run does not have, or (signed run) is not the syncer's."""
    _, d = unpack_record(blob, FAILOVER_KIND, FAILOVER_VERSION, max_bytes=MAX_FAILOVER_BYTES, what=what)
    if d.get("run_id") != desc.run_id or not isinstance(d.get("fence"), bytes):
        raise FormatError(f"{what}: not a failover record of run {desc.run_id}")
    rec = CommitRecord.from_bytes(d["fence"], what=f"{what} (fence)")
    moved = rec.info.get("failover") if isinstance(rec.info, dict) else None
    names = {r.name for r in desc.regions.regions} if desc.regions is not None else set()
    if rec.kind != "fence" or rec.epoch != epoch or not isinstance(moved, dict) \
            or moved.get("from") not in names or moved.get("to") not in names:
        raise FormatError(f"{what}: its fence is not a failover fence of epoch {epoch} between the run's regions")
    if trusted is not None and not trusted(rec):
        raise FormatError(f"{what}: its fence does not carry the syncer's signature (forged?)")
    return Failover(moved["from"], moved["to"], epoch, rec.seq)


# -- what the regions hold ----------------------------------------------------------------------------

@dataclass
class RegionView:
    """What a start read in one region's store: its log ``tail``, the highest ``epoch`` it shows
    (claims, its tail record, failovers), its trusted ``failovers``; ``error``: it did not answer."""

    name: str
    tail: int = -1
    epoch: int = 0
    failovers: list[Failover] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str | None = None


def _read_view(name: str, store: ObjectStore, desc: RunDescriptor, full: bool) -> RegionView:
    """Region ``name``'s failover records; ``full``: also its tail and the epochs it shows."""
    view, trusted = RegionView(name), trusted_commits(desc)
    for key in store.list(FAILOVER_PREFIX):
        what = f"{store.uri}/{key}"
        try:
            f = read_failover(store.get(key), desc, parse_failover_key(key), what, trusted)
        except (FormatError, NotFound) as exc:
            view.notes.append(f"{exc}: ignored")
            continue
        view.failovers.append(f)
        view.epoch = max(view.epoch, f.epoch)
    if full:
        log = CommitLog(store)
        view.tail = log.tail()
        view.epoch = max(view.epoch, current_epoch(store))
        if view.tail >= 0:
            try:
                view.epoch = max(view.epoch, log.read(view.tail).epoch)
            except FormatError as exc:
                view.notes.append(f"{exc}: its epoch is not counted")
    return view


def survey(stores: Mapping[str, ObjectStore], desc: RunDescriptor, full: bool,
           timeout_s: float) -> dict[str, RegionView]:
    """Every region's view, each read on its own daemon thread; a region whose store fails, or
    has not answered within ``timeout_s``, gets a view with ``error`` set (never blocks longer)."""
    views: dict[str, RegionView] = {}

    def read(name: str, store: ObjectStore) -> None:
        try:
            views[name] = _read_view(name, store, desc, full)
        except (StoreError, FormatError) as exc:
            views[name] = RegionView(name, error=str(exc)[:200])
    threads = [threading.Thread(target=read, args=item, name=f"home-survey-{item[0]}", daemon=True)
               for item in stores.items()]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:           # one deadline for all: a hung region costs timeout_s once, not per region
        t.join(max(0.0, deadline - time.monotonic()))
    return {n: views.get(n) or RegionView(n, error=f"no answer within {timeout_s:g} s") for n in stores}


def _newest(views: Mapping[str, RegionView]) -> Failover | None:
    """The failover with the highest epoch any region holds (None: the run never failed over)."""
    found = [f for v in views.values() for f in v.failovers]
    return max(found, key=lambda f: f.epoch, default=None)


# -- the check at start ---------------------------------------------------------------------------

@dataclass(frozen=True)
class HomeStart:
    """What ``start_home`` decided: this store's ``region`` and the run's ``home`` region (None:
    a run without regions); for a failover, the region it takes over ``from_region``, the lowest
    epoch to claim and what the fence records."""

    region: str | None
    home: str | None
    from_region: str | None = None
    epoch_floor: int = 1
    fence_info: dict = field(default_factory=dict)

    def claimed(self, store: ObjectStore, desc: RunDescriptor, fence_seq: int, events: EventLog) -> Failover | None:
        """After the claim: write the failover record (its fence's bytes) at ``failovers/<epoch>``
        in this store, which is now home; the replicator copies it to every region. None when this
        start was no failover."""
        if self.from_region is None:
            return None
        fence_blob = store.get(commit_key(fence_seq))
        epoch = CommitRecord.from_bytes(fence_blob, what=f"{store.uri}/{commit_key(fence_seq)}").epoch
        key, blob = failover_key(epoch), pack_failover(desc.run_id, fence_blob)
        try:
            store.put_if_absent(key, blob)
        except AlreadyExists:
            if digest(store.get(key)) != digest(blob):   # our epoch is ours alone: anything else is not ours
                raise RegionConflict(f"{store.uri}/{key} already holds another failover record") from None
        events.emit("region-failover", **{**self.fence_info["failover"], "epoch": epoch, "fence_seq": fence_seq})
        return Failover(self.from_region, self.region, epoch, fence_seq)


def start_home(store: ObjectStore, desc: RunDescriptor, others: Mapping[str, ObjectStore],
               failover_from: str | None = None, events: EventLog | None = None,
               cfg: HomeConfig = HomeConfig()) -> HomeStart:
    """Decide whether a syncer may commit in ``store`` (module docstring); ``others``: every other
    region's store. Without ``failover_from`` a store that is not home raises ``HomeRegionError``;
    with it (naming the home region it takes over from) the failover is prepared: commits a
    reachable region holds beyond this store's are adopted first (writes, before the claim).
    Reads only otherwise. ``RegionConflict`` when the regions' logs disagree."""
    if desc.regions is None:
        if failover_from is not None:
            raise ValueError(f"--failover-from-region {failover_from}: run {desc.run_id} has no regions section, "
                             "so there is no other region to fail over from")
        return HomeStart(None, None)
    me = store_region(store, desc)
    full = failover_from is not None
    views = {me.name: _read_view(me.name, store, desc, full),     # our own store must answer
             **survey(others, desc, full, cfg.survey_timeout_s)}
    notes = ([me.note] if me.note else []) + [n for v in views.values() for n in v.notes]
    for note in notes if events is not None else ():
        events.emit("home-check", detail=note)     # ignored markers or failover records: said, not fatal
    newest = _newest(views)
    home = newest.to if newest is not None else desc.regions.home
    if me.name == home:
        if failover_from is not None and not (newest is not None and newest.source == failover_from):
            raise ValueError(f"--failover-from-region {failover_from}: {store.uri} is already the home region "
                             f"{home}'s store; start the syncer without the flag")
        return HomeStart(me.name, home)
    if failover_from is None:
        raise HomeRegionError(_refusal(store, desc, me.name, me.how, home, newest))
    if failover_from != home:
        raise ValueError(f"--failover-from-region {failover_from}: the run's home region is {home}"
                         + (f" (since the failover of epoch {newest.epoch})" if newest is not None else "")
                         + f"; name it to take over from it")
    return _prepare_failover(store, me.name, home, views, others)


def _refusal(store: ObjectStore, desc: RunDescriptor, region: str, how: str, home: str,
             newest: Failover | None) -> str:
    """What a syncer started on region ``region``'s copy is told: where home is and what to do."""
    since = f" since the failover of epoch {newest.epoch}" if newest is not None else ""
    told = {"marker": "its region marker", "location": "the descriptor's regions"}.get(how, how)
    return (f"{store.uri} is region {region}'s copy of run {desc.run_id} ({told}), not the home region's: the "
            f"home region is {home}{since} ({desc.regions.region(home).uri}). A syncer commits only in the home "
            f"store: start it with --store {desc.regions.region(home).uri}. If region {home} is lost, take over "
            f"here explicitly: ddiloco syncer --store {store.uri} --failover-from-region {home} "
            "(docs/regions.md \"Failover\")")


def _prepare_failover(store: ObjectStore, me: str, home: str, views: Mapping[str, RegionView],
                      others: Mapping[str, ObjectStore]) -> HomeStart:
    """Adopt what reachable regions hold beyond this store's log, and pick an epoch above every
    epoch any reachable region shows."""
    source, copied = _catch_up(store, views[me].tail, {n: v for n, v in views.items() if n != me and not v.error},
                               others)
    seen = [v.epoch for v in views.values() if v.error is None]
    info = {"from": home, "to": me,
            "regions": {n: ({"tail": v.tail, "epoch": v.epoch} if v.error is None else {"error": v.error})
                        for n, v in sorted(views.items())}}
    if copied:
        info.update(adopted_from=source, adopted=copied)
    return HomeStart(me, me, home, max(seen) + 1, {"failover": info})


def _catch_up(store: ObjectStore, tail: int, views: Mapping[str, RegionView],
              others: Mapping[str, ObjectStore]) -> tuple[str | None, int]:
    """Check that every reachable region's log agrees with this store's where both have records,
    then copy the commits the furthest one holds beyond ``tail`` (home's bytes, version before
    record). Returns (that region, commits copied)."""
    ahead = max(views.values(), key=lambda v: v.tail, default=None)
    for v in views.values():
        _same_record(store, others[v.name], v.name, min(v.tail, tail))
        if ahead is not None and v.tail > tail:
            _same_record(others[ahead.name], others[v.name], v.name, v.tail)
    if ahead is None or ahead.tail <= tail:
        return None, 0
    src = others[ahead.name]
    replicate_static(src, store)          # members who joined after this copy's last refresh
    for seq in range(tail + 1, ahead.tail + 1):
        replicate_commit(src, store, seq)
    return ahead.name, ahead.tail - tail


def _same_record(a: ObjectStore, b: ObjectStore, name: str, seq: int) -> None:
    """``RegionConflict`` unless commit ``seq`` holds the same bytes in both stores (seq < 0: none)."""
    if seq < 0:
        return
    key = commit_key(seq)
    if digest(a.get(key)) != digest(b.get(key)):
        raise RegionConflict(f"region {name}'s {b.uri}/{key} differs from {a.uri}/{key}: the regions' logs forked "
                             "before this failover; compare them (ddiloco replay --regions) and fail over to the "
                             "copy that holds home's log")
