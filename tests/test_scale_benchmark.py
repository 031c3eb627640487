"""infra/scale_benchmark.py (`ddiloco benchmark scale`, issue 31): its figures and one tiny real run.
Timing claims live in the benchmark, never here: this checks what it measures, not how fast."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from infra.scale_benchmark import ScalePlan, WARMUP, format_table, parse_sizes, size_figures, start_gap


def test_sizes_and_plan_are_validated():
    assert parse_sizes("2x128, 6x256") == ((2, 128), (6, 256))
    for bad in ("2x", "x128", "0x128", "2x2", "2x128,2x128", ""):
        with pytest.raises(ValueError, match="--sizes"):
            parse_sizes(bad)
    with pytest.raises(ValueError, match="--steps"):
        ScalePlan(steps=2 * WARMUP)
    with pytest.raises(ValueError, match="--layers"):
        ScalePlan(run_args=("--layers", "3"))


def test_start_gap_is_the_longest_early_gap_over_the_median():
    t = [float(i) for i in range(60)]
    t[3:] = [x + 4.0 for x in t[3:]]               # one 5 s gap between steps 3 and 4
    events = [{"event": "step", "t": x} for x in t]
    assert start_gap(events, 8) == pytest.approx(5.0)
    assert start_gap(events[:5], 8) is None        # not enough steps to say


def test_size_figures_per_parameter():
    stops = {"l0": {"deltas": 10, "bytes_sent": 2000, "bytes_spilled": 500, "spill_found": 1, "bytes_received": 3000,
                    "versions_applied": 12, "median_step_s": 0.11},
             "l1": {"deltas": 10, "bytes_sent": 2500, "bytes_spilled": 0, "spill_found": 0, "bytes_received": 3000,
                    "versions_applied": 12, "median_step_s": 0.13}}
    samples = {"syncer": [(0, 900, 900, 1.0), (1, 400, 2000, 5.0)], "learner l0": [(0, 3000, 3100, 0)],
               "learner l1": [(0, 3000, 3300, 0)], "control": [(0, 2900, 3000, 0)]}
    control = {"step_times": [1.0] * WARMUP + [0.1] * 30}
    summary = {"merge_commits": 50, "deltas_spilled": 1, "utilisation": {"l0": 0.8, "l1": 0.6},
               "version_latency_steps_p50": {"l0": 2, "l1": 3}, "publish_to_applied_p50_s": 0.2}
    row = size_figures(summary, stops, samples, control, params=100, fragment_params=25.0, steps=40, gaps=[1.2, 1.4])
    assert row["step_ratio_on_off"] == pytest.approx(1.2)            # median 0.12 over 0.1 (warm-up left out)
    assert row["learner_extra_bytes_per_param"] == pytest.approx(2.0)  # median peak 3200 - 3000
    assert row["syncer_end_bytes_per_param"] == pytest.approx(4.0)
    assert row["syncer_peak_bytes_per_param"] == pytest.approx(20.0)
    assert row["syncer_cpu_s_per_commit"] == pytest.approx(0.1)
    assert row["bytes_up_per_delta_per_fragment_param"] == pytest.approx(5000 / 20 / 25)
    assert row["bytes_down_per_version_per_fragment_param"] == pytest.approx(6000 / 24 / 25)
    assert row["reduction_vs_fp32_ring"] == pytest.approx(2 * 1.0 * 4 * 100 / (11000 / 2 / 40))
    assert row["delivered_and_spilled"] == 1 and row["start_gap_over_median"] == 1.4
    assert row["utilisation_mean"] == pytest.approx(0.7) and row["version_latency_steps_p50"] == 2.5
    table = format_table([{"size": "1x8", **row}])
    assert "1x8" in table and "syncer B/param" in table and "4.0" in table


@pytest.mark.timeout(600)
def test_a_tiny_scale_run_reports_every_figure(tmp_path):
    out = tmp_path / "bench"
    done = subprocess.run([sys.executable, "-m", "workers.cli", "benchmark", "scale", "--sizes", "1x32", "--steps", "40",
                           "--out", str(out), "--json", str(tmp_path / "s.json")], capture_output=True, text=True,
                          timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    row = json.loads((tmp_path / "s.json").read_text())["sizes"][0]
    assert row["size"] == "1x32" and row["params"] > 0 and row["commits"] > 0
    # int4 both ways: about half a byte per fragment parameter each way (plus block scales)
    assert 0.3 < row["bytes_up_per_delta_per_fragment_param"] < 1.0
    assert 0.3 < row["bytes_down_per_version_per_fragment_param"] < 1.0
    for key in ("syncer_end_bytes_per_param", "learner_extra_mb", "step_ratio_on_off", "syncer_cpu_s_per_commit"):
        assert row[key] is not None and row[key] == row[key], key
    assert row["syncer_end_mb"] > 10 and row["control_peak_mb"] > 10   # sampled processes, not zeros
    assert "syncer B/param" in done.stdout
