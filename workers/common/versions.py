"""Reading committed fragment versions: learners, the evaluator and export all go through here.

Only versions named by a commit are ever used (a version blob without a commit is an orphan of a
crashed syncer). A version blob is a codec blob of kind ``version`` whose meta names its fragment,
version, seq and epoch; its values' digest must equal the commit's ``output_checksum``.

In a signed run a version is used only if its commit carries the syncer's
signature and the blob's ``meta["sig"]`` signs (fragment, version, seq, epoch, value digest) with
the same key (workers/bus/signing.py): a forged or altered version is refused here, which is the one
path learners, the evaluator, export and replay all read versions through.
"""
from __future__ import annotations

import threading
from functools import partial
from typing import Mapping

import numpy as np

from pipeline.checksum import tensor_digest
from pipeline.codec import CodecConfig, MapFn, decode, encode
from pipeline.codec_raw import seal_raw
from pipeline.version_chain import CHAIN_SCHEME, ChainStep, apply_delta, is_chained
from pipeline.errors import FormatError
from pipeline.descriptor import RunDescriptor
from pipeline.types import CommitRecord
from storage.errors import NotFound, StoreError
from storage.layout import HEAD_HINT_KEY, SNAPSHOT_INFO, snapshot_key, unpack_head_hint
from storage.log import CommitLog
from storage.shards import owned_fragments
from storage.store import ObjectStore
from workers.bus.signing import Signer, check_commit_signature, commit_signature_ok, sign_version_meta, version_signature_ok

VERSION_KIND = "version"
VERSION_DELTA_KIND = "version-delta"   # an int4 run's version: a delta against the one before it
FETCH_WINDOW = 32          # commits poll_fast reads at once
RECORD_CACHE = 4096        # commit records a tracker keeps by seq (a chain walk reads them again)


def _call(fn):
    return fn()


def version_codec(descriptor: RunDescriptor) -> CodecConfig:
    """How the run's versions are encoded: its versions dtype, in its codec's blob format (the
    descriptor's ``codec.format``: a republished or re-persisted version has the bytes stored first)."""
    return CodecConfig(scheme="bf16" if descriptor.versions.dtype == "bf16" else "fp32",
                       block_size=descriptor.codec.block_size, zstd_level=descriptor.codec.zstd_level,
                       format=descriptor.codec.format)


def delta_codec(descriptor: RunDescriptor) -> CodecConfig:
    """How an int4 run's version deltas are encoded: int4 at the run's block size and blob format."""
    return CodecConfig(scheme=CHAIN_SCHEME, block_size=descriptor.codec.block_size,
                       zstd_level=descriptor.codec.zstd_level, format=descriptor.codec.format)


def encode_version(descriptor: RunDescriptor, fragment: int, version: int, seq: int, epoch: int,
                   published: Mapping[str, np.ndarray], signer: Signer | None = None,
                   values_digest: str | None = None, map_fn: MapFn | None = None) -> bytes:
    """A version blob; signed by ``signer`` (the syncer's key) in a signed run. ``values_digest``
    is the values' tensor digest if the caller has it (the commit's ``output_checksum``).
    ``map_fn``: runs the codec's jobs (a caller's thread pool; the same bytes whatever runs them)."""
    values = {n: published[n] for n in descriptor.layout.fragments[fragment]}
    meta = {"fragment": fragment, "version": version, "seq": seq, "epoch": epoch}
    if signer is not None:
        meta = sign_version_meta(meta, values_digest or tensor_digest(values), signer, descriptor.run_id)
    return encode(VERSION_KIND, meta, values, version_codec(descriptor), map_fn=map_fn)


def encode_version_delta(descriptor: RunDescriptor, record: CommitRecord, link: ChainStep,
                         signer: Signer | None = None, map_fn: MapFn | None = None) -> bytes:
    """The version of ``record`` in an int4 run: the int4 payload of ``link`` against the version
    before it (meta ``base_version``), signed over the *published* values' digest (the commit's
    ``output_checksum``), which a reader checks after adding the delta to its base."""
    names = descriptor.layout.fragments[record.fragment]
    meta = {"fragment": record.fragment, "version": record.version, "seq": record.seq, "epoch": record.epoch,
            "base_version": record.version - 1}
    if signer is not None:
        meta = sign_version_meta(meta, record.output_checksum, signer, descriptor.run_id)
    specs = [(n, descriptor.spec(n).shape, "float32") for n in names]
    return seal_raw(VERSION_DELTA_KIND, meta, specs, link.payload(names), delta_codec(descriptor), map_fn=map_fn)


def version_blobs(descriptor: RunDescriptor, record: CommitRecord, published: Mapping[str, np.ndarray],
                  link: ChainStep | None, signer: Signer | None = None,
                  map_fn: MapFn | None = None) -> list[tuple[str, bytes]]:
    """``(key, bytes)`` of every object a commit publishes (``storage.layout.published_keys``): its
    version, as a delta in an int4 run (``link``), and the full snapshot its info asks for."""
    if link is None:
        return [(record.output_key, encode_version(descriptor, record.fragment, record.version, record.seq,
                                                   record.epoch, published, signer, record.output_checksum,
                                                   map_fn=map_fn))]
    out = [(record.output_key, encode_version_delta(descriptor, record, link, signer, map_fn))]
    if record.info.get(SNAPSHOT_INFO):
        out.append((snapshot_key(record.output_key),
                    encode_version(descriptor, record.fragment, record.version, record.seq, record.epoch, published,
                                   signer, record.output_checksum, map_fn=map_fn)))
    return out


def max_fragment_bytes(descriptor: RunDescriptor) -> int:
    """Upper bound on a fragment's decoded float32 bytes (plus slack), for decode limits."""
    return max(sum(4 * descriptor.spec(n).numel for n in frag) for frag in descriptor.layout.fragments) + (1 << 20)


def max_version_bytes(descriptor: RunDescriptor) -> int:
    """Upper bound on a stored version blob (fp32 values, zstd's worst case, meta): larger objects
    are refused before they are downloaded."""
    m = max_fragment_bytes(descriptor)
    return m + m // 128 + (64 << 10)


def _open_version(blob: bytes, kind: str, descriptor: RunDescriptor, record: CommitRecord,
                  map_fn: MapFn | None):
    """The decoded blob of ``record``'s version (its commit's signature checked first, in a signed run)."""
    sec = descriptor.security
    if sec is not None:
        check_commit_signature(record, sec.syncer.sign, descriptor.run_id, f"commit {record.seq}")
    return decode(blob, kind, max_bytes=max_fragment_bytes(descriptor),
                  expect=descriptor.fragment_specs(record.fragment), what=record.output_key, map_fn=map_fn)


def _accepted(values: dict[str, np.ndarray], meta: dict, descriptor: RunDescriptor, record: CommitRecord,
              mismatch: str) -> dict[str, np.ndarray]:
    """``values`` if their digest is the commit's and, in a signed run, the blob's signature signs
    them (FormatError otherwise; ``mismatch`` says what the digest was of)."""
    what, sec = record.output_key, descriptor.security
    got = tensor_digest(values)
    if got != record.output_checksum:
        raise FormatError(f"{what}: {mismatch} {got[:16]}… does not match commit {record.seq}'s "
                          f"output_checksum {record.output_checksum[:16]}…")
    if sec is not None and (meta.get("seq") != record.seq or meta.get("epoch") != record.epoch
                            or not version_signature_ok(meta, got, sec.syncer.sign, descriptor.run_id)):
        raise FormatError(f"{what}: missing or bad syncer signature on the version (forged or altered; refused)")
    return values


def decode_version(blob: bytes, descriptor: RunDescriptor, record: CommitRecord,
                   map_fn: MapFn | None = None) -> dict[str, np.ndarray]:
    """Decode and check a committed version against its commit record (FormatError if anything differs).
    ``map_fn``: runs the codec's decoding jobs (a caller's thread pool; the same values)."""
    dec = _open_version(blob, VERSION_KIND, descriptor, record, map_fn)
    meta = dec.meta
    if meta.get("fragment") != record.fragment or meta.get("version") != record.version:
        raise FormatError(f"{record.output_key}: holds fragment {meta.get('fragment')} version "
                          f"{meta.get('version')}, but commit {record.seq} names fragment {record.fragment} "
                          f"version {record.version}")
    tensors = {n: np.asarray(a, dtype=np.float32) for n, a in dec.tensors.items()}
    return _accepted(tensors, meta, descriptor, record, "value digest")


def decode_version_delta(blob: bytes, descriptor: RunDescriptor, record: CommitRecord,
                         base: Mapping[str, np.ndarray], map_fn: MapFn | None = None) -> dict[str, np.ndarray]:
    """An int4 run's version of ``record`` from its delta blob and ``base``, the values of the
    version before it (FormatError if anything differs, the published digest included: a base that
    is not the one the syncer used fails here)."""
    what = record.output_key
    dec = _open_version(blob, VERSION_DELTA_KIND, descriptor, record, map_fn)
    meta = dec.meta
    if (meta.get("fragment"), meta.get("version"), meta.get("base_version")) != \
            (record.fragment, record.version, record.version - 1):
        raise FormatError(f"{what}: holds fragment {meta.get('fragment')} version {meta.get('version')} on base "
                          f"{meta.get('base_version')}, but commit {record.seq} names fragment {record.fragment} "
                          f"version {record.version}")
    try:
        values = apply_delta(base, dec.tensors)
    except ValueError as exc:
        raise FormatError(f"{what}: {exc}") from None
    return _accepted(values, meta, descriptor, record, "the base plus this delta has digest")


class VersionTracker:
    """Follows the commit log from a cursor and loads the versions it names.

    In an int4 run (pipeline/version_chain.py) a version is the one before it plus a delta: the
    tracker keeps the newest values it loaded of each fragment (its *head*) and the commit records
    it read, and loads a version by adding the deltas from its head, or from the nearest full
    snapshot (a commit whose info says ``snapshot``, or version 0) when it has no head or the head
    is not on the way; every step is checked against its commit's digest."""

    def __init__(self, store: ObjectStore, descriptor: RunDescriptor):
        self.store = store
        self.descriptor = descriptor
        self.log = CommitLog(store)
        self.cursor = -1   # seq of the last commit seen
        self.security = descriptor.security
        self.refused: list[str] = []       # commits skipped by latest() for a bad signature or damage
        self.newest: dict[int, CommitRecord] = {}   # what latest() found last
        self.bytes_loaded = 0              # bytes of version objects downloaded by load()
        self._dead_end = -2                # a head hint that pointed past the log (not followed again)
        self._count_lock = threading.Lock()
        self.chained = is_chained(descriptor.versions.dtype)
        self._heads: dict[int, tuple[CommitRecord, dict[str, np.ndarray]]] = {}   # int4 runs: newest loaded
        self._records: dict[int, CommitRecord] = {}   # seq -> record read (int4 runs: chain walks)

    def latest(self) -> dict[int, CommitRecord]:
        """The newest version-carrying commit of every fragment the log holds (all of them; in a
        sharded run's shard, its own: storage/shards.py), scanning back from the tail. Moves the
        cursor to the tail."""
        tail = self.log.tail()
        found: dict[int, CommitRecord] = {}
        seq = tail
        want = set(owned_fragments(self.store, self.descriptor))
        while seq >= 0 and not want <= found.keys():
            try:
                rec = self._read(seq)
            except (NotFound, FormatError) as exc:   # a lost or damaged commit: look further back
                self.refused.append(f"commit {seq}: {exc}")
                seq -= 1
                continue
            if rec.kind in ("init", "merge") and rec.fragment in want and rec.fragment not in found:
                if self.security is None or commit_signature_ok(rec, self.security.syncer.sign,
                                                                self.descriptor.run_id):
                    found[rec.fragment] = rec
                else:    # a forged commit is skipped: the newest genuine version is used instead
                    self.refused.append(f"commit {rec.seq}: bad syncer signature")
            seq -= 1
        missing = sorted(want - set(found))
        if missing:
            raise FormatError(f"{self.store.uri}: the log has no version of fragments {missing}")
        self.cursor = max(self.cursor, tail)
        self.newest = found
        return found

    def next_incarnation(self, learner: str) -> int:
        """One above the newest incarnation of ``learner`` that the newest commits merged (0 if
        none): the floor of its next claimed incarnation, so that a run whose learners once took
        wall-clock incarnations still orders new lives after old ones (storage/log.py)."""
        return 1 + max((rec.high_water[learner][0] for rec in self.newest.values() if learner in rec.high_water),
                       default=-1)

    def poll(self, limit: int = 256) -> list[CommitRecord]:
        """Commits after the cursor (at most ``limit``); the cursor moves past exactly the commits
        returned. A read that fails after some commits were read returns those (the failing one is
        read again next time); with none read, the error is raised."""
        out = []
        while len(out) < limit:
            try:
                rec = self._read(self.cursor + 1)
            except NotFound:
                break
            except (StoreError, FormatError):
                if not out:
                    raise
                break
            self.cursor += 1
            out.append(rec)
        return out

    def poll_fast(self, *, at_least: int = -1, map_fn: MapFn | None = None, limit: int = 256) -> list[CommitRecord]:
        """``poll`` with one request when nothing is new and parallel reads when something is.

        - Nothing announced beyond the cursor: one GET of the next commit; NotFound (the usual
          answer, as cheap as a request gets: no LIST, no HEAD, no walk) ends the poll.
        - It exists: the log's head hint (``hints/log-head``, which the syncer rewrites after
          every commit) and the commit after it are read at once; the hint says how far the log
          went, and the commits up to it and one past it are read in parallel through ``map_fn``
          (e.g. a pool's map) in windows of ``FETCH_WINDOW``, then on while more exist (the hint
          is advisory and may lag). One new commit costs 2 round trips (as the serial walk), k new
          ones 3 instead of k + 1.
        - ``at_least``: a seq known to exist (an announcement's): read up to it at once.

        The log decides, the hint only saves round trips: a missing, lagging or wrong hint costs
        requests, never a commit (one that points past the log is not followed again). As
        ``poll``, the cursor moves past exactly the commits returned, in order, and a read that
        fails with none read raises."""
        run = map_fn or map
        out: list[CommitRecord] = []
        known: dict[int, CommitRecord | Exception] = {}
        target = at_least
        if at_least <= self.cursor:
            first = self._try_read(self.cursor + 1)
            if isinstance(first, Exception):
                if isinstance(first, NotFound):
                    return []
                raise first
            self.cursor += 1
            out.append(first)
            hint, known[self.cursor + 1] = list(run(_call, [self._read_hint, partial(self._try_read, self.cursor + 1)]))
            target = hint if hint is not None and hint != self._dead_end else -1
        while len(out) < limit:
            end = min(max(target, self.cursor) + 1, self.cursor + min(FETCH_WINDOW, limit - len(out)))
            seqs = range(self.cursor + 1, end + 1)
            todo = [q for q in seqs if q not in known]
            known.update(zip(todo, run(self._try_read, todo)))
            for seq in seqs:
                got = known.pop(seq)
                if isinstance(got, CommitRecord):
                    self.cursor = seq
                    out.append(got)
                    continue
                if isinstance(got, NotFound) and seq <= target:
                    self._dead_end = target            # the hint pointed past the log
                if isinstance(got, NotFound) or out:
                    return out
                raise got
        return out

    def _read(self, seq: int) -> CommitRecord:
        """Commit ``seq``; int4 runs keep what was read for their chain walks."""
        rec = self._records.get(seq)
        if rec is not None:
            return rec
        rec = self.log.read(seq)
        if self.chained:
            with self._count_lock:
                self._records[seq] = rec
                while len(self._records) > RECORD_CACHE:     # the first read goes first (dicts keep order)
                    del self._records[next(iter(self._records))]
        return rec

    def _try_read(self, seq: int) -> CommitRecord | Exception:
        try:
            return self._read(seq)
        except (StoreError, FormatError) as exc:     # NotFound is a StoreError
            return exc

    def _read_hint(self) -> int | None:
        try:
            return unpack_head_hint(self.store.get(HEAD_HINT_KEY), what=f"{self.store.uri}/{HEAD_HINT_KEY}")
        except (StoreError, FormatError):
            return None

    def _get(self, key: str) -> bytes:
        size, limit = self.store.head(key).size, max_version_bytes(self.descriptor)
        if size > limit:   # checked before downloading: a planted huge object must not exhaust memory
            raise FormatError(f"{key}: {size} bytes exceeds the run's version size limit {limit}")
        blob = self.store.get(key)
        with self._count_lock:              # load may run on several threads (the receiver's pool)
            self.bytes_loaded += len(blob)  # versions-down traffic, for bandwidth figures
        return blob

    def load(self, record: CommitRecord) -> dict[str, np.ndarray]:
        """The values of ``record``'s version (FormatError when they fail a check, StoreError when
        storage fails). In an int4 run the values become the fragment's head, read-only."""
        if not self.chained:
            return decode_version(self._get(record.output_key), self.descriptor, record)
        head = self._heads.get(record.fragment)
        try:
            values = self._load_chain(record, head)
        except (NotFound, FormatError):
            if head is None:
                raise
            values = self._load_chain(record, None)   # the head is not on the way: from a snapshot
        with self._count_lock:
            self._heads[record.fragment] = (record, values)
        return values

    def _load_chain(self, record: CommitRecord, head: tuple[CommitRecord, dict] | None) -> dict[str, np.ndarray]:
        path = self._chain_path(record, head)
        start = path[0]
        if head is not None and start.seq == head[0].seq and start.output_checksum == head[0].output_checksum:
            values = head[1]
            sec = self.descriptor.security
            if len(path) == 1 and sec is not None:   # the head itself: its record must still be the syncer's
                check_commit_signature(record, sec.syncer.sign, self.descriptor.run_id, f"commit {record.seq}")
        elif start.kind == "init":
            values = decode_version(self._get(start.output_key), self.descriptor, start)
        else:
            values = decode_version(self._get(snapshot_key(start.output_key)), self.descriptor, start)
        for rec in path[1:]:
            values = decode_version_delta(self._get(rec.output_key), self.descriptor, rec, values)
        for a in values.values():
            a.flags.writeable = False
        return values

    def _chain_path(self, record: CommitRecord, head: tuple[CommitRecord, dict] | None) -> list[CommitRecord]:
        """The commits whose versions lead to ``record``'s, oldest first: from ``head`` when it is
        within ``full_every`` versions back, else from the newest full snapshot (FormatError when
        none is within the retained versions' reach)."""
        full_every = self.descriptor.versions.full_every
        limit = self.descriptor.versions.retain + full_every
        path, snapshot_at = [record], None
        rec = record
        while True:
            if head is not None and rec.seq == head[0].seq and rec.output_checksum == head[0].output_checksum:
                return path[::-1]
            if snapshot_at is None and (rec.kind == "init" or rec.info.get(SNAPSHOT_INFO)):
                snapshot_at = len(path)
            # past a snapshot, look for the head only within full_every deltas (cheaper than the snapshot)
            if snapshot_at is not None and (head is None or head[0].seq > rec.seq or len(path) > full_every):
                break
            if rec.kind == "init" or len(path) > limit:
                break
            older = self._older(record.fragment, rec.seq)
            if older is None:
                break
            path.append(older)
            rec = older
        if snapshot_at is None:
            raise FormatError(f"{self.store.uri}: no full snapshot of fragment {record.fragment} within "
                              f"{limit} versions before version {record.version} (commit {record.seq})")
        return path[:snapshot_at][::-1]

    def load_all(self) -> tuple[dict[str, np.ndarray], dict[int, int]]:
        """The full global model as it stands now: values and the version of each fragment."""
        values: dict[str, np.ndarray] = {}
        versions: dict[int, int] = {}
        for p, rec in sorted(self.latest().items()):
            part, rec = self._load_intact(p, rec)
            values.update(part)
            versions[p] = rec.version
        return values, versions

    def _load_intact(self, p: int, rec: CommitRecord) -> tuple[dict[str, np.ndarray], CommitRecord]:
        """``rec``'s version of fragment ``p``; when its object is damaged or missing, the newest of
        up to ``retain_versions`` older versions that loads (issue 11 item 10: a starting learner
        takes a slightly older version rather than dying; it applies newer ones as they come, and
        the syncer republishes the damaged one when it next starts). FormatError if none loads."""
        first: Exception | None = None
        for _ in range(self.descriptor.versions.retain + 1):
            try:
                return self.load(rec), rec
            except (NotFound, FormatError) as exc:
                first = first or exc
                self.refused.append(f"commit {rec.seq}: version {rec.version} of fragment {p}: {exc}")
            older = self._older(p, rec.seq)
            if older is None:
                break
            rec = older
        raise FormatError(f"{self.store.uri}: no intact version of fragment {p} near the end of the log "
                          f"(newest: {first})")

    def _older(self, p: int, before: int) -> CommitRecord | None:
        """The newest version-carrying commit of ``p`` before seq ``before`` that reads and verifies."""
        for seq in range(before - 1, -1, -1):
            try:
                rec = self._read(seq)
            except (NotFound, FormatError):
                continue
            if rec.kind in ("init", "merge") and rec.fragment == p and (
                    self.security is None or commit_signature_ok(rec, self.security.syncer.sign,
                                                                 self.descriptor.run_id)):
                return rec
        return None
