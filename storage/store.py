"""The object-store interface every component uses, key rules, and ``open_store(uri)`` (SPEC §7).

One small interface with two backends: a local directory (``storage/local.py``, the embedded
default) and S3 (``storage/s3.py``: AWS, MinIO, SeaweedFS). The semantics are S3's:

- ``put_if_absent`` is the only write that the log's safety rests on: atomic create-if-absent,
  ``AlreadyExists`` when the key exists (after an ambiguous, timed-out attempt that may be our own
  earlier write: callers that care read the key back and compare).
- ``put`` overwrites; use it only for advisory objects (hints) that readers verify.
- ``list`` returns keys in byte order (= log order for zero-padded numbers), optionally only those
  strictly after ``start_after``, at most ``limit`` of them.
- ``delete`` of a missing key is not an error.

Keys are relative to the run location, ``/``-separated, every segment from a safe alphabet
(``[A-Za-z0-9_=-]`` first, then also ``.``), at most 512 bytes: they map 1:1 onto file paths and
S3 keys and sort the same everywhere.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol, runtime_checkable
from urllib.parse import unquote, urlsplit

from .errors import BadLocation

MAX_KEY_BYTES = 512
_SEGMENT_RE = re.compile(r"^[A-Za-z0-9_=-][A-Za-z0-9._=-]*$")
_PREFIX_RE = re.compile(r"^[A-Za-z0-9._=/-]*$")


@dataclass(frozen=True)
class ObjectInfo:
    """What ``head`` reports about one object. ``etag`` is informational (backend specific)."""

    key: str
    size: int
    etag: str = ""


@runtime_checkable
class ObjectStore(Protocol):
    """A flat namespace of immutable-by-convention objects at one run location."""

    uri: str

    def get(self, key: str) -> bytes:
        """The object's bytes; ``NotFound`` if absent."""
        ...

    def head(self, key: str) -> ObjectInfo:
        """Size (and etag) of the object; ``NotFound`` if absent."""
        ...

    def exists(self, key: str) -> bool:
        """Whether the object exists (one cheap request)."""
        ...

    def put_if_absent(self, key: str, data: bytes) -> None:
        """Create the object atomically; ``AlreadyExists`` if the key exists."""
        ...

    def put(self, key: str, data: bytes) -> None:
        """Create or overwrite (advisory objects only: nothing's safety may rest on it)."""
        ...

    def list(self, prefix: str = "", start_after: str | None = None, limit: int | None = None) -> list[str]:
        """Keys starting with ``prefix``, strictly after ``start_after``, in byte order."""
        ...

    def delete(self, key: str) -> None:
        """Remove the object; a missing key is not an error."""
        ...


def check_key(key: str, uri: str = "") -> str:
    """Validate an object key (see the module docstring); ``BadLocation`` names what is wrong."""
    if not isinstance(key, str):
        raise BadLocation(f"object key must be a string, got {type(key).__name__}", uri=uri)
    if not key:
        raise BadLocation("object key must be non-empty", uri=uri)
    if len(key.encode()) > MAX_KEY_BYTES:
        raise BadLocation(f"object key {key[:40]!r}... is longer than {MAX_KEY_BYTES} bytes", uri=uri)
    for segment in key.split("/"):
        if not _SEGMENT_RE.match(segment):
            raise BadLocation(f"bad object key {key!r}: segment {segment!r} must match {_SEGMENT_RE.pattern} "
                              "(no empty, '.', '..' or hidden segments, no leading or trailing '/')", uri=uri)
    return key


def check_prefix(prefix: str, uri: str = "", what: str = "prefix") -> str:
    """Validate a list prefix or start-after marker: the key alphabet, no leading '/' or '..'."""
    if not isinstance(prefix, str):
        raise BadLocation(f"{what} must be a string, got {type(prefix).__name__}", uri=uri)
    if not _PREFIX_RE.match(prefix) or prefix.startswith("/") or "//" in prefix or ".." in prefix.split("/"):
        raise BadLocation(f"bad {what} {prefix!r}: use the key alphabet [A-Za-z0-9._=-] and '/'", uri=uri)
    if len(prefix.encode()) > MAX_KEY_BYTES:
        raise BadLocation(f"{what} is longer than {MAX_KEY_BYTES} bytes", uri=uri)
    return prefix


def check_limit(limit: int | None, uri: str = "") -> int | None:
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 0):
        raise BadLocation(f"list limit must be a non-negative int or None, got {limit!r}", uri=uri)
    return limit


def open_store(uri: str, *, s3_endpoint: str | None = None, path_style: bool | None = None,
               connect_timeout: float = 1.0, read_timeout: float = 5.0, attempts: int = 2,
               create: bool = True, profile: str | None = None) -> ObjectStore:
    """Open the run location ``uri``.

    - a plain path or ``file:///abs/path``: a ``LocalStore`` (the directory is created, unless
      ``create=False``: then a missing directory is ``NotFound`` - for everything that joins or
      reads an existing run, so that a mistyped path never becomes a new, empty store);
    - ``s3://bucket/prefix``: an ``S3Store``; keys are relative to ``prefix``. The endpoint is
      ``s3_endpoint`` or the standard ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``; credentials
      and region come from the standard AWS chain. ``path_style`` defaults to True when a custom
      endpoint is set (MinIO, SeaweedFS). ``connect_timeout``/``read_timeout`` (seconds) and
      ``attempts`` (total tries per call) bound how long a dead store takes to raise ``Unavailable``.
      ``profile``: the AWS shared-config profile for its credentials (s3:// only; a region's, issue 14).
    """
    if not isinstance(uri, str) or not uri.strip():
        raise BadLocation(f"store URI must be a non-empty string, got {uri!r}")
    if not (isinstance(attempts, int) and attempts >= 1):
        raise ValueError(f"attempts must be an int >= 1, got {attempts!r}")
    for name, value in (("connect_timeout", connect_timeout), ("read_timeout", read_timeout)):
        if not (isinstance(value, (int, float)) and value > 0):
            raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    if profile is not None and not uri.lower().startswith("s3://"):
        raise ValueError(f"a credentials profile ({profile!r}) applies to s3:// stores only, not {uri!r}")
    if "://" not in uri:
        if re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:", uri):
            raise BadLocation(f"store URI {uri!r} looks like a URI without '//': use file:///abs/path, "
                              "s3://bucket/prefix or a plain directory path")
        from .local import LocalStore
        return LocalStore(uri, create=create)
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise BadLocation(f"file URI {uri!r} names host {parts.netloc!r}; use file:///absolute/path")
        if parts.query or parts.fragment:
            raise BadLocation(f"file URI {uri!r} must not carry a query or fragment")
        path = unquote(parts.path)
        if not path.startswith("/"):
            raise BadLocation(f"file URI {uri!r} must hold an absolute path (file:///abs/path)")
        from .local import LocalStore
        return LocalStore(path, create=create)
    if scheme == "s3":
        from .s3 import S3Store
        return S3Store(uri, endpoint=s3_endpoint, path_style=path_style, connect_timeout=connect_timeout,
                       read_timeout=read_timeout, attempts=attempts, profile=profile)
    raise BadLocation(f"unsupported store URI {uri!r}: use a directory path, file:///abs/path or s3://bucket/prefix")
