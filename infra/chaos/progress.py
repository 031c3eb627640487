"""Progress invariants (SPEC §11 "Progress"): not whether the books balance, but whether every
live learner's work keeps reaching the model. The bookkeeping checks (invariants.py) passed while a
restarted syncer's runaway clock made every learner stop answering; these do not.

All five are functions of what a run left behind - the commit log and the learners' event logs
(``invariants.Observation``) - and of the run's H (``sync_every``) and K (``quorum``):

- ``learner_progress`` (a): every learner life's work reaches the model at least once per 2H of its
  own steps. A merged delta holding ``c_steps`` steps up to learner step ``s`` carries the work of
  own steps ``s - c_steps + 1 .. s`` (a delta is cumulative since its base, SPEC §3); the longest
  run of a life's steps that no merged delta carries must stay <= 2H. Healthy, that run is the
  tau steps between an answer and the version's arrival (SPEC §3). Exempt: the steps after the last
  merged delta of a life the harness SIGKILLed (lost with the process, counted by the ledger).
  A learner the harness paused takes no steps while paused, so its pauses cost it nothing here.
- ``fragment_progress`` (b): no fragment goes more than 2H steps between merges while learners
  answer it, counted in the steps the learners that answered it inside the gap took (not in round
  ids: see the function) - a frozen fragment, answers nobody merged. Steps while no merge can
  happen by design (the syncer down and recovering, the S3 server down: ``blind_windows``) do not
  count; what the learners did meanwhile must then reach the model, which (a) checks.
- ``utilisation_recovers`` (c): after each fault ends, each learner's utilisation - the share of its
  own steps whose work a merged delta of each fragment carries, averaged over the fragments (tokens
  merged / tokens trained, at a fixed batch) -
  over the 4H steps that start 4H steps after the fault ended is within 10 points (``tolerance``)
  of its undisturbed level (the same share over its steps outside every fault and its recovery,
  never above the (H - tau)/H the design promises: the adaptive grace window may spend the
  tau-step overlap at any time, SPEC §3-4). Points, not a ratio, and never less than 1/H (a round
  loses a whole number of steps, so a window's share moves in quanta of 1/H as the learner's steps
  drift against the global clock): a healthy window moves by about that, while a frozen fragment
  of P costs 1/P of the level and a stopped learner all of it.
- ``drops_truthful`` (d) and ``quorum_minimum`` (e), in infra/chaos/truthful.py: every drop named
  and counted lost or harmless truthfully, both ways; no merge of fewer than K learners.
"""
from __future__ import annotations

import bisect
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Sequence

from pipeline.types import CommitRecord
from .invariants import Check, Observation, _lives_of, _minus
from .truthful import drops_truthful, evicted_deltas, produced_bases, quorum_minimum  # noqa: F401  (d), (e): run and re-exported here

REPAIRS = ("resume", "restart", "restore", "up", "heal", "start")   # a mark that ends a fault (its ``what``)
FAULTS = ("pause", "kill", "blackhole", "down", "partition", "slow", "skew")
INSTANT = ("rogue", "kill-agent")     # over when done: bad input sent, a sync agent the learner replaces itself


@dataclass(frozen=True)
class Life:
    """One learner life as its event log tells it."""

    learner: str
    incarnation: int
    started: float                   # its learner-start time
    steps: tuple[tuple[float, int], ...]   # (t, step) of its step events, in order
    last_step: int                   # the last step it took (from its stop or its last step event)
    killed: bool


def lives(obs: Observation) -> list[Life]:
    out = []
    for lid, events in sorted(obs.learner_events.items()):
        for life in _lives_of(events):
            start = next(e for e in life if e.get("event") == "learner-start")
            steps = tuple((e["t"], int(e["step"])) for e in life if e.get("event") == "step")
            stop = next((e for e in life if e.get("event") == "learner-stop"), None)
            produced = [int(e.get("step", 0)) for e in life if e.get("event") == "delta"]
            last = max([s for _, s in steps] + produced + ([int(stop["step"]) - 1] if stop else []) + [0])
            out.append(Life(lid, int(start.get("incarnation", -1)), float(start["t"]), steps, last,
                            bool(obs.process_of(lid, life).get("killed", False))))
    return out


def carried(records: Iterable[CommitRecord], learner: str, incarnation: int,
            fragment: int | None = None) -> list[tuple[int, int]]:
    """The own-step intervals [lo, hi] whose work merged deltas of this learner life carry (of one
    fragment, or of any), as disjoint sorted intervals."""
    spans = sorted((max(0, i.learner_step - i.c_steps + 1), i.learner_step) for r in records if r.kind == "merge"
                   and (fragment is None or r.fragment == fragment)
                   for i in r.inputs if i.learner == learner and i.incarnation == incarnation and i.c_steps > 0)
    out: list[list[int]] = []
    for lo, hi in spans:
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(a, b) for a, b in out]


def _covered(spans: Sequence[tuple[int, int]], lo: int, hi: int) -> int:
    """How many of the steps lo..hi (inclusive) the spans carry."""
    return sum(max(0, min(b, hi) - max(a, lo) + 1) for a, b in spans)


def _uncovered_runs(spans: Sequence[tuple[int, int]], last: int, tail: bool) -> list[tuple[int, int]]:
    """Runs of steps 0..last no span carries; without ``tail`` the run after the last span is left out."""
    runs, at = [], 0
    for a, b in spans:
        if a > at:
            runs.append((at, min(a - 1, last)))
        at = max(at, b + 1)
        if at > last:
            break
    if tail and at <= last:
        runs.append((at, last))
    return [(a, b) for a, b in runs if b >= a]


# -- (a) -------------------------------------------------------------------------------------------

def learner_progress(obs: Observation, H: int, K: int = 1) -> Check:
    """(a). A run of steps that overlaps a time no merge could happen is exempt: fewer than K
    learners training (``short_of_quorum``; e.g. the last learner still training at the end), or a
    fault's blind window (``blind_windows``, as (b) uses: e.g. an S3 outage until the first commit
    after it - a learner's steps there are overwritten by the versions that follow when the
    post-outage commits come late, seen in tests/test_chaos.py test_s3_outage: 34 steps)."""
    bound = 2 * H
    short = short_of_quorum(obs, K) + blind_windows(obs)
    worst: dict[str, dict] = {}
    problems = []
    for life in lives(obs):
        name = f"{life.learner}/{life.incarnation}"
        spans = carried(obs.records, life.learner, life.incarnation)
        runs = [r for r in _uncovered_runs(spans, life.last_step, tail=not life.killed)
                if not _during(life, r, short)]
        longest = max(runs, key=lambda r: r[1] - r[0], default=None)
        n = 0 if longest is None else longest[1] - longest[0] + 1
        worst[name] = {"longest_uncarried_steps": n, "at": list(longest) if longest else None,
                       "steps": life.last_step + 1, "carried": _covered(spans, 0, life.last_step)}
        if n > bound:
            problems.append(f"{name}: own steps {longest[0]}..{longest[1]} ({n} steps) reached the model in no "
                            f"merged delta (bound 2H = {bound})")
    if not worst:
        problems.append("no learner life to judge")
    detail = problems[0] if problems else "longest run of own steps no merge carried: " + ", ".join(
        f"{k} {w['longest_uncarried_steps']}" for k, w in worst.items()) + f" (bound 2H = {bound})"
    return Check("progress-learners", not problems, detail, {"bound_steps": bound, "per_life": worst,
                                                            "violations": problems[:10]})


def _during(life: Life, run: tuple[int, int], windows: Sequence[tuple[float, float]]) -> bool:
    """Whether the wall time of the life's steps ``run`` overlaps any of ``windows``."""
    if not windows or not life.steps:
        return False
    times = [t for t, _ in life.steps]
    steps = [st for _, st in life.steps]
    lo = times[max(0, bisect.bisect_right(steps, run[0]) - 1)]
    hi = times[min(len(times) - 1, bisect.bisect_left(steps, run[1]))]
    return any(a < hi and b > lo for a, b in windows)


# -- (b) -------------------------------------------------------------------------------------------

def global_period(obs: Observation) -> float:
    """The global step's length in seconds as the syncer's clock sets it (SPEC §2, rounds.py): the
    median over learner lives of each one's median step-to-step time (from its step events)."""
    periods = []
    for life in lives(obs):
        rates = [(t1 - t0) / (s1 - s0) for (t0, s0), (t1, s1) in zip(life.steps, life.steps[1:]) if s1 > s0]
        if rates:
            periods.append(statistics.median(rates))
    return statistics.median(periods) if periods else 0.0


def fragment_progress(obs: Observation, H: int, fragments: int, K: int = 1) -> Check:
    """(b): between two merges of a fragment, and after its last one, at most 2H global steps while
    learners answer it. Global steps are round ids (a round's id is the global step it opened at),
    so the gap is the difference of the merged rounds' ids: H when every round merges, 2H when one
    was replaced - free of the jitter of commit times, which a bound in seconds alone would judge
    (0.53 s for 24 steps of 22 ms tripped it). A gap counts only if learners answered a round inside
    it (in round ids and in time), and if its commits' time span, without the ``blind_windows`` (no merge is possible by design)
    extended by the 4H global steps of recovery that (c) grants and the times fewer than K learners
    train (``short_of_quorum``), still lasts more than 2H global steps (``global_period``), or, if
    it overlaps a bus blackhole, a blind window or the 4H steps after either, more than
    ``SPILL_PATH_GAP_S``."""
    bound = 2 * H
    period = global_period(obs)
    # (time, round) of every answer: a gap counts an answer given inside it in time as well as in
    # round ids - a learner that answered round 268 of the *dead* syncer's extrapolated clock 3 s
    # earlier did not answer the new syncer's round 268 (a gap its stall made was judged frozen).
    answered: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for events in obs.learner_events.values():
        for e in events:
            if e.get("event") == "delta" and isinstance(e.get("fragment"), int) and isinstance(e.get("round"), int):
                answered[int(e["fragment"])].append((float(e["t"]), int(e["round"])))
    end = max((e["t"] for ev in obs.learner_events.values() for e in ev), default=0.0)
    blind = [(a, b + 4 * H * period) for a, b in blind_windows(obs)] + short_of_quorum(obs, K)
    # ... and the 4H global steps after its restore, when the bytes the link held arrive at once
    # (as TCP delivers them after a partition heals) and the syncer checks and acks each (0.61 s
    # between two merges of a fragment at 20 ms steps beside two busy loops: a clean-clone CI run)
    # The same after a store outage or a syncer's restart: the answers the learners held, resent and
    # spilled meanwhile arrive at once and are checked, merged or dropped as superseded first (a CI
    # s3-outage run at 20 ms steps: 1.8 s from the first commit after the store came back to
    # fragment 0's next round merge, through 3 backlog merges and 22 superseded drops).
    holes = [(a, b + 4 * H * period) for a, b in bus_down(obs) + blind_windows(obs)]
    problems, per = [], {}
    for p in range(fragments):
        merges = sorted((r.round, float(r.info.get("committed_at") or 0.0)) for r in obs.merges()
                        if r.fragment == p and r.round >= 0)
        asked = sorted(answered.get(p, []))
        top = max((r for _, r in asked), default=-1)
        worst = 0
        tail = (top + 1, end) if asked and merges and top >= merges[-1][0] else None
        for (r1, t1), (r2, t2) in zip(merges, merges[1:] + ([tail] if tail else [])):
            if r2 - r1 <= bound or not any(r1 < r < r2 and t1 < t < t2 for t, r in asked):
                continue
            allowed = bound * period
            if any(a < t2 and b > t1 for a, b in holes):
                allowed = max(allowed, SPILL_PATH_GAP_S)   # the spill path's cadence, or the held bytes' flood
            if _seen(t1, t2, blind) <= allowed:
                continue      # most of it was a time no merge could happen: a fault, its recovery
            worst = max(worst, r2 - r1)
            problems.append(f"fragment {p}: no merge between rounds {r1} and {r2 if tail is None or (r2, t2) != tail else 'the end'} "
                            f"({r2 - r1} global steps; bound 2H = {bound}) while learners answered rounds in between")
        per[str(p)] = {"merges": len(merges), "answers": len(asked), "worst_gap_steps": worst}
        if not merges and asked:
            problems.append(f"fragment {p}: learners answered {len(asked)} rounds and none was merged")
    # The global step itself must keep the learners' pace (SPEC §2): a clock that runs away (a
    # restarted syncer that read its inbox backlog's spacing as a period ran 13x fast) turns every
    # gap into a burst of rounds no learner could answer in time, which the time filter above hides.
    timed = sorted((float(r.info["committed_at"]), r.round) for r in obs.merges()
                   if r.round >= 0 and r.info.get("committed_at") is not None)
    if len(timed) >= 2 and period > 0 and timed[-1][0] - timed[0][0] >= 8 * H * period:   # bursts average out
        rate = (timed[-1][1] - timed[0][1]) / (timed[-1][0] - timed[0][0])
        per["clock"] = {"rounds_per_s": round(rate, 2), "learner_steps_per_s": round(1 / period, 2)}
        if rate > 2.0 / period:
            problems.append(f"the global clock ran {rate * period:.1f}x the learners' pace ({rate:.1f} global steps/s "
                            f"against one step per {period * 1000:.0f} ms)")
    return Check("progress-fragments", not problems, problems[0] if problems else
                 f"every fragment merged at least every 2H = {bound} global steps while answered",
                 {"bound_steps": bound, "global_step_s": round(period, 5), "per_fragment": per,
                  "violations": problems[:10]})


def _seen(a: float, b: float, blind: Sequence[tuple[float, float]]) -> float:
    """Seconds of (a, b) outside the ``blind`` windows."""
    pieces = [(a, b)]
    for cut in blind:
        pieces = [q for piece in pieces for q in _minus(piece, cut)]
    return sum(y - x for x, y in pieces)


def _restarted(obs: Observation, who: str, t: float) -> bool:
    """Whether syncer ``who`` was started again after its exit at ``t`` (a crash and its restart,
    not the run's end or a fenced syncer's exit 3)."""
    return any(m["who"] == who and m["what"] == "start" and m["t"] > t for m in obs.marks)


def short_of_quorum(obs: Observation, K: int) -> list[tuple[float, float]]:
    """When fewer than K learner lives were training (start to last step, minus their pauses):
    nothing can merge then by design (SPEC §4: K is a minimum). With K = 1 that is when nobody
    trains - e.g. after every learner's last step, while the syncer holds their closing answers
    as late ones (they wait up to 2H global steps for a round: infra/faultsim found it)."""
    spans = []
    for life in lives(obs):
        if life.steps:
            pieces = [(life.started, life.steps[-1][0])]
            for cut in obs.pauses(life.learner):
                pieces = [q for piece in pieces for q in _minus(piece, cut)]
            spans += pieces
    edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    out, alive, since = [], 0, -math.inf
    for t, d in edges:
        before = alive
        alive += d
        if before >= K > alive:
            since = t
        elif before < K <= alive:
            out.append((since, t))
            since = None
    if since is not None and alive < K:
        out.append((since, math.inf))
    return [(a, b) for a, b in out if b > a]


BUS_FALLBACK_S = 4.0   # bus gone: rounds from the storage clock after 1 s (receiver.py), answers spill after the ack timeout
# Once learners spill, a fragment merges at the spill path's cadence, not every round: a learner reads
# the round clock every poll (0.5 s) and the syncer lists its inbox every 0.5 s (0.72 s between two
# merges of a fragment measured at 20 ms steps, 36 global steps: tests/test_chaos.py bus-blackhole).
SPILL_PATH_GAP_S = 2.0


def bus_down(obs: Observation) -> list[tuple[float, float]]:
    """When the bus was blackholed (its marks), to its restore (or forever)."""
    out, hole = [], None
    for m in obs.marks:
        if m["who"] == "bus" and m["what"] == "blackhole":
            hole = m["t"] if hole is None else hole
        elif m["who"] == "bus" and m["what"] == "restore" and hole is not None:
            out.append((hole, m["t"]))
            hole = None
    return out + ([(hole, math.inf)] if hole is not None else [])


def blind_windows(obs: Observation, after_repair_s: float = 10.0) -> list[tuple[float, float]]:
    """When no merge can happen by design: from a syncer fault (its kill, its crash, a second
    syncer's start) until the next ``syncer-recovered``; from a store fault (down, slow, full) until
    the first commit after its repair, at most ``after_repair_s`` after it; a syncer's pause until
    its resume (SIGSTOPped, it merges nothing: infra/faultsim pauses syncers); and the first
    ``BUS_FALLBACK_S`` of a bus blackhole, until the learners hear rounds from storage and spill
    their answers (the slower path)."""
    recovered = sorted(e["t"] for ev in obs.syncer_events.values() for e in ev if e.get("event") == "syncer-recovered")
    commits = sorted(float(r.info["committed_at"]) for r in obs.records if r.info.get("committed_at") is not None)
    out, down, hole, paused = [], None, None, {}
    for m in obs.marks:
        who, what, t = m["who"], m["what"], m["t"]
        if who.startswith("syncer") and what == "pause":
            paused.setdefault(who, t)
        elif who.startswith("syncer") and what == "resume" and who in paused:
            out.append((paused.pop(who), t))
        elif who == "s3" and what in ("down", "slow", "full"):
            down = t if down is None else down
        elif who == "s3" and what in ("up", "restore") and down is not None:
            nxt = [c for c in commits if c > t]
            out.append((down, min(nxt[0], t + after_repair_s) if nxt else t + after_repair_s))
            down = None
        elif who == "bus" and what == "blackhole":
            hole = t
        elif who == "bus" and what == "restore" and hole is not None:   # not a learner's or the store's restore
            out.append((hole, min(t, hole + BUS_FALLBACK_S)))
            hole = None
        elif who.startswith("syncer") and (what == "kill" or what == "exit" and _restarted(obs, who, t)
                                           or (what == "start" and recovered and t > recovered[0])):
            # until the syncer is back, however long its recovery took (over a slow store it read
            # the log at 0.3-0.4 s a request for half a minute: seeds 407 and 932 of the simulation)
            nxt = [r for r in recovered if r > t]
            out.append((t, nxt[0] if nxt else math.inf))
    return out


# -- (c) -------------------------------------------------------------------------------------------

def fault_windows(obs: Observation) -> list[tuple[float, float]]:
    """(start, end) wall times of every fault (``targeted_faults`` without the targets)."""
    return [(a, b) for a, b, _ in targeted_faults(obs)]


def targeted_faults(obs: Observation) -> list[tuple[float, float, str]]:
    """(start, end) wall times of every fault the harness applied, from its timeline: a fault mark to
    the next repair mark of the same target (a kill without restart ends at the kill). A learner
    started again ends its fault at its new life's first step, not at the start mark: until then
    it imports and loads, seconds of both cores on a busy 2-core machine, which slows the other
    learners' versions (a CI run: 0.76 utilisation against 0.88 while a restarted learner took
    3.6 s to its first step)."""
    out, open_at = [], {}
    for m in obs.marks:
        who, what = m["who"], m["what"]
        if what in INSTANT:
            out.append((m["t"], m["t"], who))
        elif what.startswith(FAULTS) and what != "start":
            open_at.setdefault(who, m["t"])
        elif what.startswith(REPAIRS) and who in open_at:
            until = m["t"]
            if what in ("restart", "start"):      # a learner's new life: its first step (a syncer has none)
                until = next((float(e["t"]) for e in obs.learner_events.get(who, ())
                              if e.get("event") == "step" and float(e["t"]) >= m["t"]), until)
            out.append((open_at.pop(who), until, who))
    end = max((m["t"] for m in obs.marks), default=0.0)
    out += [(t, end if not obs.marks else max(t, end), who) for who, t in open_at.items()]
    return sorted(out)


def _step_at(life: Life, t: float) -> int | None:
    """The life's step at wall time ``t`` (interpolated between step events; None outside them)."""
    if not life.steps or t < life.steps[0][0] or t > life.steps[-1][0]:
        return None
    k = bisect.bisect_left([x for x, _ in life.steps], t)
    if life.steps[k][0] == t or k == 0:
        return life.steps[k][1]
    (t0, s0), (t1, s1) = life.steps[k - 1], life.steps[k]
    return int(s0 + (s1 - s0) * (t - t0) / max(t1 - t0, 1e-9))


def _level(obs: Observation, life: Life, faults: Sequence[tuple[float, float]], H: int, fragments: int,
           overlap: int, short: Sequence[tuple[float, float]] = ()):
    """(share(lo, hi), undisturbed level or None, last step that may start a window, (level before
    the first fault, level after the last) or None) of ``life``.

    The level is capped at (H - tau)/H, what SPEC §3 promises a healthy round loses (the tau steps
    between an answer and its version). Early in a run the adaptive grace window has not yet
    learned the step and sync times and spends less than the overlap allows, so versions come back
    a step sooner than later on: measured in the bad-input scenario (H = 12, tau = 2), grace 9 ms
    then 27 ms from step 80 on, answer-to-version 2.6-3.0 steps then 3.2-4.7, a pre-fault level of
    0.87-0.91 against 0.79-0.83 for the rest of the run, fault or not. A level taken from that
    early stretch held the rest of the run to a standard the policy is allowed to spend.

    Nor do learners that start together stay in step: until a fault they answer each round in the
    same step of the syncer's clock, after it at different ones, and the grace window waits for the
    later one (the answer spread, workers/syncer/rounds.py). Measured in the s3-outage scenario
    beside two busy loops: median grace 15 ms before the outage, 29-35 ms from 3 s after it to the
    end of the run, utilisation 0.77 before and 0.62-0.65 for the whole rest of the run, every
    window alike. So where a life has both, its level is the lower of the two calm stretches'
    (before the first fault and after the last one's recovery, each at least 4H steps), and the
    stretch after is held to the one before within twice the tolerance (``utilisation_recovers``):
    a fault whose damage lasts (a learner whose every other answer is lost from then on) still
    shows, as a level that never comes back rather than a slow recovery. Steps taken while fewer
    than K learners trained (``short``) are no level at all: nothing can merge then by design.
    """
    per = [carried(obs.records, life.learner, life.incarnation, p) for p in range(fragments)]

    def share(lo: int, hi: int) -> float:
        return sum(_covered(sp, lo, hi) for sp in per) / (len(per) * (hi - lo + 1))

    end = life.last_step - 2 * H          # the life's last 2H steps are its tail, not a level
    disturbed = []
    for a, b in faults:
        sa, sb = _step_at(life, a), _step_at(life, b)
        if sa is None and sb is None:
            continue
        disturbed.append((sa if sa is not None else 0, (sb if sb is not None else life.last_step) + 8 * H))
    calm = [s for s in range(2 * H, max(end, 0)) if not any(x <= s <= y for x, y in disturbed)]
    if short:
        calm = [s for s in calm if not any(a <= (_wall(life, s) or -math.inf) <= b for a, b in short)]
    cap = (H - overlap) / H

    def level(steps: Sequence[int]) -> float | None:
        return min(sum(share(x, x) for x in steps) / len(steps), cap) if len(steps) >= 4 * H else None

    before = level([x for x in calm if x < min((x for x, _ in disturbed), default=end)])
    after = level([x for x in calm if x > max((y for _, y in disturbed), default=-1)])
    if before is not None and after is not None:
        return share, min(before, after), end, (before, after)
    return share, before if before is not None else after if after is not None else level(calm), end, None


def _wall(life: Life, step: int) -> float | None:
    """Wall time at which ``life`` took ``step`` (interpolated; None outside its step events)."""
    pts = life.steps
    if not pts or step < pts[0][1] or step > pts[-1][1]:
        return None
    k = bisect.bisect_left([s for _, s in pts], step)
    if pts[k][1] == step or k == 0:
        return pts[k][0]
    (t0, s0), (t1, s1) = pts[k - 1], pts[k]
    return t0 + (t1 - t0) * (step - s0) / max(s1 - s0, 1)


def _control_drop(life: Life, window: tuple[int, int], levels: dict, every: Sequence[Life]) -> float | None:
    """The mean drop below their own levels of the other learners' lives over the wall time of
    ``life``'s steps ``window`` (None: no such life)."""
    t0, t1 = _wall(life, window[0]), _wall(life, window[1])
    if t0 is None or t1 is None:
        return None
    drops = []
    for other in every:
        if other.learner == life.learner:
            continue
        share, level, end, _ = levels[id(other)]
        lo, hi = _step_at(other, t0), _step_at(other, t1)
        if level is None or lo is None or hi is None or hi <= lo or hi > end:
            continue
        drops.append(level - share(lo, hi))
    return statistics.fmean(drops) if drops else None


def utilisation_recovers(obs: Observation, H: int, fragments: int, *, overlap: int, tolerance: float = 0.10,
                         short: Sequence[tuple[float, float]] = ()) -> Check:
    """(c): a step's work on fragment p reaches the model only in a merged delta of p, so a life's
    utilisation over some steps is the mean over fragments of the share of those steps carried.

    After a fault of one learner (paused, killed, slowed) the other learners are a control: over
    the same wall-time window their utilisation moves with the machine (a burst of other work on a
    small machine delays every version by steps), so each life's window is judged against its level
    less the others' mean drop - the faulted learner's slow recovery still shows, as it alone is low
    (a pause that stopped everyone's merges is (a) and (b)'s to catch). A fault of the syncer, the
    store or the bus touches every learner and has no control."""
    faults = targeted_faults(obs)
    if not faults:
        return Check("progress-recovery", True, "no fault in this run", {"faults": 0})
    # A syncer or store fault ends when merging can resume (the syncer recovered, the store's first
    # commit after it is up: ``blind_windows``), not at its repair mark (a restarted syncer still
    # imports and recovers for seconds).
    blind = blind_windows(obs)
    faults = [(a, max([b] + [y for x, y in blind if x <= b <= y or a <= x <= b]), who) for a, b, who in faults]
    period = global_period(obs)
    every = lives(obs)
    levels = {id(life): _level(obs, life, [(a, b) for a, b, _ in faults], H, fragments, overlap, short)
              for life in every}
    learners = {life.learner for life in every}
    problems, measured = [], []
    for life in every:
        share, level, end, stretches = levels[id(life)]
        if level is None:
            continue                            # no undisturbed stretch long enough to be a level
        if stretches is not None and stretches[1] < stretches[0] - 2 * max(tolerance, 1.0 / H):
            problems.append(f"{life.learner}/{life.incarnation}: utilisation {stretches[1]:.2f} after the faults "
                            f"settled vs {stretches[0]:.2f} before them (a lasting loss, beyond "
                            f"{2 * max(tolerance, 1.0 / H):.2f})")
        for a, b, who in faults:
            sb = _step_at(life, b)
            if sb is None:
                continue
            lo, hi = sb + 4 * H, sb + 8 * H - 1
            # another fault on, or recovering (its own 4H grace and 4H window), during this window
            others = [(x, y + 8 * H * period) for x, y, _ in faults if (x, y) != (a, b)]
            if hi > end or _during(life, (lo, hi), list(short) + others):
                continue    # the life ended first, fewer than K trained, or another fault was on: no level to expect
            got = share(lo, hi)
            drop = _control_drop(life, (lo, hi), levels, every) if who in learners else None
            expect = level - max(drop or 0.0, 0.0)
            measured.append({"life": f"{life.learner}/{life.incarnation}", "fault_end_step": sb,
                             "window": [lo, hi], "utilisation": round(got, 3), "undisturbed": round(level, 3),
                             "levels": None if stretches is None else [round(x, 3) for x in stretches],
                             "control_drop": None if drop is None else round(drop, 3)})
            # A round loses a whole number of a learner's steps (answer to version), so a window's
            # share moves in quanta of 1/H as the learner's steps drift against the global clock
            # (seen: 5 of 6 steps carried per round for 60 steps, then 4 for 30, no fault between):
            # the tolerance is never finer than one step per round.
            if got < expect - max(tolerance, 1.0 / H):
                problems.append(f"{life.learner}/{life.incarnation}: utilisation {got:.2f} over own steps {lo}..{hi} "
                                f"(4H after the fault that ended at step {sb}) vs {level:.2f} undisturbed"
                                + (f", {drop:.2f} lower for the other learners then" if drop else ""))
    detail = problems[0] if problems else (
        f"{len(measured)} post-fault windows, each within {max(tolerance, 1.0 / H):.2f} of its learner's undisturbed level"
        if measured else "no post-fault window inside a learner life (the run ended first)")
    return Check("progress-recovery", not problems, detail, {"faults": len(faults), "windows": measured[:40],
                                                            "violations": problems[:10]})


def progress_checks(obs: Observation, H: int, K: int, fragments: int, overlap: int) -> list[Check]:
    """The five progress invariants of issue 25, in order (a)-(e); ``overlap`` is the run's tau."""
    return [learner_progress(obs, H, K), fragment_progress(obs, H, fragments, K),
            utilisation_recovers(obs, H, fragments, overlap=overlap, short=short_of_quorum(obs, K)),
            drops_truthful(obs.records, produced_bases(obs), evicted_deltas(obs)),
            quorum_minimum(obs.records, K)]
