"""infra/benchmark.py's step-time tails (issue 15: p99 <= 1.1x median with sync on)."""
import json

import numpy as np
import pytest

from infra.benchmark import step_tails


def _stop(lid, median, p95, p99):
    return {"t": 1.0, "role": "learner", "id": lid, "event": "learner-stop",
            "median_step_s": median, "p95_step_s": p95, "p99_step_s": p99}


def test_tails_of_learners_and_control(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "l0.jsonl").write_text(json.dumps({"t": 0.5, "id": "l0", "event": "step", "step": 10}) + "\n"
                                   + json.dumps(_stop("l0", 0.010, 0.012, 0.020)) + "\n")
    (logs / "l1.jsonl").write_text(json.dumps(_stop("l1", 0.020, 0.022, 0.030)) + "\n")
    control = [0.01] * 98 + [0.05, 0.09]
    res = step_tails(tmp_path, control)
    assert res["step_time_sync_on_p99_s"] == pytest.approx(0.025)          # median of the learners' p99
    assert res["step_time_sync_on_p95_s"] == pytest.approx(0.017)
    assert res["step_time_sync_on_p99_over_median"] == pytest.approx((2.0 + 1.5) / 2)
    assert res["step_time_sync_off_p99_s"] == pytest.approx(np.percentile(control, 99))
    assert res["step_time_sync_off_p99_over_median"] == pytest.approx(np.percentile(control, 99) / 0.01)


def test_no_learner_tails_reads_none(tmp_path):
    (tmp_path / "logs").mkdir()
    res = step_tails(tmp_path, [])
    assert res["step_time_sync_on_p99_s"] is None and res["step_time_sync_off_p99_s"] is None
    assert res["step_time_sync_on_p99_over_median"] is None and res["step_time_sync_off_p99_over_median"] is None
