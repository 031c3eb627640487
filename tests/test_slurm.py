"""Issue 29 acceptance on a real one-node SLURM (infra/slurm/local.py: munged, slurmctld, slurmd on loopback).

``ddiloco slurm submit`` puts a run of three learners on it: l0 trains on through everything, l1
and l2 hold at a gate (tests/fixtures/gated_minimal.py). Then l1's process is SIGKILLed (its job
alone is requeued and the learner resumes from its record), l2's job is scancelled (it drains and
stays stopped), and the syncer's process is SIGKILLed (its job is requeued and the new syncer
recovers, advertises where it listens, and the learners follow it there). After the gate opens
the run ends on its own (the stop job), the token ledger balances and ``ddiloco replay`` passes.
Every wait is a condition with a generous deadline."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra.chaos.invariants import Observation, token_ledger
from infra.slurm.local import LocalSlurm, missing
from storage.log import CommitLog
from storage.store import open_store
from tests.runhelpers import wait_for
from tests.test_launch import _recorded_step
from workers.common.events import read_events

ROOT = Path(__file__).resolve().parents[1]
GATED = ROOT / "tests" / "fixtures" / "gated_minimal.py"
DEADLINE_S = 240

pytestmark = pytest.mark.skipif(missing() is not None, reason=f"SLURM for tests/test_slurm.py: {missing()}")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm")).start()
    yield cluster
    cluster.stop()


def _env(cluster: LocalSlurm, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDILOCO_")}
    return {**env, **cluster.env(), "OMP_NUM_THREADS": "1", **extra}


def _events(out: Path, name: str) -> list[dict]:
    path = out / "logs" / f"{name}.jsonl"
    return read_events(path) if path.exists() else []


def _of(out: Path, name: str, event: str) -> list[dict]:
    return [e for e in _events(out, name) if e.get("event") == event]


def _step(out: Path, lid: str) -> int:
    return max((e.get("step", 0) for e in _of(out, lid, "step")), default=0)


def _jobs_state(cluster: LocalSlurm, job: str) -> str:
    return cluster.run("squeue", "-h", "-j", job, "-o", "%T", check=False).stdout.strip()


def _submit(cluster: LocalSlurm, out: Path, gate: Path, until: Path) -> dict:
    env = _env(cluster, GATE_AT="60", GATE_FILE=str(gate), GATE_FOR="l1,l2", UNTIL_FILE=str(until), UNTIL_FOR="l0",
               PACE_S="0.1")
    done = subprocess.run([sys.executable, "-m", "workers.cli", "slurm", "submit", "--out", str(out), "--learners", "3",
                           "--steps", "200", "--fragments", "2", "--sync-every", "8", "--bind", "127.0.0.1",
                           "--launch.state_every", "0.2", "--max-restarts", "2", "--", "python", str(GATED)],
                          capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "submitted run" in done.stdout
    return json.loads((out / "slurm" / "jobs.json").read_text())


def test_a_run_on_slurm_survives_a_killed_learner_a_cancelled_job_and_a_killed_syncer(slurm, tmp_path):
    out, gate, until = tmp_path / "run", tmp_path / "gate", tmp_path / "until"
    jobs = _submit(slurm, out, gate, until)
    learners = jobs["learners"]
    assert sorted(learners) == ["l0", "l1", "l2"] and len(set(learners.values())) == 3

    def job_out(role: str) -> str:
        return "\n".join(p.read_text() for p in sorted((out / "slurm").glob(f"{role}-*.out")))

    def wait(cond, what: str) -> None:
        try:
            wait_for(cond, DEADLINE_S, what, poll_s=0.2)
        except AssertionError as exc:    # what each job printed, as it stands now
            raise AssertionError(f"{exc}\n" + "\n".join(f"--- {r}\n{job_out(r)[-1500:]}"
                                                         for r in ("syncer", "l0", "l1", "l2", "stop"))) from None

    wait(lambda: all(_recorded_step(out, lid) == 60 for lid in ("l1", "l2")) and _of(out, "syncer", "syncer-advertised")
         and _step(out, "l0") > 60, "l1 and l2 to hold at step 60 with l0 past it and the syncer advertised")
    created = _of(out, "syncer", "run-created")
    assert created and created[0]["by"] == "syncer" and created[0]["initial_model_from"] in learners

    # 1. SIGKILL l1's process: its job alone is requeued, the new life resumes at 60
    t_kill = time.time()
    os.kill(_of(out, "l1", "learner-start")[0]["pid"], signal.SIGKILL)
    wait(lambda: len(_of(out, "l1", "learner-start")) == 2 and _of(out, "l1", "learner-resumed"),
         "l1's requeued job to start a new life")
    t_back = _of(out, "l1", "learner-start")[1]["t"]
    assert _of(out, "l1", "learner-resumed")[0]["step"] == 60
    assert "l1 requeued" in job_out("l1")

    # 2. scancel l2's job: the learner drains and records where it stands; the job is not requeued
    slurm.run("scancel", learners["l2"])
    wait(lambda: _of(out, "l2", "learner-stop") and not _jobs_state(slurm, learners["l2"]), "l2's job to end")
    assert _of(out, "l2", "learner-stop")[0]["step"] == 60 and len(_of(out, "l2", "learner-start")) == 1
    assert "requeued" not in job_out("l2")

    # 3. SIGKILL the syncer's process: its job is requeued, the new syncer recovers in a new epoch,
    #    advertises its new endpoints, and l0 (which never stopped) follows it there
    first = _of(out, "syncer", "syncer-recovered")[0]
    l0_at_kill = _step(out, "l0")
    os.kill(first["pid"], signal.SIGKILL)
    wait(lambda: len(_of(out, "syncer", "syncer-recovered")) == 2 and len(_of(out, "syncer", "syncer-advertised")) == 2,
         "the requeued syncer to recover and advertise")
    second = _of(out, "syncer", "syncer-recovered")[1]
    assert second["epoch"] > first["epoch"] and second["pid"] != first["pid"]
    assert "syncer requeued" in job_out("syncer")
    log = CommitLog(open_store(str(out / "store"), create=False))

    def merged_in_new_epoch(lid: str) -> bool:
        return any(r.kind == "merge" and r.epoch == second["epoch"] and any(i.learner == lid for i in r.inputs)
                   for r in log.read_range(0))
    wait(lambda: merged_in_new_epoch("l0"), "the new syncer to merge l0's deltas")
    assert _step(out, "l0") > l0_at_kill and len(_of(out, "l0", "learner-start")) == 1

    # 4. open the gate and end l0: l1 runs to its budget, the stop job ends the syncer and summarises
    gate.touch()
    wait(lambda: _step(out, "l1") >= 150, "l1 to train on after the gate")
    until.touch()
    wait(lambda: (out / "summary.json").exists() and not _jobs_state(slurm, jobs["stop"]), "the stop job's summary")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "slurm" and summary["ok"], summary["problems"]
    assert summary["restarts"] == {"l0": 0, "l1": 1, "l2": 0} and summary["syncer_lives"] == 2
    assert summary["per_learner"]["l1"]["step"] == 200
    assert merged_in_new_epoch("l1"), "l1's second life contributed to the new syncer"
    # the requeued learner's deltas are merged again after it rejoined (its new incarnation's)
    again = _of(out, "l1", "learner-start")[1]["incarnation"]
    assert any(i.learner == "l1" and i.incarnation == again for r in log.read_range(0) if r.kind == "merge"
               for i in r.inputs)
    # the survivor never waited while l1 was away: its longest step gap in that window (each step
    # event carries the longest since the one before) stays within 2x its median gap
    median = _of(out, "l0", "learner-stop")[0]["median_gap_s"]
    window = [e["max_gap_s"] for e in _of(out, "l0", "step") if t_kill < e["t"] <= t_back]
    assert window and max(window) <= 2 * median, (max(window, default=None), median, len(window))
    assert [e["step"] for e in _of(out, "l1", "learner-stop")] == [200]
    for lid in ("syncer", "l0", "l1", "l2"):
        assert not _jobs_state(slurm, learners.get(lid, jobs["syncer"]))

    # the ledger balances: every delta merged once, dropped with a reason, or lost with a SIGKILLed life
    records = list(log.read_range(0))
    events = {lid: _events(out, lid) for lid in learners}
    lives = {"l1": [{"pid": _of(out, "l1", "learner-start")[0]["pid"], "killed": True}]}
    ledger = token_ledger(Observation(records, events, {}, lives, [], drained=True))
    assert ledger.ok, ledger.detail
    assert ledger.data["deltas"].get("merged", 0) > 0
    done = subprocess.run([sys.executable, "-m", "workers.cli", "replay", str(out / "store")], capture_output=True,
                          text=True, env=_env(slurm), timeout=DEADLINE_S)
    assert done.returncode == 0 and "verified" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]


def test_submit_refuses_what_slurm_cannot_run_here(slurm, tmp_path):
    base = [sys.executable, "-m", "workers.cli", "slurm", "submit", "--out", str(tmp_path / "x"), "--learners", "2"]
    for extra, says in ((["--syncers", "2", "--fragments", "2"], "--syncers > 1"),
                        (["--no-bus"], "drop --no-bus"),
                        ([], "no training command and no run at"),
                        (["--nodes-per-learner", "0", "--", "python", "x.py"], "--nodes-per-learner must be >= 1")):
        done = subprocess.run([*base, *extra], capture_output=True, text=True, env=_env(slurm), timeout=120)
        assert done.returncode == 2 and says in done.stderr, (extra, done.stderr[-800:])
    # a refused setting (exit 2) is never requeued: the job says so and ends
    out = tmp_path / "refused"
    done = subprocess.run([*base[:6], str(out), "--learners", "1", "--insecure", "--", "python", "-c",
                           "import sys; sys.exit(2)"], capture_output=True, text=True, env=_env(slurm), timeout=120)
    assert done.returncode == 0, done.stderr[-800:]
    l0 = json.loads((out / "slurm" / "jobs.json").read_text())["learners"]["l0"]     # refused: exit 2
    wait_for(lambda: not _jobs_state(slurm, l0), DEADLINE_S, "the refused learner's job to end", poll_s=0.2)
    text = "".join(p.read_text() for p in (out / "slurm").glob("l0-*.out"))
    assert "not requeued" in text and "life 1" not in text
    record = json.loads((out / "slurm" / "jobs.json").read_text())
    slurm.run("scancel", record["syncer"], record["stop"], check=False)
