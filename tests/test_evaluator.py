"""Issue 28: an evaluator follows the log. A run started by hand (`ddiloco syncer` + `ddiloco learner`)
with `ddiloco evaluate` beside it shows the global model's held-out loss in the dashboard's view; the
in-process Evaluator logs one evaluation per new log position and refuses a model that does not fit."""
from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from storage.log import CommitLog
from storage.store import open_store
from tests.runhelpers import TinyRun, last_step, wait_for
from workers.common.events import EventLog, read_events
from workers.evaluator import Evaluator
from workers.launch import RunSettings, Schedule, create_run
from workers.tools.dashboard_state import RunView, ViewConfig


def test_a_hand_started_run_shows_the_evaluators_loss_in_the_dashboard(tmp_path):
    run = TinyRun(str(tmp_path / "store"), tmp_path, env=None, steps=60, secure=False)
    run.create()
    run.syncer()
    run.cluster.wait_ready("syncer")
    log = run.cluster.log_path("evaluator")
    evaluator = run.cluster.spawn("evaluator", "evaluator", ["evaluate", "--every", "0.5"]).popen
    try:
        for lid in ("l0", "l1"):
            run.learner(lid)
        wait_for(lambda: all(last_step(run, lid) >= 60 for lid in ("l0", "l1")) or
                 not any(run.cluster.alive(n) for n in ("l0", "l1")), 300, "the learners to finish")
        assert run.wait_inbox_empty(120), run.drain_status
        tail = CommitLog(run.store).tail()
        wait_for(lambda: any(e.get("event") == "eval" and e.get("seq") == tail for e in read_events(log)), 120,
                 "an evaluation of the final model")
    finally:
        run.stop_all()
    evals = [e for e in read_events(log) if e.get("event") == "eval"]
    assert evals[-1]["loss"] < evals[0]["loss"] and evals[-1]["tokens"] > 0, evals
    assert evaluator.returncode == 0
    view = RunView(run.uri, tmp_path / "logs", config=ViewConfig(refresh_s=1))
    series = view.state()["eval"]
    assert series and series[-1][1] == pytest.approx(evals[-1]["loss"]), series


def _run(tmp_path):
    store = open_store(str(tmp_path / "run"))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    create_run(store, {n: p.detach().numpy().copy() for n, p in model.named_parameters()},
               RunSettings(schedule=Schedule(fragments=1, sync_every=4)), embedding_tensors=())
    return store, model


def test_the_evaluator_loads_the_global_model_and_logs_one_evaluation_per_new_commit(tmp_path):
    store, model = _run(tmp_path)
    events = EventLog(tmp_path / "eval.jsonl", "evaluator", "evaluator")
    mine = torch.nn.Linear(4, 2)
    torch.nn.init.zeros_(mine.weight)
    seen = []
    looks = iter([False, False, True])   # three looks at the log; nothing is committed between them
    n = Evaluator(mine, store, events, poll_s=0.01).follow(lambda m: seen.append(m.weight.detach().clone()) or 1.0,
                                                           stop=lambda: next(looks))
    assert n == 1 and len(seen) == 1     # one log position, one evaluation
    assert np.allclose(seen[0].numpy(), model.weight.detach().numpy(), atol=1e-2)   # version 0 (bf16), not zeros
    ev = [e for e in read_events(tmp_path / "eval.jsonl") if e.get("event") == "eval"]
    assert ev[0]["versions"] == {"0": 0} and ev[0]["tokens"] == 0 and ev[0]["seq"] == 0


def test_the_evaluator_refuses_a_model_that_is_not_the_runs(tmp_path):
    store, _ = _run(tmp_path)
    other = torch.nn.Linear(5, 3)
    with pytest.raises(ValueError, match="does not match run"):
        Evaluator(torch.nn.Sequential(other), store, poll_s=0.01).follow(lambda m: 0.0, stop=lambda: True)


def test_ddiloco_evaluate_refuses_a_run_of_the_users_own_model(tmp_path):
    import subprocess
    _run(tmp_path)
    done = subprocess.run([sys.executable, "-m", "workers.cli", "evaluate", "--store", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "not a run of the demo job" in done.stderr
