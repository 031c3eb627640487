"""Request and byte accounting for an object store: ``CountingStore(inner)``.

A transparent ``ObjectStore`` wrapper that counts what the calls through it would cost on S3,
thread-safe, read with ``snapshot()`` (a frozen ``StoreCounters``; subtract two for an interval,
e.g. one outer step). Counting rules, chosen to match how S3 bills requests:

- every call counts as the request(s) it makes, whether it succeeds or fails (S3 bills a 404 GET
  and a 412 conditional PUT too); ``exists`` is a HEAD;
- ``list`` counts one LIST per page of up to ``page_size`` keys returned (the inner store's
  ``page_size``, else 1000, S3's maximum), at least one; ``limit=0`` makes no request;
- a write larger than the inner store's multipart threshold (``S3Store.transfer``) counts its
  parts plus the initiating and completing requests as PUTs (``multipart_puts``), as S3 bills them;
- bytes count only for calls that succeeded: ``bytes_written`` (PUT bodies, client -> store) and
  ``bytes_read`` (GET bodies, store -> client). Request headers and listings are not counted.

It counts calls, not wire traffic: a retry inside the inner store (botocore's second attempt)
is invisible here, and a ``LocalStore`` is counted as if it were S3.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass, fields

from .store import ObjectInfo, ObjectStore

DEFAULT_PAGE_SIZE = 1000
# What the inner store says about itself (where it is, how it pages and uploads), read through the
# wrapper so that code locating a store (storage/regions.py) sees a counted one as the same store.
# Only plain attributes: every call still goes through the counting methods below.
DESCRIBING = frozenset({"endpoint", "root", "bucket", "prefix", "page_size", "transfer"})


@dataclass(frozen=True)
class StoreCounters:
    """Requests by kind and bytes moved through one ``CountingStore`` (a snapshot or a difference)."""

    put: int = 0              # PutObject (overwrite)
    put_if_absent: int = 0    # conditional PutObject (If-None-Match: *)
    multipart_puts: int = 0   # extra requests of multipart uploads (initiate, parts, complete), PUT-priced
    get: int = 0              # GetObject
    head: int = 0             # HeadObject (also ``exists``)
    list: int = 0             # ListObjectsV2 pages
    delete: int = 0           # DeleteObject
    failed: int = 0           # calls that raised (already counted above by kind)
    bytes_written: int = 0    # bodies of successful writes
    bytes_read: int = 0       # bodies of successful reads

    @property
    def requests(self) -> int:
        """Every request counted (all kinds, including the multipart extras)."""
        return (self.put + self.put_if_absent + self.multipart_puts + self.get + self.head + self.list
                + self.delete)

    def __add__(self, other: "StoreCounters") -> "StoreCounters":
        if not isinstance(other, StoreCounters):
            return NotImplemented
        return StoreCounters(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def __sub__(self, other: "StoreCounters") -> "StoreCounters":
        """The counts between two snapshots (``later - earlier``)."""
        if not isinstance(other, StoreCounters):
            return NotImplemented
        return StoreCounters(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class CountingStore:
    """An ``ObjectStore`` that forwards every call to ``inner`` and counts it (module docstring)."""

    def __init__(self, inner: ObjectStore) -> None:
        if not isinstance(inner, ObjectStore):
            raise TypeError(f"CountingStore wraps an ObjectStore, got {type(inner).__name__}")
        self.inner = inner
        self.uri = inner.uri
        self._lock = threading.Lock()
        self._counts = {f.name: 0 for f in fields(StoreCounters)}

    def __repr__(self) -> str:
        return f"CountingStore({self.inner!r})"

    def __getattr__(self, name: str):
        # Called only for names not found on the wrapper: the inner store's describing attributes.
        if name in DESCRIBING:
            return getattr(self.__dict__["inner"], name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def snapshot(self) -> StoreCounters:
        """The counts so far (consistent: taken under the lock)."""
        with self._lock:
            return StoreCounters(**self._counts)

    # -- reads ---------------------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        self._add(get=1)
        data = self._call(self.inner.get, key)
        self._add(bytes_read=len(data))
        return data

    def head(self, key: str) -> ObjectInfo:
        self._add(head=1)
        return self._call(self.inner.head, key)

    def exists(self, key: str) -> bool:
        self._add(head=1)
        return self._call(self.inner.exists, key)

    def list(self, prefix: str = "", start_after: str | None = None, limit: int | None = None) -> list[str]:
        if limit == 0:
            return self.inner.list(prefix, start_after, limit)    # no request is made
        try:
            keys = self.inner.list(prefix, start_after, limit)
        except Exception:
            self._add(list=1, failed=1)
            raise
        page = getattr(self.inner, "page_size", DEFAULT_PAGE_SIZE)
        self._add(list=max(1, math.ceil(len(keys) / page)))
        return keys

    # -- writes --------------------------------------------------------------------------------

    def put_if_absent(self, key: str, data: bytes) -> None:
        self._write(self.inner.put_if_absent, "put_if_absent", key, data)

    def put(self, key: str, data: bytes) -> None:
        self._write(self.inner.put, "put", key, data)

    def delete(self, key: str) -> None:
        self._add(delete=1)
        self._call(self.inner.delete, key)

    # -- helpers -------------------------------------------------------------------------------

    def _write(self, fn, kind: str, key: str, data: bytes) -> None:
        self._add(**{kind: 1, "multipart_puts": self._multipart_extra(len(data))})
        self._call(fn, key, data)
        self._add(bytes_written=len(data))

    def _multipart_extra(self, size: int) -> int:
        """Requests beyond the one counted by kind when the inner store uploads in parts:
        initiate + N parts + complete = N + 2, so N + 1 extra."""
        transfer = getattr(self.inner, "transfer", None)
        threshold = getattr(transfer, "multipart_threshold", None)
        chunk = getattr(transfer, "multipart_chunksize", None)
        if not threshold or not chunk or size <= threshold:
            return 0
        return math.ceil(size / chunk) + 1

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except Exception:
            self._add(failed=1)
            raise

    def _add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                self._counts[name] += n
