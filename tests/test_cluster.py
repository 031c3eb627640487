"""workers/cluster.py: the one local orchestrator (issue 12). A 2-learner tiny run as real processes:
readiness from the event logs, kill and restart of a learner (a new incarnation), pause and
resume, a clean stop, and drain detected as a polled condition; plus the checks that need no process."""
from __future__ import annotations

import pytest

from storage.layout import commit_key
from storage.log import CommitLog
from storage.store import open_store
from workers.cluster import ClusterConfig, DrainStatus, Life, LocalCluster, RoleExited, create_job_run, global_eval_loss
from workers.job.job import JobSettings
from workers.launch import RunSettings, Schedule

from runhelpers import TINY

pytestmark = pytest.mark.timeout(180)


def _tiny_run(tmp_path, learners=("l0", "l1"), steps: int = 60):
    uri = str(tmp_path / "store")
    job = JobSettings(steps=steps, batch_size=4, lr=3e-3, max_bytes=300_000, shards=2)
    settings = RunSettings(schedule=Schedule(fragments=3, sync_every=6), model=TINY.to_dict(), job=job.to_dict())
    desc, _ = create_job_run(open_store(uri), settings, TINY, 0, tmp_path / "keys", list(learners))
    return uri, desc


def _steps(life) -> int:
    return max((e["step"] for e in life.events() if e.get("event") == "step"), default=0)


def test_config_and_status_say_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match="location"):
        ClusterConfig("", tmp_path)
    with pytest.raises(ValueError, match="> 0"):
        ClusterConfig("x", tmp_path, stop_timeout_s=0)
    cluster = LocalCluster(ClusterConfig(str(tmp_path / "store"), tmp_path))
    assert cluster.ingest != cluster.announce and cluster.ingest.startswith("tcp://127.0.0.1:")
    assert cluster.key_args("l0") == ["--insecure"]
    with pytest.raises(KeyError, match="no role named 'l9'"):
        cluster.restart("l9")
    with pytest.raises(ValueError, match="role must be"):
        cluster.spawn("x", "rogue", [])
    assert DrainStatus().ok and str(DrainStatus()) == "drained"
    status = DrainStatus(running=["l1"], unreported=7)
    assert not status.ok and "l1" in str(status) and "commit 7" in str(status)


def test_keys_are_paths_to_the_roles_own_files(tmp_path):
    cluster = LocalCluster(ClusterConfig("x", tmp_path, keydir=tmp_path / "keys"))
    syncer, learner = cluster.key_args("syncer"), cluster.key_args("l0")
    assert syncer[0] == "--key" and syncer[1].endswith("syncer.key_secret") and len(syncer) == 2
    assert learner[1].endswith("l0.key_secret") and learner[2:] == ["--syncer-key", syncer[1][:-len("_secret")]]


class _NoTail:
    def read(self) -> list[dict]:
        return []


def test_a_syncer_told_to_advertise_is_ready_once_it_published_where_it_listens(tmp_path):
    """Issue 25's busy clean-clone run: ready at "syncer-bus" let a test read the advertisement
    before the syncer had written it (StopIteration); readiness now waits for it when --advertise is given."""
    cluster = LocalCluster(ClusterConfig("x", tmp_path))

    def life(argv, events):
        cluster.lives["syncer"] = [Life("syncer", "syncer", None, 0.0, argv, "workers.cli", 0, _NoTail(),
                                        seen=[{"event": e} for e in events])]
        return cluster.ready("syncer")

    bound = ["syncer-recovered", "syncer-bus"]
    assert life(["syncer"], bound)
    assert not life(["syncer"], bound[:1]) and life(["syncer", "--no-bus"], bound[:1])
    assert not life(["syncer", "--advertise", "127.0.0.1"], bound)
    assert not life(["syncer", "--advertise=h"], bound)
    assert life(["syncer", "--advertise", "127.0.0.1"], [*bound, "syncer-advertised"])
    assert life(["syncer", "--advertise", "127.0.0.1"], [*bound, "syncer-advertise-failed"])   # reported, not fatal


def test_a_role_that_dies_before_it_is_ready_is_reported(tmp_path):
    uri, _ = _tiny_run(tmp_path)
    with LocalCluster(ClusterConfig(uri, tmp_path, keydir=tmp_path / "keys", stop_timeout_s=10)) as cluster:
        cluster.start_learner("l0", ["--slow", "0.5"])        # refused at once: --slow must be >= 1
        with pytest.raises(RoleExited, match="l0 exited .* before it was ready"):
            cluster.wait_ready("l0", timeout_s=60)


def test_two_learners_kill_restart_pause_resume_and_drain(tmp_path):
    uri, desc = _tiny_run(tmp_path)
    marks = []
    cfg = ClusterConfig(uri, tmp_path, keydir=tmp_path / "keys", stop_timeout_s=15)
    with LocalCluster(cfg, observer=lambda who, what, detail: marks.append((who, what))) as cluster:
        cluster.start_syncer()
        cluster.start_learner("l0", ["--steps", "5000", "--slow", "2"])   # runs until stopped
        cluster.start_learner("l1", ["--steps", "5000", "--slow", "2"])
        cluster.wait_ready(["syncer", "l0", "l1"], timeout_s=90)
        assert not cluster.drain_status().ok and cluster.drain_status().running == ["l0", "l1"]
        first = next(e["incarnation"] for e in cluster.life("l0").events() if e["event"] == "learner-start")

        # kill + restart: a new life, a new incarnation, the same flags
        cluster.wait_for(lambda: _steps(cluster.life("l0")) >= 10, 60, "l0 to train")
        cluster.kill("l0")
        killed = cluster.life("l0")
        assert killed.killed and killed.how == "killed" and not cluster.alive("l0")
        cluster.restart("l0")
        cluster.wait_ready("l0", timeout_s=60)
        assert len(cluster.lives["l0"]) == 2 and cluster.life("l0").argv == killed.argv
        again = next(e["incarnation"] for e in cluster.life("l0").events() if e["event"] == "learner-start")
        assert again > first
        with pytest.raises(RuntimeError, match="still running"):
            cluster.restart("l0")

        # pause: l1 trains on while l0 stands still; resume: l0 trains again
        cluster.wait_for(lambda: _steps(cluster.life("l0")) >= 10, 60, "l0's new life to train")
        cluster.pause("l0")
        held, l1_at = _steps(cluster.life("l0")), _steps(cluster.life("l1"))
        cluster.wait_for(lambda: _steps(cluster.life("l1")) >= l1_at + 20, 60, "l1 to train on")
        assert _steps(cluster.life("l0")) <= held + cluster_log_every()
        cluster.resume("l0")
        cluster.wait_for(lambda: _steps(cluster.life("l0")) > held + cluster_log_every(), 60, "l0 to resume")

        # a clean stop of both learners, then the drain is detected without a sleep
        cluster.stop(["l0", "l1"])
        assert [life.how for life in cluster.lives["l0"]] == ["killed", "exit 0"]
        assert cluster.life("l1").how == "exit 0"
        status = cluster.wait_drained(timeout_s=60)
        assert status.ok, str(status)
        assert cluster.alive("syncer")
        log = CommitLog(cluster.store)
        records = list(log.read_range(0, log.tail() + 1))
        named = {i.delta_id for r in records for i in r.inputs} | {d.delta_id for r in records for d in r.dropped}
        for lid in ("l0", "l1"):
            durable = [e["delta"] for e in cluster.events(lid) if e.get("event") in ("delta-acked", "delta-spilled")]
            assert durable and durable[-1] in named
        assert any(e.get("event") == "commit" and e["seq"] == records[-1].seq for e in cluster.events("syncer"))
        loss, versions = global_eval_loss(cluster.store, desc)
        assert loss > 0 and max(versions.values()) >= 1
    assert not cluster.alive("syncer") and cluster.life("syncer").how == "exit 0"
    assert ("l0", "kill") in marks and ("l0", "pause") in marks and ("l0", "resume") in marks


def cluster_log_every() -> int:
    """Steps between two ``step`` events (LearnerConfig.log_every): a pause may land mid-window."""
    from workers.learner.learner import LearnerConfig
    return LearnerConfig().log_every


def test_the_drain_check_reads_past_a_commit_a_killed_syncer_left_empty(tmp_path):
    """A SIGKILLed syncer's half-made commit (SeaweedFS once kept an empty object at its key, in a
    clean-clone run) is lost to recovery, which goes on past it; the drain check must too."""
    uri, desc = _tiny_run(tmp_path)
    store = open_store(uri)
    log = CommitLog(store)
    damaged = log.tail() + 1
    store.put(commit_key(damaged), b"")
    with LocalCluster(ClusterConfig(uri, tmp_path, keydir=tmp_path / "keys")) as cluster:
        assert cluster._uncommitted(["l0", "l1"]) == {}          # before the fix: FormatError
        assert cluster._log_next[0] == damaged + 1
