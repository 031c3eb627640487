"""Run one chaos scenario end to end: start, inject the schedule, drain, check, report.

``run_scenario(scenario, out, seed)`` creates the run (``harness.ChaosRun``), starts the syncer and
learners, waits for the first merge commit (time 0 of the schedule), applies each ``Fault`` on time
(restarting, resuming and restoring after its duration), waits for the learners to finish and the
syncer to commit every durable delta, stops everything, then checks the invariants
(``invariants.py``, plus the scenario's extra checks below) and writes ``OUT/report.json`` and
``OUT/timeline.png`` (``report.py``). The result is the report as a dict; ``ok`` is true only if
every check held.
"""
from __future__ import annotations

import dataclasses
import heapq
import time
from pathlib import Path
from typing import Callable

from storage.layout import SPILL_PREFIX, VERSION_PREFIX, parse_spill_key
from workers.bus.bus import BusConfig
from . import invariants as inv
from . import progress
from .harness import ROGUE, ChaosRun, free_port
from .region_checks import REGION_CHECKS
from .report import write_report
from .scenarios import Fault, Scenario, draw_failures, faults_from_events

Check = inv.Check


# -- scenario-specific checks ---------------------------------------------------------------------

def _restarted_learner_merged(run: ChaosRun, obs: inv.Observation) -> Check:
    merged = {(i.learner, i.incarnation) for r in obs.merges() for i in r.inputs}
    missing = []
    for lid, events in obs.learner_events.items():
        incs = [e["incarnation"] for e in events if e.get("event") == "learner-start"]
        missing += [f"{lid}/{inc}" for inc in incs[1:] if (lid, inc) not in merged]
    restarted = sum(max(0, len([e for e in ev if e.get("event") == "learner-start"]) - 1)
                    for ev in obs.learner_events.values())
    ok = restarted > 0 and not missing
    return Check("restarted-learner-merged", ok, f"{restarted} restarted lives, not merged: {missing}" if not ok
                 else f"{restarted} restarted learner lives (new incarnations) each had deltas merged")


def _all_learners_merged(run: ChaosRun, obs: inv.Observation) -> Check:
    tokens: dict[str, int] = {}
    for r in obs.merges():
        for i in r.inputs:
            tokens[i.learner] = tokens.get(i.learner, 0) + i.c_tokens
    missing = [lid for lid in obs.learner_events if lid not in tokens]
    return Check("all-learners-merged", not missing, f"learners never merged: {missing}" if missing else
                 "merged tokens per learner: " + ", ".join(f"{k} {v}" for k, v in sorted(tokens.items())),
                 {"merged_tokens": tokens})


def _syncer_recovered(run: ChaosRun, obs: inv.Observation) -> Check:
    recovered = [e for ev in obs.syncer_events.values() for e in ev if e.get("event") == "syncer-recovered"]
    recovered.sort(key=lambda e: e["t"])
    if len(recovered) < 2:
        return Check("syncer-recovered", False, f"{len(recovered)} syncer start(s) logged; expected a restart")
    fence = recovered[-1]["fence_seq"]
    after = [r for r in obs.merges() if r.seq > fence]
    ok = bool(after) and fence > recovered[0]["fence_seq"]
    return Check("syncer-recovered", ok, f"restarted syncer replayed {recovered[-1]['replayed']} commits in "
                 f"{recovered[-1]['seconds']} s (from checkpoint {recovered[-1]['from_checkpoint']}), then "
                 f"committed {len(after)} merges", {"recoveries": len(recovered) - 1})


def _orphan_ignored(run: ChaosRun, obs: inv.Observation) -> Check:
    crashed = [life for life in obs.lives.get("syncer", []) if life["how"] == "exit 137"]
    named = {r.output_key for r in obs.records}
    orphans = [k for k in run.store.list(VERSION_PREFIX) if k not in named]
    ok = bool(crashed) and bool(orphans)
    return Check("orphan-ignored", ok, f"crashed lives {len(crashed)}, unnamed version objects {orphans[:3]}; "
                 "no commit names them and replay verified the log" if ok else
                 f"expected a syncer exit 137 and an orphan version (lives: {[l['how'] for l in obs.lives.get('syncer', [])]}, "
                 f"orphans: {orphans[:3]})")


def _fenced_once(run: ChaosRun, obs: inv.Observation) -> Check:
    first = obs.lives.get("syncer", [{}])[0]
    fenced = any(e.get("event") == "syncer-fenced" for e in obs.syncer_events.get("syncer", []))
    fences = [r for r in obs.records if r.kind == "fence"]
    last = fences[-1] if fences else None
    tail_epochs = {r.epoch for r in obs.records if last is not None and r.seq > last.seq}
    ok = first.get("how") == "exit 3" and fenced and len(fences) == 2 and tail_epochs <= {last.epoch}
    return Check("fenced-once", ok, f"first syncer: {first.get('how')}, fenced event {fenced}, fences "
                 f"{[(f.seq, f.epoch) for f in fences]}, epochs after the last fence {sorted(tail_epochs)}")


def _spilled_during_fault(run: ChaosRun, obs: inv.Observation) -> Check:
    spans = progress.bus_down(obs)
    spilled = {e["delta"] for ev in obs.learner_events.values() for e in ev if e.get("event") == "delta-spilled"
               and any(a <= e["t"] <= b for a, b in spans)}
    merged = sum(1 for r in obs.merges() if any(a <= (r.info.get("committed_at") or 0) <= b for a, b in spans))
    # What the fast path lost went through the inbox: every delta spilled during the blackhole is in
    # the log, merged or recorded. Merges *during* it are reported, not required: with few spills they
    # can land just after the restore on a loaded machine (the commit-gap bound covers liveness).
    named = {i.delta_id for r in obs.records for i in r.inputs}
    recorded = named | {d.delta_id for r in obs.records for d in r.dropped}
    ok = bool(spans) and bool(spilled) and spilled <= recorded
    return Check("spilled-during-fault", ok, f"during the blackhole: {len(spilled)} deltas spilled "
                 f"({len(spilled & named)} merged, {len(spilled - recorded)} not in the log), {merged} merges")


def _first_merge(run: ChaosRun) -> bool:
    """Whether the run has merged; a syncer that exited before that fails the scenario at once with
    its error, instead of after the 120 s wait (it once could not bind its bus port: CI, issue 25)."""
    if run.merges() > 0:
        return True
    life = run.cluster.life("syncer")
    if life.how and not life.killed:
        raise RuntimeError(f"the syncer exited ({life.how}) before the first merge commit: "
                           f"{run.cluster.stderr('syncer', 800).strip()}")
    return False


EXTRA_CHECKS: dict[str, Callable[[ChaosRun, inv.Observation], Check]] = {
    "restarted-learner-merged": _restarted_learner_merged, "all-learners-merged": _all_learners_merged,
    "syncer-recovered": _syncer_recovered, "orphan-ignored": _orphan_ignored, "fenced-once": _fenced_once,
    "spilled-during-fault": _spilled_during_fault, **REGION_CHECKS}


# -- running ----------------------------------------------------------------------------------------

class _Schedule:
    def __init__(self):
        self._q: list = []
        self._n = 0
        self.closing = False       # the run is over: repairs that wait on a condition do it now

    def add(self, at: float, what: str, fn: Callable[[], None]) -> None:
        heapq.heappush(self._q, (at, self._n, what, fn))
        self._n += 1

    def due(self, now: float) -> list[tuple[str, Callable[[], None]]]:
        out = []
        while self._q and self._q[0][0] <= now:
            _, _, what, fn = heapq.heappop(self._q)
            out.append((what, fn))
        return out

    def pending(self, prefix: str = "") -> bool:
        return any(w.startswith(prefix) for _, _, w, _ in self._q)

    def __len__(self) -> int:
        return len(self._q)


def _last_step(run: ChaosRun, lid: str) -> int:
    steps = [e.get("step", 0) for e in run.events(lid)[::-1] if e.get("event") in ("step", "learner-start")]
    return steps[0] if steps else 0


def run_scenario(sc: Scenario, out: str | Path, seed: int = 0, events_path: str | None = None,
                 time_scale: float = 1.0, say: Callable[[str], None] = print, timeout_s: float = 300.0) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spec = dataclasses.replace(sc.spec, seed=seed)
    faults = list(sc.faults)
    if sc.failure_rate_per_min > 0 or events_path:
        more, learners = _event_faults(sc, spec, out, seed, events_path, time_scale)
        faults += more
        spec = dataclasses.replace(spec, learners=learners)
    run = ChaosRun(spec, out)
    injections: list[dict] = []
    skipped: list[str] = []
    drained = False
    t_begin = time.time()
    try:
        run.create()
        say(f"chaos {sc.name}: run {run.descriptor.run_id} at {run.uri}, {spec.learners} learners")
        run.start_syncer("syncer", fault=sc.syncer_fault or None)
        for lid in spec.learner_ids():
            run.start_learner(lid)
        run.wait_for(lambda: _first_merge(run), 120, "the first merge commit", tick=run.poll)
        t0 = time.time()
        run.mark("run", "training", "schedule time 0")
        sched = _Schedule()
        for f in faults:
            sched.add(t0 + f.at_s, f.action, lambda f=f: _apply(run, sc, f, sched, injections, say))
        syncer_restarted = False
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            run.poll()
            if sc.syncer_fault and not syncer_restarted and not run.alive("syncer"):
                syncer_restarted = True
                say(f"  syncer exited ({run.life('syncer').how}); restarting in {sc.restart_syncer_after_s} s")
                sched.add(time.time() + sc.restart_syncer_after_s, "restart-syncer", lambda: run.start_syncer("syncer"))
            for what, fn in sched.due(time.time()):
                # Repairs (restart, restore, resume, s3-up) always run; only new faults are moot once
                # every learner has finished.
                if run.learners_done() and not what.startswith(("restart", "restore", "resume", "s3-up", "heal")):
                    skipped.append(what)
                    continue
                fn()
            if run.learners_done() and not sched.pending("restart") and not sched.pending("resume") \
                    and not sched.pending("s3-up") and not sched.pending("restore") and not sched.pending("heal"):
                if not _train_on_after_rogue(run, injections):
                    break
            time.sleep(0.05)
        sched.closing = True
        for what, fn in sched.due(float("inf")):     # whatever is left undoes a fault: do it now
            if not what.startswith(("kill", "pause", "blackhole", "s3-down", "rogue", "second", "partition")):
                fn()
            else:
                skipped.append(what)
        say("  learners finished; draining")
        drained = run.drain(60.0)
    finally:
        try:
            run.stop_all()
            report = _check_and_report(run, sc, spec, out, seed, injections, drained, skipped, t_begin, faults)
        finally:
            run.close()
    return report


def _event_faults(sc: Scenario, spec, out: Path, seed: int, events_path: str | None,
                  time_scale: float) -> tuple[list[Fault], int]:
    """The faults of a failure event log (drawn from the seed and written, or ``events_path``),
    and how many learners the run needs (a given log decides: its learner m is ``l<m>``)."""
    from infra.simulator.eventlog import read_event_log, scale, write_events
    if events_path is None:
        duration = 10.0
        events = draw_failures(spec.learners, duration, sc.failure_rate_per_min, sc.repair_s, seed)
        events_path = str(out / "failures.events")
        write_events(events_path, events, {"learners": spec.learners, "duration_s": duration,
                                           "rate_per_min": sc.failure_rate_per_min, "repair_s": sc.repair_s,
                                           "seed": seed, "source": "ddiloco chaos event-log"})
    log = read_event_log(events_path)          # written or given: the same reader checks it
    return list(faults_from_events(scale(log.events, time_scale), log.learners)), log.learners


def _apply(run: ChaosRun, sc: Scenario, f: Fault, sched: _Schedule, injections: list, say) -> None:
    say(f"  t={time.time() - run.timeline[0].t:6.1f}s {f.action} {f.target} "
        f"{f'for {f.duration_s} s' if f.duration_s else ''}")
    _pull(run, f, sched, injections)


def _pull(run: ChaosRun, f: Fault, sched: _Schedule, injections: list) -> None:
    """Pull the fault's lever, then schedule its repair ``duration_s`` after the lever's mark: the
    repair is timed from the moment the fault took effect, so a fault lasts at least its duration
    however long the lever took (a partition's resets took ~10 ms under load, and a 20 s cut
    measured 19.9988 s from mark to mark)."""
    def later(what: str, fn: Callable[[], None]) -> None:
        sched.add(time.time() + f.duration_s, what, fn)

    if f.action == "kill-learner":
        run.kill(f.target)
        if f.duration_s:
            later("restart-learner", lambda: _restart_learner(run, f.target))
    elif f.action == "restart-learner":
        _restart_learner(run, f.target)
    elif f.action == "pause-learner":
        run.pause(f.target)
        later("resume", lambda: run.resume(f.target))
    elif f.action == "kill-syncer":
        run.kill(f.target or "syncer")
        if f.duration_s:
            later("restart-syncer", lambda: run.start_syncer(f.target or "syncer"))
    elif f.action == "second-syncer":
        ports = (free_port(), free_port())
        run.start_syncer(f.target or "syncer2", ports=ports)
        run.retarget(ports)
    elif f.action == "s3-down":
        run.s3_down()
        later("s3-up", run.s3_up)
    elif f.action == "blackhole":
        run.blackhole()
        began = time.time()
        later("restore", lambda: _restore_after_spill(run, sched, began, began + 10 * max(f.duration_s, 1.0)))
    elif f.action == "rogue":
        _rogue(run, f, injections)
    elif f.action == "kill-agent":            # the learner replaces its sync agent (--sync-process runs)
        run.kill_agent(f.target)
    elif f.action == "partition-region":      # target "r1" (a reset cut) or "r1:hold" (a blackhole)
        region, _, mode = f.target.partition(":")
        run.partition_region(region, mode or "reset")
        later("heal-region", lambda: run.heal_region(region))


def _spilled_since(run: ChaosRun, t: float) -> int:
    return sum(1 for lid in run.learner_names() for e in run.events(lid)
               if e.get("event") == "delta-spilled" and e["t"] >= t)


def _restore_after_spill(run: ChaosRun, sched: _Schedule, began: float, deadline: float) -> None:
    """Restore the bus once the blackhole has lasted its duration *and* a learner spilled a delta
    during it (what the fault is there to exercise), or at ``deadline``. On a loaded machine the
    learners may not reach a round whose answer waits out its ack timeout within the duration
    alone (seen: '0 deltas spilled during the blackhole'); the condition, not a longer sleep, says
    when the fault has done its work."""
    if sched.closing or _spilled_since(run, began) or time.time() >= deadline or run.learners_done():
        run.restore()
    else:
        sched.add(time.time() + 0.1, "restore", lambda: _restore_after_spill(run, sched, began, deadline))


def _restart_learner(run: ChaosRun, lid: str) -> None:
    if run.alive(lid):
        return
    left = max(30, run.spec.steps - _last_step(run, lid))
    run.start_learner(lid, steps=left)


def _rogue(run: ChaosRun, f: Fault, injections: list) -> None:
    from .rogue import Rogue
    attacks = [a for a in f.target.split(",") if a]
    desc = run.descriptor
    if "too-old" in attacks:   # its base must already be outside the retained window
        run.wait_for(lambda: min(_versions(run).values()) >= desc.versions.retain, 60,
                     f"every fragment at version >= {desc.versions.retain}", tick=run.poll)
    rogue = Rogue(run.store, desc, run.keydir, BusConfig(run.relays[0].endpoint, run.relays[1].endpoint))
    run.mark(ROGUE, "rogue", ",".join(attacks))
    try:
        for a in attacks:
            injections += [i.to_dict() for i in rogue.attack(a)]
    finally:
        rogue.close()
    # "Nothing else changes" includes: training goes on. If the learners finished while the rogue
    # attacked (a fast machine, a slow attack), one more learner life trains, so the check that a good
    # delta was merged after the last bad input tests the run, not the timing.
    if not any(run.alive(lid) for lid in run.spec.learner_ids()):
        lid = run.spec.learner_ids()[0]
        run.mark(lid, "restart", "train on after the attack")
        run.start_learner(lid, steps=60)


def _train_on_after_rogue(run: ChaosRun, injections: list, lives: int = 3) -> bool:
    """After bad input the run must show that training went on: a learner delta merged after the
    last injection (invariants.bad_inputs_rejected). If every learner finished before one was (a
    loaded machine: the attack took long, the learners' last answers closed before it ended),
    start one more learner life - at most ``lives`` of them - and return True (keep running)."""
    if not injections:
        return False
    last = max(i["t"] for i in injections)
    lid = run.spec.learner_ids()[0]

    def merged_after() -> bool:
        return any((r.info.get("committed_at") or 0) > last and any(i.learner != ROGUE for i in r.inputs)
                   for r in run.commits() if r.kind == "merge")

    extra = sum(1 for m in run.timeline if m.who == lid and m.what == "restart" and m.detail.startswith("train on"))
    if extra >= lives or merged_after():
        return False
    run.settled(60.0)      # what the learners left may still be merged after it
    if merged_after():
        return False
    run.mark(lid, "restart", "train on after the attack (no learner merge after it yet)")
    run.start_learner(lid, steps=60)
    return True


def _versions(run: ChaosRun) -> dict[int, int]:
    from workers.common.versions import VersionTracker
    return {p: r.version for p, r in VersionTracker(run.store, run.descriptor).latest().items()}


def _tail(text: str, lines: int = 12) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def observe(run: ChaosRun, injections: list[dict], drained: bool) -> inv.Observation:
    lives = {n: [{"pid": l.popen.pid, "started": l.started, "ended": l.ended, "how": l.how, "killed": l.killed,
                  "role": l.role}
                 for l in ls] for n, ls in run.lives.items()}
    return inv.Observation(records=run.commits(),
                           learner_events={n: run.events(n) for n in run.learner_names()},
                           syncer_events={n: run.events(n) for n in run.syncer_names()},
                           lives=lives, marks=[m.to_dict() for m in run.timeline], injections=injections,
                           drained=drained, rogue=ROGUE)


def _check_and_report(run: ChaosRun, sc: Scenario, spec, out: Path, seed: int, injections: list, drained: bool,
                      skipped: list[str], t_begin: float, faults: list[Fault]) -> dict:
    obs = observe(run, injections, drained)
    b = sc.bounds
    final = {n: ls[-1]["how"] for n, ls in obs.lives.items() if ls[0]["role"] == "learner"}
    clean = all(h in ("exit 0", "killed") for h in final.values())
    # A learner that failed says why in the check itself: CI keeps no run directory to read.
    why = "".join(f"\n{n} stderr: ...{_tail(run.stderr(n))}" for n, h in sorted(final.items())
                  if h not in ("exit 0", "killed"))
    checks = [
        Check("drained", drained and clean,
              f"{run.last_drain or 'not drained'}; learners' last lives: {final}{why}"),
        inv.commit_sequence(obs.records, run.descriptor.num_fragments),
        inv.token_ledger(obs, run.store),
        inv.replay_bitexact(run.store, run.descriptor),
        inv.commit_gap(obs, b.quorum_alive, b.max_commit_gap_s, b.margin_s),
        inv.no_blocking(obs, b.stall_factor, b.stall_abs_s),
        inv.bad_inputs_rejected(obs),
        *progress.progress_checks(obs, run.descriptor.schedule.sync_every, run.descriptor.policy.quorum,
                                  run.descriptor.num_fragments, run.descriptor.policy.overlap),
        *[EXTRA_CHECKS[name](run, obs) for name in sc.checks],
    ]
    if skipped:
        checks.append(Check("schedule-complete", False, f"faults not applied (learners had finished): {skipped}"))
    report = {
        "format": "ddiloco-chaos-report", "version": 1,
        "scenario": sc.name, "kind": sc.kind, "description": sc.description, "seed": seed,
        "ok": all(c.ok for c in checks), "run_id": run.descriptor.run_id, "store": run.uri,
        "wall_s": round(time.time() - t_begin, 2), "spec": dataclasses.asdict(spec),
        "bounds": dataclasses.asdict(b), "faults": [f.to_dict() for f in faults],
        "checks": [c.to_dict() for c in checks], "timeline": [m.to_dict() for m in run.timeline],
        "lives": obs.lives, "injections": injections,
        "commits": {"total": len(obs.records), "merge": len(obs.merges()),
                    "drop": sum(r.kind == "drop" for r in obs.records)},
        "rogue_inbox_left": [k for k in _safe_list(run) if _learner_of(k) == ROGUE],
    }
    write_report(report, obs, out)
    return report


def _safe_list(run: ChaosRun) -> list[str]:
    try:
        return run.store.list(SPILL_PREFIX)
    except Exception:
        return []


def _learner_of(key: str) -> str:
    try:
        return parse_spill_key(key)[0]
    except Exception:
        return ""
