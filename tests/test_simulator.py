"""Goodput simulator (SPEC §9): state machines by hand, analytic checks, the paper's rule of thumb,
limits, the spare pool, determinism, the event-log format, the CLI."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from infra.simulator import engine, intervals as iv, systems
from infra.simulator.calibrate import calibrate, dp_goodput_analytic, kept_per_run, solve_restart_mean
from infra.simulator.config import DAY_S, DEFAULT_CHIPS, DEFAULT_LEARNERS, YEAR_S, ModelConfig, SweepConfig
from infra.simulator.dists import Dist, expweibull_unit_mean, parse_dist
from infra.simulator.eventlog import Event, events_from_stalls, read_event_log, read_events, scale, write_events
from infra.simulator.events import FailureTrace, generate_trace
from infra.simulator.speed import lockstep_efficiency
from infra.simulator.sweep import half_width, point_rng, run_sweep, t95
from infra.simulator.validate import _lives, learner_uptime, simulated, time_shares
from pipeline.envelope import pack_record
from pipeline.errors import FormatError
from workers.cli import main

MODEL = calibrate(ModelConfig())


def hand_trace(slices: int, events: list[tuple[float, int]], horizon: float = 100.0, det=1.0, restart=5.0,
               down=2.0, up=3.0, recovery=10.0, repair=1000.0) -> FailureTrace:
    """A trace written by hand: (time, slice) per potential interruption, fixed durations."""
    n = len(events)
    full = lambda v: np.full(n, float(v))  # noqa: E731
    return FailureTrace(slices, slices, horizon, np.array([t for t, _ in events], dtype=float),
                        np.array([s for _, s in events], dtype=np.int64), full(det), full(restart), full(down),
                        full(up), full(recovery), full(repair))


def mean_over_seeds(model, chips, fn, seeds=3):
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


# ------------------------------------------------------------------------- state machines by hand
def test_elastic_job_shrinks_trains_smaller_and_grows_back():
    # slice 0 fails at 5: stalled for detection 1 + shrink 2, trains on 3 slices from 8; its spare is
    # ready at 5 + 1 + 10 = 16 and joins in a grow of 3 (16..19). Interruptions of a stalled job (6,
    # 17) and of the slot that has no slice (10) never happen; slot 0 computes again from 19 (20).
    tr = hand_trace(4, [(5.0, 0), (6.0, 1), (10.0, 0), (17.0, 2), (20.0, 0)])
    rec = engine.run_jobs(tr, [(0, 4)], elastic=True, pool_size=10).jobs[0]
    assert rec.segments[:3] == [(0.0, 5.0, 4), (8.0, 16.0, 3), (19.0, 20.0, 4)]
    assert rec.stalls[:2] == [(5.0, 6.0, 8.0), (16.0, 16.0, 19.0)]
    assert rec.failures == 2


def test_replacement_ready_during_a_stall_joins_right_after_it():
    # slice 0 at 5 (spare ready at 16); slice 1 at 14.5 (stall 14.5..17.5): the ready spare waits,
    # then one grow 17.5..20.5 adds it; slice 1's own spare is ready at 25.5 and grows 25.5..28.5.
    tr = hand_trace(4, [(5.0, 0), (14.5, 1)], horizon=40.0)
    rec = engine.run_jobs(tr, [(0, 4)], elastic=True, pool_size=10).jobs[0]
    assert rec.segments == [(0.0, 5.0, 4), (8.0, 14.5, 3), (20.5, 25.5, 3), (28.5, 40.0, 4)]
    assert [s[:2] for s in rec.stalls] == [(5.0, 6.0), (14.5, 17.5), (25.5, 25.5)]


def test_single_slice_learner_waits_for_its_replacement_then_restarts():
    tr = hand_trace(1, [(5.0, 0), (8.0, 0)], horizon=50.0)
    rec = engine.run_jobs(tr, [(0, 1)], elastic=True, pool_size=1).jobs[0]
    # down 5 .. 5 + detection 1 + recovery 10 = 16, restart (a grow of 3) until 19
    assert rec.segments == [(0.0, 5.0, 1), (19.0, 50.0, 1)] and rec.stalls == [(5.0, 16.0, 19.0)]


def test_restart_job_loses_progress_since_its_checkpoint_and_ignores_failures_while_down():
    # fails at 5 with checkpoints every 2 s of progress: keeps 4, loses 1; down until 5 + 1 + 5 = 11
    # (the interruption at 7 is of a stopped job); fails again at 20: progress 4 + 9 = 13 -> 12.
    tr = hand_trace(8, [(5.0, 3), (7.0, 1), (20.0, 0)], horizon=30.0)
    rec = engine.run_jobs(tr, [(0, 8)], elastic=False, pool_size=4, checkpoint_s=2.0).jobs[0]
    assert rec.segments == [(0.0, 5.0, 8), (11.0, 20.0, 8), (26.0, 30.0, 8)]
    assert rec.lost_s == pytest.approx(2.0) and rec.progress_s == pytest.approx(12.0 + 4.0)


def test_without_spares_a_restart_waits_for_the_repair():
    tr = hand_trace(8, [(5.0, 3), (200.0, 1)], horizon=300.0, repair=100.0)
    ample = engine.run_jobs(tr, [(0, 8)], elastic=False, pool_size=1)
    dry = engine.run_jobs(tr, [(0, 8)], elastic=False, pool_size=0)
    assert ample.jobs[0].stalls[0] == (5.0, 6.0, 11.0) and ample.waited == 0
    # the broken slice is healthy at 5 + 1 + 100 = 106: the restart begins then
    assert dry.jobs[0].stalls[0] == (5.0, 106.0, 111.0) and dry.waited == 2 and dry.replacements == 2


def test_learners_share_the_spare_pool_first_come_first_served():
    # two single-slice learners, one spare, repairs of 50: l0's failure takes the spare, l1's waits
    # for l0's broken slice (back at 5 + 1 + 50 = 56), ready 10 later, restarted 3 later.
    tr = hand_trace(2, [(5.0, 0), (7.0, 1)], horizon=100.0, repair=50.0)
    res = engine.run_jobs(tr, [(0, 1), (1, 2)], elastic=True, pool_size=1)
    assert res.jobs[0].stalls[0] == (5.0, 16.0, 19.0)
    assert res.jobs[1].stalls[0] == (7.0, 66.0, 69.0)
    assert (res.replacements, res.waited) == (2, 1)


def test_pool_ran_dry_counts_returns_before_requests():
    assert not engine.pool_ran_dry(1, [1.0, 5.0], [3.0, 9.0])
    assert engine.pool_ran_dry(1, [1.0, 2.0], [3.0, 9.0])
    assert not engine.pool_ran_dry(1, [1.0, 3.0], [3.0, 9.0])   # back at 3 serves the request at 3
    assert not engine.pool_ran_dry(0, [], [])


@pytest.mark.parametrize("elastic, learners", [(False, 1), (True, 1), (True, 8)])
def test_shared_driver_equals_independent_jobs_when_the_pool_is_ample(elastic, learners):
    model = replace(MODEL, duration_s=DAY_S)
    tr = generate_trace(model, 200_000, point_rng(1, 0, 200_000))
    blocks = systems.learner_bounds(tr.slices, learners)
    fast = engine.run_jobs(tr, blocks, elastic, pool_size=10**6, checkpoint_s=10.0)
    streams = [engine.Stream(tr.subset(lo, hi)) for lo, hi in blocks]
    exact = engine._run_shared(streams, blocks, elastic, 10**6, 10.0, tr.duration)
    assert fast.jobs == exact.jobs and fast.replacements == exact.replacements > 100 and exact.waited == 0


# ---------------------------------------------------------------------------------- analytic checks
def test_calibration_point_and_simulator_match_the_analytic_dp_formula():
    assert MODEL.restart.mean == pytest.approx(64.87, abs=0.01)
    assert dp_goodput_analytic(MODEL, 150_000) == pytest.approx(0.72, abs=1e-12)
    model = replace(MODEL, duration_s=3 * DAY_S)
    for chips in (150_000, 600_000):
        sim = mean_over_seeds(model, chips, lambda t: systems.dp(t, model).goodput)
        # the renewal-reward formula is exact in expectation; 3 seeds x 3 days: sd of the mean ~0.4 pt
        assert sim == pytest.approx(dp_goodput_analytic(model, chips), abs=0.012)


def test_kept_progress_per_run_and_its_limits():
    assert kept_per_run(100.0, 0.0) == 100.0
    assert kept_per_run(100.0, 1e-6) == pytest.approx(100.0, rel=1e-6)
    assert kept_per_run(100.0, 10.0) == pytest.approx(10 * math.exp(-0.1) / (1 - math.exp(-0.1)))
    assert kept_per_run(1.0, 50.0) < 1e-15   # runs far shorter than a checkpoint keep nothing


def test_one_slice_systems_match_their_renewal_formulas():
    model = replace(MODEL, mtbi_s=1000.0, chips_per_slice=1, detection=Dist("fixed", 10.0),
                    restart=Dist("exp", 40.0), checkpoint_s=0.0, reconfiguration=Dist("fixed", 20.0),
                    recovery=Dist("exp", 30.0), spares=1000, duration_s=4e6)
    dp = mean_over_seeds(model, 1, lambda t: systems.dp(t, model).goodput)
    el = mean_over_seeds(model, 1, lambda t: systems.elastic_dp(t, model).goodput)
    assert dp == pytest.approx(1000 / (1000 + 10 + 40), abs=0.005)
    assert el == pytest.approx(1000 / (1000 + 10 + 30 + 20), abs=0.005)   # down until ready, then a grow


def test_calibration_refuses_impossible_settings_and_keeps_a_given_restart():
    slow = ModelConfig(detection=Dist("fixed", 90.0))
    with pytest.raises(ValueError, match="no restart time fits"):
        solve_restart_mean(slow)
    assert calibrate(replace(slow, restart=Dist("exp", 5.0))).restart.mean == 5.0


# ------------------------------------------------------------------------- limits and rule of thumb
def test_no_failures_is_full_goodput_and_uptime_everywhere():
    model = replace(MODEL, mtbi_s=math.inf, duration_s=DAY_S)
    trace = generate_trace(model, 150_000, point_rng(0, 0, 150_000))
    assert trace.t.size == 0
    outs = [systems.dp(trace, model), systems.elastic_dp(trace, model)]
    outs += [systems.decoupled(trace, model, m, k).outcome for m in (1, 4, 16) for k in (1, m)]
    assert all(o.goodput == 1.0 and o.uptime == 1.0 for o in outs)
    # and long MTBIs approach it: every system rises towards 100% as MTBI grows
    last = {}
    for years in (1, 10, 100):
        rare = replace(MODEL, mtbi_s=years * YEAR_S)
        trace = generate_trace(rare, 150_000, point_rng(0, 0, 150_000))
        now = {"dp": systems.dp(trace, rare).goodput, "elastic": systems.elastic_dp(trace, rare).goodput,
               "decoupled": systems.decoupled(trace, rare, 4).outcome.goodput}
        assert trace.t.size > 0 and all(now[k] > last.get(k, 0.0) for k in now), (years, now)
        last = now
    assert min(last.values()) > 0.99


def test_single_learner_is_elastic_data_parallel():
    model = replace(MODEL, duration_s=DAY_S)
    for seed in range(3):
        trace = generate_trace(model, 300_000, point_rng(seed, 0, 300_000))
        one, ela = systems.decoupled(trace, model, 1).outcome, systems.elastic_dp(trace, model)
        assert one == ela and ela.goodput < 0.9   # failures did happen


def test_rule_of_thumb_m_learners_match_one_elastic_job_with_m_times_fewer_chips():
    """The paper's rule of thumb (arXiv 2604.21428, chaos-engineering study) over the default sweep.

    Tolerance 2 points. In this model the rule holds exactly in expectation for K = 1 while the
    spare pool does not run dry (every learner is an elastic job of N/M chips on the same physics,
    and a training learner is always a quorum), so the differences are: sampling noise (3 seeds
    x 3 days: the elastic job's 95% CI half-width is at most ~1 point, the decoupled average over
    M learners' is smaller; their difference stays within ~1.4 points), and slice rounding (N/M
    chips make 146.5 slices at 150k/16: learners of 146 and 147 vs one job of 146, < 0.7% in size,
    < 0.3 points of goodput). A model where a failure stalled every learner, or a learner saw the
    whole cluster's failure rate, would miss by 5 to 60 points (checked below against elastic DP
    at N, which differs from Decoupled DiLoCo by at least 10 points at every point of the sweep).
    """
    model = replace(MODEL, duration_s=3 * DAY_S)
    def mean(fn, chips):   # noqa: E306
        return float(np.mean([fn(generate_trace(model, chips, point_rng(11, s, chips))) for s in range(3)]))
    elastic = {}
    for n in DEFAULT_CHIPS:
        for m in DEFAULT_LEARNERS:
            small = n // m
            if small not in elastic:
                elastic[small] = mean(lambda t: systems.elastic_dp(t, model).goodput, small)
            dec = mean(lambda t: systems.decoupled(t, model, m).outcome.goodput, n)
            assert dec == pytest.approx(elastic[small], abs=0.02), (n, m, dec, elastic[small])
            assert dec > mean(lambda t: systems.elastic_dp(t, model).goodput, n) + 0.1, (n, m)


# ---------------------------------------------------------------------------------- spare pool
def test_repair_time_matters_only_when_spares_run_out():
    model = replace(MODEL, duration_s=DAY_S)
    slow_repair = replace(model, repair=Dist("exp", 100 * 3600.0))
    chips = 300_000
    a, b = (generate_trace(m, chips, point_rng(2, 0, chips)) for m in (model, slow_repair))
    ample = replace(model, spares=10**6)
    assert systems.dp(a, ample) == systems.dp(b, ample) and systems.elastic_dp(a, ample) == systems.elastic_dp(b, ample)
    assert systems.dp(a, model).pool_waits == 0   # the default pool (2%) never runs dry here
    none = replace(model, spares=0)
    fast_fix, slow_fix = systems.dp(a, none), systems.dp(b, none)
    assert fast_fix.pool_waits == 1.0 and slow_fix.goodput < fast_fix.goodput < systems.dp(a, model).goodput - 0.2
    # elastic DP trains on while a slice is away, so even without spares it loses little
    assert systems.elastic_dp(a, none).goodput > systems.elastic_dp(a, model).goodput - 0.02


# ---------------------------------------------------------------------------------------- sweeps
def small_sweep(**kw) -> SweepConfig:
    model = replace(MODEL, duration_s=DAY_S, mtbi_s=kw.pop("mtbi_s", YEAR_S))
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


def test_decoupled_beats_elastic_beats_dp_and_quorum_costs_uptime():
    rows = by_key(run_sweep(small_sweep(chips=(1_200_000,), learners=(4, 8))).rows)
    assert rows[("decoupled", 8)].goodput > rows[("decoupled", 4)].goodput > rows[("elastic_dp", 1)].goodput
    assert rows[("elastic_dp", 1)].goodput > rows[("dp", 1)].goodput
    assert rows[("decoupled", 8)].uptime > 0.99
    strict = by_key(run_sweep(small_sweep(chips=(1_200_000,), learners=(4, 8), quorum=4)).rows)
    assert strict[("decoupled", 4)].uptime < rows[("decoupled", 4)].uptime - 0.3
    assert strict[("decoupled", 4)].goodput < rows[("decoupled", 4)].goodput - 0.1


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
    # speed variance is paid at the calibration point too, so it leaves less to the restart time
    assert calibrate(ModelConfig(speed_cv=0.05)).restart.mean == pytest.approx(8.04, abs=0.01)
    with pytest.raises(ValueError, match="lock-step efficiency 0.766"):   # 150k-chip DP is already < 77%
        calibrate(ModelConfig(speed_cv=0.06))
    with pytest.raises(ValueError, match="speed variance alone"):
        calibrate(ModelConfig(speed_cv=0.08))
    model = replace(MODEL, duration_s=DAY_S, speed_cv=0.05, mtbi_s=math.inf)
    trace = generate_trace(model, 160_000, point_rng(0, 0, 160_000))
    dp, dec = systems.dp(trace, model), systems.decoupled(trace, model, 16).outcome
    assert dec.goodput == pytest.approx(lockstep_efficiency(10_000, 0.05), rel=1e-6)
    assert dp.goodput == pytest.approx(lockstep_efficiency(160_000, 0.05)) and dp.goodput < dec.goodput


def test_traces_are_vectorised_and_follow_the_failure_rate():
    model = replace(MODEL, duration_s=DAY_S)
    trace = generate_trace(model, 2_400_000, point_rng(0, 0, 2_400_000))
    expected = 2_400_000 * DAY_S / YEAR_S
    assert abs(trace.t.size - expected) < 5 * math.sqrt(expected)
    assert np.all(np.diff(trace.t) >= 0) and trace.t.max() < DAY_S
    assert trace.slices == 37_500 and 0 <= trace.slot.min() and trace.slot.max() < 37_500
    first_half = (trace.slot < 18_750).mean()   # every slice equally likely: a fair coin per event
    assert abs(first_half - 0.5) < 5 * 0.5 / math.sqrt(trace.t.size)
    sub = trace.subset(100, 200)
    assert sub.slices == 100 and sub.slot.max() < 100 and sub.chips == 6400
    with pytest.raises(ValueError, match="not inside"):
        trace.subset(5, 5)


@pytest.mark.parametrize("bad, match", [
    (dict(quorum=3, learners=(2, 4)), "exceeds the smallest"),
    (dict(chips=(128,), learners=(4,)), "fewer than M=4"),
    (dict(min_seeds=5, max_seeds=2), "min_seeds"),
])
def test_sweep_config_names_bad_values(bad, match):
    with pytest.raises(ValueError, match=match):
        small_sweep(**bad)


@pytest.mark.parametrize("kw, match", [
    (dict(mtbi_s=0), "mtbi_s"), (dict(checkpoint_s=-1.0), "checkpoint_s"), (dict(spare_fraction=2.0), "spare_fraction"),
    (dict(spares=-1), "spares"), (dict(recovery=Dist("exp", None)), "recovery needs a mean"),
])
def test_model_config_names_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**kw)


def test_spare_pool_size():
    assert ModelConfig().pool_slices(2343) == 47 and ModelConfig(spares=5).pool_slices(2343) == 5
    assert ModelConfig(spare_fraction=0.0).pool_slices(100) == 0 and ModelConfig().pool_slices(3) == 1


def test_dist_parsing_sampling_and_validation():
    assert parse_dist("exp:60") == Dist("exp", 60.0)
    assert parse_dist("lognormal:60:0.5") == Dist("lognormal", 60.0, 0.5)
    assert parse_dist("expweibull:60:1.5:0.7") == Dist("expweibull", 60.0, shape=1.5, power=0.7)
    assert parse_dist("exp").mean is None and parse_dist("lognormal:auto:0.5").mean is None
    for bad in ("weibull:3", "exp:-1", "fixed:x", "lognormal:5", "exp:1:2:3", "expweibull:60:0"):
        with pytest.raises(ValueError):
            parse_dist(bad)
    rng = np.random.default_rng(0)
    ln = Dist("lognormal", 60.0, 0.5).sample(rng, 200_000)
    assert ln.mean() == pytest.approx(60.0, rel=0.01) and ln.std() / ln.mean() == pytest.approx(0.5, rel=0.03)
    # exponentiated Weibull: unit means by hand (k=2, a=1: Gamma(1.5); k=1, a=2: 1 + 1/2), mean kept
    assert expweibull_unit_mean(2.0, 1.0) == pytest.approx(math.gamma(1.5), rel=1e-6)
    assert expweibull_unit_mean(1.0, 2.0) == pytest.approx(1.5, rel=1e-6)
    ew = Dist("expweibull", 60.0, shape=0.8, power=2.5).sample(rng, 400_000)
    assert ew.mean() == pytest.approx(60.0, rel=0.01) and ew.min() >= 0
    assert str(Dist("expweibull", 60.0, shape=0.8, power=2.5)) == "expweibull:60:0.8:2.5"


# ----------------------------------------------------------------------------------------- event log
def simulated_run(chips=20_000, learners=2):
    model = replace(MODEL, duration_s=DAY_S, mtbi_s=YEAR_S / 20)
    trace = generate_trace(model, chips, point_rng(0, 0, chips))
    return model, systems.decoupled(trace, model, learners)


def test_event_log_round_trip_and_matches_the_simulation(tmp_path):
    model, run = simulated_run()
    events = events_from_stalls([r.stalls for r in run.learners], model.duration_s)
    assert len(events) > 20 and {e.event for e in events} == {"fail", "recover"}
    path = tmp_path / "events.bin"
    write_events(path, events, {"learners": 2, "duration_s": model.duration_s, "chips": 20_000})
    log = read_event_log(path)
    assert list(log.events) == events == read_events(path)
    assert log.meta["chips"] == 20_000 and log.learners == 2
    # fail -> recover + one reconfiguration (fixed 30 s) is each stall; the rest is training time
    for m, rec in enumerate(run.learners):
        down, t_fail = 0.0, None
        for e in events:
            if e.learner == m and e.event == "fail":
                t_fail = e.time_s
            elif e.learner == m:
                down += min(e.time_s + 30.0, model.duration_s) - t_fail
                t_fail = None
        if t_fail is not None:
            down += model.duration_s - t_fail
        train = sum(b - a for a, b, _ in rec.segments)
        assert model.duration_s - down == pytest.approx(train, rel=1e-9)


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


# ------------------------------------------------------------------------------ simulated vs real
def test_validation_helpers(tmp_path):
    spans = [[(0.0, 4.0), (6.0, 10.0)], [(0.0, 10.0)], [(2.0, 5.0)]]
    assert learner_uptime(spans, 0.0, 10.0, 1) == 1.0
    assert learner_uptime(spans, 0.0, 10.0, 2) == pytest.approx(0.9)   # all but 5..6
    assert learner_uptime(spans, 0.0, 10.0, 3) == pytest.approx(0.2)   # 2..4
    ev = [{"event": "learner-start", "t": 1.0, "pid": 7}, {"event": "delta", "t": 2.0, "delta": "a"},
          {"event": "delta", "t": 3.0, "delta": "b"}, {"event": "learner-start", "t": 9.0, "pid": 8}]
    lives = _lives(ev, {"a"})
    assert lives == {7: (1.0, 2.0), 8: (9.0, None)}
    # life 7 spawned at 0, killed at 4; life 8 spawned at 6 (started 9), killed at 12; life 9 never started
    spawns = [{"pid": 7, "started": 0.0, "ended": 4.0, "how": "killed"},
              {"pid": 8, "started": 6.0, "ended": 12.0, "how": "killed"},
              {"pid": 9, "started": 14.0, "ended": 15.0, "how": "killed"}]
    shares, startups = time_shares(spawns, lives, 0.5, 20.0)
    assert startups == [3.0]
    assert shares == pytest.approx({"training": 1.0, "lost": 2.0 + 3.0, "restarting": 0.5 + 3.0 + 1.0,
                                    "waiting": 2.0 + 2.0 + 5.0})
    assert sum(shares.values()) == pytest.approx(19.5)
    path = tmp_path / "e.bin"
    write_events(path, [Event(10.0, 0, "fail"), Event(30.0, 0, "recover"), Event(100.0, 0, "fail")],
                 {"learners": 1, "duration_s": 100.0, "reconfiguration": "fixed:5", "goodput": 0.7, "uptime": 0.8})
    sim = simulated(read_event_log(path), 0.1)   # the closing fail at the horizon is not a failure
    assert sim["shares"] == pytest.approx({"training": 0.7, "waiting": 0.2, "restarting": 0.1, "lost": 0.0})
    assert (sim["kills"], sim["mean_startup_s"], sim["window_s"]) == (1, 0.5, pytest.approx(10.0))


def test_event_log_can_stop_every_learner_at_the_end():
    stalls = [[(5.0, 6.0, 8.0)], [(90.0, 95.0, 98.0)], [(97.0, float("inf"), float("inf"))], []]
    plain = events_from_stalls(stalls, 100.0)
    closed = events_from_stalls(stalls, 100.0, stop_at_end=True)
    assert [(e.time_s, e.learner, e.event) for e in closed[len(plain):]] == [
        (100.0, 0, "fail"), (100.0, 1, "fail"), (100.0, 3, "fail")]   # learner 2 is already down


# ---------------------------------------------------------------------------------------------- CLI
def test_simulate_cli_json_plot_and_events(tmp_path, capsys):
    events = tmp_path / "ev.bin"
    rc = main(["simulate", "--chips", "20k", "40k", "--learners", "1", "2", "--mtbi-years", "0.05",
               "--duration-days", "0.5", "--max-seeds", "3", "--json", "--out", str(tmp_path),
               "--events", str(events), "--recovery", "expweibull:60:1.5:0.8"])
    assert rc == 0
    out = capsys.readouterr()
    rows = json.loads(out.out)
    assert len(rows) == 2 * 4 and "calibrated: restart mean = 64.87 s" in out.err
    assert all(set(r) == {"system", "chips", "learners", "quorum", "goodput", "uptime", "ci"} for r in rows)
    assert {r["system"] for r in rows} == {"dp", "elastic_dp", "decoupled"}
    assert all(0 <= r["goodput"] <= r["uptime"] + 1e-12 <= 1 + 1e-12 for r in rows if r["system"] != "decoupled")
    png = (tmp_path / "goodput.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    log = read_event_log(events)
    assert log.meta["chips"] == 20_000 and log.learners == 1 and log.meta["recovery"] == "expweibull:60:1.5:0.8"


def test_simulate_cli_table_and_errors(capsys):
    assert main(["simulate", "--chips", "10k", "--learners", "2", "--duration-days", "0.2",
                 "--max-seeds", "2", "--no-plot", "--spares", "0"]) == 0
    out = capsys.readouterr().out
    assert "elastic_dp" in out and "decoupled" in out and "calibrated: restart mean" in out
    assert "spare pool ran dry" in out
    assert main(["simulate", "--chips", "10k", "--learners", "2", "--quorum", "3", "--no-plot"]) == 2
    assert "quorum K=3" in capsys.readouterr().err
    assert main(["simulate", "--chips", "10k", "--repair", "exp", "--no-plot"]) == 2
    assert "repair needs a mean" in capsys.readouterr().err


def test_chaos_accepts_step_and_speed_overrides_for_event_log_replays(capsys):
    # `ddiloco chaos event-log --steps N --slow F` (used for the simulated-vs-real runs) validates
    # the overrides before it starts any process
    for argv, match in ((["--steps", "0"], "steps (0) must be >= 1"), (["--slow", "0.5"], "slow factor must be >= 1")):
        try:
            rc = main(["chaos", "event-log", *argv])
        except SystemExit as exc:   # older CLIs let the SystemExit through
            rc, err = 2, str(exc)
        else:
            err = capsys.readouterr().err
        assert rc == 2 and match in err
