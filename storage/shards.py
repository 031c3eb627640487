"""One syncer shard's view of a sharded run (docs/storage.md "Sharded runs").

A run whose descriptor says ``syncers`` N >= 2 has N syncer shards; shard i owns the fragments
p with ``p % N == i`` (storage/layout.py ``shard_owner``). Each shard has its own epochs, commit
log, hints, checkpoints and spill inbox under ``shards/s<iiii>/``; the descriptor, the versions,
the deltas and the learners' incarnations are shared.

``ShardStore`` is that partition seen as an ordinary ``ObjectStore``: it maps every key through
``layout.shard_key`` (and back in listings), and hides the versions of fragments the shard does
not own from listings, so that the syncer, recovery, retention, replay, ``log`` and ``export``
run on a shard unchanged: each one of them sees "a run" whose log is that shard's log. Every
shard's log begins with the same init commits (version 0 of every fragment, the same objects):
one shard replays from its own log alone, and its state holds the other shards' fragments at
version 0, which it never changes.

With N = 1 there is no ``ShardStore``: ``shard_stores`` returns the run's store itself, so an
unsharded run keeps its layout and bytes exactly.
"""
from __future__ import annotations

from typing import Sequence

from pipeline.errors import FormatError
from pipeline.descriptor import RunDescriptor

from .layout import (SHARDED_PREFIXES, VERSION_PREFIX, check_shard, parse_version_key, shard_fragments, shard_key,
                     shard_prefix)
from .store import ObjectInfo, ObjectStore

LIST_PAGE = 1000


class ShardStore:
    """Shard ``shard`` of ``syncers``: the run's store with that shard's partition in place of the
    unsharded keys (see the module docstring). ``uri`` is the run's, ``fragments`` what it owns."""

    def __init__(self, inner: ObjectStore, shard: int, syncers: int, num_fragments: int):
        check_shard(shard, syncers)
        if syncers < 2:
            raise ValueError("a ShardStore is for sharded runs (syncers >= 2); use the run's store itself")
        self.inner, self.shard, self.syncers = inner, shard, syncers
        self.fragments = shard_fragments(shard, syncers, num_fragments)
        self._owned = set(self.fragments)
        self.uri = inner.uri
        self.prefix = shard_prefix(shard)

    def __repr__(self) -> str:
        return f"ShardStore({self.uri!r}, shard {self.shard}/{self.syncers})"

    def _k(self, key: str) -> str:
        return shard_key(self.shard, key)

    def get(self, key: str) -> bytes:
        return self.inner.get(self._k(key))

    def head(self, key: str) -> ObjectInfo:
        info = self.inner.head(self._k(key))
        return ObjectInfo(key, info.size, info.etag)

    def exists(self, key: str) -> bool:
        return self.inner.exists(self._k(key))

    def put_if_absent(self, key: str, data: bytes) -> None:
        self.inner.put_if_absent(self._k(key), data)

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(self._k(key), data)

    def delete(self, key: str) -> None:
        self.inner.delete(self._k(key))

    def list(self, prefix: str = "", start_after: str | None = None, limit: int | None = None) -> list[str]:
        """Keys of the partition under a sharded prefix (``log/``, ``spill/``, ...), with the
        partition's prefix taken off; any other prefix lists the shared keys, less other shards'
        partitions and the versions of fragments this shard does not own."""
        if prefix.startswith(SHARDED_PREFIXES):
            cut = len(self.prefix)
            after = None if start_after is None else self._k(start_after)
            return [k[cut:] for k in self.inner.list(self._k(prefix), after, limit)]
        if any(p.startswith(prefix) for p in SHARDED_PREFIXES):
            raise ValueError(f"{self!r}: listing {prefix!r} would mix the shard's partition with shared keys; "
                             "list one prefix of storage/layout.py at a time")
        out: list[str] = []
        after = start_after
        while limit is None or len(out) < limit:
            page = self.inner.list(prefix, after, LIST_PAGE if limit is None else max(limit - len(out), 1))
            out.extend(k for k in page if self._visible(k))
            if not page or (limit is None and len(page) < LIST_PAGE):
                break
            after = page[-1]
        return out if limit is None else out[:limit]

    def _visible(self, key: str) -> bool:
        if key.startswith(VERSION_PREFIX):
            try:
                return parse_version_key(key)[0] in self._owned
            except FormatError:
                return True
        return True


def shard_stores(store: ObjectStore, descriptor: RunDescriptor) -> list[ObjectStore]:
    """Every shard's view of the run, in shard order: ``[store]`` itself for an unsharded run."""
    n = descriptor.syncers
    if n == 1:
        return [store]
    return [ShardStore(store, i, n, descriptor.num_fragments) for i in range(n)]


def owned_fragments(store: ObjectStore, descriptor: RunDescriptor) -> Sequence[int]:
    """The fragments whose commits ``store``'s log holds: a shard's, or all of them."""
    view = _shard_view(store)
    return view.fragments if view is not None else range(descriptor.num_fragments)


def shard_of(store: ObjectStore) -> tuple[int, int]:
    """(shard, syncers) of a store: (0, 1) for a run's own store."""
    view = _shard_view(store)
    return (view.shard, view.syncers) if view is not None else (0, 1)


def _shard_view(store: ObjectStore) -> "ShardStore | None":
    """The ShardStore ``store`` is, or wraps (a wrapper that delegates, as the syncer's size-noting
    store does, exposes it as ``shard_view``)."""
    if isinstance(store, ShardStore):
        return store
    inner = getattr(store, "shard_view", None)
    return inner if isinstance(inner, ShardStore) else None


def syncer_store(store: ObjectStore, descriptor: RunDescriptor, shard: int | None) -> ObjectStore:
    """The store a syncer runs on: shard ``shard``'s view of a sharded run, the run's store for an
    unsharded one. ValueError when ``shard`` does not fit the run (a sharded run needs one, an
    unsharded run takes none: either mistake would commit into the wrong log)."""
    n = descriptor.syncers
    if shard is None:
        if n > 1:
            raise ValueError(f"run {descriptor.run_id} has {n} syncer shards: start each with --shard i/{n}")
        return store
    if n == 1:
        raise ValueError(f"run {descriptor.run_id} is not sharded (one syncer): drop --shard")
    check_shard(shard, n)
    return ShardStore(store, shard, n, descriptor.num_fragments)


def run_records(store: ObjectStore, descriptor: RunDescriptor) -> list:
    """Every commit of the run, for figures and tools that read a whole run: the log of an
    unsharded run; in a sharded run each shard's log in shard order, the shared init commits
    once (shard 0's). Seqs are per shard there: (shard, seq) names a commit."""
    from .log import CommitLog
    out = []
    for i, s in enumerate(shard_stores(store, descriptor)):
        log = CommitLog(s)
        out.extend(r for r in log.read_range(0, log.tail() + 1) if i == 0 or r.kind != "init")
    return out
