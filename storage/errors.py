"""Errors of the object stores and the run log (SPEC §7). Each says whether retrying can help.

| error          | retryable | meaning                                                              |
|----------------|-----------|----------------------------------------------------------------------|
| NotFound       | no        | the key (or the run) does not exist                                  |
| AlreadyExists  | no        | create-if-absent refused: the key exists (HTTP 412)                  |
| Conflict       | yes       | concurrent modification of the same key (HTTP 409): try again        |
| Unavailable    | yes       | store unreachable, timed out, throttled or 5xx: try again later      |
| Fenced         | no        | a newer syncer epoch owns the log: this syncer must stop cleanly     |
| BadLocation    | no        | a malformed URI or key (also a ``ValueError``)                       |

A write that ends in ``Unavailable`` is *ambiguous*: it may have landed. Callers that care
(the commit log) read the key back and compare bytes.
"""
from __future__ import annotations

from pipeline.errors import DilocoError


class StoreError(DilocoError):
    """Base of storage errors. The message names the store URI and, when there is one, the key."""

    retryable = False

    def __init__(self, detail: str, *, uri: str = "", key: str | None = None) -> None:
        self.detail = detail
        self.uri = uri
        self.key = key
        where = uri.rstrip("/") if uri else ""
        if key is not None:
            where = f"{where}/{key}" if where else key
        super().__init__(f"{where}: {detail}" if where else detail)


class NotFound(StoreError):
    """The key does not exist (fatal for that key)."""


class AlreadyExists(StoreError):
    """Create-if-absent refused because the key exists (fatal for that key)."""


class Conflict(StoreError):
    """A concurrent modification of the same key (HTTP 409); the same call may succeed later."""

    retryable = True


class Unavailable(StoreError):
    """The store is unreachable, timed out, throttled or failing (5xx); retry later."""

    retryable = True


class Fenced(StoreError):
    """This syncer's epoch was superseded by a newer syncer; stop cleanly, do not retry."""


class BadLocation(StoreError, ValueError):
    """A malformed store URI or object key."""
