"""int4 versions down (issue 31; pipeline/version_chain.py, docs/algorithm.md "Versions down").

A run with ``versions.dtype = "int4"`` publishes each version as an int4 delta against the previous
published one, with error feedback, and a full snapshot every ``full_every`` versions and at a
fragment's first commit of each syncer epoch. Checked here: the chain's math and that it keeps the
published values within one quantisation step of the master values; the descriptor field; and real
in-process runs whose every reader (a fresh tracker from a snapshot, a following one from its head,
replay, export, a restarted syncer) holds the syncer's published values bit for bit, at about a
third of bf16's bytes per version.
"""
from __future__ import annotations

import numpy as np
import pytest

from pipeline.checksum import tensor_digest
from pipeline.codec import decode, dequantize, quantize
from pipeline.descriptor import RunDescriptor, VersionsConfig
from pipeline.errors import FormatError
from pipeline.version_chain import apply_delta, chain_step
from storage.errors import NotFound
from storage.layout import SNAPSHOT_INFO, VERSION_PREFIX, published_keys, read_descriptor, snapshot_key
from storage.retention import apply_retention, plan_retention
from storage.log import CommitLog
from workers.common.refold import rebuild
from workers.common.versions import VERSION_DELTA_KIND, VersionTracker
from workers.syncer.syncer import Syncer, SyncerConfig
from workers.tools.export import model_at
from workers.tools.replay_verify import replay_run

from tests.test_codec_format_run import _run

INT4 = VersionsConfig(dtype="int4", retain=8, full_every=4)


# -- the chain --------------------------------------------------------------------------------------

def test_error_feedback_keeps_the_published_values_one_quantisation_step_from_the_master_values():
    rng = np.random.default_rng(0)
    theta = {"w": rng.normal(size=(64, 33)).astype(np.float32), "b": rng.normal(size=7).astype(np.float32)}
    pub = {n: a.copy() for n, a in theta.items()}
    for _ in range(40):      # an outer step each time: small moves that int4 alone would round away
        theta = {n: (a + np.float32(1e-3) * rng.normal(size=a.shape)).astype(np.float32) for n, a in theta.items()}
        link = chain_step(theta, pub, 64)
        for n in theta:      # the residual: half a quantisation step of this difference (+ the addition's ulps)
            step = np.abs(np.subtract(theta[n], pub[n], dtype=np.float32)).max() / 7
            ulp = np.abs(theta[n]).max() * np.finfo(np.float32).eps
            assert np.abs(theta[n] - link.published[n]).max() <= step / 2 + 2 * ulp
        # a reader holds the same bits: the codec's decoder of the stored bytes plus the base
        decoded = {n: dequantize(link.raw[n], "int4", 64, theta[n].size).reshape(theta[n].shape) for n in theta}
        assert tensor_digest(apply_delta(pub, decoded)) == tensor_digest(link.published)
        pub = link.published
    drift = max(float(np.abs(theta[n] - pub[n]).max()) for n in theta)
    assert drift < 1e-3      # no accumulation over 40 versions (each move is ~1e-3 per value)


def test_raw_payload_is_the_codecs_int4_of_the_difference():
    a, b = np.linspace(-1, 1, 100, dtype=np.float32), np.zeros(100, np.float32)
    link = chain_step({"x": a}, {"x": b}, 16)
    assert link.raw["x"] == quantize(a, "int4", 16)
    with pytest.raises(ValueError, match="tensors"):
        apply_delta({"x": b}, {"y": b})
    with pytest.raises(ValueError, match="shape"):
        apply_delta({"x": b}, {"x": b[:5]})


# -- the descriptor ---------------------------------------------------------------------------------

def test_full_every_is_written_only_for_int4_versions_and_checked():
    assert "full_every" not in RunDescriptor.__dataclass_fields__       # a section field, not a document one
    from pipeline.descriptor import _versions, _versions_dict
    assert _versions_dict(INT4)["full_every"] == 4
    assert "full_every" not in _versions_dict(VersionsConfig(dtype="bf16"))   # other runs keep their bytes
    assert _versions(_versions_dict(INT4), "versions") == INT4
    with pytest.raises(FormatError, match="full_every"):
        _versions({**_versions_dict(VersionsConfig(dtype="bf16")), "full_every": 4}, "versions")
    with pytest.raises(FormatError, match="full_every"):
        _versions({k: v for k, v in _versions_dict(INT4).items() if k != "full_every"}, "versions")
    with pytest.raises(ValueError, match="exceeds retain"):
        VersionsConfig(dtype="int4", retain=4, full_every=8)
    with pytest.raises(ValueError, match="retain >= 2"):
        VersionsConfig(dtype="int4", retain=1, full_every=1)
    with pytest.raises(ValueError, match="int4 versions only"):
        VersionsConfig(dtype="bf16", full_every=3)
    with pytest.raises(FormatError, match="full_every: must be >= 1"):
        _versions({**_versions_dict(INT4), "full_every": 0}, "versions")
    # new runs: int4, a snapshot every 8 versions or every retained one when fewer are kept
    assert VersionsConfig().dtype == "int4" and VersionsConfig().full_every == 8
    assert VersionsConfig(retain=3).full_every == 3 and VersionsConfig(dtype="bf16").full_every == 0


# -- real runs --------------------------------------------------------------------------------------

def test_an_int4_run_stores_deltas_and_snapshots_that_every_reader_follows_bit_for_bit(tmp_path):
    store, desc = _run(tmp_path, 20, versions=INT4)
    assert read_descriptor(store).versions == INT4
    log = CommitLog(store)
    merges = [r for r in log.read_range(0, log.tail() + 1) if r.kind == "merge"]
    assert len(merges) >= 12
    for r in merges:         # the delta is a version-delta blob; snapshots where the rule says
        assert decode(store.get(r.output_key), VERSION_DELTA_KIND).meta["base_version"] == r.version - 1
        assert bool(r.info.get(SNAPSHOT_INFO)) == (r.version % 4 == 0 or r.version == 1), (r.version, r.info)
        assert published_keys(r)[1:] == ([snapshot_key(r.output_key)] if r.info.get(SNAPSHOT_INFO) else [])
    # a fresh reader starts from the snapshots; the values are the syncer's published ones, bit for bit
    fresh = VersionTracker(store, desc)
    values, versions = fresh.load_all()
    newest = fresh.latest()
    for p, rec in newest.items():
        part = {n: values[n] for n in desc.layout.fragments[p]}
        assert tensor_digest(part) == rec.output_checksum
    tail = log.tail()
    state, _ = rebuild(store, desc, tail)       # the syncer's state, recomputed from the log
    assert {p: f.version for p, f in enumerate(state.fragments)} == versions
    for p, f in enumerate(state.fragments):     # the syncer's published values = what the reader holds
        assert tensor_digest(f.history[f.version]) == tensor_digest({n: values[n] for n in desc.layout.fragments[p]})
        master = max(float(np.abs(f.params[n] - values[n]).max()) for n in f.params)
        assert 0 < master < 1e-2                # int4 of a small difference: close, and not the master itself

    # pipeline/version_history.py: a state folded from the start holds only the oldest and newest
    # retained versions full (a checkpoint's history is full until its versions leave the window)
    for f in rebuild(store, desc, tail, use_checkpoint=False)[0].fragments:
        assert len(f.history) == min(f.version + 1, INT4.retain)
        assert f.history.full_versions() == sorted({min(f.history), f.version}), f.history

    # a reader that follows every commit from version 0 adds one delta at a time (no snapshot read)
    follower = VersionTracker(store, desc)
    first = {r.fragment: r for r in log.read_range(0, desc.num_fragments)}
    for r in first.values():
        follower.load(r)
    before = follower.bytes_loaded
    for r in merges:
        got = follower.load(r)
        assert tensor_digest(got) == r.output_checksum
    assert follower.bytes_loaded - before == sum(store.head(r.output_key).size for r in merges)

    # replay recomputes every delta and snapshot; export reads along the chain
    report = replay_run(store, desc)
    assert report.versions == len(merges) and not report.warnings
    weights, commits = model_at(store, desc, tail)
    assert all(tensor_digest({n: weights[n] for n in desc.layout.fragments[p]}) == commits[p].output_checksum
               for p in commits)


def test_a_lost_newest_delta_is_refused_then_made_again_by_a_restarted_syncer(tmp_path):
    store, desc = _run(tmp_path, 12, versions=INT4)
    newest = VersionTracker(store, desc).latest()
    p, rec = max(newest.items(), key=lambda kv: kv[1].version)
    assert rec.kind == "merge"
    lost = {k: store.get(k) for k in published_keys(rec)}      # the delta and, if it has one, its snapshot
    for k in lost:
        store.delete(k)
    with pytest.raises(NotFound):            # a hole in the chain: refused, never guessed around
        VersionTracker(store, desc).load(rec)
    Syncer(store, SyncerConfig()).recover()  # the delta again from the master values and the version before
    assert {k: store.get(k) for k in lost} == lost
    assert tensor_digest(VersionTracker(store, desc).load(rec)) == rec.output_checksum
    again = replay_run(store, desc)
    assert again.versions >= 8 and not again.warnings


def test_a_damaged_delta_beside_its_snapshot_costs_a_follower_the_snapshot_and_a_restart_repairs_it(tmp_path):
    store, desc = _run(tmp_path, 8, versions=VersionsConfig(dtype="int4", retain=4, full_every=1))
    log = CommitLog(store)
    newest = VersionTracker(store, desc).latest()
    p, rec = max(newest.items(), key=lambda kv: kv[1].version)
    assert rec.kind == "merge" and rec.info.get(SNAPSHOT_INFO)         # full_every 1: every version has one
    previous = max((r for r in log.read_range(0, rec.seq) if r.fragment == p and r.kind in ("init", "merge")),
                   key=lambda r: r.seq)
    follower = VersionTracker(store, desc)
    follower.load(previous)
    good = store.get(rec.output_key)
    store.put(rec.output_key, good[:-7] + bytes(7))                   # the delta damaged, its snapshot intact
    before = follower.bytes_loaded
    assert tensor_digest(follower.load(rec)) == rec.output_checksum     # the follower falls back to the snapshot
    assert follower.bytes_loaded - before > len(good) + store.head(snapshot_key(rec.output_key)).size // 2
    Syncer(store, SyncerConfig()).recover()
    assert store.get(rec.output_key) == good                            # found and made again, the same bytes


def test_a_head_that_is_not_on_the_way_is_left_for_the_snapshot(tmp_path):
    store, desc = _run(tmp_path, 14, versions=INT4)
    log = CommitLog(store)
    merges = [r for r in log.read_range(0, log.tail() + 1) if r.kind == "merge" and r.fragment == 0]
    snap = [r for r in merges if r.info.get(SNAPSHOT_INFO)]
    target = merges[-1]
    assert snap
    reader = VersionTracker(store, desc)
    reader.load(merges[0])
    bogus = {n: np.full(a.shape, 7.0, np.float32) for n, a in reader._heads[0][1].items()}
    reader._heads[0] = (reader._heads[0][0], bogus)       # a head that is not what its record names
    got = reader.load(target)                              # its deltas fail the digest: from the snapshot
    assert tensor_digest(got) == target.output_checksum


def test_retention_keeps_the_newest_snapshot_and_the_deltas_after_it_whatever_keep_versions(tmp_path):
    store, desc = _run(tmp_path, 24, versions=INT4)
    plan = plan_retention(store, keep_checkpoints=1, keep_versions=1)
    doomed = {i.key for i in plan.items}
    assert any(k.startswith(VERSION_PREFIX) for k in doomed)         # older versions do go
    apply_retention(store, plan)
    fresh = VersionTracker(store, desc)
    values, _ = fresh.load_all()                                       # a new learner still starts
    for p, rec in fresh.latest().items():
        assert tensor_digest({n: values[n] for n in desc.layout.fragments[p]}) == rec.output_checksum
