"""Issue 15: thread pools wired into the sender's encode, the commit (guard norms, outer gradients,
merge, Nesterov step) and the version codec - the same bytes and bits at 1 and N threads.

Job sizes are shrunk here (monkeypatched) so that small tensors still split into many jobs that
finish out of order on a pool; the serial reference runs with the real sizes, so these tests also
show that how the work is cut never changes a bit."""
from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import pipeline.codec as codec_mod
import pipeline.fold as fold_mod
import pipeline.merge as merge_mod
import pipeline.outer as outer_mod
import workers.learner.sender as sender_mod
from pipeline.codec import CodecConfig, encode
from pipeline.commit import CommitMeta, _guard, apply_commit, initial_window, verify_commit
from pipeline.descriptor import RunDescriptor, VersionsConfig
from pipeline.fold import RoundInput, initial_state
from pipeline.fragment import FragmentLayout
from pipeline.guard import NormGuardConfig, apply_guard
from pipeline.merge import MergeConfig
from pipeline.schedule import ScheduleConfig
from pipeline.types import DeltaHeader, TensorSpec
from storage.layout import SPILL_PREFIX
from storage.store import open_store
from workers.common.versions import decode_version, encode_version
from workers.launch import Schedule
from workers.learner.sender import Sender, SenderConfig

from runhelpers import Recorder

SHAPES = {"emb.w": (300, 257), "h.0.w": (70_001,), "h.0.b": (33,)}
GUARD = NormGuardConfig(factor=4.0, window=8, min_history=2, cap=50.0)


@pytest.fixture
def small_jobs(monkeypatch):
    """Cut every kernel's work into many small jobs (on block/leaf boundaries where they need them)."""
    monkeypatch.setattr(fold_mod, "_GRAD_JOB", 3_001)
    monkeypatch.setattr(outer_mod, "_JOB", 4_097)
    monkeypatch.setattr(merge_mod, "_JOB", merge_mod._LEAF)
    monkeypatch.setattr(codec_mod, "_JOB", 4_096)


def _desc(dtype: str = "fp32") -> RunDescriptor:
    layout = FragmentLayout(tuple(TensorSpec(n, s) for n, s in SHAPES.items()), (tuple(SHAPES),))
    return RunDescriptor(run_id="threads", layout=layout, schedule=ScheduleConfig(1, (0,)),
                         merge=MergeConfig("rda", frozenset({"emb.w"})), versions=VersionsConfig(retain=4, dtype=dtype),
                         guard=GUARD)


def _delta(rng, scale=0.01):
    return {n: (rng.standard_normal(s) * scale).astype(np.float32) for n, s in SHAPES.items()}


def _inp(learner, seq, tensors, base):
    h = DeltaHeader(learner, 0, seq, 0, base, 10, 1000 + 37 * seq + len(learner), learner_step=seq)
    return RoundInput(h, f"deltas/{learner}/{seq}", f"sum-{learner}-{seq}", tensors)


def _two_rounds(map_fn, dtype="fp32"):
    """Version 1 from one round, then a round of stale (base 0) and fresh (base 1) deltas, one an
    outlier: every kernel runs, the outer gradient of stale deltas included."""
    desc = _desc(dtype)
    rng = np.random.default_rng(7)
    state = initial_state(desc, {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()})
    window = initial_window(desc)
    out = []
    rounds = [[_inp("a", 0, _delta(rng), 0), _inp("b", 0, _delta(rng), 0), _inp("c", 0, _delta(rng), 0)],
              [_inp("a", 1, _delta(rng), 1), _inp("b", 1, _delta(rng), 0), _inp("c", 1, _delta(rng), 0),
               _inp("d", 0, _delta(rng, scale=5.0), 1)]]
    for inputs in rounds:
        c = apply_commit(state, window, desc, 0, inputs, CommitMeta(state.last_seq + 1, 1, f"v{state.last_seq}"),
                         map_fn=map_fn)
        out.append((c, inputs, state, window))
        state, window = c.state, c.window
    return desc, out


def _same_commit(a, b):
    assert a.record == b.record
    assert a.window == b.window
    fa, fb = a.state.fragments[0], b.state.fragments[0]
    for x, y in ((fa.params, fb.params), (fa.momentum, fb.momentum), (a.published, b.published)):
        assert sorted(x) == sorted(y)
        for n in x:
            assert x[n].tobytes() == y[n].tobytes(), n


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_apply_commit_is_the_same_bits_at_1_and_4_threads(monkeypatch, dtype):
    _, serial = _two_rounds(None, dtype)
    monkeypatch.setattr(fold_mod, "_GRAD_JOB", 3_001)
    monkeypatch.setattr(outer_mod, "_JOB", 4_097)
    monkeypatch.setattr(merge_mod, "_JOB", merge_mod._LEAF)
    seen = set()

    with ThreadPoolExecutor(4) as pool:
        def spy(fn, jobs):
            jobs = list(jobs)
            seen.add(len(jobs))
            return pool.map(fn, jobs)
        desc, threaded = _two_rounds(spy, dtype)
    assert max(seen) > 8, "the work was cut into many jobs"
    for (a, *_), (b, *_) in zip(serial, threaded):
        _same_commit(a, b)
    second = threaded[1][0].record
    assert second.kind == "merge" and len(second.inputs) == 3 and second.norms is not None
    assert [d.reason for d in second.dropped] == ["norm-outlier"]
    assert {i.staleness for i in second.inputs} == {0, 1}, "stale deltas took the outer-gradient path"


def test_verify_commit_on_a_pool_accepts_a_serial_commit(small_jobs):
    """Replay may run on any number of threads: a commit the syncer made serially verifies on a pool."""
    desc, serial = _two_rounds(None)
    with ThreadPoolExecutor(3) as pool:
        for c, inputs, state, window in serial:
            got = verify_commit(state, window, desc, c.record, inputs, map_fn=pool.map)
            _same_commit(c, got)


def test_the_pooled_guard_decides_as_apply_guard():
    rng = np.random.default_rng(3)
    params = _delta(rng, scale=1.0)
    inputs = [_inp("a", 0, _delta(rng), 0), _inp("b", 0, _delta(rng, scale=100.0), 0),
              dataclasses.replace(_inp("c", 0, _delta(rng), 0), reject_reason="bad-signature"),
              _inp("a", 0, _delta(rng, scale=0.2), 0), _inp("e", 0, None, 0)]
    inputs[3] = dataclasses.replace(inputs[3], checksum="sum-a-0-copy")
    history = [3.5, 4.0, 3.8]          # the first input (~3.8) passes; 4 x median 3.8 = 15.2
    want = apply_guard(inputs, history, GUARD, params)
    with ThreadPoolExecutor(3) as pool:
        got = _guard(inputs, history, GUARD, params, pool.map)
    assert got[1] == want[1]
    assert [(i.checksum, i.reject_reason) for i in got[0]] == [(i.checksum, i.reject_reason) for i in want[0]]
    assert [i.reject_reason for i in got[0]] == ["", "norm-outlier", "bad-signature", "norm-outlier", ""]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_version_blobs_are_the_same_bytes_and_values_on_a_pool(small_jobs, dtype):
    desc, serial = _two_rounds(None, dtype)
    c = serial[1][0]
    blob = encode_version(desc, 0, c.record.version, c.record.seq, 1, c.published)
    with ThreadPoolExecutor(4) as pool:
        assert encode_version(desc, 0, c.record.version, c.record.seq, 1, c.published, map_fn=pool.map) == blob
        got = decode_version(blob, desc, c.record, map_fn=pool.map)
    want = decode_version(blob, desc, c.record)
    assert all(got[n].tobytes() == want[n].tobytes() for n in SHAPES)


def test_sender_config_refuses_a_bad_thread_count():
    for bad in (0, -1, 1.5, True, 1000):
        with pytest.raises(ValueError, match="encode_threads"):
            SenderConfig(encode_threads=bad)


def test_sender_encodes_on_its_pool_and_spills_the_same_bytes(tmp_path, monkeypatch, small_jobs):
    """encode_threads=3: the codec's jobs run on the sender's pool (other threads), and the spilled
    blob is byte for byte what encoding on one thread gives."""
    real, threads = sender_mod.encode, set()

    def watched(*args, map_fn=None, **kw):
        assert map_fn is not None, "the sender passes its pool to the codec"

        def spy(fn, jobs):
            return map_fn(lambda j: (threads.add(threading.current_thread().name), fn(j))[1], jobs)
        return real(*args, map_fn=spy, **kw)

    monkeypatch.setattr(sender_mod, "encode", watched)
    codec = CodecConfig("int4", 64, 3)
    rng = np.random.default_rng(5)
    tensors = {"w": rng.standard_normal(50_000).astype(np.float32), "b": rng.standard_normal(77).astype(np.float32)}
    header = DeltaHeader("l0", 1, 0, 0, 0, c_steps=1, c_tokens=100, learner_step=0)
    store = open_store(str(tmp_path / "run"))
    sender = Sender(store, codec, SenderConfig(encode_threads=3), Recorder(), bus=None, identity=b"l0",
                    heartbeat=dict)
    sender.start()
    sender.submit(header, dict(tensors))
    deadline = time.monotonic() + 20
    while not store.list(SPILL_PREFIX) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sender.drain(20)
    sender.stop()
    (key,) = store.list(SPILL_PREFIX)
    assert store.get(key) == real("delta", header.to_dict(), tensors, codec)
    assert threads and all(t.startswith("sender-encode") for t in threads), threads


def _syncer_store_after_rounds(base, root, threads: int) -> dict[str, str]:
    """A syncer (``SyncerConfig.threads``) on a copy of the run at ``base``, merging the same spilled
    deltas of three learners over three rounds; every stored object's sha256 afterwards."""
    import hashlib
    import itertools
    import shutil
    import uuid

    from pipeline.policy import Decision
    from storage.layout import spill_key
    from workers.syncer.syncer import Syncer, SyncerConfig

    shutil.copytree(base, root)
    rng = np.random.default_rng(1)
    store = open_store(str(root))
    ids = itertools.count(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(uuid, "uuid4", lambda: uuid.UUID(int=next(ids)))     # commit ids are random otherwise
        syncer = Syncer(store, SyncerConfig(threads=threads), bus=None, clock=lambda: 100.0, wall=lambda: 1000.0,
                        sleep=lambda s: None)
        syncer.recover()
        seq = itertools.count()
        for _ in range(3):
            base = syncer.state.fragments[0].version
            for learner in ("l0", "l1", "l2"):
                s = next(seq)
                h = DeltaHeader(learner, 1, s, 0, base, 4, 400 + 13 * s, learner_step=s)
                store.put_if_absent(spill_key(learner, 1, s), encode("delta", h.to_dict(), _delta(rng), CodecConfig()))
            syncer.ingest.poll_inboxes()
            keys = list(syncer.pending[0])
            syncer.merge(0, keys, Decision(tuple(keys), (), 0.0, None, None, "all-reported"))
        syncer.io.shutdown(wait=True)
        if syncer.compute is not None:
            syncer.compute.shutdown(wait=True)
    return {k: hashlib.sha256(store.get(k)).hexdigest() for k in sorted(store.list(""))}


def test_a_syncer_on_a_pool_stores_the_same_bytes(tmp_path, small_jobs):
    """SyncerConfig.threads is a pure speed setting: commits, versions and deltas are the same bytes
    (so replay never needs to know how many threads the syncer had)."""
    from workers.launch import RunSettings, create_run
    rng = np.random.default_rng(0)
    init = {n: (rng.standard_normal(s) * 0.02).astype(np.float32) for n, s in SHAPES.items()}
    create_run(open_store(str(tmp_path / "base")), init, RunSettings(schedule=Schedule(fragments=1, sync_every=1),
                                                                     run_id="threads-syncer"),
               embedding_tensors=("emb.w",))
    serial = _syncer_store_after_rounds(tmp_path / "base", tmp_path / "t1", threads=1)
    pooled = _syncer_store_after_rounds(tmp_path / "base", tmp_path / "t3", threads=3)
    assert sum(k.startswith("log/") for k in serial) >= 4          # init + three merges
    assert serial == pooled


def test_syncer_config_refuses_a_bad_thread_count():
    from workers.syncer.syncer import SyncerConfig
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="threads"):
            SyncerConfig(threads=bad)
