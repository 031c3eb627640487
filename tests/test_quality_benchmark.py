"""Issue 30: `ddiloco benchmark quality` - the plan it runs, the table it computes, and one real
(tiny) run of the command end to end."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from infra.quality_benchmark import QualityPlan, QualityTable, run_args, run_quality


def test_the_plan_runs_every_side_per_m_and_seed_and_each_dp_lr():
    plan = QualityPlan(learners=(2, 4), seeds=(0, 1), steps=50, dp_lrs=(1e-3, 2e-3))
    runs = plan.runs()
    assert len(runs) == 2 * 2 * (2 + 2) + 2
    assert ("dp", 4, 1, 2e-3) in runs and ("alone", 1, 0, None) in runs and ("diloco", 2, 1, None) in runs
    args = run_args(plan, "dp", 4, 1, 2e-3, "o")
    assert args[args.index("--mode") + 1] == "dp" and args[args.index("--learners") + 1] == "4"
    assert args[args.index("--lr") + 1] == "0.002" and args[args.index("--seed") + 1] == "1"
    alone = run_args(plan, "alone", 1, 0, None, "o")
    assert alone[alone.index("--mode") + 1] == "dp" and alone[alone.index("--learners") + 1] == "1"
    assert "--mode" not in run_args(plan, "decoupled", 2, 0, None, "o")


@pytest.mark.parametrize("bad, match", [
    (dict(learners=()), "--learners"), (dict(learners=(2, 2)), "--learners"), (dict(seeds=()), "--seeds"),
    (dict(steps=0), "--steps"), (dict(dp_lrs=(0.0,)), "--dp-lrs"), (dict(run_args=("--mode", "dp")), "--mode"),
    (dict(run_args=("--seed=3",)), "--seed")])
def test_a_bad_plan_is_refused_by_name(bad, match):
    with pytest.raises(ValueError, match=match):
        QualityPlan(**bad)


def test_the_table_takes_dps_best_lr_and_gaps_of_the_means(tmp_path):
    plan = QualityPlan(learners=(2,), seeds=(0, 1), steps=5, dp_lrs=(1e-3, 2e-3))
    fake = {"decoupled": 2.2, "diloco": 2.1, "dp": {1e-3: 2.0, 2e-3: 1.9}, "alone": 2.5}

    def run(args, out):       # a loss per side (seed 1 is 0.02 higher), no process started
        mode = args[args.index("--mode") + 1] if "--mode" in args else "decoupled"
        lr = float(args[args.index("--lr") + 1]) if "--lr" in args else None
        side = "alone" if args[args.index("--learners") + 1] == "1" else mode
        base = fake[side][lr] if side == "dp" else fake[side]
        return base + 0.02 * int(args[args.index("--seed") + 1])
    lines = []
    table = run_quality(plan, tmp_path, run=run, progress=lines.append)
    row = table.rows[2]
    assert row["dp_lr"] == 2e-3 and row["dp"]["mean"] == pytest.approx(1.91)
    assert row["gap_to_dp_pct"] == pytest.approx(100 * (2.21 - 1.91) / 1.91)
    assert row["gap_to_diloco_pct"] == pytest.approx(100 * (2.21 - 2.11) / 2.11)
    assert row["decoupled"]["std"] == pytest.approx(0.0141421, rel=1e-4) and table.alone["mean"] == pytest.approx(2.51)
    assert len(lines) == len(plan.runs()) and (tmp_path / "quality.png").stat().st_size > 0
    text = table.format()
    assert "+15.71%" in text and "best of 0.001, 0.002" in text and "through the run's codec" in text
    again = json.loads(json.dumps(table.to_dict()))
    assert again["rows"]["2"]["dp_lr"] == 2e-3 and set(again["rows"]["2"]["dp_by_lr"]) == {"0.001", "0.002"}
    one = {(side, 1 if side == "alone" else 2, 0, None): 1.0 for side in ("decoupled", "diloco", "dp", "alone")}
    untuned = QualityTable.from_losses(QualityPlan(learners=(2,), seeds=(0,)), one)
    assert "not tuned" in untuned.format()


def test_ddiloco_benchmark_quality_runs_its_table_end_to_end(tmp_path):
    out, js = tmp_path / "q", tmp_path / "q.json"
    done = subprocess.run([sys.executable, "-m", "workers.cli", "benchmark", "quality", "--learners", "2",
                           "--seeds", "0", "--steps", "8", "--out", str(out), "--json", str(js), "--run-args",
                           "--layers 1 --width 16 --batch-size 2 --sync-every 4 --eval-every 1000"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "vs DP" in done.stdout and "one learner alone" in done.stdout
    row = json.loads(js.read_text())["rows"]["2"]
    for side in ("decoupled", "diloco", "dp"):      # each a real run whose summary gave its loss
        summary = json.loads((out / f"{side}-m2-seed0" / "summary.json").read_text())
        assert row[side]["values"] == [summary["final_eval_loss"]]
    assert (out / "quality.png").exists()
    bad = subprocess.run([sys.executable, "-m", "workers.cli", "benchmark", "quality", "--learners", "2,x"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--learners must be comma-separated counts" in bad.stderr
    one = subprocess.run([sys.executable, "-m", "workers.cli", "benchmark", "codec", "--learners", "2,4"],
                         capture_output=True, text=True, timeout=120)
    assert one.returncode != 0 and "a list is for `benchmark quality`" in one.stderr
