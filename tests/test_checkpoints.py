"""Checkpoints of the syncer state and the retention planner, on the local directory and real S3."""
from __future__ import annotations

import logging

import pytest

from conftest import make_commit
from pipeline.errors import FormatError
from pipeline.descriptor import RunDescriptor, VersionsConfig
from pipeline.fragment import FragmentLayout
from pipeline.schedule import ScheduleConfig
from pipeline.types import DroppedRecord, TensorSpec
from storage import layout
from storage.checkpoints import (CheckpointPolicy, latest_checkpoint, list_checkpoints, read_checkpoint,
                                 write_checkpoint)
from storage.errors import NotFound
from storage.layout import checkpoint_key, commit_key, write_descriptor
from storage.log import CommitLog
from storage.retention import apply_retention, plan_retention


def _log_with(store, n: int) -> CommitLog:
    log = CommitLog(store)
    for i in range(n):
        log.append(make_commit(i))
    return log


def test_checkpoint_needs_its_commit(store):
    with pytest.raises(NotFound, match="does not exist"):
        write_checkpoint(store, 0, b"state")
    assert store.list(layout.CHECKPOINT_PREFIX) == []
    assert latest_checkpoint(store) is None


def test_latest_checkpoint_and_bounds(store):
    _log_with(store, 10)
    for seq in (3, 6, 9):
        write_checkpoint(store, seq, f"state@{seq}".encode())
    assert list_checkpoints(store) == [3, 6, 9]
    assert latest_checkpoint(store) == (9, b"state@9")
    assert latest_checkpoint(store, at_or_before=8) == (6, b"state@6")
    assert latest_checkpoint(store, at_or_before=6) == (6, b"state@6")
    assert latest_checkpoint(store, at_or_before=2) is None
    write_checkpoint(store, 9, b"other")  # the state after a commit is fixed: the first one stays
    assert read_checkpoint(store, 9) == b"state@9"


def test_damaged_or_foreign_checkpoints_are_skipped(store, caplog):
    _log_with(store, 8)
    write_checkpoint(store, 2, b"good")
    write_checkpoint(store, 5, b"also good")
    store.put_if_absent(checkpoint_key(7), b"\x93garbage")
    with caplog.at_level(logging.WARNING, logger="storage.checkpoints"):
        assert latest_checkpoint(store) == (5, b"also good")
    assert "skipping checkpoint 7" in caplog.text
    with pytest.raises(FormatError, match=checkpoint_key(7)):
        read_checkpoint(store, 7)
    # Checkpoint 5 was written for a commit 5 that is no longer the one in the log.
    store.delete(commit_key(5))
    store.put_if_absent(commit_key(5), make_commit(5, note="rewritten").to_bytes())
    with pytest.raises(FormatError, match="different commit"):
        read_checkpoint(store, 5)
    assert latest_checkpoint(store) == (2, b"good")


def test_checkpoint_policy():
    policy = CheckpointPolicy(every=4)
    assert [s for s in range(12) if policy.due(s)] == [3, 7, 11]
    for bad in ({"every": 0}, {"keep": 0}, {"every": 1.5}):
        with pytest.raises(ValueError, match="CheckpointPolicy"):
            CheckpointPolicy(**bad)


def _build_run(store):
    """Commits 0..11; each merge names one delta (some spilled) and produces a version of
    fragment 0; checkpoints after 3, 7 and 11."""
    write_descriptor(store, RunDescriptor(run_id="r", layout=FragmentLayout((TensorSpec("w", (1,)),), (("w",),)),
                                          schedule=ScheduleConfig(1, (0,)), versions=VersionsConfig(retain=3)))
    log = CommitLog(store)
    store.put_if_absent(layout.version_key(0, 0), b"v0")
    log.append(make_commit(0, kind="init", version=0, output_key=layout.version_key(0, 0)))
    for seq in range(1, 12):
        delta = layout.spill_key("bob", 0, seq) if seq % 3 == 0 else layout.delta_key("alice", 0, seq)
        store.put_if_absent(delta, b"d")
        vkey = layout.version_key(0, seq)
        store.put_if_absent(vkey, b"v")
        dropped = (DroppedRecord("c/0/1", "c", layout.delta_key("carol", 0, 1), "0" * 64, "too stale"),) \
            if seq == 2 else ()
        inputs = (delta,) + ((layout.delta_key("alice", 0, 1),) if seq == 9 else ())  # alice/1 named again later
        log.append(make_commit(seq, version=seq, inputs=inputs, dropped=dropped, output_key=vkey))
    store.put_if_absent(layout.delta_key("carol", 0, 1), b"d")
    store.put_if_absent(layout.delta_key("dave", 0, 0), b"orphan")  # no commit names it
    store.put_if_absent(layout.version_key(0, 12), b"in flight")      # its commit never landed
    store.put_if_absent(layout.version_key(0, 5, 7), b"orphan")       # a fenced syncer's version 5
    for seq in (3, 7, 11):
        write_checkpoint(store, seq, b"s")


def test_retention_plan_lists_and_deletes_only_when_asked(store):
    _build_run(store)
    before = sorted(store.list())
    plan = plan_retention(store, keep_checkpoints=2)
    assert sorted(store.list()) == before  # planning deletes nothing
    assert plan.horizon == 7 and plan.kept_checkpoints == (7, 11)
    expected = {checkpoint_key(3),
                layout.delta_key("alice", 0, 2), layout.delta_key("alice", 0, 4), layout.delta_key("alice", 0, 5),
                layout.delta_key("alice", 0, 7), layout.spill_key("bob", 0, 3), layout.spill_key("bob", 0, 6),
                layout.delta_key("carol", 0, 1)}
    # versions: keep the newest 3 of fragment 0 (10, 11, 12) and v0; 8 and 9 come from commits after 7
    expected |= {layout.version_key(0, v) for v in range(1, 8)} | {layout.version_key(0, 5, 7)}
    assert set(plan.keys()) == expected
    assert all(item.reason for item in plan.items)
    assert plan.summary() == {"checkpoints": 1, "deltas": 5, "spill": 2, "versions": 8}
    assert apply_retention(store, plan) == len(expected)
    # ... and, before deleting, the horizon for replay (issue 26: ddiloco replay starts after it)
    assert sorted(store.list()) == sorted((set(before) - expected) | {layout.RETENTION_KEY})
    assert layout.unpack_retention_hint(store.get(layout.RETENTION_KEY)) == 7
    # What recovery needs is intact: the kept checkpoints and every commit after the horizon.
    assert latest_checkpoint(store) == (11, b"s") and latest_checkpoint(store, 10) == (7, b"s")
    assert [r.seq for r in CommitLog(store).read_range(0)] == list(range(12))
    assert plan_retention(store, keep_checkpoints=2).items == ()  # nothing more to do


def test_retention_without_enough_checkpoints_keeps_the_history(store):
    _build_run(store)
    plan = plan_retention(store, keep_checkpoints=4)
    assert plan.horizon == -1 and plan.items == ()
    plan = plan_retention(store, keep_checkpoints=3, keep_versions=20)
    assert plan.horizon == 3
    assert not any(k.startswith(layout.VERSION_PREFIX) for k in plan.keys())
    with pytest.raises(ValueError, match="keep_checkpoints"):
        plan_retention(store, keep_checkpoints=0)


def test_retention_plan_is_bound_to_its_store(store, tmp_path):
    from storage.store import open_store
    _log_with(store, 1)
    plan = plan_retention(store)
    with pytest.raises(ValueError, match="was made for"):
        apply_retention(open_store(str(tmp_path / "elsewhere")), plan)
