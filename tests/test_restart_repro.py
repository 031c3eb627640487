"""Issue 25, defect 1, as real processes: after a syncer restart the global clock must not run
away and the learners must keep answering rounds until they end.

The reproduction from the issue: a 2-learner run of 400 steps, ``ddiloco syncer`` and two
``ddiloco learner --pace 0.05`` on the bus; the syncer is SIGKILLed when l0 reaches step 200 and a
new one starts 4 s later (the 4 s outage is the fault injected, the only fixed wait here). Before
the fix the restarted syncer read the spacing of its inbox backlog as the learners' pace, its clock
ticked every loop turn and both learners stopped answering at about step 300.

Asserted (SPEC §11 "Progress"): after the restart every learner's deltas keep being merged up to
its end (no run of more than a few H of its own steps without a merged delta, and merged deltas in
its last quarter), and no commit's round id runs beyond the global steps the learners' steps imply.
Everything waits on conditions (event logs, the commit log) with generous deadlines.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from storage.layout import read_descriptor
from storage.log import CommitLog
from storage.store import open_store
from workers.cluster import ClusterConfig, LocalCluster

pytestmark = pytest.mark.timeout(420)

STEPS = 400
KILL_AT = 200
OUTAGE_S = 4.0          # the fault: how long no syncer runs
PACE_S = 0.05


def _create(out: Path) -> Path:
    """``ddiloco run --create-only --learners 2 --steps 400`` (a small model: the pace, not the CPU,
    sets the step time on a shared machine)."""
    store = out / "store"
    cmd = [sys.executable, "-m", "workers.cli", "run", "--create-only", "--learners", "2", "--steps", str(STEPS),
           "--layers", "1", "--width", "32", "--batch-size", "4", "--out", str(out), "--store", str(store)]
    done = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return store


def _step(cluster: LocalCluster, name: str) -> int:
    """The newest step a learner reported (its ``step`` events, every 10 steps)."""
    steps = [e["step"] for e in cluster.events(name) if e.get("event") == "step"]
    return max(steps, default=0)


def _step_at(cluster: LocalCluster, name: str, t: float) -> int:
    """The step a learner had reported by wall time ``t``."""
    return max((e["step"] for e in cluster.events(name) if e.get("event") == "step" and e["t"] <= t), default=0)


def _merged_steps(records, learner: str) -> list[int]:
    return sorted(i.learner_step for r in records if r.kind == "merge" for i in r.inputs if i.learner == learner)


def test_learners_keep_answering_and_being_merged_after_a_syncer_restart(tmp_path):
    store_uri = str(_create(tmp_path))
    store = open_store(store_uri, create=False)
    H = read_descriptor(store).schedule.sync_every           # 16: 4 fragments, H = 4 P (the demo's default)
    cluster = LocalCluster(ClusterConfig(store_uri, tmp_path, keydir=tmp_path / "keys", poll_s=0.1))
    names = ["l0", "l1"]
    try:
        cluster.start_syncer()
        cluster.wait_ready("syncer", 120)
        for m, lid in enumerate(names):
            cluster.start_learner(lid, ["--shard", str(m), "--pace", str(PACE_S)])
        cluster.wait_for(lambda: _step(cluster, "l0") >= KILL_AT, 300, f"l0 to reach step {KILL_AT}")
        cluster.kill("syncer")
        killed_at = time.time()
        log_at_kill = CommitLog(store).tail()
        rounds_before = [r.round for r in CommitLog(store).read_range(0, log_at_kill + 1)]
        steps_at_kill = {n: _step(cluster, n) for n in names}
        time.sleep(OUTAGE_S)                                  # the outage: the fault being injected
        cluster.restart("syncer")
        cluster.wait_ready("syncer", 120)
        ready_at = time.time()
        cluster.wait_for(cluster.learners_done, 300, "both learners to finish their steps")
        assert cluster.wait_drained(120).ok, cluster.drain_status()
    finally:
        cluster.stop()
    for n in names:
        assert cluster.life(n).how == "exit 0", (n, cluster.life(n).how, cluster.stderr(n))
    records = list(CommitLog(store).read_range(0))
    after = [r for r in records if r.seq > log_at_kill and r.kind == "merge"]
    assert after, "nothing was merged after the restart"

    # No runaway clock: the global step moves at the learners' pace, so after the restart it is at
    # most the newest round before the kill plus the steps the learners still had to make (the
    # new syncer resumes after the newest round in the log), plus a few rounds of slack.
    limit = max(rounds_before) + (STEPS - min(steps_at_kill.values())) + 4 * H
    runaway = [(r.seq, r.round) for r in after if r.round > limit]
    assert not runaway, f"commits closed rounds beyond the global step the learners imply ({limit}): {runaway[:5]}"

    # Progress: from shortly after the new syncer was ready to each learner's end, no 4 H of its
    # own steps pass without one of its deltas being merged; its last quarter is merged too.
    for n in names:
        start = _step_at(cluster, n, ready_at) + 2 * H
        merged = [s for s in _merged_steps(records, n) if s >= start]
        assert merged and merged[-1] >= STEPS * 3 // 4, (n, start, merged[-10:])
        points = [start, *merged, STEPS - 1]
        gaps = [b - a for a, b in zip(points, points[1:])]
        assert max(gaps) <= 4 * H, f"{n}: {max(gaps)} steps without a merged delta after the restart " \
                                   f"(from step {start}; merged {merged})"
    assert killed_at < ready_at
