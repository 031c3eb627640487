"""Issue 12: fault injection is passed into the syncer from outside, never read from the environment.

``Syncer(before_commit=...)`` is called with each commit record after the record's inputs and
version are stored and before the append (SPEC §7: data before the commit that names it); the chaos
wrapper infra/chaos/faulty_syncer.py turns it into an exit 137 on the N-th merge. The process-level
scenario is tests/test_chaos.py::test_syncer_killed_mid_commit_recovers_and_ignores_the_orphan.
"""
from __future__ import annotations

import numpy as np
import pytest

from infra.chaos.faulty_syncer import CrashBeforeCommit, crash_count, main as faulty_main
from pipeline.codec import CodecConfig, encode
from pipeline.policy import Decision
from pipeline.types import CommitRecord, DeltaHeader
from storage.errors import NotFound
from storage.layout import delta_key, spill_key
from storage.log import CommitLog
from storage.store import open_store
from workers.launch import RunSettings, Schedule, create_run
from workers.syncer.syncer import Syncer, SyncerConfig

pytestmark = pytest.mark.timeout(60)


class _Crash(Exception):
    """Stands in for the process dying: the syncer does not catch it."""


def _run(tmp_path):
    store = open_store(str(tmp_path / "store"))
    rng = np.random.default_rng(0)
    init = {"a.weight": rng.normal(size=(8, 4)).astype(np.float32), "b.weight": rng.normal(size=(16,)).astype(np.float32)}
    desc = create_run(store, init, RunSettings(schedule=Schedule(fragments=1, sync_every=2)), embedding_tensors=())
    return store, desc


def _spill(store, desc, seq: int) -> DeltaHeader:
    h = DeltaHeader("l0", 1, seq, 0, 0, 4, 400, seq)
    tensors = {t.name: np.full(t.shape, 0.01 * (seq + 1), np.float32) for t in desc.layout.tensors}
    store.put_if_absent(spill_key(h.learner, h.incarnation, h.seq), encode("delta", h.to_dict(), tensors,
                                                                           CodecConfig(scheme="int8")))
    return h


def _merge_pending(syncer: Syncer) -> None:
    """Close fragment 0's round now with everything it holds (the policy is tested apart)."""
    syncer.ingest.poll_inboxes()
    pend = syncer.pending[0]
    syncer.merge(0, list(pend), Decision(tuple(k for k, h in pend.items() if not h.reason), (), 0.0, None, None,
                                          "all-reported"))


def test_before_commit_runs_after_the_data_and_before_the_append_and_a_new_syncer_ignores_the_orphan(tmp_path):
    store, desc = _run(tmp_path)
    h = _spill(store, desc, 0)
    seen: list[dict] = []

    def hook(rec: CommitRecord) -> None:
        try:
            CommitLog(store).read(rec.seq)
            appended = True
        except NotFound:
            appended = False
        seen.append({"kind": rec.kind, "appended": appended, "version_stored": store.exists(rec.output_key),
                     "input_stored": store.exists(delta_key(h.learner, h.incarnation, h.seq)),
                     "output_key": rec.output_key, "seq": rec.seq})
        raise _Crash()

    first = Syncer(store, SyncerConfig(spill_poll_s=0.1), bus=None, before_commit=hook)
    first.recover()
    with pytest.raises(_Crash):
        _merge_pending(first)
    first.io.shutdown(wait=True)
    assert seen == [{"kind": "merge", "appended": False, "version_stored": True, "input_stored": True,
                     "output_key": seen[0]["output_key"], "seq": seen[0]["seq"]}]

    second = Syncer(store, SyncerConfig(spill_poll_s=0.1), bus=None)     # production: no hook
    second.recover()
    _merge_pending(second)
    second.io.shutdown(wait=True)
    records = list(CommitLog(store).read_range(0))
    merges = [r for r in records if r.kind == "merge"]
    assert [i.delta_id for r in merges for i in r.inputs] == [h.id]
    assert seen[0]["output_key"] not in {r.output_key for r in records}     # the orphan is never named
    assert store.exists(seen[0]["output_key"])


def _rec(kind: str, seq: int) -> CommitRecord:
    return CommitRecord(seq=seq, kind=kind, fragment=0, version=seq, epoch=1, output_key=f"v{seq}",
                        output_checksum="0" * 64)


class _Events:
    def __init__(self):
        self.seen = []

    def emit(self, event, **fields):
        self.seen.append((event, fields))


def test_the_crash_hook_counts_merge_commits_only_and_exits_137_on_the_nth():
    events, exits = _Events(), []
    hook = CrashBeforeCommit(2, events, exit=exits.append)
    for rec in (_rec("fence", 3), _rec("merge", 4), _rec("drop", 5)):
        hook(rec)
    assert exits == [] and events.seen == []
    hook(_rec("merge", 6))
    assert exits == [137]
    assert events.seen == [("fault-injected", {"fault": "crash-before-commit", "seq": 6, "output_key": "v6"})]


@pytest.mark.parametrize("spec, n", [("crash-before-commit", 1), ("crash-before-commit:12", 12)])
def test_a_scenario_fault_names_the_merge_to_crash_on(spec, n):
    assert crash_count(spec) == n


@pytest.mark.parametrize("spec", ["", "crash-before-commit:0", "crash-before-commit:x", "crash-after-commit:1"])
def test_a_bad_scenario_fault_is_refused_before_anything_starts(spec):
    with pytest.raises(ValueError, match="expected crash-before-commit"):
        crash_count(spec)


def test_the_wrapper_refuses_a_crash_count_below_one(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        faulty_main(["--crash-before-commit", "0", "--store", str(tmp_path)])
    assert exc.value.code == 2 and "expected an int >= 1" in capsys.readouterr().err
