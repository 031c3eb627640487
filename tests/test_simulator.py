"""Goodput simulator (SPEC §9): analytic checks, determinism, the event-log format, the CLI."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from infra.simulator import intervals as iv
from infra.simulator import systems
from infra.simulator.calibrate import calibrate, dp_goodput_analytic, solve_repair_mean
from infra.simulator.config import DAY_S, YEAR_S, Dist, ModelConfig, SweepConfig, parse_dist
from infra.simulator.eventlog import (Event, events_from_running, read_event_log, read_events, scale,
                                      write_events)
from infra.simulator.events import generate_trace
from infra.simulator.speed import lockstep_efficiency
from infra.simulator.sweep import half_width, point_rng, run_sweep, t95
from pipeline.envelope import pack_record
from pipeline.errors import FormatError
from workers.cli import main


def one_chip(mtbi=1000.0, det=10.0, rep=40.0, rc=0.0, duration=2e6, **kw) -> ModelConfig:
    return ModelConfig(mtbi_s=mtbi, chips_per_slice=1, detection=Dist("fixed", det),
                       reconfiguration=Dist("fixed", rc), repair=Dist("exp", rep), duration_s=duration, **kw)


def mean_over_seeds(model, chips, fn, seeds=4):
    return float(np.mean([fn(generate_trace(model, chips, point_rng(7, s, chips))) for s in range(seeds)]))


# ------------------------------------------------------------------------------- interval algebra
def test_union_merges_overlapping_and_touching_and_clips():
    s, e = iv.union(np.array([5.0, 0.0, 2.0, 9.0, 12.0]), np.array([6.0, 2.0, 3.0, 11.0, 20.0]), 15.0)
    assert s.tolist() == [0.0, 5.0, 9.0, 12.0] and e.tolist() == [3.0, 6.0, 11.0, 15.0]
    assert iv.complement((s, e), 15.0)[0].tolist() == [3.0, 6.0, 11.0]


def test_integral_and_intersect_of_step_function():
    fn = iv.step(np.array([4.0, 2.0]), np.array([-1.0, -1.0]), 3.0, 10.0)  # 3 on [0,2), 2 on [2,4), 1 after
    assert iv.integral(fn, (np.array([1.0, 3.0]), np.array([2.5, 10.0])), 10.0) == pytest.approx(3 + 1 + 2 + 6)
    both = iv.intersect((np.array([0.0, 5.0]), np.array([3.0, 8.0])), (np.array([2.0]), np.array([6.0])), 10.0)
    assert both[0].tolist() == [2.0, 5.0] and both[1].tolist() == [3.0, 6.0]


# ---------------------------------------------------------------------------------- analytic checks
def test_one_chip_goodput_is_mtbf_over_mtbf_plus_mttr():
    model = one_chip()  # MTTR = 10 s detection + 40 s repair, no restart cost
    expected = 1000.0 / (1000.0 + 50.0)
    for fn in (lambda t: systems.dp(t).goodput, lambda t: systems.elastic_dp(t).goodput,
               lambda t: systems.decoupled(t, 1).outcome.goodput):
        assert mean_over_seeds(model, 1, fn) == pytest.approx(expected, abs=0.004)


def test_one_chip_restart_cost_counts_in_mttr():
    model = one_chip(rc=30.0)  # MTTR = 10 + 40 + 30
    assert mean_over_seeds(model, 1, lambda t: systems.dp(t).goodput) == pytest.approx(1000 / 1080, abs=0.005)
    # and it is really lower than without the restart: the check can fail
    assert mean_over_seeds(model, 1, lambda t: systems.dp(t).goodput) < 1000 / 1050 - 0.01


def test_no_failures_is_full_goodput_and_uptime():
    model = replace(calibrate(ModelConfig(duration_s=DAY_S)), mtbi_s=math.inf)
    trace = generate_trace(model, 150_000, point_rng(0, 0, 150_000))
    assert trace.t_fail.size == 0
    for out in (systems.dp(trace), systems.elastic_dp(trace), systems.decoupled(trace, 4, 4).outcome):
        assert out.goodput == 1.0 and out.uptime == 1.0


def test_calibration_point_and_simulator_match_the_analytic_dp_formula():
    model = calibrate(ModelConfig(duration_s=3 * DAY_S))
    assert model.repair.mean == pytest.approx(29.07, abs=0.01)
    assert dp_goodput_analytic(model, 150_000) == pytest.approx(0.72, abs=1e-9)
    for chips in (150_000, 600_000):
        sim = mean_over_seeds(model, chips, lambda t: systems.dp(t).goodput, seeds=3)
        assert sim == pytest.approx(dp_goodput_analytic(model, chips), abs=0.012)


def test_calibration_refuses_impossible_settings():
    slow = ModelConfig(detection=Dist("fixed", 60.0), reconfiguration=Dist("fixed", 30.0))
    with pytest.raises(ValueError, match="no repair time fits"):
        solve_repair_mean(slow)
    # an explicit repair mean is kept, not recalibrated
    assert calibrate(replace(slow, repair=Dist("exp", 5.0))).repair.mean == 5.0


def test_single_learner_is_elastic_data_parallel():
    model = calibrate(ModelConfig(duration_s=DAY_S))
    for seed in range(3):
        trace = generate_trace(model, 300_000, point_rng(seed, 0, 300_000))
        one, ela = systems.decoupled(trace, 1).outcome, systems.elastic_dp(trace)
        assert one.goodput == pytest.approx(ela.goodput, rel=1e-12)
        assert one.uptime == pytest.approx(ela.uptime, rel=1e-12)
        assert ela.goodput < 1.0  # failures did happen


def small_sweep(**kw) -> SweepConfig:
    model = calibrate(ModelConfig(duration_s=DAY_S, mtbi_s=kw.pop("mtbi_s", YEAR_S)))
    base = dict(model=model, chips=(100_000,), learners=(1, 4), seed=3, min_seeds=3, max_seeds=3)
    base.update(kw)
    return SweepConfig(**base)


def by_key(rows):
    return {(r.system, r.learners): r for r in rows}


def test_goodput_falls_with_cluster_size_and_rises_with_mtbi():
    sizes = run_sweep(small_sweep(chips=(100_000, 400_000, 1_600_000))).rows
    for key in (("dp", 1), ("elastic_dp", 1), ("decoupled", 4)):
        g = [r.goodput for r in sizes if (r.system, r.learners) == key]
        assert g[0] > g[1] + 0.02 and g[1] > g[2] + 0.02, (key, g)
    short = by_key(run_sweep(small_sweep(mtbi_s=YEAR_S / 4)).rows)
    long = by_key(run_sweep(small_sweep(mtbi_s=YEAR_S * 4)).rows)
    for key in short:
        assert long[key].goodput > short[key].goodput + 0.02, key


def test_decoupled_beats_data_parallel_and_quorum_costs_uptime():
    rows = by_key(run_sweep(small_sweep(chips=(1_200_000,), learners=(4, 8))).rows)
    assert rows[("decoupled", 8)].goodput > rows[("decoupled", 4)].goodput > rows[("elastic_dp", 1)].goodput
    assert rows[("decoupled", 8)].uptime > 0.99
    strict = by_key(run_sweep(small_sweep(chips=(1_200_000,), learners=(4, 8), quorum=4)).rows)
    assert strict[("decoupled", 4)].uptime < rows[("decoupled", 4)].uptime - 0.1
    assert strict[("decoupled", 4)].goodput < rows[("decoupled", 4)].goodput


def test_same_seed_same_rows_other_seed_other_rows():
    a, b = run_sweep(small_sweep()).rows, run_sweep(small_sweep()).rows
    assert [r.to_json() for r in a] == [r.to_json() for r in b]
    c = run_sweep(small_sweep(seed=4)).rows
    assert [r.goodput for r in a] != [r.goodput for r in c]


def test_sweep_repeats_until_ci_is_tight():
    loose = run_sweep(small_sweep(max_seeds=12, target_ci=0.5)).rows
    tight = run_sweep(small_sweep(max_seeds=12, target_ci=0.002)).rows
    assert all(r.seeds == 3 for r in loose)
    assert all(r.seeds > 3 for r in tight)
    assert all(r.ci is not None and (r.ci <= 0.002 or r.seeds == 12) for r in tight)


def test_confidence_interval_helpers():
    assert t95(1) == 12.706 and 1.96 < t95(200) < t95(31) < t95(30)
    assert half_width([0.5]) is None
    assert half_width([0.4, 0.6]) == pytest.approx(12.706 * math.sqrt(0.02) / math.sqrt(2))


def test_speed_variance_hurts_lockstep_more_at_scale():
    assert lockstep_efficiency(10_000, 0.0) == 1.0 and lockstep_efficiency(1, 0.1) == 1.0
    assert lockstep_efficiency(2, 0.05) == pytest.approx(1 / (1 + 0.05 / math.sqrt(math.pi)), abs=2e-3)
    assert lockstep_efficiency(1_000_000, 0.05) < lockstep_efficiency(1000, 0.05) < 1.0
    with pytest.raises(ValueError, match="lock-step efficiency 0.80"):  # 150k-chip DP is already < 80%
        calibrate(ModelConfig(speed_cv=0.05))
    model = ModelConfig(duration_s=DAY_S, speed_cv=0.05, mtbi_s=math.inf, repair=Dist("exp", 60.0))
    trace = generate_trace(model, 160_000, point_rng(0, 0, 160_000))
    dp, dec = systems.dp(trace, 0.05), systems.decoupled(trace, 16, 1, 0.05).outcome
    assert dec.goodput == pytest.approx(lockstep_efficiency(10_000, 0.05), rel=1e-6)
    assert dp.goodput == pytest.approx(lockstep_efficiency(160_000, 0.05)) and dp.goodput < dec.goodput


def test_traces_are_vectorised_and_follow_the_failure_rate():
    model = calibrate(ModelConfig(duration_s=DAY_S))
    trace = generate_trace(model, 2_400_000, point_rng(0, 0, 2_400_000))
    expected = 2_400_000 * DAY_S / YEAR_S
    assert abs(trace.t_fail.size - expected) < 5 * math.sqrt(expected)
    assert np.all(np.diff(trace.t_fail) >= 0) and trace.t_fail.max() < DAY_S
    # a slice never fails again before it is back
    order = np.lexsort((trace.t_fail, trace.slice))
    sl, tf, tb = trace.slice[order], trace.t_fail[order], trace.t_back[order]
    same = sl[1:] == sl[:-1]
    assert np.all(tf[1:][same] > tb[:-1][same])


@pytest.mark.parametrize("bad, match", [
    (dict(quorum=3, learners=(2, 4)), "exceeds the smallest"),
    (dict(chips=(128,), learners=(4,)), "fewer than M=4"),
    (dict(min_seeds=5, max_seeds=2), "min_seeds"),
])
def test_sweep_config_names_bad_values(bad, match):
    with pytest.raises(ValueError, match=match):
        small_sweep(**bad)


def test_dist_parsing_and_validation():
    assert parse_dist("exp:60") == Dist("exp", 60.0)
    assert parse_dist("lognormal:60:0.5") == Dist("lognormal", 60.0, 0.5)
    assert parse_dist("exp").mean is None and parse_dist("exp:auto").mean is None
    for bad in ("weibull:3", "exp:-1", "fixed:x", "lognormal:5"):
        with pytest.raises(ValueError):
            parse_dist(bad)
    with pytest.raises(ValueError, match="mtbi_s"):
        ModelConfig(mtbi_s=0)
    draws = Dist("lognormal", 60.0, 0.5).sample(np.random.default_rng(0), 200_000)
    assert draws.mean() == pytest.approx(60.0, rel=0.01) and draws.std() / draws.mean() == pytest.approx(0.5, rel=0.03)


# ----------------------------------------------------------------------------------------- event log
def simulated_log(chips=20_000, learners=2):
    model = calibrate(ModelConfig(duration_s=DAY_S, mtbi_s=YEAR_S / 20))
    trace = generate_trace(model, chips, point_rng(0, 0, chips))
    run = systems.decoupled(trace, learners)
    return model, run, events_from_running(run.learner_running, model.duration_s)


def test_event_log_round_trip_and_matches_the_simulation(tmp_path):
    model, run, events = simulated_log()
    assert len(events) > 20 and {e.event for e in events} == {"fail", "recover"}
    path = tmp_path / "events.bin"
    write_events(path, events, {"learners": 2, "duration_s": model.duration_s, "chips": 20_000})
    log = read_event_log(path)
    assert list(log.events) == events == read_events(path)
    assert log.meta["chips"] == 20_000 and log.learners == 2
    # replaying the log gives back each learner's training time
    for m in range(2):
        down, t_fail = 0.0, None
        for e in events:
            if e.learner == m:
                if e.event == "fail":
                    t_fail = e.time_s
                else:
                    down += e.time_s - t_fail
                    t_fail = None
        if t_fail is not None:
            down += model.duration_s - t_fail
        assert model.duration_s - down == pytest.approx(iv.length(run.learner_running[m]), rel=1e-9)


def test_scale_compresses_time():
    events = [Event(10.0, 0, "fail"), Event(70.0, 0, "recover")]
    assert [e.time_s for e in scale(events, 0.1)] == pytest.approx([1.0, 7.0])
    for bad in (0, -1, math.inf):
        with pytest.raises(ValueError):
            scale(events, bad)


def test_event_log_rejects_damage_and_bad_schedules(tmp_path):
    path = tmp_path / "events.bin"
    write_events(path, [Event(1.0, 1, "fail")], {"learners": 2, "duration_s": 10.0})
    blob = bytearray(path.read_bytes())
    blob[-40] ^= 0xFF
    path.write_bytes(bytes(blob))
    with pytest.raises(FormatError):
        read_events(path)
    with pytest.raises(ValueError, match="expected 'fail'"):
        write_events(path, [Event(1.0, 0, "recover")], {"learners": 1, "duration_s": 10.0})
    with pytest.raises(ValueError, match="outside"):
        write_events(path, [Event(1.0, 3, "fail")], {"learners": 2, "duration_s": 10.0})
    body = {"meta": {}, "learners": 1, "duration_s": 10.0, "time_s": [5.0, 1.0], "learner": [0, 0],
            "event": ["fail", "recover"]}
    path.write_bytes(pack_record("sim-events", 1, body))
    with pytest.raises(FormatError, match="out of order"):
        read_events(path)
    path.write_bytes(pack_record("sim-events", 1, dict(body, event=["fail"])))
    with pytest.raises(FormatError, match="equal length"):
        read_events(path)
    path.write_bytes(pack_record("sim-events", 2, body))
    with pytest.raises(FormatError, match="version"):
        read_events(path)


# ---------------------------------------------------------------------------------------------- CLI
def test_simulate_cli_json_plot_and_events(tmp_path, capsys):
    events = tmp_path / "ev.bin"
    rc = main(["simulate", "--chips", "20k", "40k", "--learners", "1", "2", "--mtbi-years", "0.05",
               "--duration-days", "0.5", "--max-seeds", "3", "--json", "--out", str(tmp_path),
               "--events", str(events)])
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 2 * 4
    assert all(set(r) == {"system", "chips", "learners", "quorum", "goodput", "uptime", "ci"} for r in rows)
    assert {r["system"] for r in rows} == {"dp", "elastic_dp", "decoupled"}
    assert all(0 <= r["goodput"] <= r["uptime"] + 1e-12 <= 1 + 1e-12 for r in rows if r["system"] != "decoupled")
    png = (tmp_path / "goodput.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    log = read_event_log(events)
    assert log.meta["chips"] == 20_000 and log.learners == 1


def test_simulate_cli_table_and_errors(tmp_path, capsys):
    assert main(["simulate", "--chips", "10k", "--learners", "2", "--duration-days", "0.2",
                 "--max-seeds", "2", "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "elastic_dp" in out and "decoupled" in out and "calibrated" in out
    assert main(["simulate", "--chips", "10k", "--learners", "2", "--quorum", "3", "--no-plot"]) == 2
    assert "quorum K=3" in capsys.readouterr().err
