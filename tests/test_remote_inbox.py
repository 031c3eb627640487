"""Another region's inbox is read off the syncer's loop (issue 14, workers/syncer/remote_inbox.py):
over a slow store a poll never waits on the link, the backlog is fetched in parallel, each object
is read once, and the loop admits complete deltas as before (oversize and damaged ones refused)."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from pipeline.codec import CodecConfig, encode
from pipeline.types import DeltaHeader
from storage.layout import spill_key
from storage.store import open_store
from workers.launch import RunSettings, Schedule, create_run
from workers.syncer.ingest import Ingest
from workers.syncer.records import Refusal, Source
from workers.syncer.remote_inbox import RemoteInbox
from workers.syncer.rounds import RoundBook

pytestmark = pytest.mark.timeout(60)
RTT = 0.1


class Slow:
    """A store whose every call takes one round trip; counts GETs per key and the most calls at once."""

    def __init__(self, inner):
        self.inner, self.uri = inner, inner.uri
        self.lock = threading.Lock()
        self.gets: dict[str, int] = {}
        self.active = self.most_active = 0

    def __getattr__(self, name):
        attr = getattr(self.inner, name)

        def call(*a, **kw):
            with self.lock:
                self.active += 1
                self.most_active = max(self.most_active, self.active)
                if name == "get":
                    self.gets[a[0]] = self.gets.get(a[0], 0) + 1
            try:
                time.sleep(RTT)
                return attr(*a, **kw)
            finally:
                with self.lock:
                    self.active -= 1
        return call


class _Events:
    def __init__(self):
        self.seen = []

    def emit(self, event, **fields):
        self.seen.append((event, fields))


def _run(tmp_path):
    home = open_store(str(tmp_path / "home"))
    rng = np.random.default_rng(0)
    init = {"a.weight": rng.normal(0, 0.02, size=(8, 4)).astype(np.float32)}
    desc = create_run(home, init, RunSettings(schedule=Schedule(fragments=1, sync_every=2)), embedding_tensors=())
    return home, desc


def _spill(store, desc, learner: str, seq: int) -> str:
    h = DeltaHeader(learner, 1, seq, 0, 0, 2 * (seq + 1), 100, 2)
    tensors = {n: np.full(desc.spec(n).shape, 0.01, np.float32) for n in desc.layout.fragments[0]}
    key = spill_key(learner, 1, seq)
    store.put(key, encode("delta", h.to_dict(), tensors, CodecConfig(scheme="int8")))
    return key


def test_a_remote_backlog_is_read_off_the_loop_once_each_and_admitted(tmp_path):
    home, desc = _run(tmp_path)
    remote_inner = open_store(str(tmp_path / "remote"))
    keys = [_spill(remote_inner, desc, "l1", s) for s in range(12)]
    remote_inner.put(spill_key("l1", 1, 99), b"not a delta")                 # damaged: refused, kept
    remote = Slow(remote_inner)
    events = _Events()
    io = ThreadPoolExecutor(2)
    ingest = Ingest(home, desc, None, RoundBook(desc, live_timeout_s=5.0, initial_step_s=0.1), lambda p, m: None,
                    events, time.monotonic, time.sleep, io, max_pending=64, max_per_poll=256,
                    inboxes=[home, remote])
    slowest = 0.0
    t_end = time.monotonic() + 10
    while (len(ingest.pending[0]) < 12 or not ingest.bad) and time.monotonic() < t_end:
        t0 = time.monotonic()
        ingest.poll_inboxes()
        ingest.poll_bus(0.02)
        slowest = max(slowest, time.monotonic() - t0)
    io.shutdown()
    assert sorted(h.inbox_key for h in ingest.pending[0].values()) == sorted(keys)
    assert all(h.source is Source.SPILL and h.inbox.store is remote for h in ingest.pending[0].values())
    # 13 objects x (HEAD + GET) at 0.1 s each would hold a serial loop 2.6 s; here no poll waits a trip
    assert slowest < RTT / 2, slowest
    assert remote.most_active >= 3                      # fetched in parallel
    assert max(remote.gets.values()) == 1               # each object read once
    assert ingest.stats.rejections == {Refusal.UNDECODABLE: 1}
    assert spill_key("l1", 1, 99) in ingest.bad and remote_inner.exists(spill_key("l1", 1, 99))
    for reader in ingest.remote.values():
        reader.close()


def test_the_reader_refuses_to_read_an_oversize_object_and_reports_a_failed_listing(tmp_path):
    store = open_store(str(tmp_path / "r"))
    store.put(spill_key("l1", 1, 0), b"x" * 100)
    store.put(spill_key("l1", 1, 1), b"y" * 10)
    reader = RemoteInbox(Slow(store), max_bytes=50, threads=2, max_held=8)
    assert reader.refresh(set()) and not reader.refresh(set())    # one listing at a time
    got = []
    t_end = time.monotonic() + 5
    while len(got) < 2 and time.monotonic() < t_end:
        got += reader.take()[0]
        time.sleep(0.01)
    by_key = {f.key: f for f in got}
    assert by_key[spill_key("l1", 1, 0)].blob is None and by_key[spill_key("l1", 1, 0)].size == 100
    assert by_key[spill_key("l1", 1, 1)].blob == b"y" * 10
    reader.close()

    class Down:
        uri = "down://"

        def list(self, prefix):
            from storage.errors import Unavailable
            raise Unavailable("cut (test)", uri=self.uri)
    reader = RemoteInbox(Down(), max_bytes=50, threads=1)
    reader.refresh(set())
    t_end = time.monotonic() + 5
    err = None
    while err is None and time.monotonic() < t_end:
        err = reader.take()[1]
        time.sleep(0.01)
    assert err is not None and "cut" in str(err)
    reader.close()


def test_a_dropped_reader_ends_its_threads(tmp_path):
    import gc
    store = open_store(str(tmp_path / "r"))
    before = {t for t in threading.enumerate() if t.name.startswith("remote-inbox-")}
    reader = RemoteInbox(store, max_bytes=50, threads=3)
    reader.refresh(set())
    t_end = time.monotonic() + 5
    while reader._listing and time.monotonic() < t_end:
        time.sleep(0.01)
    mine = {t for t in threading.enumerate() if t.name.startswith("remote-inbox-")} - before
    assert len(mine) == 3
    del reader
    gc.collect()
    for t in mine:
        t.join(timeout=5)
        assert not t.is_alive()
