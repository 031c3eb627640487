"""report.png (workers/tools/report.py): a title that says what ran and the final loss, and a
figure drawn from the events and the summary with or without regions and references."""
from __future__ import annotations

from workers.tools.report import plot_run, report_title

SUMMARY = {"mode": "decoupled", "run_id": "ab12", "final_eval_loss": 2.17381,
           "settings": {"learners": 2, "fragments": 4, "sync_every": 16, "quorum": 1, "compression": "int4"},
           "utilisation": {"l0": 0.85, "l1": 0.42}, "version_latency_steps_p50": {"l0": 2, "l1": 5},
           "placement": {"l0": {"region": "r0", "shard": 0}, "l1": {"region": "r1", "shard": 1}},
           "references": {"data parallel": 2.067, "one learner": 2.322}}


def test_the_title_names_the_settings_and_the_final_loss():
    assert report_title(SUMMARY) == "decoupled run ab12: M=2 P=4 H=16 K=1 int4 - final held-out loss 2.174"
    assert report_title({"mode": "dp", "learners": 4, "final_eval_loss": 2.0}) == \
        "dp run: M=4 - final held-out loss 2.000"


def test_the_report_draws_with_regions_references_and_without_them(tmp_path):
    events = [{"t": 0.0, "event": "eval", "tokens": 0, "loss": 5.5},
              {"t": 9.0, "event": "eval", "tokens": 20000, "loss": 2.2},
              {"t": 3.0, "event": "commit", "kind": "merge", "fragment": 0, "version": 1}]
    full = plot_run(events, tmp_path / "a.png", SUMMARY)
    bare = plot_run([], tmp_path / "b.png", {})
    assert full.stat().st_size > 10_000 and bare.stat().st_size > 5_000
