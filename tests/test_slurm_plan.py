"""``ddiloco slurm submit``'s jobs and the batch script's requeue rule, without a SLURM (issue 29).

tests/test_slurm.py runs them on a real slurmctld; here the plan is read as data (what each job
runs, which variables it carries, what it waits for), and ``role.sbatch`` runs under bash with a
recording ``scontrol`` on PATH, so the rule "requeue a failed process, never a refused setting, a
stopped role or one past its limit" is checked on every machine."""
from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra.slurm.scripts import ROLE_SBATCH
from infra.slurm.submit import SlurmOptions, describe, plan
from workers import config
from workers.launch_config import SKIP, LaunchConfig


def _cfg(**values) -> LaunchConfig:
    return config.build(LaunchConfig, values, {k: "test" for k in values})


def test_the_plan_is_one_syncer_one_job_per_learner_and_a_stop_job_after_them(tmp_path):
    jobs = plan(_cfg(**{"launch.learners": 3, "launch.steps": 100}), SlurmOptions(partition="gpu"), tmp_path,
                ["python", "train.py", "--lr", "3e-4"])
    assert [j.role for j in jobs] == ["syncer", "l0", "l1", "l2", "stop"]
    syncer, stop = jobs[0], jobs[-1]
    assert "--create" in syncer.command and str(tmp_path / "launch.toml") in syncer.command
    assert syncer.command[syncer.command.index("--ingest") + 1] == "tcp://0.0.0.0:0"
    assert "--advertise" in syncer.command and "--keys" in syncer.command
    assert stop.after == ["l0", "l1", "l2"] and "--dependency=afterany:11:12:13" in stop.argv(
        {"syncer": "10", "l0": "11", "l1": "12", "l2": "13"})
    for job in jobs:
        assert "--partition" in job.options and f"--job-name=ddiloco-{job.role}" in job.options
    for lid, job in zip(("l0", "l1", "l2"), jobs[1:4]):
        env = job.env
        assert env["DDILOCO_LEARNER_ID"] == lid and env["DDILOCO_DISCOVER"] == "1" and env["DDILOCO_PROPOSE"] == "1"
        assert "DDILOCO_INGEST" not in env           # found in the store: no hostname in any job
        assert env["DDILOCO_KEY"] == str(tmp_path.resolve() / "keys" / f"{lid}.key_secret")   # a path, its own
        assert env["DDILOCO_STEPS"] == "100" and env["DDILOCO_SLURM_MAX_RESTARTS"] == "3"
        assert job.command == [sys.executable, "train.py", "--lr", "3e-4"]
        assert "--requeue" in ROLE_SBATCH and job.script.read_text() == ROLE_SBATCH
    assert sorted(p.name for p in (tmp_path / "keys").glob("*.key_secret")) == [
        "l0.key_secret", "l1.key_secret", "l2.key_secret", "syncer.key_secret"]
    assert "DDILOCO_LEARNER_ID=l2" in describe(jobs)     # --dry-run prints each job's variables
    # the launch file the syncer creates the run with reads back to the same settings
    back = config.build(LaunchConfig, config.read_toml(tmp_path / "launch.toml", LaunchConfig, SKIP), {})
    assert back.launch.learners == 3 and back.launch.steps == 100


def test_a_multi_node_learner_is_one_job_of_n_nodes_and_ranks_come_from_torchrun(tmp_path):
    jobs = plan(_cfg(**{"launch.learners": 1, "launch.nproc_per_learner": 4, "launch.insecure": True}),
                SlurmOptions(nodes_per_learner=2), tmp_path, ["python", "train.py"])
    l0 = jobs[1]
    assert "--nodes=2" in l0.options and "--cpus-per-task=4" in l0.options
    assert l0.env["DDILOCO_SLURM_NODES"] == "2" and l0.env["DDILOCO_SLURM_NPROC"] == "4"
    assert l0.command == [sys.executable, "train.py"]          # role.sbatch adds srun + torchrun
    assert "--insecure" in jobs[0].command and "DDILOCO_KEY" not in l0.env
    one_node = plan(_cfg(**{"launch.learners": 1, "launch.nproc_per_learner": 4, "launch.insecure": True}),
                    SlurmOptions(), tmp_path / "one", ["python", "train.py"])[1]
    assert one_node.command[:3] == [sys.executable, "-m", "workers.learner.localrun"]   # torchrun on loopback


def test_eval_adds_an_evaluator_job_the_stop_job_ends_after_the_syncer(tmp_path):
    jobs = plan(_cfg(**{"launch.learners": 1, "launch.eval": True}), SlurmOptions(), tmp_path, ["python", "t.py"])
    ev = next(j for j in jobs if j.role == "evaluator")
    assert ev.env["DDILOCO_ROLE"] == "evaluator" and "evaluator" not in jobs[-1].after


@pytest.mark.parametrize("values, opts, says", [
    ({"launch.syncers": 2, "schedule.fragments": 2}, {}, "--syncers > 1"),
    ({"launch.bus": False}, {}, "drop --no-bus"),
    ({}, {"nodes_per_learner": 0}, "--nodes-per-learner must be >= 1"),
    ({}, {"sbatch_args": ("qos=high",)}, "takes one sbatch option"),
])
def test_plan_refuses_what_it_cannot_run(tmp_path, values, opts, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(")):
        plan(_cfg(**values), SlurmOptions(**opts), tmp_path, ["python", "t.py"])


def test_without_a_command_the_builtin_learner_needs_an_existing_run(tmp_path):
    with pytest.raises(ValueError, match="no training command and no run at"):
        plan(_cfg(), SlurmOptions(), tmp_path, [])
    store = tmp_path / "store"
    done = subprocess.run([sys.executable, "-m", "workers.cli", "run", "--create-only", "--insecure", "--learners", "2",
                           "--store", str(store), "--out", str(tmp_path / "demo")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-1000:]
    jobs = plan(_cfg(**{"launch.insecure": True, "launch.store": str(store)}), SlurmOptions(), tmp_path / "o", [])
    assert "--create" not in jobs[0].command
    assert jobs[1].command[2:5] == ["workers.cli", "learner", "--store"] and "--discover" in jobs[1].command
    assert jobs[1].command[jobs[1].command.index("--state-every") + 1] == "5.0"     # a requeued life resumes


# -- role.sbatch under bash, with a recording scontrol ----------------------------------------------

def _role(tmp_path: Path, command: list[str], life: int = 0, max_restarts: int = 3, **env: str):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "scontrol"
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'scontrol.calls'}\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    script = tmp_path / "role.sbatch"
    script.write_text(ROLE_SBATCH)
    environ = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "77",
               "SLURM_RESTART_COUNT": str(life), "DDILOCO_SLURM_ROLE": "l0",
               "DDILOCO_SLURM_MAX_RESTARTS": str(max_restarts), **env}
    return subprocess.Popen(["bash", str(script), *command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=environ)


def _calls(tmp_path: Path) -> list[str]:
    path = tmp_path / "scontrol.calls"
    return path.read_text().splitlines() if path.exists() else []


@pytest.mark.parametrize("code, life, requeued, says", [
    (0, 0, False, "l0 exited 0"),
    (137, 0, True, "l0 requeued (life 1 of at most 4)"),
    (1, 2, True, "requeued (life 3 of at most 4)"),
    (1, 3, False, "gave up after 3 restarts"),
    (2, 0, False, "refused its settings (exit 2): not requeued"),
])
def test_the_role_script_requeues_a_failed_process_only(tmp_path, code, life, requeued, says):
    proc = _role(tmp_path, [sys.executable, "-c", f"import sys; sys.exit({code})"], life=life)
    stdout, _ = proc.communicate(timeout=60)
    assert says in stdout, stdout
    assert _calls(tmp_path) == (["requeue 77"] if requeued else [])


def test_a_stopped_role_is_not_requeued_even_if_its_process_fails(tmp_path):
    marker = tmp_path / "started"
    body = ("import pathlib, signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))\n"
            f"pathlib.Path({str(marker)!r}).touch()\n"
            "time.sleep(120)\n")
    proc = _role(tmp_path, [sys.executable, "-c", body])
    deadline = time.monotonic() + 60
    while not marker.exists():          # the process is up (a condition, polled)
        assert time.monotonic() < deadline and proc.poll() is None, "the role's process never started"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)    # what scancel sends the batch shell
    stdout, _ = proc.communicate(timeout=60)
    assert "l0 exited 143" in stdout and _calls(tmp_path) == [], stdout


def test_regions_are_data_each_learner_job_names_its_region(tmp_path):
    home, r1 = tmp_path / "home", tmp_path / "r1"
    specs = f"home={home};r1={r1},endpoint=http://127.0.0.1:9/"
    jobs = plan(_cfg(**{"launch.learners": 3, "launch.insecure": True, "launch.region_specs": specs}), SlurmOptions(),
                tmp_path / "out", ["python", "t.py"])
    syncer, learners = jobs[0], jobs[1:4]
    assert syncer.command[syncer.command.index("--store") + 1] == str(home)      # the home region's store
    assert [j.env.get("DDILOCO_REGION") for j in learners] == ["home", "r1", "home"]
    assert all(j.env["DDILOCO_STORE"] == str(home) for j in learners)
    assert "region_specs" in (tmp_path / "out" / "launch.toml").read_text()   # the syncer's --create reads them


def test_the_syncer_creates_a_multi_region_run_from_the_launch_file(tmp_path):
    import numpy as np
    from storage.proposal import propose
    from storage.store import open_store
    from workers.syncer.create import create_when_proposed
    home, r1 = tmp_path / "home", tmp_path / "r1"
    cfg = _cfg(**{"launch.learners": 2, "launch.insecure": True, "launch.region_specs": f"home={home};r1={r1}",
                  "schedule.fragments": 1})
    (tmp_path / "run.toml").write_text(config.to_toml(cfg, SKIP))
    store = open_store(str(home))
    propose(store, "l0", {"w": np.ones((4, 4), np.float32)})
    desc = create_when_proposed(store, tmp_path / "run.toml", None, None, timeout_s=30)
    assert desc.regions is not None and [r.name for r in desc.regions.regions] == ["home", "r1"]
