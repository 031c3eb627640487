"""Issue 25: the progress invariants (infra/chaos/progress.py) on hand-built logs - each holds on a
healthy run and fails on the defect it is there to catch (a learner that stops answering, a frozen
fragment, a harmless-counted drop of never-merged work, a merge below quorum, a slow recovery)."""
from __future__ import annotations

import dataclasses

from infra.chaos import progress
from infra.chaos.invariants import Observation
from pipeline.types import CommitRecord, DroppedRecord, InputRecord

H = 6


def _inp(learner: str, seq: int, step: int, steps: int, base: int = 0, inc: int = 1, rnd: int = -1) -> InputRecord:
    return InputRecord(f"{learner}/{inc}/{seq}", learner, inc, seq, f"deltas/{learner}/{seq}", "c" * 64, base,
                       steps, steps * 10, step, 1.0, 0, rnd)


def _merge(seq: int, fragment: int, rnd: int, *inputs: InputRecord, dropped=()) -> CommitRecord:
    """Committed one step (0.1 s, as ``_events`` times steps) after its newest input was made."""
    at = (max(i.learner_step for i in inputs) + 1) * 0.1 if inputs else float(seq)
    return CommitRecord(seq=seq, epoch=1, kind="merge", fragment=fragment, version=seq, inputs=tuple(inputs),
                        dropped=tuple(dropped), round=rnd, info={"committed_at": at})


def _events(learner: str, last_step: int, deltas=(), t0: float = 0.0, dt: float = 0.1, inc: int = 1) -> list[dict]:
    ev = [{"t": t0, "event": "learner-start", "incarnation": inc, "pid": hash(learner) % 1000}]
    ev += [{"t": t0 + s * dt, "event": "step", "step": s, "max_gap_s": dt} for s in range(10, last_step + 1, 10)]
    ev += [{"t": t0 + step * dt, "event": "delta", "delta": f"{learner}/{inc}/{seq}", "fragment": p, "base": base,
            "steps": 1, "tokens": 10, "step": step, "round": rnd} for seq, p, base, step, rnd in deltas]
    ev.append({"t": t0 + (last_step + 1) * dt, "event": "learner-stop", "step": last_step + 1})
    return sorted(ev, key=lambda e: e["t"])


def _obs(records, events, marks=()) -> Observation:
    """A restarted syncer logs ``syncer-recovered`` half a second after its restart mark."""
    recovered = [{"t": m["t"] + 0.5, "event": "syncer-recovered"} for m in marks
                 if m["who"].startswith("syncer") and m["what"] == "restart"]
    return Observation(records=list(records), learner_events=events, syncer_events={"syncer": recovered}, lives={},
                       marks=list(marks))


def _healthy(learner: str = "l0", steps: int = 60, period: int = H, tau: int = 1):
    """Answers every ``period`` steps; each answer carries the steps since the last version (tau
    steps after the previous answer)."""
    inputs, deltas, base_step = [], [], 0
    for seq, step in enumerate(range(period - 1, steps, period)):
        inputs.append(_inp(learner, seq, step, step - base_step + 1, base=seq, rnd=step))
        deltas.append((seq, 0, seq, step, step))
        base_step = step + tau + 1
    return inputs, deltas


def test_learner_progress_holds_for_steady_answers_and_fails_when_a_learner_stops_answering():
    inputs, deltas = _healthy(steps=120)
    records = [_merge(k, 0, i.round, i) for k, i in enumerate(inputs)]
    ok = progress.learner_progress(_obs(records, {"l0": _events("l0", 119, deltas)}), H)
    assert ok.ok, ok.detail
    assert ok.data["per_life"]["l0/1"]["longest_uncarried_steps"] <= 2
    # the runaway-clock defect: the learner trained 120 steps, its answers stopped after step 60
    stopped = [r for r in records if r.inputs[0].learner_step < 60]
    bad = progress.learner_progress(_obs(stopped, {"l0": _events("l0", 119, deltas)}), H)
    assert not bad.ok and "reached the model in no merged delta" in bad.detail


def test_learner_progress_counts_a_long_post_outage_delta_and_exempts_a_killed_lifes_tail():
    # an outage: nothing merged for 80 steps, then one delta holding all of them (the backlog) is merged
    records = [_merge(0, 0, 5, _inp("l0", 0, 5, 6)), _merge(1, 0, 11, _inp("l0", 1, 90, 84, base=1))]
    events = {"l0": _events("l0", 92, [(0, 0, 0, 5, 5), (1, 0, 1, 90, 11)])}
    assert progress.learner_progress(_obs(records, events), H).ok
    # the guard dropped that delta instead: 84 steps never reached the model
    dropped = [records[0], CommitRecord(seq=1, epoch=1, kind="drop", fragment=0, version=1, dropped=(
        DroppedRecord("l0/1/1", "l0", "k", "c" * 64, "norm-outlier", 840),))]
    assert not progress.learner_progress(_obs(dropped, events), H).ok
    # a SIGKILLed life loses its last steps with the process: not a progress violation
    obs = _obs(records[:1], {"l0": _events("l0", 92, [(0, 0, 0, 5, 5)])})
    obs.lives = {"l0": [{"pid": hash("l0") % 1000, "killed": True, "role": "learner", "how": "killed"}]}
    assert progress.learner_progress(obs, H).ok


def test_fragment_progress_fails_when_answered_rounds_go_unmerged():
    inputs, deltas = _healthy(steps=120)
    records = [_merge(k, 0, i.round, i) for k, i in enumerate(inputs)]
    events = {"l0": _events("l0", 119, deltas)}
    assert progress.fragment_progress(_obs(records, events), H, 1).ok
    frozen = records[:4]           # rounds 5..23 merged, then answers to rounds 29..119 never were
    bad = progress.fragment_progress(_obs(frozen, events), H, 1)
    assert not bad.ok and "fragment 0: no merge between rounds 23 and the end" in bad.detail
    # a gap nobody answered (every learner dead or paused) is no violation
    quiet = {"l0": _events("l0", 119, [d for d in deltas if d[4] < 24])}
    assert progress.fragment_progress(_obs(frozen, quiet), H, 1).ok
    # three of the fragment's rounds replaced within a few learner steps (the clock caught up after a
    # stalled loop turn): a gap of 3H in round ids, but the learners took only 4 steps in it
    burst = [_merge(0, 0, 5, _inp("l0", 0, 5, 6)), _merge(1, 0, 23, _inp("l0", 1, 9, 4, base=1))]
    few = {"l0": _events("l0", 40, [(0, 0, 0, 5, 5), (1, 0, 1, 7, 11), (2, 0, 1, 8, 17), (3, 0, 1, 9, 23)])}
    assert progress.fragment_progress(_obs(burst, few), H, 1).ok
    # an answer to a round inside the gap's ids, given long before it (a learner answered round 23 of a
    # dead syncer's extrapolated clock; the new syncer's round 23 came later, while its loop stalled):
    # nobody answered inside the gap, no violation - the same answer given inside it is one
    stall = [_merge(0, 0, 5, _inp("l0", 0, 30, 6)), _merge(1, 0, 41, _inp("l0", 1, 60, 30, base=1))]
    early = {"l0": _events("l0", 61, [(0, 0, 0, 2, 23), (1, 0, 0, 30, 5), (2, 0, 1, 60, 41)])}
    assert progress.fragment_progress(_obs(stall, early), H, 1).ok
    inside = {"l0": _events("l0", 61, [(0, 0, 0, 40, 23), (1, 0, 0, 30, 5), (2, 0, 1, 60, 41)])}
    bad = progress.fragment_progress(_obs(stall, inside), H, 1)
    assert not bad.ok and "no merge between rounds 5 and 41" in bad.detail
    # a clock that runs away (the restart defect): every answer merged, but the round ids race ahead
    runaway = [dataclasses.replace(r, round=r.round * 10) for r in records]
    bad = progress.fragment_progress(_obs(runaway, events), H, 1)
    assert not bad.ok and "the global clock ran" in bad.detail


def test_drops_truthful_tells_overtaken_work_from_true_duplicates():
    merged = _merge(0, 0, 11, _inp("l0", 1, 11, 6, base=1))
    events = {"l0": _events("l0", 20, [(0, 0, 0, 5, 5), (1, 0, 1, 11, 11), (2, 0, 1, 8, 11)])}
    # seq 0 was on base 0, and only the base-1 lineage was merged: "duplicate" is a lie
    lie = CommitRecord(seq=1, epoch=1, kind="drop", fragment=0, version=1, dropped=(
        DroppedRecord("l0/1/0", "l0", "k", "c" * 64, "duplicate", 60),))
    bad = progress.drops_truthful([merged, lie], progress.produced_bases(_obs([], events)))
    assert not bad.ok and "l0/1/0" in bad.detail
    # a superseded delta is harmless only if a newer delta of its own lineage was merged: l0/1/2
    # (base 1, seq 2) is newer than the merged seq 1, so nothing carried its work
    events["l0"].append({"t": 0.9, "event": "delta", "delta": "l0/1/2", "fragment": 0, "base": 1, "steps": 1,
                         "tokens": 10, "step": 8, "round": 11})
    newer = CommitRecord(seq=1, epoch=1, kind="drop", fragment=0, version=1, dropped=(
        DroppedRecord("l0/1/2", "l0", "k", "c" * 64, "superseded", 60),))
    assert not progress.drops_truthful([merged, newer], progress.produced_bases(_obs([], events))).ok
    # the overtaken drop named for what it is (lost), and an older delta of the merged lineage (harmless)
    honest = CommitRecord(seq=1, epoch=1, kind="drop", fragment=0, version=1, dropped=(
        DroppedRecord("l0/1/0", "l0", "k", "c" * 64, "overtaken", 60),))
    older = CommitRecord(seq=2, epoch=1, kind="drop", fragment=0, version=1, dropped=(
        DroppedRecord("l0/1/5", "l0", "k", "c" * 64, "superseded", 60),))
    good = progress.drops_truthful([_merge(0, 0, 11, _inp("l0", 6, 11, 6, base=1)), honest, older],
                                   {"l0/1/0": 0, "l0/1/5": 1})
    assert good.ok and good.data == {"harmless": 1, "lost": 1, "evicted": 0, "violations": []}


def test_drops_truthful_refuses_work_called_lost_that_a_newer_merged_delta_carries():
    """An evicted delta is counted lost; if a newer delta of its lineage (same life, same base) was
    merged, that one holds its steps, so "lost" is untrue: what a sender that keeps sent-but-unacked
    deltas instead of superseding them does while the store is down (the evict-unacked mutant)."""
    events = {"l0": _events("l0", 30, [(3, 0, 1, 9, 6), (4, 0, 1, 15, 12), (5, 0, 2, 21, 6)])}
    bases = progress.produced_bases(_obs([], events))
    carried = _merge(0, 0, 15, _inp("l0", 4, 15, 12, base=1))
    bad = progress.drops_truthful([carried], bases, evicted=["l0/1/3"])
    assert not bad.ok and "l0/1/3 evicted" in bad.detail and "superseded work called lost" in bad.detail
    # evicted and nothing newer of its lineage merged (a newer base's delta does not carry its steps): lost, truly
    other = _merge(0, 0, 21, _inp("l0", 5, 21, 6, base=2))
    ok = progress.drops_truthful([other], bases, evicted=["l0/1/3"])
    assert ok.ok and ok.data["evicted"] == 1, ok.detail


def test_quorum_minimum_counts_distinct_learners():
    two = _merge(0, 0, 5, _inp("l0", 0, 5, 6), _inp("l1", 0, 5, 6))
    one = _merge(1, 0, 11, _inp("l0", 1, 11, 6), _inp("l0", 2, 12, 7))
    assert progress.quorum_minimum([two], 2).ok
    bad = progress.quorum_minimum([two, one], 2)
    assert not bad.ok and bad.data["below"] == [(1, 1)]


def test_after_a_store_outage_the_backlog_may_take_the_spill_paths_time_but_a_frozen_fragment_fails():
    """The store down 6..8 s (steps 60..80 at 0.1 s): the learners' held and resent answers reach the
    syncer at once when it is back, so the first round merge may come up to SPILL_PATH_GAP_S after
    the recovery's 4H steps; a fragment that stays unmerged longer is still frozen."""
    inputs, deltas = _healthy(steps=240)
    marks = [{"t": 6.0, "who": "s3", "what": "down", "detail": ""}, {"t": 8.0, "who": "s3", "what": "up", "detail": ""}]
    events = {"l0": _events("l0", 239, deltas)}

    def merged(resume_step: int):
        kept = [i for i in inputs if i.learner_step < 60 or i.learner_step >= resume_step]
        # the first commit after the store is back: a round-less merge of another fragment at 8.1 s
        flush = CommitRecord(seq=999, epoch=1, kind="merge", fragment=1, version=1, inputs=(), round=-1,
                             info={"committed_at": 8.1})
        return [_merge(k, 0, i.round, i) for k, i in enumerate(kept)] + [flush]

    # blind until 8.1 s, + 4H steps (2.4 s): 10.5 s; the next round merge at ~12.0 s is 1.5 s later
    late = progress.fragment_progress(_obs(merged(119), events, marks), H, 2)
    assert late.ok, late.detail
    frozen = progress.fragment_progress(_obs(merged(160), events, marks), H, 2)   # ~16 s: 5.5 s later
    assert not frozen.ok and "fragment 0: no merge between rounds" in frozen.detail, frozen.detail


def test_utilisation_recovers_only_when_merges_resume_at_the_old_level():
    inputs, deltas = _healthy(steps=240)
    records = [_merge(k, 0, i.round, i) for k, i in enumerate(inputs)]
    events = {"l0": _events("l0", 239, deltas)}
    marks = [{"t": 6.0, "who": "syncer", "what": "kill", "detail": ""},
             {"t": 8.0, "who": "syncer", "what": "restart", "detail": ""}]
    ok = progress.utilisation_recovers(_obs(records, events, marks), H, 1, overlap=1)
    assert ok.ok and ok.data["windows"], ok.detail
    # after the fault (step 80) merges resume, but only every third answer: utilisation a third of before
    sparse = [r for r in records if r.inputs[0].learner_step < 80 or r.seq % 3 == 0]
    bad = progress.utilisation_recovers(_obs(sparse, events, marks), H, 1, overlap=1)
    assert not bad.ok and "a lasting loss" in bad.detail, bad.detail       # the settled level never came back
    # ... unless fewer than K learners trained then (a learner killed for good in a K = 2 run): no level
    short = progress.utilisation_recovers(_obs(sparse, events, marks), H, 1, overlap=1, short=[(8.0, 30.0)])
    assert "a lasting loss" not in short.detail, short.detail
    # only the 4H..8H steps after the fault (ended at step 85: recovered 0.5 s after the restart) low,
    # the level back after them: a slow recovery, judged against the lower of the two levels
    slow = [r for r in records if not 85 + 4 * H <= r.inputs[0].learner_step < 85 + 8 * H or r.seq % 3 == 0]
    late = progress.utilisation_recovers(_obs(slow, events, marks), H, 1, overlap=1)
    assert not late.ok and "undisturbed" in late.detail and "lasting" not in late.detail, late.detail


def test_a_run_that_settles_lower_after_a_fault_is_judged_against_its_settled_level():
    """Learners that start together answer in the same step of the syncer's clock until a fault,
    and at different ones after it (the grace window then waits for the later one): a level a
    run never returns to, fault or not. The window 4H..8H after the fault is held to the lower of
    the two calm levels; the level after is held to the one before within twice the tolerance."""
    pre, pre_d = _healthy(steps=60, tau=0)            # every step carried: 1.0
    post, post_d = _healthy(steps=240, tau=1)         # 5 of 6 steps carried ...

    def thinned(i, k):                                # ... and every other answer one fewer: 0.75
        return dataclasses.replace(i, c_steps=i.c_steps - 1) if k % 2 else i
    after = [thinned(i, k) for k, i in enumerate(i for i in post if i.learner_step - i.c_steps + 1 >= 60)]
    events = {"l0": _events("l0", 239, pre_d + [d for d in post_d if d[3] >= 60])}
    marks = [{"t": 6.0, "who": "syncer", "what": "kill", "detail": ""},
             {"t": 8.0, "who": "syncer", "what": "restart", "detail": ""}]

    def judge(inputs):
        return progress.utilisation_recovers(_obs([_merge(k, 0, i.round, i) for k, i in enumerate(inputs)],
                                                  events, marks), H, 1, overlap=0)
    ok = judge(pre + after)
    assert ok.ok and abs(ok.data["windows"][0]["undisturbed"] - 0.75) < 0.01, ok.detail   # not the early 1.0
    worse = [dataclasses.replace(i, c_steps=1) if k % 2 else i for k, i in enumerate(after)]
    assert "a lasting loss" in judge(pre + worse).detail      # settled at ~0.5: more than 2 x 1/H below 1.0


def test_the_undisturbed_level_never_asks_more_than_the_overlap_allows():
    """Early in a run the grace window, not yet calibrated, spends less of the tau-step overlap and
    versions come back sooner (real runs: 0.87-0.91 before the first fault, 0.79-0.83 after, fault or
    not). The reference is capped at (H - tau)/H; a real loss after the fault still fails."""
    pre, pre_d = _healthy(steps=80, tau=0)            # every step carried: 1.0
    post, post_d = _healthy(steps=240, tau=2)         # 2 of H = 6 steps lost a round: 0.67, tau = 2's promise
    inputs = pre + [i for i in post if i.learner_step - i.c_steps + 1 >= 80]
    deltas = pre_d + [d for d in post_d if d[3] >= 80]
    events = {"l0": _events("l0", 239, deltas)}
    marks = [{"t": 6.0, "who": "syncer", "what": "kill", "detail": ""},
             {"t": 8.0, "who": "syncer", "what": "restart", "detail": ""}]

    # Judged on the run up to step 150, so that there is no settled stretch after the fault's
    # recovery (ended at step 85, + 8H) for the level to come from instead: the early stretch alone.
    short_events = {"l0": _events("l0", 149, [d for d in deltas if d[3] < 150])}

    def judge(kept, overlap):
        return progress.utilisation_recovers(_obs([_merge(k, 0, i.round, i) for k, i in enumerate(kept)
                                                   if i.learner_step < 150], short_events, marks),
                                             H, 1, overlap=overlap)
    assert not judge(inputs, 0).ok                    # uncapped: held to the early stretch's 1.0
    capped = judge(inputs, 2)
    assert capped.ok and capped.data["windows"][0]["undisturbed"] == round(4 / 6, 3), capped.detail
    lossy = [i for i in inputs if i.learner_step < 80 or i.seq % 2]     # every other answer lost after the fault
    assert not judge(lossy, 2).ok


def test_a_learner_faults_recovery_is_judged_against_the_other_learners_over_the_same_time():
    """A burst of other work on a small machine lowers every learner's utilisation at once: after
    l1's pause, a window where l0 is as low as l1 is the machine, not the fault; l1 alone low is."""
    recs, evs = {}, {}
    for name in ("l0", "l1"):
        inputs, deltas = _healthy(name, steps=240)
        recs[name], evs[name] = inputs, _events(name, 239, deltas)
    marks = [{"t": 6.0, "who": "l1", "what": "pause", "detail": ""},
             {"t": 8.0, "who": "l1", "what": "resume", "detail": ""}]
    window = range(80 + 4 * H, 80 + 8 * H)         # l1's steps 4H..8H after its pause ended (step 80)

    def run(thin: set[str]):
        kept = [i for n, inputs in recs.items() for i in inputs
                if not (n in thin and i.learner_step in window and i.seq % 3)]
        records = [_merge(k, 0, i.round, i) for k, i in enumerate(sorted(kept, key=lambda i: i.learner_step))]
        return progress.utilisation_recovers(_obs(records, evs, marks), H, 1, overlap=1)

    assert run(set()).ok
    alone = run({"l1"})                           # only the paused learner stays low: a slow recovery
    assert not alone.ok and "l1/1" in alone.detail, alone.detail
    both = run({"l0", "l1"})                      # both low over the same seconds: the machine
    assert both.ok, both.detail
    row = next(w for w in both.data["windows"] if w["life"] == "l1/1")
    assert row["control_drop"] > 0.3


def test_a_restarted_learners_fault_lasts_until_its_new_life_steps():
    """A restarted learner imports and loads for seconds before its first step, taking the CPU the
    others' versions need on a small machine: its fault ends at that step, not at the start mark."""
    first_life = _events("l1", 50)                                   # steps 10..50 at 1..5 s
    second = _events("l1", 40, t0=11.0, inc=2)                       # first step event at 12.0 s
    marks = [{"t": 6.0, "who": "l1", "what": "kill", "detail": ""},
             {"t": 8.0, "who": "l1", "what": "restart", "detail": ""},
             {"t": 9.0, "who": "l0", "what": "pause", "detail": ""},
             {"t": 9.5, "who": "l0", "what": "resume", "detail": ""}]
    obs = _obs([], {"l1": first_life + second, "l0": _events("l0", 200)}, marks)
    assert progress.fault_windows(obs) == [(6.0, 12.0), (9.0, 9.5)]
    never = _obs([], {"l1": first_life}, marks[:2])                  # restarted, never stepped: the mark
    assert progress.fault_windows(never) == [(6.0, 8.0)]
