"""The console summary of `ddiloco run` (workers/tools/summary.py): the outcome first, plain
numbers, cost only for runs on S3."""
from __future__ import annotations

from pathlib import Path

from workers.tools.summary import summary_lines

ACCT = {"span_s": 19.0, "totals": {"requests": 1234, "cross_region_bytes": 0}, "regions": {}, "links": {},
        "learners": {}, "cost": {"scale": 136000.0, "monthly_usd": 725.71, "put_requests_usd": 1.0,
                                 "get_requests_usd": 2.0, "transfer_usd": 0.0, "unverified": True,
                                 "prices": {"source": "built-in"}}}


def _summary(**kw) -> dict:
    base = {"ok": True, "status": "ok", "problems": [], "mode": "decoupled", "run_uri": "/tmp/r/store",
            "initial_eval_loss": 5.5612, "final_eval_loss": 2.17381, "tokens_trained": 1228800,
            "tokens_merged": 1017856.0, "deltas_merged": 301, "deltas_lost": 2, "deltas_harmless": 5,
            "deltas_spilled": 0, "mean_round_size": 3.8, "utilisation": {"l0": 0.8512, "l1": 0.84},
            "version_latency_steps_p50": {"l0": 2, "l1": 2.0}, "publish_to_applied_p50_s": 0.0812,
            "wall_s": 19.23, "accounting": ACCT}
    return {**base, **kw}


def test_an_ok_run_says_so_first_with_plain_numbers_and_no_cost_on_a_local_store():
    text = "\n".join(summary_lines(_summary(), Path("out"), "out/report.png"))
    lines = [x for x in text.splitlines() if x]
    assert lines[0] == "run OK"
    assert "5.561 -> 2.174" in text and "1,017,856 (83% of 1,228,800 trained)" in text
    assert "l0 85%, l1 84%" in text and "{" not in text and "1017856.0" not in text
    assert "81 ms" in text and "estimated monthly cost" not in text and "accounting:" in text


def test_an_interrupted_run_and_a_failed_one_say_it_with_the_reasons():
    stopped = summary_lines(_summary(ok=False, status="interrupted", problems=["interrupted (Ctrl-C or SIGTERM)"]),
                            Path("out"), "p")
    assert stopped[1] == "run INTERRUPTED: interrupted (Ctrl-C or SIGTERM)"
    failed = summary_lines(_summary(ok=False, status="failed", problems=["1 of 4 learner(s) did not finish"]),
                           Path("out"), "p")
    assert failed[1] == "run FAILED: 1 of 4 learner(s) did not finish"


def test_the_cost_estimate_is_shown_for_a_run_on_s3_as_an_estimate_at_its_rate():
    text = "\n".join(summary_lines(_summary(run_uri="s3://ddiloco/run1"), Path("out"), "p"))
    assert "estimated monthly cost at this rate" in text and "$725.71" in text
