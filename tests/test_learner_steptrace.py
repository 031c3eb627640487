"""The learner's step observer (workers/learner/observer.py), the lab's step trace on it
(infra/lab/steptrace.py) and the overhead benchmark's figures from it (infra/lab/overhead.py):
steps are classed by what they held, nothing is dropped silently."""
from __future__ import annotations

import gc

import numpy as np
import pytest

from infra.lab.overhead import WARMUP, compare, step_classes, summarise, tails
from infra.lab.steptrace import COLUMNS, StepTrace
from workers.learner.observer import StepParts

from test_hardening_learner import make_run, start_learner, tiny_model, train_until
from storage.store import open_store


def test_trace_keeps_the_window_and_counts_collections():
    trace = StepTrace(3)
    try:
        for i in range(5):
            if i == 4:
                gc.collect()
            trace.record(StepParts(0.01 * (i + 1), 0.001, 0.002, 0.005, i % 2, 0, i == 3))
        cols = trace.columns()
        assert list(cols) == list(COLUMNS)
        assert cols["took_s"] == [0.03, 0.04, 0.05]                     # the last 3 steps, oldest first
        assert cols["answered"] == [0, 1, 0] and cols["logged"] == [0, 1, 0]
        assert cols["gcs"][-1] >= 1 and cols["gcs"][:2] == [0, 0]
    finally:
        trace.close()


def test_trace_writes_seconds_to_the_microsecond_and_counts_as_they_were():
    trace = StepTrace(2)
    try:
        trace.record(StepParts(0.0123456789, 1e-7, 0.0000015, 0.01234549, 2, 1, True))
        cols = trace.columns()
        assert (cols["took_s"], cols["answer_s"], cols["apply_s"], cols["compute_s"]) == \
            ([0.012346], [0.0], [0.000002], [0.012345])
        assert (cols["answered"], cols["applied"], cols["logged"]) == ([2], [1], [1])
        assert all(type(v) is int for v in cols["answered"] + cols["applied"] + cols["gcs"])
    finally:
        trace.close()
    assert trace._on_gc not in gc.callbacks
    with pytest.raises(ValueError):
        StepTrace(0)


def test_a_learner_shows_its_observer_every_step_and_closes_it(tmp_path):
    store = open_store(str(tmp_path / "run"))
    model = tiny_model()
    make_run(store, model)
    trace = StepTrace(16)
    learner, events = start_learner(store, model, step_observer=trace)
    try:
        train_until(learner, lambda: learner.step_count >= 7, "seven steps")
    finally:
        learner.close(flush=False)
    cols = trace.columns()
    assert len(cols["took_s"]) == learner.step_count >= 7 and all(t > 0 for t in cols["took_s"])
    assert all(c <= t for c, t in zip(cols["compute_s"], cols["took_s"]))
    assert trace._on_gc not in gc.callbacks                      # the learner closed it


def _trace(n: int, answer_every: int, slow_answer: float) -> dict:
    took = [0.010 + (slow_answer if i % answer_every == 0 else 0.0) for i in range(n)]
    return {"took_s": took, "answer_s": [0.0] * n, "apply_s": [0.0] * n, "compute_s": took,
            "answered": [int(i % answer_every == 0) for i in range(n)],
            "applied": [int(i % answer_every == 1) for i in range(n)], "gcs": [0] * n, "logged": [0] * n}


def test_compare_classes_steps_and_reports_tails_of_both_sides():
    n = WARMUP + 400
    on = _trace(n, 4, 0.004)                         # every 4th step 4 ms slower
    off = {"step_times": [0.010] * n, "gcs": [0] * n}
    fig = compare(on, off)
    classes = step_classes(on, WARMUP)
    assert len(classes["all"]) == 400 == sum(len(classes[k]) for k in ("answer", "applied", "gc", "other"))
    assert fig["ratio_median"] == pytest.approx(1.0)          # 3 in 4 steps are as fast as the control
    assert fig["on"]["p99_over_median"] == pytest.approx(1.4)  # the answer steps are the tail
    assert fig["on_by_class"]["answer"]["median_s"] == pytest.approx(0.014)
    assert fig["off"]["p99_over_median"] == pytest.approx(1.0)
    assert fig["ratio_mean"] == pytest.approx(0.011 / 0.010)
    s = summarise([dict(fig, background_cpu_ms_per_answer=1.0), dict(fig, ratio_median=1.2,
                                                                     background_cpu_ms_per_answer=3.0)])
    assert s["ratio_median_on_off"] == pytest.approx(1.1) and s["ratio_median_max"] == pytest.approx(1.2)
    assert s["on_answer_share"] == pytest.approx(0.25)
    assert tails([])["median_s"] is None and tails([1.0, 3.0])["median_s"] == 2.0
    assert np.isclose(tails(list(range(1, 101)))["p99_s"], np.percentile(range(1, 101), 99))


def test_steal_share_per_core():
    from infra.lab.overhead import steal_share
    before = {"cpu0": [100, 0, 10, 880, 0, 0, 0, 10], "cpu1": [0] * 8}
    after = {"cpu0": [150, 0, 20, 900, 0, 0, 0, 30], "cpu1": [0] * 8}
    assert steal_share(before, after) == {"cpu0": round(20 / 100, 4), "cpu1": 0.0}
