"""The invariants checked after every chaos scenario (SPEC §7-8).

Each check is a function of what a run left behind (its commit log, the processes' event logs and
the harness's timeline of faults, gathered in ``Observation``) and returns a ``Check``: a name,
ok, a one-line detail and numbers for the report. Nothing here trusts a process's own claim that
it is healthy: the log and the objects are the truth, the event logs say what each process did.

- ``commit_sequence``: commits contiguous from 0; per fragment, versions start at 0 and every merge
  adds exactly 1 (a drop keeps it); epochs never decrease and nothing of an older epoch follows a fence.
- ``token_ledger``: every delta a learner produced (``delta`` events) is merged exactly once, or
  recorded as dropped with a reason, or dropped by its own sender with a logged reason (superseded,
  evicted), or died with a SIGKILLed process before it was durable, or is still in flight at
  shutdown, which must be none for a learner that drained. Durable but unaccounted, merged twice, or
  merged without being produced (a phantom) fail it. Reported in deltas and tokens per category.
- ``replay_bitexact``: ``ddiloco replay``'s verifier reproduces every commit and version bit for bit.
- ``commit_gap``: while at least K learners were training and the store was up, the longest time
  without a merge commit (a store outage, from the harness's ``down`` to its ``up``, is no time to commit in).
- ``no_blocking``: the longest gap between a learner's consecutive steps (outside the times the
  harness paused it) vs its median step gap: a training loop that waited on I/O shows up here.
- ``bad_inputs_rejected``: every rogue injection met one of its expected outcomes (logged rejection
  or recorded drop with the reason), none was merged unless it was good, and the syncer kept
  committing learners' deltas after the last one.
"""
from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence

from pipeline.descriptor import RunDescriptor
from pipeline.types import CommitRecord
from storage.store import ObjectStore


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"name": self.name, "ok": self.ok, "detail": self.detail, "data": self.data}


@dataclass
class Observation:
    """What a scenario left behind. ``lives[name]``: dicts with pid, started, ended, how, killed, role;
    ``marks``: the harness timeline (dicts t, who, what, detail)."""

    records: list[CommitRecord]
    learner_events: dict[str, list[dict]]
    syncer_events: dict[str, list[dict]]
    lives: dict[str, list[dict]]
    marks: list[dict]
    injections: list[dict] = field(default_factory=list)
    drained: bool = True
    rogue: str = "rogue"

    def pauses(self, name: str) -> list[tuple[float, float]]:
        """Intervals during which the harness had ``name`` SIGSTOPped."""
        out, start = [], None
        for m in self.marks:
            if m["who"] != name:
                continue
            if m["what"] == "pause":
                start = m["t"]
            elif m["what"] in ("resume", "kill", "terminate") and start is not None:
                out.append((start, m["t"]))
                start = None
        if start is not None:
            out.append((start, float("inf")))
        return out

    def process_of(self, name: str, life: list[dict]) -> dict:
        """The harness's record of the process that logged ``life`` (matched by pid), or {}."""
        pid = next((e.get("pid") for e in life if e.get("event") == "learner-start"), None)
        return next((p for p in self.lives.get(name, []) if pid is not None and p.get("pid") == pid), {})

    def merges(self) -> list[CommitRecord]:
        return [r for r in self.records if r.kind == "merge"]


def _lives_of(events: list[dict]) -> list[list[dict]]:
    """Split one learner's events into lives at each ``learner-start``."""
    lives: list[list[dict]] = []
    for e in events:
        if e.get("event") == "learner-start" or not lives:
            lives.append([])
        lives[-1].append(e)
    return [life for life in lives if any(e.get("event") == "learner-start" for e in life)]


# -- 1. the log ------------------------------------------------------------------------------------

def commit_sequence(records: list[CommitRecord], fragments: int) -> Check:
    problems = []
    if [r.seq for r in records] != list(range(len(records))):
        problems.append("commit seqs are not 0..N-1")
    version: dict[int, int] = {}
    epoch = -1
    for r in records:
        if r.epoch < epoch:
            problems.append(f"commit {r.seq}: epoch {r.epoch} after epoch {epoch}")
        epoch = max(epoch, r.epoch)
        if r.kind == "init":
            if r.version != 0 or r.fragment in version:
                problems.append(f"commit {r.seq}: init of fragment {r.fragment} at version {r.version}")
            version[r.fragment] = 0
        elif r.kind == "merge":
            if r.version != version.get(r.fragment, -1) + 1:
                problems.append(f"commit {r.seq}: fragment {r.fragment} version {r.version} after "
                                f"{version.get(r.fragment)}")
            version[r.fragment] = r.version
        elif r.kind == "drop" and r.version != version.get(r.fragment):
            problems.append(f"commit {r.seq}: drop names version {r.version}, fragment {r.fragment} is at "
                            f"{version.get(r.fragment)}")
    if sorted(version) != list(range(fragments)):
        problems.append(f"fragments with an init commit: {sorted(version)}")
    data = {"commits": len(records), "by_kind": dict(Counter(r.kind for r in records)),
            "versions": {str(p): v for p, v in sorted(version.items())}, "epochs": sorted({r.epoch for r in records})}
    return Check("commit-sequence", not problems, problems[0] if problems else
                 f"{len(records)} commits contiguous, versions monotonic, epochs {data['epochs']}", data)


# -- 2. the token ledger ---------------------------------------------------------------------------

def token_ledger(obs: Observation, store: ObjectStore | None = None) -> Check:
    """See the module docstring. With ``store``, a durable-but-unaccounted delta is diagnosed: if its
    permanent copy (``deltas/...``) exists although no commit names it, a syncer persisted it for a
    round it never committed (fenced or crashed), and a later syncer took that copy as proof of a
    merge and deleted the inbox object (listed under ``orphaned_by_syncer``)."""
    merged = Counter(i.delta_id for r in obs.merges() for i in r.inputs)
    merged_tokens = {i.delta_id: i.c_tokens for r in obs.merges() for i in r.inputs}
    dropped: dict[str, list[str]] = defaultdict(list)
    for r in obs.records:
        for d in r.dropped:
            dropped[d.delta_id].append(d.reason.split(":")[0])
    rogue_ids = {i["delta_id"] for i in obs.injections}
    produced: dict[str, dict] = {}
    categories: dict[str, Counter] = {"deltas": Counter(), "tokens": Counter()}
    problems: list[str] = []
    unaccounted: list[str] = []
    for lid, events in sorted(obs.learner_events.items()):
        for life in _lives_of(events):
            killed = obs.process_of(lid, life).get("killed", False)
            stop = next((e for e in life if e.get("event") == "learner-stop"), None)
            local = {e["event"]: set() for e in life}
            for e in life:
                if "delta" in e and e["event"] in ("delta-acked", "delta-spilled", "delta-superseded",
                                                    "delta-evicted", "delta-rejected"):
                    local[e["event"]].add(e["delta"])
            for e in life:
                if e.get("event") != "delta":
                    continue
                did, tokens = e["delta"], int(e.get("tokens", 0))
                produced[did] = e
                durable = did in local.get("delta-acked", ()) or did in local.get("delta-spilled", ())
                if merged[did] > 1:
                    problems.append(f"{did} merged {merged[did]} times")
                if merged[did]:
                    cat = "merged"
                    if merged_tokens[did] != tokens:
                        problems.append(f"{did}: merged with {merged_tokens[did]} tokens, produced with {tokens}")
                elif dropped.get(did):
                    cat = "dropped:" + dropped[did][0]
                elif did in local.get("delta-superseded", ()):
                    cat = "superseded-at-learner"
                elif did in local.get("delta-evicted", ()):
                    cat = "evicted-at-learner"
                elif did in local.get("delta-rejected", ()):
                    cat = "rejected-at-ingest"
                elif durable:
                    cat = "durable-unaccounted"
                    unaccounted.append(did)
                    if obs.drained:
                        problems.append(f"{did} was durable but is neither merged nor recorded as dropped")
                elif killed:
                    cat = "lost-with-process"
                else:
                    cat = "in-flight-at-shutdown"
                    if obs.drained and stop is not None and stop.get("drained"):
                        problems.append(f"{did} still in flight after {lid} reported a clean drain")
                categories["deltas"][cat] += 1
                categories["tokens"][cat] += tokens
    phantoms = [d for d in merged if d not in produced and d not in rogue_ids]
    if phantoms:
        problems.append(f"merged deltas nobody produced: {phantoms[:3]}")
    produced_tokens = sum(int(e.get("tokens", 0)) for e in produced.values())
    accounted = sum(categories["tokens"].values())
    if produced_tokens != accounted:
        problems.append(f"ledger does not balance: produced {produced_tokens} tokens, accounted {accounted}")
    if not produced:
        problems.append("no learner logged a produced delta (is the learner's 'delta' event missing?)")
    orphaned = _orphaned(store, unaccounted) if store is not None else []
    if orphaned:
        problems.insert(0, f"{len(unaccounted)} durable deltas unaccounted; {len(orphaned)} of them (e.g. {orphaned[0]}) "
                           "have a permanent copy no commit names: a fenced/crashed syncer persisted them, a "
                           "later syncer took that copy for a merge and deleted the inbox object")
    data = {"produced_deltas": len(produced), "produced_tokens": produced_tokens,
            "orphaned_by_syncer": orphaned, "unaccounted": unaccounted[:20],
            "deltas": dict(categories["deltas"]), "tokens": dict(categories["tokens"]),
            "duplicate_copies_recorded": sum(1 for d in merged if d in dropped)}
    detail = problems[0] if problems else _ledger_summary(len(produced), categories["deltas"])
    return Check("token-ledger", not problems, detail, data)


def _orphaned(store: ObjectStore, unaccounted: list[str]) -> list[str]:
    """The unaccounted deltas whose permanent copy exists although no commit names them."""
    from storage.layout import delta_key
    orphaned = []
    for did in unaccounted:
        learner, inc, seq = did.split("/")
        try:
            if store.exists(delta_key(learner, int(inc), int(seq))):
                orphaned.append(did)
        except Exception:      # a diagnosis only: an unreadable store must not hide the ledger's verdict
            pass
    return orphaned


def _ledger_summary(produced: int, c: Counter) -> str:
    return (f"{produced} deltas: {c['merged']} merged once, "
            f"{sum(v for k, v in c.items() if k.startswith('dropped'))} dropped with a reason, "
            f"{c['superseded-at-learner'] + c['evicted-at-learner']} superseded at the learner, "
            f"{c['lost-with-process']} lost with a killed process, {c['in-flight-at-shutdown']} in flight")


# -- 3. replay ---------------------------------------------------------------------------------------

def replay_bitexact(store: ObjectStore, descriptor: RunDescriptor) -> Check:
    from workers.tools.replay_verify import replay_run
    try:
        rep = replay_run(store, descriptor)
    except Exception as exc:      # a divergence or damage: the message names the commit
        return Check("replay-bit-exact", False, f"{type(exc).__name__}: {exc}")
    return Check("replay-bit-exact", True, f"verified {rep.commits} commits, {rep.versions} versions "
                 f"(checkpoints matched: {rep.checkpoints})",
                 {"commits": rep.commits, "versions": rep.versions, "checkpoints": rep.checkpoints})


# -- 4. commits keep flowing -----------------------------------------------------------------------

def training_windows(obs: Observation, margin_s: float) -> dict[str, list[tuple[float, float]]]:
    """Per learner: when it was training (from ``learner-start`` + margin to its last sign of
    training - a produced delta, a step report or its stop - per life), minus the times the harness
    had it paused. (Not the last delta alone: a learner that ends its budget sends no closing delta,
    docs/results.md "Rounds, defaults and quality", so its last delta can come long before it stops training.)"""
    out: dict[str, list[tuple[float, float]]] = {}
    for lid, events in obs.learner_events.items():
        spans = []
        for life in _lives_of(events):
            start = next(e["t"] for e in life if e.get("event") == "learner-start") + margin_s
            ends = [e["t"] for e in life if e.get("event") in ("delta", "step", "learner-stop")]
            if ends and ends[-1] > start:
                spans.append((start, ends[-1]))
        for a, b in obs.pauses(lid):
            spans = [piece for s in spans for piece in _minus(s, (a, b))]
        out[lid] = spans
    return out


def _minus(span: tuple[float, float], cut: tuple[float, float]) -> list[tuple[float, float]]:
    a, b = span
    c, d = cut
    if d <= a or c >= b:
        return [span]
    return [s for s in ((a, c), (d, b)) if s[1] > s[0]]


def _at_least(windows: dict[str, list[tuple[float, float]]], k: int) -> list[tuple[float, float]]:
    edges = sorted([(a, 1) for w in windows.values() for a, _ in w] + [(b, -1) for w in windows.values() for _, b in w])
    out, alive, start = [], 0, None
    for t, d in edges:
        alive += d
        if alive >= k and start is None:
            start = t
        elif alive < k and start is not None:
            if t > start:
                out.append((start, t))
            start = None
    return out


def store_outages(obs: Observation) -> list[tuple[float, float]]:
    """When the harness had the S3 server down: from its ``down`` mark to its ``up`` mark, which
    comes once the restarted server serves writes again (infra/s3server.py; seconds on an idle
    machine, 16 s seen on a loaded one: a CI run's 4 s outage lasted 20.8 s)."""
    out, down = [], None
    for m in obs.marks:
        if m["who"] == "s3" and m["what"] == "down" and down is None:
            down = m["t"]
        elif m["who"] == "s3" and m["what"] == "up" and down is not None:
            out.append((down, m["t"]))
            down = None
    return out + ([(down, math.inf)] if down is not None else [])


def commit_gap(obs: Observation, quorum_alive: int, bound_s: float, margin_s: float = 1.0) -> Check:
    times = sorted(r.info.get("committed_at") for r in obs.merges() if r.info.get("committed_at") is not None)
    windows = _at_least(training_windows(obs, margin_s), quorum_alive)
    outages = store_outages(obs)
    for cut in outages:
        windows = [piece for w in windows for piece in _minus(w, cut)]
    worst, where = 0.0, None
    for a, b in windows:
        inside = [t for t in times if a <= t <= b]
        points = [a, *inside, b]
        for x, y in zip(points, points[1:]):
            if y - x > worst:
                worst, where = y - x, (x, y)
    covered = sum(b - a for a, b in windows)
    ok = covered > 0 and worst <= bound_s
    t0 = min((m["t"] for m in obs.marks), default=0.0)
    down_s = sum(b - a for a, b in outages if b != math.inf)
    detail = (f"longest gap between commits while >= {quorum_alive} learners trained: {worst:.2f} s "
              f"(bound {bound_s:.1f} s)" + (f" at t={where[0] - t0:.1f}..{where[1] - t0:.1f} s" if where else "")
              + (f"; {len(outages)} store outage(s) left out ({down_s:.1f} s)" if outages else "")
              if covered > 0 else f"never >= {quorum_alive} learners training at once")
    return Check("commit-gap", ok, detail, {"max_gap_s": round(worst, 3), "bound_s": bound_s,
                                            "window_s": round(covered, 2), "merge_commits": len(times),
                                            "store_outage_s": round(down_s, 2)})


# -- 5. the training loop never blocks -------------------------------------------------------------

def no_blocking(obs: Observation, factor: float, abs_s: float) -> Check:
    worst: dict[str, dict] = {}
    problems = []
    for lid, events in sorted(obs.learner_events.items()):
        pauses = obs.pauses(lid)
        for life in _lives_of(events):
            steps = [e for e in life if e.get("event") == "step"]
            if not steps:
                continue
            if "max_gap_s" not in steps[-1]:
                problems.append(f"{lid}: step events carry no max_gap_s")
                continue
            stop = next((e for e in life if e.get("event") == "learner-stop"), None)
            gaps = [(b["t"] - a["t"]) / max(1, b["step"] - a["step"]) for a, b in zip(steps, steps[1:])]
            median = stop["median_gap_s"] if stop and stop.get("median_gap_s") else \
                (statistics.median(gaps) if gaps else 0.0)
            allowed = max(factor * median, abs_s)
            prev_t = next(e["t"] for e in life if e.get("event") == "learner-start")
            for e in steps:
                g = float(e["max_gap_s"])
                # The gap ends at a step start after the previous event but may begin before it: a
                # learner stopped inside the step that emitted that event reports the stop in the
                # *next* event (seen: a 4 s pause judged as a 4.07 s stall). So the gap lies within
                # (prev_t - g, t), and it is the harness's doing if a pause overlaps that.
                window = (prev_t - g, e["t"])
                prev_t = e["t"]
                if any(a < window[1] and b > window[0] for a, b in pauses):
                    continue          # the harness stopped it: not the loop's doing
                if g > worst.get(lid, {}).get("max_gap_s", -1.0):
                    worst[lid] = {"max_gap_s": round(g, 4), "median_gap_s": round(median, 5),
                                  "allowed_s": round(allowed, 3), "step": e["step"]}
                if g > allowed:
                    problems.append(f"{lid}: {g:.2f} s between two steps near step {e['step']} "
                                    f"(median {median * 1000:.0f} ms, allowed {allowed:.2f} s)")
    if not worst and not problems:
        problems.append("no step events to judge")
    detail = problems[0] if problems else "longest step gap per learner: " + ", ".join(
        f"{lid} {w['max_gap_s'] * 1000:.0f} ms (median {w['median_gap_s'] * 1000:.0f} ms)" for lid, w in worst.items())
    return Check("no-blocking", not problems, detail, {"per_learner": worst, "factor": factor, "abs_s": abs_s})


# -- 6. bad input --------------------------------------------------------------------------------------

def bad_inputs_rejected(obs: Observation, short: Sequence[tuple[float, float]] = ()) -> Check:
    """Every injection met an expected outcome, and learners' deltas were merged after the last one
    - unless fewer than K learners trained from it to the end (``short``: the windows
    ``progress.short_of_quorum`` gives), when no merge is possible by design (the fault campaign,
    seed 953: K = 3 and a learner left for good before the bad input)."""
    if not obs.injections:
        return Check("bad-inputs-rejected", True, "no bad input in this scenario")
    merged = Counter(i.delta_id for r in obs.merges() for i in r.inputs)
    dropped = defaultdict(list)
    for r in obs.records:
        for d in r.dropped:
            dropped[d.delta_id].append(d.reason)
    rejected = defaultdict(list)
    for events in obs.syncer_events.values():
        for e in events:
            if e.get("event") == "delta-rejected":
                rejected[e.get("delta", "")].append(e.get("reason", ""))
    problems, outcomes = [], []
    for inj in obs.injections:
        did, key = inj["delta_id"], inj["key"]
        seen = [f"rejected:{r}" for r in rejected.get(did, []) + (rejected.get(key, []) if key else [])]
        seen += [f"dropped:{r}" for r in dropped.get(did, [])]
        n = merged.get(did, 0)
        if n:
            seen.append(f"merged x{n}")
        good = False
        for want in inj["expect"]:
            if want == "merged-once":
                good |= n == 1
            elif want == "unheard":
                good |= not seen
            else:
                good |= any(s.startswith(want) for s in seen)
        if n and "merged-once" not in inj["expect"]:
            good = False
        outcomes.append({"attack": inj["attack"], "delta": did, "expect": inj["expect"], "seen": seen})
        if not good:
            problems.append(f"{inj['attack']} ({did}): expected {' or '.join(inj['expect'])}, saw {seen or 'nothing'}")
    last = max(i["t"] for i in obs.injections)
    after = [r for r in obs.merges() if (r.info.get("committed_at") or 0) > last
             and any(i.learner != obs.rogue for i in r.inputs)]
    no_quorum = any(a <= last and b == math.inf for a, b in short)
    if not after and not no_quorum:
        problems.append("no learner delta was merged after the last bad input")
    crashed = [f"{n} ({life['how']})" for n, lives in obs.lives.items() for life in lives
               if life["role"] == "syncer" and life["how"] not in ("", "exit 0", "exit 3", "exit 137")
               and not life["killed"]]
    if crashed:
        problems.append(f"syncer exited during bad input: {crashed}")
    return Check("bad-inputs-rejected", not problems, problems[0] if problems else
                 f"{len(obs.injections)} bad inputs, each rejected or recorded with its reason; "
                 f"{len(after)} learner merges after the last one"
                 + (" (fewer than K learners trained after it: none possible)" if no_quorum and not after else ""),
                 {"outcomes": outcomes})
