"""Issue 28 acceptance on real processes: `ddiloco launch -- python examples/minimal.py` trains and
replays; a SIGKILLed learner is restarted alone and resumes; Ctrl-C and the same command again
continue every learner from its step count. Waits are conditions with generous deadlines."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from storage.errors import StoreError
from storage.learner_state import read_state
from storage.store import open_store
from tests.runhelpers import wait_for
from workers.common.events import read_events

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "minimal.py"
GATED = ROOT / "tests" / "fixtures" / "gated_minimal.py"
DEADLINE_S = 300


def _launch_cmd(out: Path, script: Path, steps: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "workers.cli", "launch", "--learners", "2", "--steps", str(steps), "--fragments", "2",
            "--sync-every", "8", "--plain", "--out", str(out), *extra, "--", "python", str(script)]


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDILOCO_")}
    return dict(env, OMP_NUM_THREADS="1", **extra)


def _wait(cond, what: str, proc: subprocess.Popen) -> None:
    """``wait_for`` (tests/runhelpers.py), failing at once if the launcher exits first."""
    def check() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"the launcher exited ({proc.returncode}) before {what}: {proc.stdout.read()[-3000:]}")
        return bool(cond())
    wait_for(check, DEADLINE_S, what, poll_s=0.1)


def _recorded_step(out: Path, lid: str) -> int:
    """The step in ``lid``'s resume record (storage/learner_state.py), -1 before there is one."""
    try:
        state = read_state(open_store(str(out / "store"), create=False), lid)
    except StoreError:
        return -1
    return state.step if state is not None else -1


def _events(out: Path, name: str) -> list[dict]:
    return read_events(out / "logs" / f"{name}.jsonl") if (out / "logs" / f"{name}.jsonl").exists() else []


def _step(out: Path, name: str) -> int:
    return max((e.get("step", 0) for e in _events(out, name) if e.get("event") == "step"), default=0)


def _replay(out: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "workers.cli", "replay", str(out)], capture_output=True, text=True,
                          env=_env(), timeout=DEADLINE_S)
    assert done.returncode == 0 and "verified" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]


def test_launch_runs_the_minimal_example_and_the_run_replays(tmp_path):
    out = tmp_path / "minimal"
    done = subprocess.run(_launch_cmd(out, EXAMPLE, 200, "--eval"), capture_output=True, text=True, env=_env(),
                          timeout=DEADLINE_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "run OK" in done.stdout and "ddiloco replay" in done.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] and summary["mode"] == "launch" and summary["merge_commits"] > 0
    assert summary["initial_model_from"] in ("l0", "l1") and summary["deltas_merged"] > 0
    # --eval: the same script as the run's evaluator; its held-out loss is in the summary
    assert summary["final_eval_loss"] < summary["initial_eval_loss"], summary
    assert "evaluator" not in summary["per_learner"]
    # each learner ends well below the shared version 0's loss; a learner that joined late under load
    # starts from the run's latest (already trained) versions, so its own first loss is no reference
    start = summary["initial_eval_loss"]
    for lid in ("l0", "l1"):
        losses = [e["loss"] for e in _events(out, lid) if e.get("event") == "step"]
        assert losses[-1] < 0.5 * start, f"{lid} ended at {losses[-3:]}, version 0's held-out loss {start}"
        assert summary["per_learner"][lid]["step"] == 200
    _replay(out)
    # the exported global model loads back into the example's own model
    weights = tmp_path / "model.pt"
    exported = subprocess.run([sys.executable, "-m", "workers.cli", "export", str(out), "--latest", "-o", str(weights)],
                              capture_output=True, text=True, env=_env(), timeout=DEADLINE_S)
    assert exported.returncode == 0, exported.stderr[-2000:]
    spec = importlib.util.spec_from_file_location("minimal_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model = example.make_model()
    model.load_state_dict(torch.load(weights, weights_only=True))
    x = example.batch("held-out", 0)
    with torch.no_grad():
        assert float(torch.nn.functional.mse_loss(model(x), example.TEACHER(x))) < 0.5 * start


def test_a_killed_learner_is_restarted_alone_and_resumes(tmp_path):
    out = tmp_path / "killed"
    gate = tmp_path / "gate"           # both learners hold at step 60 until it exists
    proc = subprocess.Popen(_launch_cmd(out, GATED, 300, "--launch.state_every", "0.2"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=_env(GATE_AT="60", GATE_FILE=str(gate)),
                            start_new_session=True)
    try:
        _wait(lambda: _step(out, "l0") >= 60 and _recorded_step(out, "l0") == 60, "l0 to hold at step 60", proc)
        pid = next(e["pid"] for e in _events(out, "l0") if e.get("event") == "learner-start")
        os.kill(pid, signal.SIGKILL)
        _wait(lambda: sum(e.get("event") == "learner-start" for e in _events(out, "l0")) == 2, "l0's restart", proc)
        gate.touch()
        stdout, _ = proc.communicate(timeout=DEADLINE_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stdout[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["restarts"] == {"l0": 1} and "l1" not in summary["resumed"]
    l0 = _events(out, "l0")
    starts = [e for e in l0 if e.get("event") == "learner-start"]
    assert len(starts) == 2 and starts[1]["incarnation"] > starts[0]["incarnation"]
    resumed = next(e for e in l0 if e.get("event") == "learner-resumed")
    assert resumed["step"] >= 40, resumed           # records every 0.2 s: at most a few steps retrained
    assert resumed["step"] == 60                     # killed at the gate, after its record said 60
    assert summary["resumed"]["l0"]["step"] == resumed["step"]
    assert summary["per_learner"]["l0"]["step"] == 300
    # nobody else stopped: l1 had one life that ran to its end
    l1 = _events(out, "l1")
    assert sum(e.get("event") == "learner-start" for e in l1) == 1
    assert [e.get("step") for e in l1 if e.get("event") == "learner-stop"] == [300]
    _replay(out)


def test_ctrl_c_then_the_same_command_continues_every_learner(tmp_path):
    out = tmp_path / "resume"
    cmd = _launch_cmd(out, GATED, 300, "--save-optimizer-every", "20")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,   # held at step 40
                            env=_env(GATE_AT="40", GATE_FILE=str(tmp_path / "never")), start_new_session=True)
    try:
        _wait(lambda: min(_step(out, "l0"), _step(out, "l1")) >= 40, "both learners to reach step 40", proc)
        proc.send_signal(signal.SIGINT)
        stdout, _ = proc.communicate(timeout=DEADLINE_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, stdout[-3000:]
    stopped = {lid: [e for e in _events(out, lid) if e.get("event") == "learner-stop"][-1]["step"]
               for lid in ("l0", "l1")}
    assert all(40 <= s < 300 for s in stopped.values()), stopped
    again = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=DEADLINE_S)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    for lid in ("l0", "l1"):
        resumed = [e for e in _events(out, lid) if e.get("event") == "learner-resumed"]
        assert resumed and resumed[-1]["step"] == stopped[lid], (lid, resumed, stopped)
        assert resumed[-1]["optimizer_step"] == stopped[lid]     # its AdamW state came back too (at close)
        assert summary["resumed"][lid]["step"] == stopped[lid]
        assert summary["per_learner"][lid]["step"] == 300
    launcher = _events(out, "launcher")
    assert [e["event"] for e in launcher if e.get("event") in ("run-created", "run-continued")] == \
        ["run-created", "run-continued"]
    _replay(out)


def test_launch_refuses_a_missing_command_and_a_quorum_it_cannot_meet(tmp_path):
    base = [sys.executable, "-m", "workers.cli", "launch", "--out", str(tmp_path / "x")]
    done = subprocess.run(base, capture_output=True, text=True, env=_env(), timeout=120)
    assert done.returncode != 0 and "give the training command after --" in done.stderr
    done = subprocess.run([*base, "--learners", "2", "--quorum", "3", "--", "python", "x.py"], capture_output=True,
                          text=True, env=_env(), timeout=120)
    assert done.returncode != 0 and "quorum K=3 exceeds the 2 learner(s)" in done.stderr


@pytest.mark.parametrize("script", ["import sys; sys.exit(3)"])
def test_launch_says_when_no_learner_ever_proposed(tmp_path, script):
    bad = tmp_path / "bad.py"
    bad.write_text(script)
    done = subprocess.run([sys.executable, "-m", "workers.cli", "launch", "--learners", "1", "--max-restarts", "0",
                           "--insecure", "--out", str(tmp_path / "x"), "--", "python", str(bad)],
                          capture_output=True, text=True, env=_env(), timeout=120)
    assert done.returncode != 0 and "every learner exited before one proposed its model" in done.stderr


def test_launch_refuses_to_continue_a_run_in_the_other_security_mode(tmp_path):
    from tests.test_evaluator import _run
    _run(tmp_path)                       # an unsigned run at tmp_path/run
    done = subprocess.run([sys.executable, "-m", "workers.cli", "launch", "--learners", "1", "--store",
                           str(tmp_path / "run"), "--out", str(tmp_path / "x"), "--", "python", "x.py"],
                          capture_output=True, text=True, env=_env(), timeout=120)
    assert done.returncode != 0 and "is unsigned: continue it with --insecure" in done.stderr, done.stderr[-500:]
