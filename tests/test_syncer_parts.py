"""Issue 12: the syncer's parts each own their state and are built from explicit arguments - the
inbox (workers/syncer/ingest.py) and the committer (workers/syncer/committer.py) work without a
Syncer around them, and their internal records are typed (workers/syncer/records.py)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from pipeline.codec import CodecConfig, encode
from pipeline.commit import CommitMeta
from pipeline.envelope import digest
from pipeline.fold import DropReason, fold_fence
from pipeline.types import DeltaHeader
from storage.layout import delta_key, quarantine_key, spill_key
from storage.log import CommitLog, claim_epoch
from storage.store import open_store
from workers.bus.bus import Message
from workers.common.deltas import round_input
from workers.launch import RunSettings, Schedule, create_run
from workers.syncer.committer import Committer, CommitterConfig, KeyConflict
from workers.syncer.ingest import Ingest
from workers.syncer.records import BELOW_HIGH_WATER, Quarantined, Refusal, Source
from workers.syncer.recovery import recover_state
from workers.syncer.rounds import RoundBook

pytestmark = pytest.mark.timeout(60)


class _Events:
    def __init__(self):
        self.seen: list[tuple[str, dict]] = []

    def emit(self, event, **fields):
        self.seen.append((event, fields))


@pytest.fixture
def run(tmp_path):
    store = open_store(str(tmp_path / "store"))
    rng = np.random.default_rng(0)
    init = {"a.weight": rng.normal(0, 0.02, size=(8, 4)).astype(np.float32),
            "b.weight": rng.normal(0, 0.02, size=(16,)).astype(np.float32)}
    desc = create_run(store, init, RunSettings(schedule=Schedule(fragments=1, sync_every=2)), embedding_tensors=())
    io = ThreadPoolExecutor(max_workers=2)
    yield store, desc, io
    io.shutdown(wait=True)


def _blob(desc, h: DeltaHeader, fill: float = 0.01) -> bytes:
    tensors = {n: np.full(desc.spec(n).shape, fill, np.float32) for n in desc.layout.fragments[h.fragment]}
    return encode("delta", h.to_dict(), tensors, CodecConfig(scheme="int8"))


def _msg(blob: bytes, h: DeltaHeader, checksum: str | None = None) -> Message:
    return Message("delta", {"header": h.to_dict(), "checksum": checksum or digest(blob)}, blob)


def _ingest(store, desc, io, marks: dict, events: _Events, max_pending: int = 8) -> Ingest:
    rounds = RoundBook(desc, live_timeout_s=5.0, initial_step_s=0.1)
    return Ingest(store, desc, None, rounds, lambda p, m: marks.get((p, m)), events, lambda: 1.0, lambda s: None,
                  io, max_pending=max_pending, max_per_poll=16)


def test_the_inbox_admits_refuses_and_holds_out_with_typed_reasons(run):
    store, desc, io = run
    events = _Events()
    ingest = _ingest(store, desc, io, {(0, "l0"): (1, 5)}, events)
    good = DeltaHeader("l1", 1, 0, 0, 0, 3, 300, 2)
    ingest.bus_delta(b"peer", _msg(_blob(desc, good), good))
    held = ingest.pending[0][good.id]
    assert held.candidate and held.source is Source.BUS and held.inbox.key == spill_key("l1", 1, 0)
    assert store.exists(held.inbox.key) and ingest.stats.from_bus == 1

    bad = DeltaHeader("l1", 1, 1, 0, 0, 3, 300, 3)
    ingest.bus_delta(b"peer", _msg(_blob(desc, bad), bad, checksum="0" * 64))
    assert ingest.stats.rejections == {Refusal.BAD_CHECKSUM: 1}
    assert ingest.rejected_since_commit() == {"bad-checksum": 1}
    assert ("delta-rejected", {"delta": bad.id, "reason": "bad-checksum",
                               "detail": "checksum of the delta frame does not match"}) in events.seen

    below = DeltaHeader("l0", 1, 3, 0, 0, 3, 300, 3)         # under l0's merged mark (1, 5)
    ingest.bus_delta(b"peer", _msg(_blob(desc, below), below))
    at = DeltaHeader("l0", 1, 5, 0, 0, 3, 300, 5)            # exactly the merged one: a duplicate
    ingest.bus_delta(b"peer", _msg(_blob(desc, at), at))
    out = [h for h in ingest.pending[0].values() if not h.candidate]
    assert len(out) == 1 and out[0].hold == BELOW_HIGH_WATER and isinstance(out[0].pkey, Quarantined)
    assert out[0].stored_key == quarantine_key(out[0].pkey.sha256) and ingest.stats.duplicates == 1

    ingest.committed(0, list(ingest.pending[0].values()))
    assert ingest.pending[0] == {} and ingest.rejected_since_commit() == {}


def test_the_inbox_bounds_its_pending_set_superseded_first(run):
    store, desc, io = run
    ingest = _ingest(store, desc, io, {}, _Events(), max_pending=2)
    for s in range(4):
        h = DeltaHeader("l0", 1, s, 0, 0, 1 + s, 100, s)
        ingest.bus_delta(b"peer", _msg(_blob(desc, h), h))
    valid = [h.header.seq for h in ingest.pending[0].values() if h.candidate]
    evicted = [h for h in ingest.pending[0].values() if not h.candidate]
    assert valid == [2, 3] and ingest.stats.evicted == 2
    assert {h.hold for h in evicted} == {DropReason("pending-overflow", "superseded")}
    assert all(h.reason == "pending-overflow: superseded" for h in evicted)


def _committer(store, desc, io, events, before=None) -> Committer:
    c = Committer(store, desc, CommitterConfig(checkpoint_every=100), events, io, lambda s: None,
                  announce=lambda m: events.emit("announced", type=m.type), on_retry=lambda: None,
                  after_checkpoint=lambda seq: None, before_commit=before)
    rs = recover_state(store, desc, CommitLog(store).tail(), finish=True)
    epoch, fence_seq, log = claim_epoch(store, "parts")
    c.begin(epoch, log, fold_fence(rs.state, fence_seq, epoch).state, rs.window)
    return c


def test_the_committer_persists_appends_and_announces_a_merge(run):
    store, desc, io = run
    events = _Events()
    c = _committer(store, desc, io, events)
    h = DeltaHeader("l0", 1, 0, 0, 0, 3, 300, 2)
    blob = _blob(desc, h)
    key = delta_key("l0", 1, 0)
    inputs = [round_input(blob, key, desc)]
    meta = CommitMeta(seq=c.state.last_seq + 1, epoch=c.epoch, output_key=c.next_version_key(0), round_size=1)
    commit = c.decide(0, inputs, meta)
    assert CommitLog(store).tail() == c.state.last_seq                 # deciding stores nothing
    assert c.persist(commit, [(key, blob)])
    c.adopt(commit)
    c.publish(commit.record)
    rec = CommitLog(store).read(commit.record.seq)
    assert rec.kind == "merge" and rec.round_size == 1 == rec.quorum and store.exists(rec.output_key)
    assert c.state.fragments[0].version == 1 and c.stats.round_sizes.mean == 1.0
    assert ("announced", {"type": "version"}) in events.seen


def test_the_committer_refuses_a_reused_id_and_appends_nothing(run):
    store, desc, io = run
    c = _committer(store, desc, io, _Events())
    h = DeltaHeader("l0", 1, 0, 0, 0, 3, 300, 2)
    key = delta_key("l0", 1, 0)
    store.put_if_absent(key, _blob(desc, h, fill=0.02))                # other bytes under its permanent key
    blob = _blob(desc, h)
    tail = CommitLog(store).tail()
    commit = c.decide(0, [round_input(blob, key, desc)],
                      CommitMeta(seq=tail + 1, epoch=c.epoch, output_key=c.next_version_key(0), round_size=1))
    with pytest.raises(KeyConflict) as exc:
        c.persist(commit, [(key, blob)])
    assert exc.value.key == key and CommitLog(store).tail() == tail and c.state.last_seq == tail


def test_checkpoints_are_written_off_the_loop_in_order_and_only_the_newest_waiting_one(run):
    """A checkpoint serialised, sealed and PUT on the loop thread stalled every round for 100-150 ms
    beside two busy loops: ``checkpoint_soon`` hands it to the I/O pool and returns at once. One
    write at a time; states due meanwhile wait, and only the newest of them is written."""
    import threading
    from storage.checkpoints import list_checkpoints, read_checkpoint
    from pipeline.fold import SyncerState
    store, desc, io = run
    gate, writing = threading.Event(), threading.Event()

    class Held:                                   # the store, with checkpoint writes held at a gate
        def __getattr__(self, name):
            return getattr(store, name)

        def put_if_absent(self, key, data):
            if key.startswith("checkpoints/"):
                writing.set()
                assert gate.wait(30)
            store.put_if_absent(key, data)

        put = put_if_absent

    events = _Events()
    c = _committer(Held(), desc, io, events)
    seqs = []
    for seq in range(3):
        h = DeltaHeader("l0", 1, seq, 0, c.state.fragments[0].version, 3, 300, 2 + seq)
        blob, key = _blob(desc, h), delta_key("l0", 1, seq)
        commit = c.decide(0, [round_input(blob, key, desc)],
                          CommitMeta(seq=c.state.last_seq + 1, epoch=c.epoch, output_key=c.next_version_key(0),
                                     round_size=1))
        assert c.persist(commit, [(key, blob)])
        c.adopt(commit)
        seqs.append(commit.record.seq)
        c.checkpoint_soon()                       # returns while the first write waits at the gate
        if seq == 0:
            assert writing.wait(30)
    assert list_checkpoints(store) == []
    gate.set()
    io.shutdown(wait=True)                        # every write handed to the pool has finished (the file's 60 s timeout)
    assert list_checkpoints(store) == [seqs[0], seqs[2]]        # the middle one was replaced while waiting
    assert [f["seq"] for e, f in events.seen if e == "checkpoint"] == [seqs[0], seqs[2]]
    assert SyncerState.from_bytes(read_checkpoint(store, seqs[2]), desc).last_seq == seqs[2]
