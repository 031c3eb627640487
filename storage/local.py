"""Local-directory object store: the embedded default (``/path`` or ``file:///path``), SPEC §7.

Key ``a/b/c`` is the file ``ROOT/a/b/c``. Every write goes to a temporary file under
``ROOT/.tmp`` (same filesystem), is fsynced, then becomes visible in one atomic step:

- ``put_if_absent``: ``link(tmp, target)`` fails if the target exists, so of several processes
  creating one key exactly one wins, and a reader never sees a partial object;
- ``put``: ``rename(tmp, target)`` replaces atomically.

The parent directory is fsynced afterwards so an acknowledged object survives a power cut. A
crash leaves at most a stray temporary file (never listed; swept after an hour). Listing walks
only the directories that can hold matching keys and sorts, so order equals S3's byte order.
A directory store cannot hold both ``a`` and ``a/b`` (S3 can); the run layout never needs it.
"""
from __future__ import annotations

import errno
import os
import time
import uuid

from .errors import AlreadyExists, BadLocation, NotFound, StoreError, Unavailable
from .store import ObjectInfo, check_key, check_limit, check_prefix

TMP_DIR = ".tmp"
STALE_TMP_S = 3600.0
_RETRYABLE_ERRNOS = {errno.EIO, errno.ENOSPC, errno.EAGAIN, errno.EBUSY, errno.EINTR, errno.ESTALE,
                     errno.ETIMEDOUT, errno.EDQUOT, errno.EMFILE, errno.ENFILE}


class LocalStore:
    """An ``ObjectStore`` on a local (or shared POSIX) directory; safe for several processes."""

    def __init__(self, root: str, create: bool = True) -> None:
        """``create=False``: the directory must exist (``NotFound`` otherwise). Commands that join
        or read a run pass it, so that a mistyped path is an error, not a new empty store."""
        if not isinstance(root, str) or not root.strip():
            raise BadLocation(f"local store path must be a non-empty string, got {root!r}")
        self.root = os.path.abspath(os.path.expanduser(root))
        self.uri = "file://" + self.root
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise BadLocation("exists and is not a directory", uri=self.uri)
        if not create and not os.path.isdir(self.root):
            raise NotFound(f"no run at {root} (no such directory; only `ddiloco run` creates one)", uri=self.uri)
        try:
            os.makedirs(os.path.join(self.root, TMP_DIR), exist_ok=True)
        except OSError as exc:
            raise self._os_error(exc, None, "cannot create the store directory") from None
        self._sweep_stale_tmp()

    def __repr__(self) -> str:
        return f"LocalStore({self.root!r})"

    # -- reads ---------------------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                return f.read()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise NotFound("no such object", uri=self.uri, key=key) from None
        except OSError as exc:
            raise self._os_error(exc, key, "read failed") from None

    def head(self, key: str) -> ObjectInfo:
        path = self._path(key)
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            raise NotFound("no such object", uri=self.uri, key=key) from None
        except OSError as exc:
            raise self._os_error(exc, key, "stat failed") from None
        if not os.path.isfile(path):
            raise NotFound("no such object (a directory of other keys)", uri=self.uri, key=key)
        return ObjectInfo(key=key, size=st.st_size, etag=f"{st.st_mtime_ns:x}-{st.st_size:x}")

    def exists(self, key: str) -> bool:
        return os.path.isfile(self._path(key))

    def list(self, prefix: str = "", start_after: str | None = None, limit: int | None = None) -> list[str]:
        check_prefix(prefix, self.uri)
        if start_after is not None:
            check_prefix(start_after, self.uri, "start_after")
        check_limit(limit, self.uri)
        if limit == 0:
            return []
        base = prefix.rpartition("/")[0]  # the deepest directory that holds every match
        keys: list[str] = []
        self._walk(base, prefix, start_after, keys)
        keys.sort()
        return keys if limit is None else keys[:limit]

    def _walk(self, rel: str, prefix: str, start_after: str | None, out: list[str]) -> None:
        directory = os.path.join(self.root, *rel.split("/")) if rel else self.root
        try:
            entries = list(os.scandir(directory))
        except (FileNotFoundError, NotADirectoryError):
            return  # nothing there (or pruned concurrently)
        except OSError as exc:
            raise self._os_error(exc, rel or None, "list failed") from None
        for entry in entries:
            if entry.name.startswith("."):
                continue  # temporary files and anything that is not a key
            key = f"{rel}/{entry.name}" if rel else entry.name
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except OSError:
                continue
            if is_dir:
                # Keys under key/ lie strictly between key+"/" and key+"0" in byte order.
                inside = key + "/"
                if not (inside.startswith(prefix) or prefix.startswith(inside)):
                    continue
                if start_after is not None and start_after >= key + "0":
                    continue
                self._walk(key, prefix, start_after, out)
            elif key.startswith(prefix) and (start_after is None or key > start_after):
                out.append(key)

    # -- writes --------------------------------------------------------------------------------

    def put_if_absent(self, key: str, data: bytes) -> None:
        path = self._path(key)
        tmp = self._write_tmp(key, data)
        try:
            for _ in range(8):
                self._make_parent(key, path)
                try:
                    os.link(tmp, path)  # atomic, never overwrites
                    break
                except FileExistsError:
                    if os.path.isdir(path):
                        raise BadLocation("key is a directory of other keys in this local store",
                                          uri=self.uri, key=key) from None
                    raise AlreadyExists("object exists (create-if-absent refused)", uri=self.uri, key=key) from None
                except FileNotFoundError:
                    continue  # a concurrent delete pruned the parent directory: recreate it
                except OSError as exc:
                    if exc.errno in (errno.EPERM, errno.ENOTSUP, errno.EXDEV, errno.EMLINK):
                        raise StoreError(f"this filesystem refuses hard links ({exc.strerror}); "
                                         "create-if-absent cannot be atomic here", uri=self.uri, key=key) from None
                    raise self._os_error(exc, key, "create failed") from None
            else:
                raise Unavailable("parent directory kept disappearing", uri=self.uri, key=key)
            self._fsync_dir(os.path.dirname(path))
        finally:
            _unlink_quietly(tmp)

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        tmp = self._write_tmp(key, data)
        try:
            for _ in range(8):
                self._make_parent(key, path)
                try:
                    if os.path.isdir(path):
                        raise BadLocation("key is a directory of other keys in this local store",
                                          uri=self.uri, key=key)
                    os.replace(tmp, path)
                    break
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    raise self._os_error(exc, key, "write failed") from None
            else:
                raise Unavailable("parent directory kept disappearing", uri=self.uri, key=key)
            self._fsync_dir(os.path.dirname(path))
        finally:
            _unlink_quietly(tmp)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            os.unlink(path)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return
        except OSError as exc:
            if exc.errno == errno.EISDIR:
                return
            raise self._os_error(exc, key, "delete failed") from None
        # Prune now-empty parents so listings stay cheap; a concurrent writer recreates them.
        for parent in self._parents(path):
            try:
                os.rmdir(parent)
            except OSError:
                break

    # -- helpers -------------------------------------------------------------------------------

    def _path(self, key: str) -> str:
        check_key(key, self.uri)
        return os.path.join(self.root, *key.split("/"))

    def _make_parent(self, key: str, path: str) -> None:
        for _ in range(8):
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                return
            except FileNotFoundError:
                continue   # a concurrent delete pruned a parent while makedirs walked down: again
            except (FileExistsError, NotADirectoryError):
                # Also what a race looks like: makedirs' mkdir met the directory, then a concurrent
                # delete pruned it before makedirs checked it was a directory (a busy clean-clone CI
                # run). Only an object where a parent directory belongs is bad input; else again.
                if self._object_above(path):
                    raise BadLocation("a parent of this key is an object in this local store (a directory "
                                      "store cannot hold both 'a' and 'a/b')", uri=self.uri, key=key) from None
                continue
            except OSError as exc:
                raise self._os_error(exc, key, "cannot create the parent directory") from None
        raise Unavailable("parent directory kept disappearing", uri=self.uri, key=key)

    def _parents(self, path: str):
        """The directories above ``path`` inside the root, nearest first."""
        parent = os.path.dirname(path)
        while parent != self.root and parent.startswith(self.root):
            yield parent
            parent = os.path.dirname(parent)

    def _object_above(self, path: str) -> bool:
        """Whether a parent of ``path`` below the root is an object (a file), not a directory."""
        return any(os.path.lexists(p) and not os.path.isdir(p) for p in self._parents(path))

    def _write_tmp(self, key: str, data: bytes) -> str:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"object data must be bytes, got {type(data).__name__}")
        tmp = os.path.join(self.root, TMP_DIR, uuid.uuid4().hex)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileNotFoundError:  # .tmp removed by hand: recreate once
            os.makedirs(os.path.dirname(tmp), exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as exc:
            raise self._os_error(exc, key, "cannot create a temporary file") from None
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except OSError as exc:
            os.close(fd)
            _unlink_quietly(tmp)
            raise self._os_error(exc, key, "write failed") from None
        os.close(fd)
        return tmp

    def _fsync_dir(self, directory: str) -> None:
        try:
            fd = os.open(directory, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:
            pass  # some filesystems refuse fsync on directories; the rename is still atomic
        finally:
            os.close(fd)

    def _sweep_stale_tmp(self) -> None:
        """Remove temporary files left by crashed writers (older than an hour: never in flight)."""
        tmp_dir = os.path.join(self.root, TMP_DIR)
        now = time.time()
        try:
            for entry in os.scandir(tmp_dir):
                try:
                    if now - entry.stat().st_mtime > STALE_TMP_S:
                        os.unlink(entry.path)
                except OSError:
                    pass
        except OSError:
            pass

    def _os_error(self, exc: OSError, key: str | None, what: str) -> StoreError:
        detail = f"{what}: {exc.strerror or exc}"
        if exc.errno in _RETRYABLE_ERRNOS:
            return Unavailable(detail, uri=self.uri, key=key)
        return StoreError(detail, uri=self.uri, key=key)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
