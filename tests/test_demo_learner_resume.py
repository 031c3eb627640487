"""Issue 29: the built-in demo learner (``ddiloco learner``, what ``ddiloco slurm submit`` runs
without a command) resumes like a user script: with ``--state-every`` a new life of an id continues
its step count and its batch order from its resume record instead of starting again at step 0."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from workers.common.events import read_events
from workers.job.data import Corpus

TIMEOUT_S = 600


def _learner(store, log, steps: int, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workers.cli", "learner", "--store", str(store), "--id", "l0",
                           "--insecure", "--no-bus", "--steps", str(steps), "--log", str(log), *extra],
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def test_a_new_life_of_the_demo_learner_continues_its_count(tmp_path):
    from workers import cli
    assert cli.main(["run", "--create-only", "--insecure", "--fragments", "2", "--layers", "1", "--width", "16",
                     "--out", str(tmp_path / "out")]) == 0
    store, log = tmp_path / "out" / "store", tmp_path / "l0.jsonl"
    first = _learner(store, log, 12, "--state-every", "0.2")
    assert first.returncode == 0, first.stderr[-2000:]
    again = _learner(store, log, 20, "--state-every", "0.2")
    assert again.returncode == 0, again.stderr[-2000:]
    events = read_events(log)
    assert sum(e.get("event") == "learner-start" for e in events) == 2
    first_stop = next(i for i, e in enumerate(events) if e.get("event") == "learner-stop")
    second = events[first_stop + 1:]                 # the second life's events ("resumed" precedes its start)
    resumed = [e for e in second if e.get("event") == "learner-resumed"]
    assert len(resumed) == 1 and resumed[0]["step"] == 12, resumed
    steps = [e["step"] for e in second if e.get("event") == "step"]
    assert steps and min(steps) > 12 and max(steps) == 20, steps      # steps 13..20 only: no step retrained
    assert [e["step"] for e in events if e.get("event") == "learner-stop"] == [12, 20]
    # without --state-every a life keeps no record and starts at step 0, as before
    fresh = _learner(store, tmp_path / "fresh.jsonl", 3)
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    assert not [e for e in read_events(tmp_path / "fresh.jsonl") if e.get("event") == "learner-resumed"]


def test_state_every_is_refused_when_it_is_not_positive(tmp_path):
    done = _learner(tmp_path / "nowhere", tmp_path / "x.jsonl", 3, "--state-every", "0")
    assert done.returncode != 0 and "--state-every must be > 0 seconds" in done.stderr, done.stderr[-1000:]


def test_skipping_batches_lands_on_the_same_data_position():
    from workers.job.data import DataConfig
    corpus = Corpus(DataConfig(block_size=16, batch_size=2))
    whole = corpus.batches(0, 2, seed=7)
    for _ in range(5):
        next(whole)
    x, y = next(whole)
    sx, sy = next(corpus.batches(0, 2, seed=7, skip=5))
    assert torch.equal(x, sx) and torch.equal(y, sy)
    with pytest.raises(ValueError, match="skip must be >= 0"):
        next(corpus.batches(0, 2, seed=7, skip=-1))
