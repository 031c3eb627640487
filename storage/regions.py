"""Per-region stores of a run (docs/regions.md "Topology"): opening them, copying the
authoritative log's objects from the home store to another region's, and checking a copy.

A region's copy holds the same keys (storage/layout.py) with the same bytes as the home store:
the descriptor, the membership records, every commit record and every version object a commit
published, and the records of region failovers (``failovers/``). One object is a store's own: its
*region marker* (``region.marker``, issue 25), which says which region's copy of the run the store
is, so that a syncer started on a region's copy is refused (workers/syncer/home.py). Commit
records and versions carry the syncer's signatures and digests, so a learner verifies its region's copy with the run's keys exactly as it would verify the home copy; nothing
here needs to be trusted. Copies are create-if-absent and version-before-commit (SPEC §7: data
before the commit that names it), so a copy interrupted anywhere is resumed by copying again.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from pipeline.envelope import digest, pack_record, unpack_record
from pipeline.errors import FormatError
from pipeline.regions import REGION_NAME_RE, RegionSpec
from pipeline.descriptor import RunDescriptor
from pipeline.types import CommitRecord

from .errors import AlreadyExists, NotFound
from .layout import (DESCRIPTOR_KEY, FAILOVER_PREFIX, MEMBER_PREFIX, REGION_MARKER_KEY, VERSION_PREFIX, commit_key,
                     parse_version_key, published_keys, read_descriptor)
from .log import CommitLog
from .store import ObjectStore, open_store

__all__ = ["PUBLISHING", "RegionConflict", "open_region", "learner_region_store", "copy_same", "replicate_static",
           "replicate_commit", "seed_region", "prune_versions", "RegionCheck", "verify_region", "MARKER_KIND",
           "MARKER_VERSION", "pack_marker", "mark_region", "read_marker", "StoreRegion", "store_region",
           "agreed_tail", "replicate_failovers"]

PUBLISHING = ("init", "merge")   # commit kinds that name a version they created
MARKER_KIND, MARKER_VERSION = "region-marker", 1


class RegionConflict(ValueError):
    """A region's store holds other bytes than the home store under the same key."""


def open_region(spec: RegionSpec, *, create: bool = False, **kw) -> ObjectStore:
    """The store of region ``spec`` (its endpoint and credentials profile; ``kw`` as ``open_store``).
    ``create=False`` by default: a mistyped path must not become an empty region."""
    return open_store(spec.uri, s3_endpoint=spec.endpoint, profile=spec.profile, create=create, **kw)


def learner_region_store(store: ObjectStore, region: str | None, opener=open_region) -> ObjectStore:
    """The store a learner of ``region`` reads and spills to (issue 14: never a cross-region read
    in steady state). ``store`` is any copy of the run (usually the learner's own region's); its
    descriptor names the region's store, which must hold the same descriptor bytes. ``region``
    None: ``store`` itself (a single-region run, or a learner placed by its store URI alone)."""
    if region is None:
        return store
    desc = read_descriptor(store)
    if desc.regions is None:
        raise ValueError(f"run {desc.run_id} has no regions section: --region {region} needs a run created "
                         "with regions (docs/regions.md)")
    spec = desc.regions.region(region)
    if _same_location(spec, store):
        return store
    local = opener(spec)
    if digest(local.get(DESCRIPTOR_KEY)) != digest(store.get(DESCRIPTOR_KEY)):
        raise RegionConflict(f"region {region}'s store {spec.uri} holds another run descriptor than {store.uri}")
    return local


def _same_location(spec: RegionSpec, store: ObjectStore) -> bool:
    """Whether ``store`` already is region ``spec``'s store (then no second client is opened). An
    s3:// URI names a store only together with its endpoint: one bucket name on two servers is two
    stores (when in doubt: not the same, and the region's store is opened - that costs a client)."""
    if spec.uri.rstrip("/") == store.uri.rstrip("/"):
        if not spec.uri.startswith("s3://"):
            return True
        have = getattr(store, "endpoint", None)
        return (spec.endpoint or "").rstrip("/") == (have or "").rstrip("/")
    def local(uri: str) -> str | None:      # a directory path or file:/// URI, made absolute
        path = uri[len("file://"):] if uri.startswith("file://") else uri
        return None if "://" in path else os.path.abspath(os.path.expanduser(path))
    mine = local(spec.uri)
    return mine is not None and mine in (getattr(store, "root", None), local(store.uri))


def copy_same(src: ObjectStore, dst: ObjectStore, key: str, blob: bytes | None = None) -> int:
    """Create ``key`` in ``dst`` with ``src``'s bytes (``blob`` if the caller has them); bytes
    written (0: it was there already, with the same bytes). ``RegionConflict`` when ``dst`` holds
    other bytes; ``NotFound`` when ``src`` has no such object."""
    if blob is None:
        blob = src.get(key)
    try:
        dst.put_if_absent(key, blob)
        return len(blob)
    except AlreadyExists:
        if digest(dst.get(key)) != digest(blob):
            raise RegionConflict(f"{dst.uri}/{key} holds other bytes than {src.uri}/{key}") from None
        return 0


def replicate_static(home: ObjectStore, dst: ObjectStore) -> int:
    """The descriptor and every membership record (learners added after creation) of ``home`` in
    ``dst``: what a learner reads besides the log before its first step. Returns bytes written."""
    n = copy_same(home, dst, DESCRIPTOR_KEY)
    have = set(dst.list(MEMBER_PREFIX))
    for key in home.list(MEMBER_PREFIX):
        if key not in have:
            n += copy_same(home, dst, key)
    return n


def replicate_commit(home: ObjectStore, dst: ObjectStore, seq: int) -> int:
    """Commit ``seq`` of the home log in ``dst``: its version object first (for commits that
    publish one; skipped when retention already deleted it at home), then the record. Returns
    bytes written. ``NotFound`` when home has no commit ``seq``."""
    key = commit_key(seq)
    blob = home.get(key)
    rec = CommitRecord.from_bytes(blob, what=f"{home.uri}/{key}")
    n = 0
    for out in published_keys(rec) if rec.kind in PUBLISHING else ():
        try:
            n += copy_same(home, dst, out)
        except NotFound:
            pass   # an old commit whose version retention removed: the record alone is the log
    return n + copy_same(home, dst, key, blob)


def prune_versions(home: ObjectStore, dst: ObjectStore) -> int:
    """Delete from ``dst`` every version object older than the oldest version of its fragment that
    ``home`` still keeps: a region follows the home store's retention (docs/storage.md
    "Retention"), which deletes only at home. Only *older* ones go, so a version not copied yet
    or just published is never touched; a fragment home lists no version of is left alone.
    Returns how many objects were deleted."""
    oldest: dict[int, int] = {}
    for key in home.list(VERSION_PREFIX):
        p, v = parse_version_key(key)
        oldest[p] = min(v, oldest.get(p, v))
    deleted = 0
    for key in dst.list(VERSION_PREFIX):
        p, v = parse_version_key(key)
        if p in oldest and v < oldest[p]:
            try:
                dst.delete(key)
            except NotFound:
                pass   # deleted meanwhile: the goal either way
            deleted += 1
    return deleted


def seed_region(home: ObjectStore, dst: ObjectStore, region: str | None = None) -> int:
    """Copy a newly created run (descriptor, members, the init commits and version 0) from ``home``
    to region store ``dst``, so that its learners can start before the syncer does; the syncer's
    replicator goes on from the region's log tail. ``region``: its name, written in ``dst``'s
    region marker. Returns bytes written."""
    n = replicate_static(home, dst)
    if region is not None:
        n += mark_region(dst, region, home.get(DESCRIPTOR_KEY))
    seq = 0
    while home.exists(commit_key(seq)):
        n += replicate_commit(home, dst, seq)
        seq += 1
    return n


# -- which region's copy a store is ---------------------------------------------------------

def pack_marker(region: str, descriptor_blob: bytes) -> bytes:
    """The region marker of ``region``'s copy of the run whose descriptor bytes are
    ``descriptor_blob``: kind ``region-marker`` v1 {region, descriptor: hex sha256 of those bytes}
    (the digest, not the run id: a marker copied along with another run's bucket names nothing)."""
    if not isinstance(region, str) or not REGION_NAME_RE.match(region):
        raise ValueError(f"region name {region!r} must match {REGION_NAME_RE.pattern}")
    return pack_record(MARKER_KIND, MARKER_VERSION, {"region": region, "descriptor": digest(descriptor_blob)})


def mark_region(store: ObjectStore, region: str, descriptor_blob: bytes) -> int:
    """Create ``store``'s region marker (create-if-absent: never overwritten); bytes written (0:
    it was there). ``RegionConflict`` when the store already says it is another region's copy
    (the descriptor lists one store under two names, or someone copied a bucket)."""
    blob = pack_marker(region, descriptor_blob)
    try:
        store.put_if_absent(REGION_MARKER_KEY, blob)
        return len(blob)
    except AlreadyExists:
        pass
    have, note = read_marker(store, descriptor_blob)
    if have is not None and have != region:
        raise RegionConflict(f"{store.uri}/{REGION_MARKER_KEY} says this store is region {have}'s copy, "
                             f"but the run's descriptor places region {region} here") from None
    return 0


def read_marker(store: ObjectStore, descriptor_blob: bytes) -> tuple[str | None, str | None]:
    """(the region ``store``'s marker names, a note): (None, None) without a marker; (None, why) for
    one that is damaged or belongs to another descriptor (ignored: the marker guards against a
    mistake, it is not a security boundary - docs/regions.md "Failover")."""
    what = f"{store.uri}/{REGION_MARKER_KEY}"
    try:
        blob = store.get(REGION_MARKER_KEY)
    except NotFound:
        return None, None
    try:
        _, d = unpack_record(blob, MARKER_KIND, MARKER_VERSION, max_bytes=1 << 12, what=what)
    except FormatError as exc:
        return None, f"{exc}: ignored"
    if d.get("descriptor") != digest(descriptor_blob) or not isinstance(d.get("region"), str):
        return None, f"{what} names another run descriptor or no region: ignored"
    return d["region"], None


@dataclass(frozen=True)
class StoreRegion:
    """Which region's copy a store is: ``name`` (None: a run without regions) and ``how`` it was
    told: ``marker``, ``location`` (the store's URI is that region's in the descriptor) or
    ``presumed`` (neither: the home region, as before region markers existed); ``note``: a marker
    that was ignored."""

    name: str | None
    how: str
    note: str | None = None


def store_region(store: ObjectStore, desc: RunDescriptor) -> StoreRegion:
    """Which region's copy of run ``desc`` ``store`` is: its marker's region, else the
    region whose descriptor entry names this store's location, else the home region (a run
    created before markers, or a store reached by another URI)."""
    if desc.regions is None:
        return StoreRegion(None, "single")
    name, note = read_marker(store, store.get(DESCRIPTOR_KEY))
    if name is not None:
        return StoreRegion(name, "marker")
    for spec in desc.regions.regions:
        if _same_location(spec, store):
            return StoreRegion(spec.name, "location", note)
    return StoreRegion(desc.regions.home, "presumed", note)


def agreed_tail(home: ObjectStore, dst: ObjectStore, name: str) -> int:
    """The last seq of region ``name``'s log (-1: empty), once its record there holds home's
    bytes. Issue 25: a syncer that ran on the region's copy forked its log there; resuming from
    the region's tail without this check spliced home's later commits onto the fork. Records
    are create-if-absent and each carries its writer's epoch, so a fork's last record differs from
    home's at that seq (or home has none): comparing the tail is enough. ``RegionConflict`` else."""
    tail = CommitLog(dst).tail()
    if tail < 0:
        return tail
    key = commit_key(tail)
    mine = dst.get(key)
    try:
        theirs = home.get(key)
    except NotFound:
        raise RegionConflict(f"region {name}'s log reaches commit {tail} ({dst.uri}/{key}) but {home.uri}'s "
                             "ends before it: the region holds commits home never wrote (a syncer ran on its "
                             "copy?); replication to it stops here (docs/regions.md \"Failover\")") from None
    if digest(mine) != digest(theirs):
        raise RegionConflict(f"region {name}'s {dst.uri}/{key} holds other bytes than {home.uri}/{key}: its log "
                             "forked from home's; replication to it stops here (docs/regions.md \"Failover\")")
    return tail


def replicate_failovers(home: ObjectStore, dst: ObjectStore) -> int:
    """Every region failover record of ``home`` in ``dst`` (create-if-absent, home's bytes), so a
    syncer started on a store that is no longer home learns it there (workers/syncer/home.py).
    Returns bytes written."""
    have = set(dst.list(FAILOVER_PREFIX))
    return sum(copy_same(home, dst, key) for key in home.list(FAILOVER_PREFIX) if key not in have)


@dataclass
class RegionCheck:
    """What ``verify_region`` found: commits checked, and the keys missing from or differing in
    the region's copy (``behind``: the region's log ends at ``tail`` < home's)."""

    region: str
    checked: int = 0
    tail: int = -1
    missing: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.missing and not self.mismatched


def verify_region(home: ObjectStore, dst: ObjectStore, name: str, upto: int) -> RegionCheck:
    """Check region ``name``'s copy against the home log for commits ``0..upto``: the descriptor,
    every commit record and every published version that home still holds, byte for byte (sha256).
    A missing version in the region counts only if home still has it."""
    check = RegionCheck(name)
    if digest(dst.get(DESCRIPTOR_KEY)) != digest(home.get(DESCRIPTOR_KEY)):
        check.mismatched.append(DESCRIPTOR_KEY)
    for seq in range(upto + 1):
        key = commit_key(seq)
        blob = home.get(key)
        rec = CommitRecord.from_bytes(blob, what=f"{home.uri}/{key}")
        keys = [(key, blob)]
        for out in published_keys(rec) if rec.kind in PUBLISHING else ():
            try:
                keys.insert(0, (out, home.get(out)))
            except NotFound:
                pass
        for k, b in keys:
            try:
                if digest(dst.get(k)) != digest(b):
                    check.mismatched.append(k)
            except NotFound:
                check.missing.append(k)
        if check.tail == seq - 1 and key not in check.missing:
            check.tail = seq      # the region's log is contiguous up to here
        check.checked += 1
    return check
