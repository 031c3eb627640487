"""Issue 11 item 16: honest figures. `ddiloco log` and the run summary count each token of
training that entered the model once (a delta's counter repeats its predecessors'), tell harmless
drops from lost work; the summary names its latency figures for what they measure; the benchmark
counts both directions of traffic and quotes quality as mean ± spread over seeds."""
from __future__ import annotations

import pytest

from infra.benchmark import bandwidth_figures, parse_seeds, quality_figures, spread
from pipeline.types import CommitRecord, DroppedRecord, InputRecord
from workers.launch import Schedule
from workers.tools.logview import LogTotals, token_figures, totals_lines
from workers.tools.run_figures import publish_to_applied as _publish_to_applied


def merged(learner, inc, seq, base, tokens, steps=1):
    return InputRecord(f"{learner}/{inc}/{seq}", learner, inc, seq, f"deltas/{learner}/{seq}", "0" * 64,
                       base_version=base, c_steps=steps, c_tokens=tokens, learner_step=seq, weight=1.0, staleness=0)


def dropped(learner, inc, seq, tokens, reason):
    return DroppedRecord(f"{learner}/{inc}/{seq}", learner, f"deltas/{learner}/{seq}", "0" * 64, reason, tokens)


def commit(seq, fragment, version, inputs=(), drops=()):
    return CommitRecord(seq=seq, epoch=1, kind="merge" if inputs else "drop", fragment=fragment, version=version,
                        inputs=tuple(inputs), dropped=tuple(drops))


def test_tokens_merged_count_each_token_once():
    """Old code summed every merged delta's cumulative counter: 100 + 200 + 50 + 120 = 470 here,
    while the training that entered the model is 200 (base 0) + 120 (base 2) = 320."""
    recs = [commit(2, 0, 1, [merged("a", 5, 0, 0, 100)]),
            commit(3, 0, 2, [merged("a", 5, 1, 0, 200)]),            # same base: holds the 100 above
            commit(4, 0, 3, [merged("a", 5, 2, 2, 50)]),             # a version was applied: a new base
            commit(5, 0, 4, [merged("a", 5, 4, 2, 120)], [dropped("a", 5, 3, 80, "superseded")])]
    t = LogTotals()
    for r in recs:
        t.add(r)
    d = t.to_dict()
    assert d["tokens_merged"] == 320 and d["tokens_dropped"] == 0
    assert (d["deltas_dropped"], d["deltas_harmless"], d["deltas_lost"]) == (1, 1, 0)


def test_lost_work_counts_once_and_duplicates_not_at_all():
    recs = [commit(2, 0, 1, [merged("a", 5, 0, 0, 100)]),
            commit(3, 0, 1, [], [dropped("a", 5, 0, 100, "duplicate")]),      # the bus and spill copies
            commit(4, 0, 1, [], [dropped("a", 5, 1, 30, "norm-outlier")]),    # counter went down: new lineage
            commit(5, 0, 1, [], [dropped("a", 5, 2, 60, "norm-outlier")])]    # grew: holds the 30 above
    t = LogTotals()
    for r in recs:
        t.add(r)
    d = t.to_dict()
    assert d["tokens_merged"] == 100 and d["tokens_dropped"] == 60
    assert (d["deltas_dropped"], d["deltas_harmless"], d["deltas_lost"]) == (3, 1, 2)
    assert d["per_learner"]["a"]["drop_reasons"] == {"duplicate": 1, "norm-outlier": 2}


def test_token_totals_are_averaged_over_fragments():
    """Every step trains all P fragments; each fragment's share reaches the model through its own
    deltas. One learner, 2 fragments, 64 tokens trained: 64 tokens merged, not 128."""
    recs = [commit(2, 0, 1, [merged("a", 1, 0, 0, 64)]), commit(3, 1, 1, [merged("a", 1, 1, 0, 64)])]
    figures = token_figures(recs, fragments=2)
    assert figures["tokens_merged"] == 64 and figures["tokens_lost"] == 0
    t = LogTotals(fragments=2)
    for r in recs:
        t.add(r)
    text = "\n".join(totals_lines(t))
    assert "averaged over the run's 2 fragments" in text and "harmless" in text
    with pytest.raises(ValueError, match="fragments"):
        LogTotals(fragments=0)


def test_publish_to_applied_is_measured_from_the_delta_not_the_commit():
    events = [
        {"event": "delta", "id": "l0", "delta": "l0/1/0", "t": 100.0},
        {"event": "commit", "kind": "merge", "fragment": 0, "version": 1, "inputs": ["l0/1/0"], "t": 101.0},
        {"event": "version-applied", "id": "l0", "fragment": 0, "version": 1, "t": 101.2, "latency_s": 0.2},
        {"event": "version-applied", "id": "l1", "fragment": 0, "version": 1, "t": 102.5, "latency_s": 1.5},
    ]
    got = _publish_to_applied(events)
    assert got["publish_to_applied_p50_s"] == pytest.approx(2.5)     # by another learner than its producer
    alone = [e for e in events if e.get("id") != "l1"]
    assert _publish_to_applied(alone)["publish_to_applied_p50_s"] == pytest.approx(1.2)


def test_benchmark_bandwidth_counts_both_directions():
    """Old code: bytes sent (deltas up) only, against DP's send volume: 121x; with versions down
    the honest ratio was ~7x."""
    summary = {"bytes_sent_per_learner": {"l0": 1000, "l1": 1000}, "bytes_received_per_learner": {"l0": 9000, "l1": 9000}}
    f = bandwidth_figures(summary, steps=10, params=1000, learners=2)
    assert (f["bytes_per_learner_step_up"], f["bytes_per_learner_step_down"], f["bytes_per_learner_step"]) == \
        (100, 900, 1000)
    each_way = 2 * (2 - 1) / 2 * 2 * 1000                                  # ring all-reduce, bf16
    assert f["dp_bytes_per_step_each_way_bf16"] == each_way
    assert f["bandwidth_reduction_vs_bf16_dp"] == pytest.approx(2 * each_way / 1000)
    assert f["bandwidth_reduction_vs_bf16_dp_up"] == pytest.approx(each_way / 100)


def test_benchmark_quality_is_mean_and_spread_over_seeds():
    q = quality_figures([2.2, 2.4, 2.3], [2.0, 2.1, 2.05])
    assert q["decoupled_final_eval"]["mean"] == pytest.approx(2.3) and q["decoupled_final_eval"]["n"] == 3
    assert q["decoupled_final_eval"]["std"] == pytest.approx(0.1)
    assert q["gap_decoupled_minus_dp"]["mean"] == pytest.approx(0.25)
    assert "3 seeds" in q["quality_note"]
    assert "not established" in quality_figures([2.2], [2.0])["quality_note"] and spread([2.2])["std"] is None
    assert parse_seeds("0, 1,2") == [0, 1, 2]
    with pytest.raises(ValueError, match="seeds"):
        parse_seeds("0,0")


def test_a_lost_drop_on_a_base_a_later_delta_carried_is_not_lost(tmp_path):
    """The dropped record has no base; its stored blob has. A norm-outlier drop whose work a later
    merged delta on the same base carried did enter the model."""
    import numpy as np
    from pipeline.codec import CodecConfig, encode
    from pipeline.types import DeltaHeader
    from storage.store import open_store
    from workers.launch import RunSettings, create_run
    from workers.tools.logview import stored_base
    store = open_store(str(tmp_path / "run"))
    desc = create_run(store, {"w": np.zeros((4, 4), np.float32)},
                      RunSettings(schedule=Schedule(fragments=1, sync_every=4)))
    header = DeltaHeader("a", 5, 1, 0, 3, 2, 60, 7)
    store.put_if_absent("deltas/a/1", encode("delta", header.to_dict(), {"w": np.zeros((4, 4), np.float32)},
                                             CodecConfig(scheme="fp32")))
    recs = [commit(2, 0, 1, [merged("a", 5, 0, 0, 100)]),
            commit(3, 0, 1, [], [dropped("a", 5, 1, 60, "norm-outlier")]),
            commit(4, 0, 2, [merged("a", 5, 2, 3, 90)])]
    assert token_figures(recs, 1)["tokens_lost"] == 60               # without the blob: counted lost
    figures = token_figures(recs, 1, stored_base(store, desc))
    assert figures["tokens_lost"] == 0 and figures["tokens_merged"] == 190
