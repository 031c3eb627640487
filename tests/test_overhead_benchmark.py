"""The lab's ``python -m infra.lab.overhead`` runs end to end (infra/lab/overhead.py): one sync-off control and one
learner + syncer, with the sync agent, the runs under ``--store-root``; the figures are there and
say what each step held. Timings are not asserted (docs/scale.md has them), only their shape."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.timeout(240)
def test_overhead_benchmark_reports_both_sides_with_the_runs_under_store_root(tmp_path):
    """Separate processes, a small model given by --run-args (the control reads it from a created run)."""
    out, root, fig = tmp_path / "out", tmp_path / "stores", tmp_path / "fig.json"
    done = subprocess.run([sys.executable, "-m", "infra.lab.overhead", "--steps", "60", "--warmup", "12",
                           "--repeats", "1", "--sync-process", "--store-root", str(root), "--out", str(out),
                           "--run-args", "--layers 1 --width 32", "--json", str(fig)],
                          env=dict(os.environ, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    res = json.loads(fig.read_text())
    assert res["store_root"] == str(root) and res["sync_process"] is True
    assert (root / "overhead" / "on-0" / "store").is_dir() and not (out / "overhead" / "on-0").exists()
    assert res["run_args"] == "--layers 1 --width 32"      # and the control trained that model, read from:
    from storage.layout import read_descriptor
    from storage.store import open_store
    d = read_descriptor(open_store(str(root / "overhead" / "on-0" / "store"), create=False))
    control = json.loads((out / "overhead" / "control-0.json").read_text())
    assert control["params"] == sum(t.numel for t in d.layout.tensors) < 137_000   # not the demo's model
    rep = res["per_repeat"][0]
    assert rep["on"]["n"] == rep["off"]["n"] == 60 - 12 and res["warmup"] == 12   # warm-up left out on both sides
    assert rep["ratio_median"] > 0 and rep["on_by_class"]["answer"]["n"] > 0   # the learner answered rounds
    assert sum(rep["on_by_class"][k]["n"] for k in ("answer", "applied", "gc", "other")) == rep["on"]["n"]


@pytest.mark.timeout(240)
def test_interleaved_overhead_takes_both_sides_from_one_learner_process(tmp_path):
    fig = tmp_path / "fig.json"
    done = subprocess.run([sys.executable, "-m", "infra.lab.overhead", "--interleave",
                           "--steps", "60", "--repeats", "1", "--sync-process", "--out", str(tmp_path / "out"),
                           "--json", str(fig)], env=dict(os.environ, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    res = json.loads(fig.read_text())
    rep = res["per_repeat"][0]
    assert res["interleave"] is True and rep["order"] == "interleaved"
    assert not list((tmp_path / "out" / "overhead").glob("control-*"))     # no control process
    assert rep["on"]["n"] == rep["off"]["n"] == 60 - 20
    assert rep["on_by_class"]["answer"]["n"] > 0 and rep["ratio_median"] > 0
