"""Round closing: minimum quorum and adaptive grace window, on scripted timelines (SPEC §4)."""
from __future__ import annotations

import pytest

from pipeline.policy import Decision, Ewma, Pending, PolicyConfig, Timing, decide, grace_window


def P(learner: str, t: float, seq: int = 0, steps: int = 10, tokens: int = 1000, inc: int = 0) -> Pending:
    return Pending(f"{learner}/{inc}/{seq}", learner, (inc, seq), t, steps, tokens)


# ------------------------------------------------------------------ grace window

def test_grace_window_formula_and_clamps():
    cfg = PolicyConfig(quorum=1, overlap=4, gamma=0.5)
    t = Timing(step_time_s=1.0, sync_time_s=0.5)
    # 0.5 * (4*1 - 1 - 0.5) = 1.25, capped at one step time
    assert grace_window(cfg, t, 1.0) == 1.0
    assert grace_window(PolicyConfig(overlap=4, gamma=0.5, cap_s=10.0), t, 1.0) == pytest.approx(1.25)
    assert grace_window(PolicyConfig(overlap=4, gamma=0.5, cap_s=10.0), t, 5.0) == 0.0           # no slack left
    assert grace_window(PolicyConfig(overlap=2, gamma=0.25, cap_s=9.0), Timing(2.0, 0.0), 0.0) == pytest.approx(1.0)


def test_grace_window_before_any_measurement_is_the_cap():
    assert grace_window(PolicyConfig(cap_s=3.0), Timing(), 100.0) == 3.0
    assert grace_window(PolicyConfig(), Timing(), 0.0) == 0.0                          # no cap, no step time


# ------------------------------------------------------------------ decisions

CFG = PolicyConfig(quorum=2, overlap=2, gamma=0.5)
TIMING = Timing(step_time_s=1.0, sync_time_s=0.2)


def test_empty_and_quorum_not_met():
    d = decide([], 0.0, CFG, TIMING)
    assert d.merge == () and d.reason == "empty" and d.wait_s is None
    d = decide([P("a", 0.0)], 50.0, CFG, TIMING)
    assert d.merge == () and d.reason == "quorum-not-met" and d.wait_s is None and d.quorum_met_at is None


def test_quorum_reached_then_grace_then_expiry():
    pend = [P("a", 10.0), P("b", 10.4)]
    # quorum at 10.4 after 0.4 s; grace = 0.5 * (2*1 - 0.4 - 0.2) = 0.7 (< cap 1.0): closes at 11.1
    d = decide(pend, 10.5, CFG, TIMING)
    assert d.reason == "grace" and d.merge == ()
    assert d.quorum_met_at == 10.4 and d.grace_s == pytest.approx(0.7) and d.wait_s == pytest.approx(0.6)
    d = decide(pend, 11.1, CFG, TIMING)
    assert d.reason == "grace-expired" and d.merge == ("a/0/0", "b/0/0")


def test_late_arrival_joins_the_window():
    pend = [P("a", 10.0), P("b", 10.4)]
    assert decide(pend, 10.9, CFG, TIMING).merge == ()
    pend.append(P("c", 11.0))                       # inside the window (closes at 11.1)
    d = decide(pend, 11.2, CFG, TIMING)
    assert d.reason == "grace-expired" and d.merge == ("a/0/0", "b/0/0", "c/0/0")
    assert d.quorum_met_at == 10.4                   # a third learner does not move the quorum time


def test_superseding_delta_keeps_only_the_newest_and_counts_once():
    pend = [P("a", 1.0, seq=3), P("a", 2.0, seq=4), P("a", 0.5, seq=0, inc=1), P("a", 0.7, seq=0, inc=1)]
    d = decide(pend, 100.0, CFG, TIMING)
    assert d.reason == "quorum-not-met"              # one learner, however many deltas
    assert d.superseded == ("a/0/3", "a/0/4")        # the new incarnation is newest
    d = decide(pend + [P("b", 3.0)], 100.0, CFG, TIMING)
    assert d.merge == ("a/1/0", "b/0/0") and d.superseded == ("a/0/3", "a/0/4")
    # learner a has had a pending delta since 0.5: quorum wait 2.5 s leaves no grace
    assert d.quorum_met_at == 3.0 and d.grace_s == 0.0


def test_learner_with_zero_steps_does_not_count():
    pend = [P("a", 0.0), P("z", 0.1, steps=0)]
    assert decide(pend, 10.0, CFG, TIMING).reason == "quorum-not-met"
    d = decide(pend + [P("b", 0.2)], 10.0, CFG, TIMING)
    assert d.reason == "grace-expired"
    assert d.merge == ("a/0/0", "b/0/0", "z/0/0")    # handed to the fold, which records the drop
    assert d.quorum_met_at == 0.2


def test_all_live_learners_reported_closes_at_once():
    pend = [P("a", 10.0), P("b", 10.1)]
    d = decide(pend, 10.1, CFG, TIMING, live_learners=2)
    assert d.reason == "all-reported" and d.merge == ("a/0/0", "b/0/0") and d.wait_s == 0.0
    assert decide(pend, 10.1, CFG, TIMING, live_learners=3).reason == "grace"
    # fewer live learners than K: no round (the quorum is a minimum)
    assert decide([P("a", 0.0)], 1.0, CFG, TIMING, live_learners=1).reason == "quorum-not-met"


def test_no_measurement_yet_uses_the_cap():
    cfg = PolicyConfig(quorum=1, cap_s=2.0)
    d = decide([P("a", 5.0)], 6.0, cfg, Timing())
    assert d.reason == "grace" and d.grace_s == 2.0 and d.wait_s == pytest.approx(1.0)
    assert decide([P("a", 5.0)], 7.0, cfg, Timing()).reason == "grace-expired"
    # K = 1, no cap and no measurement: merge at once
    d = decide([P("a", 5.0)], 5.0, PolicyConfig(), Timing())
    assert d.merge == ("a/0/0",) and d.grace_s == 0.0


def test_decision_is_independent_of_input_order():
    pend = [P("c", 1.0), P("a", 2.0, seq=1), P("b", 0.5), P("a", 0.1, seq=0)]
    ref = decide(pend, 9.0, CFG, TIMING)
    for perm in (pend[::-1], pend[1:] + pend[:1], sorted(pend, key=lambda p: p.arrived_at)):
        assert decide(perm, 9.0, CFG, TIMING) == ref
    assert isinstance(ref, Decision)


def test_config_validation():
    with pytest.raises(ValueError, match="quorum must be an int >= 1, got 0"):
        PolicyConfig(quorum=0)
    with pytest.raises(ValueError, match="gamma must be a finite number"):
        PolicyConfig(gamma=-1.0)
    with pytest.raises(ValueError, match="step_time_s"):
        Timing(step_time_s=float("inf"))
    with pytest.raises(ValueError, match="live_learners"):
        decide([], 0.0, CFG, TIMING, live_learners=-1)


def test_ewma():
    e = Ewma(alpha=0.5)
    assert e.value is None
    e = e.update(4.0)
    assert e.value == 4.0
    e = e.update(2.0).update(2.0)
    assert e.value == pytest.approx(2.5)
    with pytest.raises(ValueError, match="alpha"):
        Ewma(alpha=0.0)
    with pytest.raises(ValueError, match="EWMA sample"):
        e.update(float("nan"))


def test_a_decision_reason_is_a_verdict_and_an_unknown_one_is_refused():
    from pipeline.policy import Decision, Verdict
    d = Decision((), (), None, None, None, "grace")
    assert d.reason is Verdict.GRACE and d.reason.value == "grace"
    with pytest.raises(ValueError, match="Decision.reason 'graze'"):
        Decision((), (), None, None, None, "graze")
