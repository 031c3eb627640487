"""The sharded syncer (issue 15; docs/scale.md "Sharded syncer", docs/storage.md "Sharded runs").

Keys and the shard view (storage/layout.py, storage/shards.py), the descriptor's shard count,
an unsharded run's layout left exactly as it was, and two real runs as processes: ``ddiloco run
--syncers 2`` (each shard's log holds merges of its own fragments only, learners apply versions
of both shards, loss goes down, replay is bit-exact, every durable delta is named exactly once)
and a shard killed mid-run and restarted alone (the other shard keeps committing; the learners
spill the dead shard's fragments into its inbox and it ingests them after the restart)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter

import pytest

from pipeline.errors import FormatError
from pipeline.descriptor import RunDescriptor
from storage.layout import (DESCRIPTOR_KEY, commit_key, shard_fragments, shard_key, shard_owner, shard_prefix,
                            spill_key, unshard_key, version_key)
from storage.log import CommitLog
from storage.shards import ShardStore, run_records, shard_stores, syncer_store
from storage.store import open_store
from workers.cluster import ClusterConfig, LocalCluster, create_job_run, global_eval_loss
from workers.commands import _check_shard, _shard_spec
from workers.job.job import JobSettings
from workers.launch import RunSettings, Schedule
from workers.learner.shards import split_bus
from workers.bus.bus import BusConfig

from runhelpers import TINY

pytestmark = pytest.mark.timeout(240)
ENV = dict(os.environ, OMP_NUM_THREADS="1")


# -- keys and the shard view -------------------------------------------------------------------------

def test_shard_keys_partition_only_what_a_shard_owns():
    assert shard_prefix(1) == "shards/s0001/"
    assert shard_key(1, commit_key(7)) == "shards/s0001/log/00000000000000000007"
    assert shard_key(0, "epochs/0000000001") == "shards/s0000/epochs/0000000001"
    assert shard_key(2, "hints/log-head") == "shards/s0002/hints/log-head"
    assert shard_key(1, spill_key("l0", 1, 3)) == "shards/s0001/spill/l0/i0000000001/s000000000003"
    # shared: a fragment has one owner, so its versions and merged deltas never collide
    for key in (DESCRIPTOR_KEY, version_key(3, 2, 1), "deltas/l0/i0000000001/s000000000003",
                "incarnations/l0/i0000000001", "members/l0"):
        assert shard_key(1, key) == key
    assert unshard_key(1, "shards/s0001/log/00000000000000000007") == commit_key(7)
    with pytest.raises(FormatError):
        unshard_key(0, "shards/s0001/log/00000000000000000007")
    assert [shard_owner(p, 3) for p in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert shard_fragments(1, 3, 7) == (1, 4)
    with pytest.raises(ValueError):
        shard_fragments(3, 3, 7)


def test_shard_store_maps_keys_and_hides_other_shards_versions(tmp_path):
    root = open_store(str(tmp_path / "run"))
    s1 = ShardStore(root, 1, 2, 4)
    s1.put_if_absent(commit_key(0), b"c")
    s1.put("hints/log-head", b"h")
    s1.put_if_absent(version_key(1, 1, 1), b"v1")
    root.put_if_absent(version_key(2, 1, 1), b"v2")       # shard 0's fragment
    assert root.get("shards/s0001/log/00000000000000000000") == b"c"
    assert not root.exists(commit_key(0))                  # the run's own log is untouched
    assert s1.list("log/") == [commit_key(0)] and s1.get(commit_key(0)) == b"c"
    assert s1.list("versions/") == [version_key(1, 1, 1)]  # retention must never see shard 0's versions
    assert s1.head(commit_key(0)).key == commit_key(0)
    with pytest.raises(ValueError, match="mix"):
        s1.list("")
    desc = _descriptor(syncers=1)
    assert shard_stores(root, desc) == [root] and syncer_store(root, desc, None) is root
    with pytest.raises(ValueError, match="not sharded"):
        syncer_store(root, desc, 0)
    with pytest.raises(ValueError, match="--shard"):
        syncer_store(root, _descriptor(syncers=2), None)


def _descriptor(syncers: int, fragments: int = 4) -> RunDescriptor:
    job = JobSettings(steps=10, batch_size=4, max_bytes=300_000, shards=1)
    from workers.job.model import build_model, EMBEDDING_TENSORS
    from pipeline.fragment import specs_from_arrays
    init = {n: p.detach().numpy() for n, p in build_model(TINY, 0).named_parameters()}
    return RunSettings(schedule=Schedule(fragments=fragments, sync_every=8), model=TINY.to_dict(),
                       job=job.to_dict(), syncers=syncers).descriptor("r1", specs_from_arrays(init), EMBEDDING_TENSORS)


def test_descriptor_records_the_shard_count_and_n1_bytes_are_unchanged():
    one, two = _descriptor(1), _descriptor(2)
    assert b"syncers" not in one.to_bytes()                # v2, as before
    assert RunDescriptor.from_bytes(one.to_bytes()) == one
    back = RunDescriptor.from_bytes(two.to_bytes())
    assert back.syncers == 2 and back == two
    assert one.to_bytes() == RunDescriptor.from_dict({**one.to_dict()}).to_bytes()
    from pipeline.envelope import pack_record
    with pytest.raises(FormatError, match="must not have a syncers"):
        RunDescriptor.from_bytes(pack_record(RunDescriptor.KIND, 2, two.to_dict()))
    with pytest.raises(FormatError, match="must have a syncers"):
        RunDescriptor.from_bytes(pack_record(RunDescriptor.KIND, 4, one.to_dict()))
    with pytest.raises(ValueError, match="syncers must be"):
        _descriptor(5, fragments=4)


def test_unsharded_run_keeps_its_layout(tmp_path):
    store = open_store(str(tmp_path / "store"))
    job = JobSettings(steps=10, batch_size=4, max_bytes=300_000, shards=1)
    create_job_run(store, RunSettings(schedule=Schedule(fragments=3, sync_every=6), model=TINY.to_dict(),
                                      job=job.to_dict()),
                   TINY, 0, None, ["l0"])
    keys = set(store.list("log/")) | set(store.list("hints/")) | set(store.list("shards/"))
    assert keys == {commit_key(0), commit_key(1), commit_key(2), "hints/log-head"}


def test_cli_shard_flags():
    assert _shard_spec("1/3") == (1, 3)
    for bad in ("3/3", "x", "1"):
        with pytest.raises(Exception):
            _shard_spec(bad)
    two = _descriptor(2)
    assert _check_shard((1, 2), two) == 1
    with pytest.raises(SystemExit, match="2 syncer shards"):
        _check_shard((1, 3), two)
    with pytest.raises(SystemExit, match="--shard"):
        _check_shard(None, two)
    assert _check_shard(None, _descriptor(1)) is None
    buses = split_bus(BusConfig("tcp://127.0.0.1:1,tcp://127.0.0.1:2", "tcp://127.0.0.1:3,tcp://127.0.0.1:4"), 2)
    assert [(b.ingest, b.announce) for b in buses] == [("tcp://127.0.0.1:1", "tcp://127.0.0.1:3"),
                                                      ("tcp://127.0.0.1:2", "tcp://127.0.0.1:4")]
    with pytest.raises(ValueError, match="2 syncer shards"):
        split_bus(BusConfig("tcp://127.0.0.1:1", "tcp://127.0.0.1:3"), 2)


# -- real runs ----------------------------------------------------------------------------------------

def _events(logs) -> list[dict]:
    return [json.loads(line) for f in sorted(logs.glob("*.jsonl")) for line in f.read_text().splitlines()
            if line.strip().startswith("{")]


def _check_shard_logs(store, desc) -> dict[int, list]:
    """Each shard's merges, asserting they are all of its own fragments."""
    merges = {}
    for i, s in enumerate(shard_stores(store, desc)):
        log = CommitLog(s)
        recs = list(log.read_range(0, log.tail() + 1))
        assert [r.kind for r in recs[:desc.num_fragments]] == ["init"] * desc.num_fragments
        merges[i] = [r for r in recs if r.kind in ("merge", "drop")]
        assert {r.fragment % desc.syncers for r in merges[i]} <= {i}
    return merges


def _ledger(store, desc, events) -> None:
    """Every delta a learner made durable is named by a commit; none is merged twice; none is invented."""
    named = [d for r in run_records(store, desc) for d in [*(i.delta_id for i in r.inputs),
                                                            *(x.delta_id for x in r.dropped)]]
    merged = Counter(i.delta_id for r in run_records(store, desc) for i in r.inputs)
    produced = {e["delta"] for e in events if e.get("event") == "delta"}
    durable = {e["delta"] for e in events if e.get("event") in ("delta-acked", "delta-spilled")}
    assert durable and durable <= set(named), sorted(durable - set(named))[:5]
    assert set(named) <= produced
    assert max(merged.values()) == 1


def _replay(uri: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workers.cli", "replay", uri, "--plain"], env=ENV,
                          capture_output=True, text=True, timeout=120)


def test_ddiloco_run_with_two_syncers(tmp_path):
    """Signed (the default): both shards sign with the run's syncer key, learners verify both."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "workers.cli", "run", "--learners", "2", "--steps", "80", "--fragments", "4",
           "--sync-every", "8", "--layers", "1", "--width", "32", "--batch-size", "4", "--plain",
           "--eval-every", "1000", "--syncers", "2", "--out", str(out)]
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] and summary["drained"]
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.5
    store = open_store(str(out / "store"), create=False)
    from storage.layout import read_descriptor
    desc = read_descriptor(store)
    assert desc.syncers == 2 and not store.list("log/")        # no unsharded log in a sharded run
    merges = _check_shard_logs(store, desc)
    assert all(any(r.kind == "merge" for r in merges[i]) for i in (0, 1))
    events = _events(out / "logs")
    applied = {e["fragment"] % 2 for e in events if e.get("event") == "version-applied"}
    assert applied == {0, 1}                                    # learners applied versions of both shards
    assert {e["id"] for e in events if e.get("event") == "syncer-recovered"} == {"syncer-s0", "syncer-s1"}
    _ledger(store, desc, events)
    rep = _replay(str(out / "store"))
    assert rep.returncode == 0 and "2 of 2 shard logs verified" in rep.stdout, rep.stdout[-2000:] + rep.stderr


def _tail(store, desc, shard: int) -> int:
    return CommitLog(shard_stores(store, desc)[shard]).tail()


def test_one_shard_dies_and_restarts_alone(tmp_path):
    uri = str(tmp_path / "store")
    store = open_store(uri)
    job = JobSettings(steps=400, batch_size=4, lr=3e-3, max_bytes=300_000, shards=2)
    settings = RunSettings(schedule=Schedule(fragments=4, sync_every=8), model=TINY.to_dict(), job=job.to_dict(),
                           syncers=2)
    desc, _ = create_job_run(store, settings, TINY, 0, None, ["l0", "l1"])
    with LocalCluster(ClusterConfig(uri, tmp_path, syncers=2)) as cluster:
        s0, s1 = cluster.syncer_names()
        cluster.start_syncers()
        cluster.wait_ready([s0, s1])
        for lid in ("l0", "l1"):
            # paced (400 steps >= 8 s): the learners must still be training after the kill, whatever
            # the machine's load did to the syncers' start (once in CI they ran out of steps first)
            cluster.start_learner(lid, ["--ack-timeout", "0.5", "--pace", "0.02"])
        cluster.wait_ready(["l0", "l1"])
        cluster.wait_for(lambda: _tail(store, desc, 1) >= desc.num_fragments + 2, 60, "shard 1 commits")
        cluster.kill(s1)
        down_at = _tail(store, desc, 0)
        spill1 = shard_stores(store, desc)[1]

        def spilled_to_1() -> set[str]:
            return {e["delta"] for lid in ("l0", "l1") for e in cluster.events(lid)
                    if e.get("event") == "delta-spilled" and e["fragment"] % 2 == 1}
        # the spill's event is logged after its PUT: wait for both (once in CI the listing was seen first)
        cluster.wait_for(lambda: _tail(store, desc, 0) >= down_at + 4 and spill1.list("spill/") and spilled_to_1(), 60,
                         "shard 0 commits and the learners spill shard 1's fragments while it is down")
        spilled = spilled_to_1()
        assert spilled
        assert _tail(store, desc, 0) >= down_at + 4             # the other shard kept committing
        cluster.restart(s1)
        cluster.wait_ready(s1)
        for lid in ("l0", "l1"):
            cluster.life(lid).popen.wait(timeout=150)
        status = cluster.wait_drained(60)
        assert status.ok, str(status)
        cluster.stop()
        events = [e for n in cluster.names() for e in cluster.events(n)]
    named1 = {i.delta_id for r in CommitLog(shard_stores(store, desc)[1]).read_range(0, _tail(store, desc, 1) + 1)
              for i in [*r.inputs, *r.dropped]}
    assert spilled <= named1                                    # shard 1 ingested its spills after the restart
    _check_shard_logs(store, desc)
    _ledger(store, desc, events)
    assert global_eval_loss(store, desc)[0] > 0
    rep = _replay(uri)
    assert rep.returncode == 0, rep.stdout[-2000:] + rep.stderr


def test_a_shard_syncer_owns_its_fragments_only(tmp_path):
    from workers.syncer.syncer import Syncer, SyncerConfig
    from workers.learner.shards import ShardedTracker
    store = open_store(str(tmp_path / "store"))
    job = JobSettings(steps=10, batch_size=4, max_bytes=300_000, shards=1)
    settings = RunSettings(schedule=Schedule(fragments=4, sync_every=8), model=TINY.to_dict(), job=job.to_dict(),
                           syncers=2)
    desc, model = create_job_run(store, settings, TINY, 0, None, ["l0"])
    s1 = Syncer(store, SyncerConfig(syncer_id="s1", shard=1))
    assert isinstance(getattr(s1.store, "shard_view", s1.store), ShardStore) and s1.ingest.owned == {1, 3} and s1.rounds.owned == {1, 3}
    opened = [p for t in range(1, 40) for _, p in s1.rounds.tick(t * 0.1)]   # 0.1 s per global step
    assert opened and set(opened) == {1, 3}                # rounds only for its own fragments
    with pytest.raises(ValueError, match="--shard"):
        Syncer(store, SyncerConfig(syncer_id="s"))
    s1.recover()                                      # its own epoch, in its own partition
    assert store.exists("shards/s0001/epochs/0000000001") and not store.exists("shards/s0000/epochs/0000000001")
    values, versions = ShardedTracker(store, desc).load_all()
    assert versions == {0: 0, 1: 0, 2: 0, 3: 0}
    assert set(values) == {n for n, _ in model.named_parameters()}


def test_a_sharded_learners_counters_add_up_and_its_cursors_go_to_each_shard():
    """What a sync agent reads from its per-shard senders, receivers and trackers
    (workers/learner/shards.py): idle only when every shard's sender is, counts summed, the copy
    wait a mean over every wait (not of the shards' means), one log cursor per shard."""
    from types import SimpleNamespace
    from workers.common.aggregate import RunningMean
    from workers.learner.shards import ShardedReceiver, ShardedSender, ShardedTracker

    def receiver(waits):
        mean = RunningMean()
        for w in waits:
            mean.append(w)
        return SimpleNamespace(awaited=len(waits), copy_misses=2 * len(waits), _copy_wait=mean)

    r = ShardedReceiver([receiver([1.0, 1.0, 1.0]), receiver([5.0])])
    assert (r.awaited, r.copy_misses, r.copy_wait_s) == (4, 8, 2.0)       # (1+1+1+5)/4, not (1+5)/2
    assert ShardedReceiver([receiver([])]).copy_wait_s == 0.0
    busy, idle = SimpleNamespace(idle=lambda: False), SimpleNamespace(idle=lambda: True)
    assert ShardedSender([idle, idle]).idle() and not ShardedSender([idle, busy]).idle()
    tracker = ShardedTracker.__new__(ShardedTracker)
    tracker.trackers = [SimpleNamespace(cursor=-1), SimpleNamespace(cursor=-1)]
    tracker.cursor = [7, 9]
    assert tracker.cursor == [7, 9] and [t.cursor for t in tracker.trackers] == [7, 9]
    with pytest.raises(ValueError, match="2 shard cursors"):
        tracker.cursor = [7]
