"""A store that wraps another and sees every request: the base of the wrappers tests and benchmarks
put around a run's store (counting by operation, adding a round trip, failing on cue).

``StoreWrapper`` forwards each ``ObjectStore`` method to ``inner`` through one hook,
``_call(op, key, fn, *args)``; a subclass overrides the hook instead of repeating all seven
methods. Reads are ``get``, ``head``, ``exists`` and ``list`` (``key`` is the prefix); writes are
``put``, ``put_if_absent`` and ``delete``.
"""
from __future__ import annotations

from typing import Any, Callable

from .store import ObjectInfo, ObjectStore

READS = ("get", "head", "exists", "list")


class StoreWrapper:
    """Forwards every request to ``inner`` through ``_call`` (the default hook just calls it)."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner, self.uri = inner, inner.uri

    def _call(self, op: str, key: str, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)

    def get(self, key: str) -> bytes:
        return self._call("get", key, self.inner.get, key)

    def head(self, key: str) -> ObjectInfo:
        return self._call("head", key, self.inner.head, key)

    def exists(self, key: str) -> bool:
        return self._call("exists", key, self.inner.exists, key)

    def list(self, prefix: str = "", start_after: str | None = None, limit: int | None = None) -> list[str]:
        return self._call("list", prefix, self.inner.list, prefix, start_after, limit)

    def put(self, key: str, data: bytes) -> None:
        return self._call("put", key, self.inner.put, key, data)

    def put_if_absent(self, key: str, data: bytes) -> None:
        return self._call("put_if_absent", key, self.inner.put_if_absent, key, data)

    def delete(self, key: str) -> None:
        return self._call("delete", key, self.inner.delete, key)
