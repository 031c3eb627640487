"""Issue 11 (Hardening), the syncer's restart and liveness: items 8, 9, 10 and 14.

A tiny run grows a few commits with an in-process syncer (no bus), then the store is damaged by
hand the way the audit did, and a new syncer must recover: salvage what can be recomputed, say so
loudly (events and the fence commit), and keep merging; replay stays strict (docs/replay.md).
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from pipeline.errors import FormatError
from pipeline.types import CommitRecord, DeltaHeader
from storage.checkpoints import list_checkpoints
from storage.errors import NotFound
from storage.layout import checkpoint_key, commit_key
from storage.log import CommitLog
from storage.store import open_store
from workers.bus.keys import KeyRing, ensure_identities
from workers.launch import RunSettings, Schedule, create_run
from workers.common.refold import rebuild
from workers.tools.replay_verify import replay_run
from workers.bus.signing import commit_signature_ok, seal_delta
from workers.syncer.syncer import Syncer, SyncerConfig
from workers.common.versions import VersionTracker

from test_hardening_syncer import _blob, _commits, _init, _merge_all, _offer

pytestmark = pytest.mark.timeout(120)


class Run:
    """A two-fragment run and the syncers started on it (the events of each are kept)."""

    def __init__(self, root, signed: bool = False):
        self.store = open_store(str(root / "store"))
        self.ids = ensure_identities(root / "keys", ["syncer", "l0", "l1"]) if signed else {}
        self.desc = create_run(self.store, _init(), RunSettings(schedule=Schedule(fragments=2, sync_every=2)),
                               embedding_tensors=(),
                               syncer=self.ids.get("syncer"),
                               learners=[self.ids[n].public for n in ("l0", "l1")] if signed else ())
        self.seq = {"l0": 0, "l1": 0}

    def syncer(self, **cfg) -> Syncer:
        keys = KeyRing(self.ids["syncer"], self.ids["syncer"].public) if self.ids else None
        s = Syncer(self.store, SyncerConfig(checkpoint_every=4, **cfg), bus=None, keys=keys)
        s.seen = []
        emit = s.events.emit
        s.events.emit = lambda event, **f: (s.seen.append((event, f)), emit(event, **f))[-1]
        s.recover()
        return s

    def grow(self, s: Syncer, merges: int) -> None:
        """``merges`` merge commits, alternating fragments, from both learners."""
        for k in range(merges):
            p = k % 2
            for learner in ("l0", "l1"):
                h = DeltaHeader(learner, 1, self.seq[learner], p, s.state.fragments[p].version, 3, 300, k)
                self.seq[learner] += 1
                blob = _blob(self.desc, h, fill=0.001 * (1 + k % 3) * (1 if learner == "l0" else -0.5))
                if self.ids:
                    blob = seal_delta(blob, learner, self.ids[learner].signer(), self.desc.run_id)
                _offer(s, blob, h.to_dict())
            _merge_all(s)

    def notes(self, s: Syncer) -> list[str]:
        return [f["detail"] for e, f in s.seen if e == "recovery-salvaged"]


def _done(s: Syncer) -> None:
    s.io.shutdown(wait=True)


def _flip(store, key: str) -> None:
    blob = bytearray(store.get(key))
    blob[len(blob) // 2] ^= 0xFF
    store.put(key, bytes(blob))


# -- item 8: a fenced syncer that is idle exits ----------------------------------------------------------

def test_an_idle_fenced_syncer_exits(tmp_path):
    run = Run(tmp_path)
    old = run.syncer(fence_check_s=0.1)
    out: dict = {}
    t0 = time.monotonic()
    t = threading.Thread(target=lambda: out.setdefault("rc", old.run(lambda: time.monotonic() - t0 > 30)))
    t.start()
    new = run.syncer()                     # claims the next epoch; the old one never commits again
    t.join(timeout=40)
    assert out.get("rc") == 3 and old.fenced
    assert time.monotonic() - t0 < 20, "the fenced syncer kept running while idle"
    assert any(e == "syncer-fenced" for e, _ in old.seen)
    _done(new)


# -- item 9: rebuild read-only first, then claim -----------------------------------------------------

def test_a_syncer_that_cannot_rebuild_claims_no_epoch_and_fences_nobody(tmp_path):
    run = Run(tmp_path)
    running = run.syncer()
    run.grow(running, 1)                         # no checkpoint yet
    assert not list_checkpoints(run.store)
    init0 = CommitLog(run.store).read(0)
    run.store.delete(init0.output_key)          # version 0 lost and no checkpoint: nothing to start from
    epochs, tail = run.store.list("epochs/"), CommitLog(run.store).tail()
    with pytest.raises((NotFound, FormatError)):
        run.syncer()
    assert run.store.list("epochs/") == epochs and CommitLog(run.store).tail() == tail
    running.log.check_fenced()                  # the old syncer still owns the run
    run.grow(running, 1)
    assert CommitLog(run.store).tail() == tail + 1
    _done(running)


# -- item 10: damaged objects ---------------------------------------------------------------------------

def _grown(tmp_path, merges: int = 7, signed: bool = False) -> tuple[Run, int]:
    run = Run(tmp_path, signed=signed)
    s = run.syncer()
    run.grow(s, merges)
    _done(s)
    return run, max(list_checkpoints(run.store))


def test_a_deleted_merged_input_after_the_checkpoint_is_salvaged_from_its_stored_version(tmp_path):
    run, cp = _grown(tmp_path)
    victim = next(r for r in _commits(run.store) if r.kind == "merge" and r.seq > cp)
    run.store.delete(victim.inputs[0].key)
    with pytest.raises(NotFound):               # replay stays strict: it reports, never repairs
        rebuild(run.store, run.desc, CommitLog(run.store).tail())
    s = run.syncer()
    fence = CommitLog(run.store).read(s.state.last_seq)
    assert fence.kind == "fence" and any("does not re-fold" in n for n in fence.info["recovery"])
    assert any(f"adopted version {victim.version}" in n for n in run.notes(s))
    assert s.state.last_seq in list_checkpoints(run.store)          # salvaged state checkpointed at the fence
    run.grow(s, 4)                              # and it goes on merging both fragments
    _done(s)
    report = replay_run(run.store, run.desc, start=fence.seq + 1)
    assert report.commits == CommitLog(run.store).tail() - fence.seq and report.from_checkpoint >= fence.seq


def test_a_flipped_byte_in_a_commit_stops_neither_the_syncer_nor_new_learners(tmp_path):
    run, cp = _grown(tmp_path)
    victim = [r for r in _commits(run.store) if r.kind == "merge"][-1]     # the newest version of its fragment
    _flip(run.store, commit_key(victim.seq))
    values, versions = VersionTracker(run.store, run.desc).load_all()     # a new learner starts
    assert versions[victim.fragment] < victim.version
    s = run.syncer()
    assert any(f"commit {victim.seq} is missing or damaged" in n for n in run.notes(s))
    assert s.state.fragments[victim.fragment].version == victim.version   # the lost number is never reused
    run.grow(s, 2)
    _done(s)
    assert VersionTracker(run.store, run.desc).load_all()[1][victim.fragment] > victim.version


def test_a_damaged_newest_version_is_skipped_by_learners_and_republished_by_the_syncer(tmp_path):
    run, _ = _grown(tmp_path, signed=True)
    newest = VersionTracker(run.store, run.desc).latest()
    rec = newest[0]
    _flip(run.store, rec.output_key)
    tracker = VersionTracker(run.store, run.desc)
    _, versions = tracker.load_all()                   # used to crash every new learner
    assert versions[0] < rec.version and any("version" in r for r in tracker.refused)
    s = run.syncer()
    assert any(f"republished version {rec.version} of fragment 0" in f["detail"]
               for e, f in s.seen if e == "version-republished")
    _done(s)
    values, versions = VersionTracker(run.store, run.desc).load_all()
    assert versions[0] == rec.version
    np.testing.assert_array_equal(values["a.weight"] if "a.weight" in run.desc.layout.fragments[0] else
                                  values[run.desc.layout.fragments[0][0]],
                                  s.state.fragments[0].history[rec.version][run.desc.layout.fragments[0][0]])


def test_a_deleted_commit_before_the_checkpoint_is_reported_not_appended_over_silently(tmp_path):
    run, cp = _grown(tmp_path)
    gone = cp - 1
    run.store.delete(commit_key(gone))
    s = run.syncer()
    notes = run.notes(s)
    assert any("gaps" in n and str(gone) in n for n in notes), notes
    fence = CommitLog(run.store).read(s.state.last_seq)
    assert any("gaps" in n for n in fence.info["recovery"])
    run.grow(s, 2)
    _done(s)
    with pytest.raises((FormatError, NotFound)):    # the gap (or a delta retention removed before it)
        replay_run(run.store, run.desc)
    replay_run(run.store, run.desc, start=fence.seq + 1)   # what docs/replay.md tells the user to do


def test_a_damaged_newest_checkpoint_falls_back_to_an_older_one_loudly(tmp_path):
    run, cp = _grown(tmp_path, merges=11)
    assert len(list_checkpoints(run.store)) >= 2
    _flip(run.store, checkpoint_key(cp))
    s = run.syncer()
    assert any(f"checkpoint {cp} skipped" in n for n in run.notes(s))
    run.grow(s, 1)
    _done(s)
    state, stats = rebuild(run.store, run.desc, CommitLog(run.store).tail())    # replay skips it too
    assert stats.from_checkpoint < cp


# -- item 14: fence commits are signed -------------------------------------------------------------------

def test_fences_are_signed_and_a_forged_one_is_refused_by_replay_and_skipped_by_recovery(tmp_path):
    run, _ = _grown(tmp_path, merges=3, signed=True)
    sec = run.desc.security.syncer.sign
    fences = [r for r in _commits(run.store) if r.kind == "fence"]
    assert fences and all(commit_signature_ok(r, sec, run.desc.run_id) for r in fences)
    log = CommitLog(run.store)
    forged = CommitRecord(seq=log.tail() + 1, epoch=99, kind="fence", info={"syncer": "mallory", "nonce": "0"})
    log.append(forged)                          # anyone who can write to the bucket can do this
    with pytest.raises(FormatError, match="fence"):
        rebuild(run.store, run.desc, log.tail(), use_checkpoint=False)
    s = run.syncer()
    assert any("fence" in n and "skipped" in n for n in run.notes(s))
    run.grow(s, 2)
    _done(s)
    assert [r.kind for r in _commits(run.store)[-2:]] == ["merge", "merge"]
