"""The syncer's ingest path in-process: the same delta delivered twice (bus twice, and spilled
too) is merged once; damaged messages are rejected with a reason and change nothing."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import zmq

from pipeline.codec import CodecConfig, encode
from pipeline.envelope import digest
from pipeline.types import DeltaHeader
from storage.layout import spill_key
from storage.log import CommitLog
from storage.store import open_store
from workers.bus.bus import BusConfig, LearnerLink, Message
from workers.launch import RunSettings, Schedule, create_run
from workers.syncer.syncer import Syncer, SyncerConfig

from runhelpers import free_port, syncer_thread

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def tiny(tmp_path):
    store = open_store(str(tmp_path / "store"))
    rng = np.random.default_rng(0)
    init = {"a.weight": rng.normal(size=(8, 4)).astype(np.float32), "b.weight": rng.normal(size=(16,)).astype(np.float32)}
    desc = create_run(store, init, RunSettings(schedule=Schedule(fragments=1, sync_every=1)), embedding_tensors=())
    bus = BusConfig(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
    return store, desc, bus


def _delta(desc, seq: int, learner: str = "l0") -> tuple[DeltaHeader, bytes]:
    h = DeltaHeader(learner, 1, seq, 0, 0, 4, 400, seq)
    tensors = {t.name: np.full(t.shape, 0.01 * (seq + 1), np.float32) for t in desc.layout.tensors}
    return h, encode("delta", h.to_dict(), tensors, CodecConfig(scheme="int8"))


def _send(link: LearnerLink, msg: Message, timeout: float = 10.0) -> None:
    """Send once the link is connected (IMMEDIATE: a send before the connection would block)."""
    deadline = time.time() + timeout
    while not link.send(msg):
        assert time.time() < deadline, "the learner link never connected to the syncer"
        time.sleep(0.05)


def _run_syncer(store, bus, until, timeout=20.0):
    return syncer_thread(store, bus=bus, until=until, timeout=timeout)


def test_same_delta_twice_and_spilled_is_merged_once(tiny):
    store, desc, bus = tiny
    h, blob = _delta(desc, 0)
    store.put_if_absent(spill_key(h.learner, h.incarnation, h.seq), blob)   # the learner also spilled it
    acked = threading.Event()   # stop only after both replies: the inbox re-listing also counts duplicates
    syncer, t = _run_syncer(store, bus, lambda s: s.stats.commits >= 1 and s.stats.duplicates >= 2 and acked.is_set())
    link = LearnerLink(bus, b"l0")
    msg = Message("delta", {"header": h.to_dict(), "checksum": digest(blob)}, blob)
    time.sleep(0.3)
    acks = []
    for _ in range(2):
        _send(link, msg)
        reply = link.recv(5.0)
        acks.append(reply.fields if reply else None)
    acked.set()
    t.join()
    link.close()
    records = list(CommitLog(store).read_range(0))
    merged = [i.delta_id for r in records if r.kind == "merge" for i in r.inputs]
    assert merged == [h.id]
    assert all(a and a["status"] == "durable" for a in acks), acks
    assert syncer.stats.duplicates >= 2


def test_damaged_bus_message_is_rejected_and_changes_nothing(tiny):
    store, desc, bus = tiny
    h, blob = _delta(desc, 0)
    bad = bytearray(blob)
    bad[len(bad) // 2] ^= 0xFF
    replied = threading.Event()   # stop only after the reply arrived (closing drops queued acks)
    syncer, t = _run_syncer(store, bus, lambda s: s.stats.rejected >= 2 and replied.is_set())
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.connect(bus.ingest)
    link = LearnerLink(bus, b"l0")
    _send(link, Message("delta", {"header": h.to_dict(), "checksum": digest(bytes(bad))}, bytes(bad)))
    raw.send_multipart([b"not an envelope"])
    reply = link.recv(15.0)
    replied.set()
    t.join()
    link.close()
    raw.close(0)
    assert reply is not None and reply.fields["status"] == "rejected" and reply.fields["reason"]
    assert CommitLog(store).tail() == desc.num_fragments   # init commits + the fence only
    assert syncer.stats.rejected >= 2


class _OverwritingStore:
    """A store whose create-if-absent silently overwrites (what a non-conforming S3 does)."""

    def __init__(self, inner):
        self.inner, self.uri = inner, "fake://no-conditional-writes"

    def put_if_absent(self, key, data):
        self.inner.put(key, data)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_syncer_refuses_a_store_without_create_if_absent(tiny):
    from storage.errors import StoreError
    from storage.log import CommitLog
    store, desc, bus = tiny
    syncer = Syncer(_OverwritingStore(store), SyncerConfig(), bus=None)
    with pytest.raises(StoreError, match="fake://no-conditional-writes"):
        syncer.recover()
    assert CommitLog(store).tail() == desc.num_fragments - 1   # no epoch claimed, no fence written
