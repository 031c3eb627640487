"""Shared test fixtures and helpers.

- ``s3_server`` (session): one local SeaweedFS S3 server on 127.0.0.1 for the whole run, started
  on first use, SIGKILLed and its directory removed at the end.
- ``s3_env``: points the standard AWS variables at that server for one test.
- ``store``: a fresh, empty run location, parametrised over ``local`` (a temp directory) and
  ``s3`` (a fresh prefix in the server's bucket).
- ``make_commit``: builds ``CommitRecord`` objects; ``FlakyStore``: wraps a store to inject
  failures (also after a write landed: the ambiguous timeout) and to count calls.
"""
from __future__ import annotations

import shutil
import threading
import uuid
from collections import Counter
from typing import Callable

import pytest

from pipeline.types import CommitRecord, InputRecord
from storage.errors import StoreError, Unavailable
from storage.store import ObjectInfo, ObjectStore, open_store

_AWS_VARS_TO_CLEAR = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN",
                      "AWS_SECURITY_TOKEN", "AWS_DEFAULT_REGION")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A session-wide local S3 server (SeaweedFS). Fails loudly if ``weed`` is missing."""
    from infra.s3server import S3Server

    directory = tmp_path_factory.mktemp("s3server")
    server = S3Server(directory).start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(directory, ignore_errors=True)


def use_s3_env(monkeypatch, server) -> None:
    """Point the standard AWS variables at ``server`` (restored after the test)."""
    for name in _AWS_VARS_TO_CLEAR:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/ddiloco-test-credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/ddiloco-test-config")
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    use_s3_env(monkeypatch, s3_server)
    return s3_server


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path) -> ObjectStore:
    """A fresh, empty run location on each backend."""
    if request.param == "local":
        return open_store(str(tmp_path / "run"))
    server = request.getfixturevalue("s3_env")
    return open_store(server.uri(f"t-{uuid.uuid4().hex[:12]}"))


def make_commit(seq: int, epoch: int = 1, kind: str = "merge", fragment: int = 0, version: int | None = None,
                inputs: tuple[str, ...] = (), dropped: tuple = (), output_key: str = "", **info) -> CommitRecord:
    """A ``CommitRecord`` for tests; ``inputs`` are delta keys (other input fields are dummies)."""
    records = tuple(InputRecord(delta_id=f"x/0/{i}", learner="x", incarnation=0, seq=i, key=k, checksum="0" * 64,
                                base_version=0, c_steps=1, c_tokens=1, learner_step=i, weight=1.0, staleness=0)
                    for i, k in enumerate(inputs))
    return CommitRecord(seq=seq, epoch=epoch, kind=kind, fragment=fragment,
                        version=seq if version is None else version, inputs=records, dropped=tuple(dropped),
                        output_key=output_key, info=dict(info))


@pytest.fixture(name="make_commit")
def make_commit_fixture() -> Callable[..., CommitRecord]:
    return make_commit


class FlakyStore:
    """Wraps an ``ObjectStore``: counts calls per operation and injects failures.

    ``fail(op, times=1, prefix="", after=False)``: the next ``times`` calls of ``op`` on keys
    starting with ``prefix`` raise ``Unavailable``; with ``after=True`` the call is performed
    first (the write lands, then the "timeout"). ``before(op, prefix, fn)``: run ``fn(key)`` once
    before the next matching call (to interleave another writer deterministically).
    """

    OPS = ("get", "head", "exists", "put_if_absent", "put", "list", "delete")

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.uri = inner.uri
        self.calls: Counter[str] = Counter()
        self._faults: list[dict] = []
        self._hooks: list[tuple[str, str, Callable[[str], None]]] = []
        self._lock = threading.Lock()

    def fail(self, op: str, times: int = 1, prefix: str = "", after: bool = False,
             error: type[StoreError] = Unavailable) -> None:
        assert op in self.OPS, op
        self._faults.append({"op": op, "left": times, "prefix": prefix, "after": after, "error": error})

    def before(self, op: str, prefix: str, fn: Callable[[str], None]) -> None:
        self._hooks.append((op, prefix, fn))

    def _call(self, op: str, key: str, *args):
        with self._lock:
            self.calls[op] += 1
            hook = next((h for h in self._hooks if h[0] == op and key.startswith(h[1])), None)
            if hook:
                self._hooks.remove(hook)
            fault = next((f for f in self._faults if f["op"] == op and f["left"] > 0 and key.startswith(f["prefix"])),
                         None)
            if fault:
                fault["left"] -= 1
        if hook:
            hook[2](key)
        if fault and not fault["after"]:
            raise fault["error"]("injected failure (before)", uri=self.uri, key=key)
        if fault:  # the call reaches the store, whatever it answers is lost
            try:
                getattr(self.inner, op)(key, *args)
            except StoreError:
                pass
            raise fault["error"]("injected failure (after the call reached the store)", uri=self.uri, key=key)
        return getattr(self.inner, op)(key, *args)

    def get(self, key: str) -> bytes:
        return self._call("get", key)

    def head(self, key: str) -> ObjectInfo:
        return self._call("head", key)

    def exists(self, key: str) -> bool:
        return self._call("exists", key)

    def put_if_absent(self, key: str, data: bytes) -> None:
        return self._call("put_if_absent", key, data)

    def put(self, key: str, data: bytes) -> None:
        return self._call("put", key, data)

    def list(self, prefix: str = "", start_after: str | None = None, limit: int | None = None) -> list[str]:
        return self._call("list", prefix, start_after, limit)

    def delete(self, key: str) -> None:
        return self._call("delete", key)


@pytest.fixture(name="flaky")
def flaky_fixture() -> type[FlakyStore]:
    return FlakyStore
