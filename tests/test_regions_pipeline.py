"""Pipelined replication to regions and the receiver's wait for a region's copy (issue 14, "over a
slow link"; docs/regions.md "Replication"): versions of several commits in flight, each record
after its own version and in log order, the cursor never past a gap, a region that hangs never
stalls another, the syncer's bytes copied without a read back from home; a learner that hears of
a commit its region does not hold yet waits for the copy with a bounded backoff."""
from __future__ import annotations

import threading
import time

from storage.accounting import CountingStore
from storage.errors import NotFound, Unavailable
from storage.layout import DESCRIPTOR_KEY, commit_key, version_key
from storage.regions import verify_region
from storage.store import open_store
from pipeline.types import CommitRecord
from workers.common.events import EventLog
from workers.launch import Schedule
from workers.syncer.replicate import Replicator, ReplicatorConfig

CFG = ReplicatorConfig(retry_s=0.01, max_retry_s=0.05, inflight=4)


def wait_until(cond, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.005)


def home_log(tmp_path, n: int, name="home"):
    """A home store whose log holds ``n`` merge commits of fragment 0, each with its version."""
    home = open_store(str(tmp_path / name))
    home.put(DESCRIPTOR_KEY, b"a descriptor (copied as bytes, never parsed here)")
    blobs = {}
    for seq in range(n):
        key = version_key(0, seq, 0)
        ver = f"version {seq} ".encode() * 50
        rec = CommitRecord(seq, 0, "merge", fragment=0, version=seq, output_key=key)
        home.put(key, ver)
        home.put(commit_key(seq), rec.to_bytes())
        blobs[seq] = {key: ver, commit_key(seq): rec.to_bytes()}
    return home, blobs


class Watched:
    """A region store that records the order of its writes, can be slowed, can fail writes of
    chosen keys, and can hold every call (a partition that holds connections)."""

    def __init__(self, inner, delay_s: float = 0.0):
        self.inner, self.uri, self.delay_s = inner, inner.uri, delay_s
        self.lock = threading.Lock()
        self.events: list[tuple[str, str]] = []      # ("start" | "done", key)
        self.active = self.most_active = 0
        self.fail: set[str] = set()
        self.gate = threading.Event()
        self.gate.set()
        self.gaps: list[str] = []                     # records written while the one before was missing

    def __getattr__(self, name):
        attr = getattr(self.inner, name)

        def call(*a, **kw):
            self.gate.wait()
            return attr(*a, **kw)
        return call

    def put_if_absent(self, key, blob):
        self.gate.wait()
        with self.lock:
            if key in self.fail:
                raise Unavailable("failing (test)", uri=self.uri)
            self.events.append(("start", key))
            self.active += 1
            self.most_active = max(self.most_active, self.active)
            if key.startswith("log/"):
                seq = int(key.rsplit("/", 1)[1].split(".")[0]) if key.rsplit("/", 1)[1][0].isdigit() else None
                if seq is not None and seq > 0 and not self.inner.exists(commit_key(seq - 1)):
                    self.gaps.append(key)
        try:
            time.sleep(self.delay_s)
            return self.inner.put_if_absent(key, blob)
        finally:
            with self.lock:
                self.active -= 1
                self.events.append(("done", key))


def test_versions_are_copied_in_parallel_and_each_record_after_its_version(tmp_path):
    home, _ = home_log(tmp_path, 12)
    region = Watched(open_store(str(tmp_path / "r")), delay_s=0.03)
    rep = Replicator(home, {"r": region}, EventLog(None, "syncer", "t"), CFG).start()
    wait_until(lambda: rep.lag() == {"r": 0}, 20, "r to catch up")
    assert rep.stop()
    assert region.most_active >= 2, "versions were copied one at a time"
    order = [(what, key) for what, key in region.events]
    records = [key for what, key in order if what == "start" and key.startswith("log/")]
    assert records == sorted(records) and len(records) == 12        # log order
    for seq in range(12):   # the version was written (done) before its record's write started
        assert order.index(("done", version_key(0, seq, 0))) < order.index(("start", commit_key(seq)))
    assert not region.gaps
    assert verify_region(home, region.inner, "r", 11).ok


def test_the_cursor_never_passes_a_commit_whose_version_failed(tmp_path):
    """Commit 3's version cannot be written: later versions may be, but no record from 3 on,
    and the cursor stays at 3; once the write succeeds the region catches up without a gap."""
    home, _ = home_log(tmp_path, 8)
    region = Watched(open_store(str(tmp_path / "r")))
    region.fail.add(version_key(0, 3, 0))
    rep = Replicator(home, {"r": region}, EventLog(None, "syncer", "t"), CFG).start()
    wait_until(lambda: rep.stats()["r"]["failures"] >= 3, 10, "retries of commit 3")
    assert rep.stats()["r"]["next"] == 3
    for seq in range(3, 8):
        assert not region.inner.exists(commit_key(seq)), f"record {seq} written past the failed version"
    region.fail.clear()
    wait_until(lambda: rep.lag() == {"r": 0}, 10, "r to catch up")
    assert rep.stop() and not region.gaps
    assert verify_region(home, region.inner, "r", 7).ok


def test_a_region_that_hangs_does_not_stall_another(tmp_path):
    home, _ = home_log(tmp_path, 6)
    stuck, fine = Watched(open_store(str(tmp_path / "b"))), Watched(open_store(str(tmp_path / "c")))
    stuck.gate.clear()          # every call to b waits (a partition holding connections)
    rep = Replicator(home, {"b": stuck, "c": fine}, EventLog(None, "syncer", "t"), CFG).start()
    wait_until(lambda: rep.lag()["c"] == 0, 10, "c to catch up while b hangs")
    assert rep.lag()["b"] == 6            # b: nothing copied (its thread waits in its first call)
    rep.committed(5, 0)
    stuck.gate.set()
    wait_until(lambda: rep.lag() == {"b": 0, "c": 0}, 10, "b to catch up after the heal")
    assert rep.stop()
    assert verify_region(home, stuck.inner, "b", 5).ok and verify_region(home, fine.inner, "c", 5).ok


def test_the_bytes_the_syncer_wrote_are_copied_without_a_read_back(tmp_path):
    """Commits noted with their bytes are copied from them: no GET at home for those commits."""
    home, blobs = home_log(tmp_path, 6)
    counted = CountingStore(home)
    region = open_store(str(tmp_path / "r"))
    for seq in range(3):      # the region already holds 0..2 (seeded); 3..5 are noted with their bytes
        for key, blob in blobs[seq].items():
            region.put(key, blob)
    rep = Replicator(counted, {"r": region}, EventLog(None, "syncer", "t"), CFG)
    rep.start(tail=2)
    wait_until(lambda: rep.lag() == {"r": 0}, 10, "r to be at 2")
    gets = counted.snapshot().get
    for seq in range(3, 6):
        rep.committed(seq, 0, blobs[seq])
    wait_until(lambda: rep.lag() == {"r": 0}, 10, "r to copy 3..5")
    assert rep.stop()
    assert rep.stats()["r"]["home_reads"] == 0
    # membership copies may read home (every 5 s, not in this window): no commit or version read
    assert counted.snapshot().get - gets == 0
    assert verify_region(home, region, "r", 5).ok


# -- the receiver waits for its region's copy ------------------------------------------------------

class LogMisses:
    """Counts reads of commit records that were not there (404s on log/)."""

    def __init__(self, inner):
        self.inner, self.uri, self.misses = inner, inner.uri, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def get(self, key, *a, **kw):
        try:
            return self.inner.get(key, *a, **kw)
        except NotFound:
            if key.startswith("log/"):
                self.misses += 1
            raise


class _Announcer:
    """Stands in for the bus's AnnounceListener: announces ``msg`` every ``every_s``."""
    msg = None

    def __init__(self, cfg, ctx=None, curve=None):
        self.every_s = 0.01

    def recv(self, timeout_s):
        time.sleep(min(timeout_s, self.every_s))
        return _Announcer.msg

    def close(self):
        pass


def test_a_learner_waits_for_its_regions_copy_instead_of_hammering(tmp_path, monkeypatch):
    """The announcement of commit 1 arrives while the learner's region holds only commit 0: the
    receiver re-reads with a bounded backoff (a few 404s, not one per announcement), applies the
    version once the replicator copies it, and counts the wait."""
    import torch
    from storage.log import CommitLog
    from storage.regions import replicate_commit, replicate_static
    from workers.bus.bus import Message, Transport
    from workers.common.versions import VersionTracker
    from workers.launch import RunSettings, create_run
    from workers.learner import receiver as receiver_mod
    from storage.layout import read_descriptor

    home, region = open_store(str(tmp_path / "home")), open_store(str(tmp_path / "r"))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    create_run(home, {n: p.detach().numpy().copy() for n, p in model.named_parameters()},
               RunSettings(schedule=Schedule(fragments=2, sync_every=4)), embedding_tensors=())
    replicate_static(home, region)
    replicate_commit(home, region, 0)          # the region's copy ends at commit 0
    rec1 = CommitLog(home).read(1)
    _Announcer.msg = Message("version", {"seq": 1, "fragment": rec1.fragment, "version": rec1.version,
                                         "key": rec1.output_key, "epoch": 0, "round": -1})
    counted = LogMisses(region)
    tracker = VersionTracker(counted, read_descriptor(region))
    tracker.cursor = 0
    rcv = receiver_mod.Receiver(tracker, {0: 0, 1: -1}, EventLog(None, "learner", "l1"), bus=object(), poll_s=0.5,
                                transport=Transport(listener=_Announcer))
    rcv.start()
    try:
        time.sleep(1.2)                        # ~100 announcements meanwhile
        misses_before_copy = counted.misses
        replicate_commit(home, region, 1)      # the replicator's copy lands
        copied_at = time.monotonic()
        got = []
        wait_until(lambda: got.extend(rcv.take()) or got, 5, "the version after its copy")
        waited = time.monotonic() - copied_at
    finally:
        rcv.stop()
    assert [(a.fragment, a.version) for a in got] == [(rec1.fragment, rec1.version)]
    assert waited <= 0.5 + 0.3                 # the backoff is bounded by poll_s
    assert rcv.awaited == 1 and rcv.copy_misses >= 2
    # ~100 announcements in 1.2 s, but reads back off (0.05, 0.1, 0.2, 0.4, 0.5 s ...), one GET each
    assert 2 <= misses_before_copy <= 8, misses_before_copy
    # the copy landed ~1.2 s after the announcement: the estimate lies between the last miss and the find
    assert 0.7 <= rcv.copy_wait_s <= 1.3, rcv.copy_wait_s
