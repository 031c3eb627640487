"""One contract for every object store: the local directory and a real S3 server (SeaweedFS).

Covers round trips (0 bytes to > 64 MiB, multipart), ordered listing with start-after and
pagination, create-if-absent races between threads and processes, dead and killed servers,
the conformance probe, bad keys and bad URIs. Log-level timelines live in test_log.py.
"""
from __future__ import annotations

import multiprocessing
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import FlakyStore, make_commit, use_s3_env
from storage.errors import AlreadyExists, BadLocation, NotFound, StoreError, Unavailable
from storage.log import CommitLog
from storage.probe import probe_conditional_writes
from storage.s3 import S3Store
from storage.store import ObjectStore, open_store


def test_round_trips_small_sizes(store):
    for size in (0, 1, 1000, (1 << 20) + 7):
        data = os.urandom(size)
        key = f"blobs/b{size}"
        assert not store.exists(key)
        store.put_if_absent(key, data)
        assert store.get(key) == data
        assert store.head(key).size == size and store.head(key).key == key
        assert store.exists(key)


def test_large_blob_round_trip_uses_multipart(store):
    data = os.urandom((65 << 20) + 3)  # > 64 MiB: several 16 MiB parts on S3
    store.put_if_absent("big/blob", data)
    info = store.head("big/blob")
    assert info.size == len(data)
    if isinstance(store, S3Store):
        assert info.etag.endswith("-5"), f"expected a 5-part multipart ETag, got {info.etag}"
    assert store.get("big/blob") == data


def test_conditional_multipart_create_is_refused(s3_env):
    store = S3Store(s3_env.uri("mp-cond"), multipart_threshold=5 << 20, multipart_chunksize=5 << 20)
    first, second = os.urandom(11 << 20), os.urandom(11 << 20)
    store.delete("x")
    store.put_if_absent("x", first)
    with pytest.raises(AlreadyExists):
        store.put_if_absent("x", second)
    assert store.get("x") == first
    store.put("x", second)  # a plain multipart put overwrites
    assert store.get("x") == second


def test_put_overwrites_put_if_absent_refuses(store):
    store.put_if_absent("k", b"one")
    with pytest.raises(AlreadyExists) as err:
        store.put_if_absent("k", b"two")
    assert store.uri.rstrip("/") in str(err.value) and "k" in str(err.value)
    assert not err.value.retryable
    assert store.get("k") == b"one"
    store.put("k", b"three")
    assert store.get("k") == b"three"
    store.put("fresh", b"new")
    assert store.get("fresh") == b"new"


def test_missing_keys(store):
    with pytest.raises(NotFound) as err:
        store.get("nope/x")
    assert "nope/x" in str(err.value)
    with pytest.raises(NotFound):
        store.head("nope/x")
    assert not store.exists("nope/x")
    store.delete("nope/x")  # deleting a missing key is not an error
    store.put_if_absent("d/x", b"1")
    store.delete("d/x")
    assert not store.exists("d/x") and store.list("d/") == []
    store.put_if_absent("d/x", b"2")  # a deleted key can be created again
    assert store.get("d/x") == b"2"


TRICKY = ["A", "Z", "_x", "a", "a-b", "a.c", "a0", "a=1", "a_", "b", "0", "9", "z-", "-q"]


def test_list_one_level_in_byte_order(store):
    keys = [f"o/{k}" for k in TRICKY]
    for k in random.Random(3).sample(keys, len(keys)):
        store.put_if_absent(k, b"")
    store.put_if_absent("other", b"")
    assert store.list("o/") == sorted(keys)
    assert store.list("o/a") == sorted(k for k in keys if k.startswith("o/a"))
    assert store.list("o/", start_after="o/a") == [k for k in sorted(keys) if k > "o/a"]
    assert store.list("o/", start_after="o/a.") == [k for k in sorted(keys) if k > "o/a."]
    assert store.list("o/", limit=3) == sorted(keys)[:3]
    assert store.list("o/", start_after="o/a", limit=2) == [k for k in sorted(keys) if k > "o/a"][:2]
    assert store.list("o/", limit=0) == []
    assert store.list("o/zzz") == [] and store.list("nothing/") == []
    assert sorted(store.list()) == sorted(keys + ["other"])


def test_list_nested_returns_every_key_once(store):
    keys = ["n/a/1", "n/a/2", "n/a-b/1", "n/a.c/x/1", "n/a0/1", "n/b", "n/c/d/e/f"]
    for k in keys:
        store.put_if_absent(k, b"")
    got = store.list("n/")
    assert sorted(got) == sorted(keys) and len(got) == len(set(got))
    # Within one directory every backend agrees on byte order.
    assert [k for k in got if k.startswith("n/a/")] == ["n/a/1", "n/a/2"]
    assert store.list("n/a/", start_after="n/a/1") == ["n/a/2"]


def test_list_pagination(store):
    keys = [f"p/{i:04d}" for i in range(11)]
    for k in keys:
        store.put_if_absent(k, b"x")
    paged = S3Store(store.uri, page_size=3) if isinstance(store, S3Store) else store
    assert paged.list("p/") == keys
    assert paged.list("p/", start_after="p/0002") == keys[3:]
    assert paged.list("p/", start_after="p/0002", limit=5) == keys[3:8]
    # Walking with start_after and a limit reassembles the whole listing.
    walked, after = [], None
    while True:
        page = paged.list("p/", start_after=after, limit=4)
        if not page:
            break
        walked += page
        after = page[-1]
    assert walked == keys


BAD_KEYS = ["", "/a", "a/", "a//b", "../x", "a/../b", "./a", ".hidden", "a/.tmp/x", "a b", "ü", "a\\b",
            "a?b", "x" * 600, None, 7]


@pytest.mark.parametrize("key", BAD_KEYS, ids=range(len(BAD_KEYS)))
def test_bad_keys_are_rejected(store, key):
    for call in (lambda: store.get(key), lambda: store.put_if_absent(key, b"x"), lambda: store.put(key, b"x"),
                 lambda: store.head(key), lambda: store.delete(key)):
        with pytest.raises(BadLocation) as err:
            call()
        assert isinstance(err.value, ValueError)
    with pytest.raises(BadLocation):
        store.list("a b")
    with pytest.raises(BadLocation):
        store.list("", start_after="../x")
    with pytest.raises(BadLocation):
        store.list("", limit=-1)


@pytest.mark.parametrize("uri", ["", "   ", "gs://bucket/x", "http://host/x", "s3://", "s3://A_B/x", "s3://ab/x",
                                 "s3://bucket/a//b", "s3://bucket/../x", "s3://user@bucket/x", "s3://bucket/x?y=1",
                                 "file://somehost/x", "file://relative/path", "file:relative"])
def test_bad_uris_are_rejected(uri, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    with pytest.raises(BadLocation) as err:
        open_store(uri)
    assert str(err.value)


def test_bad_options_are_rejected(tmp_path):
    with pytest.raises(BadLocation, match="endpoint"):
        open_store("s3://bucket/x", s3_endpoint="ftp://host")
    with pytest.raises(ValueError, match="attempts"):
        open_store(str(tmp_path), attempts=0)
    with pytest.raises(ValueError, match="read_timeout"):
        open_store(str(tmp_path), read_timeout=0)
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(BadLocation, match="not a directory"):
        open_store(str(tmp_path / "file"))


def test_file_uri_and_plain_path_are_the_same_store(tmp_path):
    a = open_store(str(tmp_path / "r"))
    b = open_store(f"file://{tmp_path / 'r'}")
    a.put_if_absent("x/y", b"1")
    assert b.get("x/y") == b"1" and a.uri == b.uri == f"file://{tmp_path / 'r'}"


def test_create_if_absent_race_threads(store):
    for round_ in range(2):
        key, n = f"race/{round_}", 5
        barrier, winners, refused, errors = threading.Barrier(n), [], [], []

        def contend(i: int) -> None:
            barrier.wait()
            try:
                store.put_if_absent(key, f"writer {i}".encode())
                winners.append(i)
            except AlreadyExists:
                refused.append(i)
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=contend, args=(i,)) for i in range(n)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert not errors and len(winners) == 1 and len(refused) == n - 1
        assert store.get(key) == f"writer {winners[0]}".encode()


def _race_in_process(uri: str, keys: list[str], me: int, barrier) -> list[str]:
    store = open_store(uri)
    barrier.wait()
    won = []
    for key in keys:
        try:
            store.put_if_absent(key, f"process {me}".encode())
            won.append(key)
        except AlreadyExists:
            pass
    return won


def test_create_if_absent_race_processes(store):
    ctx = multiprocessing.get_context("spawn")  # fork would copy boto3's connection pools
    n, keys = 3, [f"prace/{i}" for i in range(2)]
    with ctx.Manager() as manager:
        barrier = manager.Barrier(n)
        with ctx.Pool(n) as pool:
            results = pool.starmap(_race_in_process, [(store.uri, keys, i, barrier) for i in range(n)])
    won = [k for r in results for k in r]
    assert sorted(won) == keys, f"each key must have exactly one winner, got {results}"
    for i, r in enumerate(results):
        for key in r:
            assert store.get(key) == f"process {i}".encode()


def test_dead_endpoint_fails_fast_as_unavailable(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    silent = socket.socket()  # accepts connections (backlog) but never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))
    refused_port = refused.getsockname()[1]
    refused.close()  # nothing listens there now
    try:
        for port, budget in ((silent.getsockname()[1], 4.0), (refused_port, 2.0)):
            store = open_store("s3://bucket/run", s3_endpoint=f"http://127.0.0.1:{port}",
                               connect_timeout=0.5, read_timeout=0.5, attempts=2)
            started = time.monotonic()
            with pytest.raises(Unavailable) as err:
                store.put_if_absent("log/x", b"1")
            assert time.monotonic() - started < budget
            assert err.value.retryable and f"127.0.0.1:{port}" in str(err.value)
    finally:
        silent.close()


def test_missing_bucket_and_bad_credentials_are_clear(s3_env, monkeypatch):
    with pytest.raises(StoreError, match="does not exist") as err:
        open_store("s3://no-such-bucket-here/x").get("k")
    assert not err.value.retryable
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(StoreError, match="access denied"):
        open_store(s3_env.uri("x")).get("k")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(StoreError, match="no S3 credentials"):
        open_store(s3_env.uri("x")).get("k")


def test_probe_accepts_conforming_stores(store):
    probe_conditional_writes(store)
    assert store.list("probe/") == []  # the probe cleans up after itself


class _IgnoresCondition(FlakyStore):
    """A store that accepts If-None-Match and ignores it (some S3 clones do)."""

    def put_if_absent(self, key: str, data: bytes) -> None:
        self.inner.put(key, data)


class _KeepsFirstSilently(FlakyStore):
    """A store that refuses nothing but silently keeps the first bytes."""

    def put_if_absent(self, key: str, data: bytes) -> None:
        if not self.inner.exists(key):
            self.inner.put(key, data)


@pytest.mark.parametrize("fake", [_IgnoresCondition, _KeepsFirstSilently])
def test_probe_refuses_stores_without_create_if_absent(tmp_path, fake):
    store = fake(open_store(str(tmp_path)))
    with pytest.raises(StoreError) as err:
        probe_conditional_writes(store)
    assert str(tmp_path) in str(err.value) and "not enforced" in str(err.value).lower()
    assert store.list("probe/") == []


def test_probe_passes_unavailable_through(tmp_path):
    store = FlakyStore(open_store(str(tmp_path)))
    store.fail("put_if_absent")
    with pytest.raises(Unavailable):
        probe_conditional_writes(store)


def test_server_killed_mid_run(tmp_path, monkeypatch):
    """Kill -9 the S3 server: calls fail fast as Unavailable; after a restart every committed
    record is there and the log continues."""
    from infra.s3server import S3Server

    server = S3Server(tmp_path / "srv").start()
    try:
        use_s3_env(monkeypatch, server)
        store = open_store(server.uri("killed"), connect_timeout=0.5, read_timeout=1.0, attempts=2)
        log = CommitLog(store, sleep=lambda s: None)
        records = [make_commit(i, info_n=i) for i in range(5)]
        for r in records:
            log.append(r)
        server.kill()
        started = time.monotonic()
        with pytest.raises(Unavailable):
            log.append(make_commit(5))
        with pytest.raises(Unavailable):
            store.get("log/00000000000000000000")
        assert time.monotonic() - started < 5.0
        server.restart()
        fresh = CommitLog(open_store(server.uri("killed")))
        assert fresh.tail() == 4
        assert list(fresh.read_range(0)) == records
        fresh.append(make_commit(5))
        assert fresh.tail() == 5
    finally:
        server.stop()
    leftovers = [f for f in os.listdir("/tmp")
                 if f.endswith(f"-grpc-{server._ports['master_grpc']}.sock")]
    assert leftovers == []


def test_socket_clean_up_spares_a_live_server(tmp_path):
    """weed names its gRPC sockets by port only: after our server exits, its clean-up must not
    delete the socket of another server that took the same port since (a volume server then
    vanished mid-run), while a stale socket file is removed."""
    import socket
    from infra.s3server import _unlink_stale

    live, stale = str(tmp_path / "live.sock"), str(tmp_path / "stale.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(live)
    listener.listen(1)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(stale)          # the file stays after close, as after a SIGKILL
    dead.close()
    try:
        _unlink_stale(live)
        _unlink_stale(stale)
        _unlink_stale(str(tmp_path / "missing.sock"))
        assert os.path.exists(live) and not os.path.exists(stale)
    finally:
        listener.close()


def test_s3_up_command_runs_and_stops(tmp_path, monkeypatch):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    proc = subprocess.Popen([sys.executable, "-m", "workers.cli", "s3", "up", "--dir", str(tmp_path / "up"),
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("# a run location"):
                break
        exports = dict(l[len("export "):].strip().split("=", 1) for l in lines if l.startswith("export "))
        assert exports["AWS_ENDPOINT_URL"].startswith("http://127.0.0.1:")
        assert exports["AWS_ACCESS_KEY_ID"] and exports["AWS_SECRET_ACCESS_KEY"]
        for name, value in exports.items():  # the printed lines are all a client needs
            monkeypatch.setenv(name, value)
        s3 = open_store("s3://ddiloco/cli")
        s3.put_if_absent("hello", b"world")
        assert s3.get("hello") == b"world"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(tmp_path / "up", ignore_errors=True)
