"""The region-partition scenario's own checks (issue 14 acceptance; docs/regions.md "Partition").

- ``region-kept-training``: for every learner of a region the harness cut off (``partition`` /
  ``heal`` marks), steps went on during the cut with no step gap above 2x the learner's own median
  gap (a learner compared with itself, so a loaded machine slows both sides of the ratio), it
  spilled deltas into its region's bucket during the cut, and the syncer ingested every one of
  them after the heal: each is named by a commit, merged or dropped with its reason (mostly
  ``superseded``: a later delta of the same learner on the same base carries its steps too).
  Reported, not required: how many of them entered the model (``carried``: merged, or superseded
  by a merged delta of the same learner, fragment and base at a later step) - a delta may also be
  dropped for a reason of its own (the norm guard, staleness), which the ledger accepts.
- ``regions-verified``: every other region's copy of the log - commit records, the versions they
  published, the descriptor - matches the home store byte for byte up to the home tail
  (``storage.regions.verify_region``, what ``ddiloco replay --regions`` runs).
"""
from __future__ import annotations

import statistics
from collections import Counter
from typing import Callable

from storage.log import CommitLog
from storage.regions import open_region, verify_region
from .invariants import Check, Observation

GAP_FACTOR = 2.0     # the acceptance bound: max step gap during the cut <= 2x the learner's median gap


def cuts(obs: Observation) -> dict[str, list[tuple[float, float]]]:
    """Per region: the (partition, heal) intervals of the harness timeline."""
    out: dict[str, list[tuple[float, float]]] = {}
    for m in obs.marks:
        if m["what"] == "partition":
            out.setdefault(m["who"], []).append((m["t"], float("inf")))
        elif m["what"] == "heal" and out.get(m["who"]):
            out[m["who"]][-1] = (out[m["who"]][-1][0], m["t"])
    return out


def _median_gap(events: list[dict]) -> float | None:
    stop = next((e for e in reversed(events) if e.get("event") == "learner-stop"), None)
    if stop and stop.get("median_gap_s"):
        return float(stop["median_gap_s"])
    steps = [e for e in events if e.get("event") == "step"]
    gaps = [(b["t"] - a["t"]) / max(1, b["step"] - a["step"]) for a, b in zip(steps, steps[1:])]
    return statistics.median(gaps) if gaps else None


def carried(made: dict, inputs: list) -> bool:
    """Whether the work of produced delta ``made`` (its ``delta`` event) entered the model: a merged
    input of the same learner, fragment and base at the same or a later step."""
    lid = made["delta"].split("/")[0]
    return any(i.learner == lid and f == made["fragment"] and i.base_version == made["base"]
               and i.learner_step >= made["step"] for f, i in inputs)


def learner_during(events: list[dict], span: tuple[float, float]) -> dict:
    """One learner's figures inside ``span``: steps taken, the longest step gap (the ``max_gap_s``
    of each step report whose window ends inside it), deltas spilled (ids)."""
    a, b = span
    steps = [e for e in events if e.get("event") == "step" and a <= e["t"] <= b]
    first = max((e["step"] for e in events if e.get("event") == "step" and e["t"] < a), default=0)
    return {"steps": (steps[-1]["step"] - first) if steps else 0,
            "max_gap_s": max((float(e.get("max_gap_s", 0.0)) for e in steps), default=None),
            "median_gap_s": _median_gap(events),
            "spilled": [e["delta"] for e in events if e.get("event") == "delta-spilled" and a <= e["t"] <= b]}


def region_kept_training(run, obs: Observation) -> Check:
    spans = cuts(obs)
    if not spans:
        return Check("region-kept-training", False, "no region was partitioned")
    merged = {i.delta_id for r in obs.merges() for i in r.inputs}
    dropped = {d.delta_id: d.reason.split(":")[0] for r in obs.records for d in r.dropped}
    inputs = [(r.fragment, i) for r in obs.merges() for i in r.inputs]
    problems, data = [], {}
    for region, intervals in sorted(spans.items()):
        for lid, events in sorted(obs.learner_events.items()):
            if run.spec.region_of(lid) != region:
                continue
            for span in intervals:
                f = learner_during(events, span)
                f["merged_after_heal"] = sum(1 for d in f["spilled"] if d in merged)
                f["dropped_after_heal"] = dict(Counter(dropped[d] for d in f["spilled"] if d in dropped))
                left = [d for d in f["spilled"] if d not in merged and d not in dropped]
                made = {e["delta"]: e for e in events if e.get("event") == "delta"}
                f["carried"] = sum(1 for d in f["spilled"] if d in made and carried(made[d], inputs))
                data[f"{lid}@{span[0]:.1f}"] = {**f, "spilled": len(f["spilled"]), "cut_s": round(span[1] - span[0], 2)}
                median = f["median_gap_s"]
                if f["steps"] == 0 or f["max_gap_s"] is None or not median:
                    problems.append(f"{lid} took no steps during the cut of {region}")
                elif f["max_gap_s"] > GAP_FACTOR * median:
                    problems.append(f"{lid}: step gap {f['max_gap_s'] * 1000:.0f} ms during the cut > {GAP_FACTOR:g}x "
                                    f"its median {median * 1000:.0f} ms")
                if not f["spilled"]:
                    problems.append(f"{lid} spilled nothing into {region}'s bucket during the cut")
                elif left:
                    problems.append(f"{len(left)} of the {len(f['spilled'])} deltas {lid} spilled during the cut were "
                                    f"never ingested (no commit names them), e.g. {left[0]}")
    if not data:
        problems.append(f"no learner lives in the partitioned regions {sorted(spans)}")
    detail = problems[0] if problems else "; ".join(
        f"{k}: {v['steps']} steps in {v['cut_s']} s, max gap {v['max_gap_s'] * 1000:.0f} ms (median "
        f"{v['median_gap_s'] * 1000:.0f} ms), {v['spilled']} spilled, after the heal {v['merged_after_heal']} merged, dropped {v['dropped_after_heal']}, "
        f"{v['carried']} carried into the model"
        for k, v in data.items())
    return Check("region-kept-training", not problems, detail, {"per_learner": data, "factor": GAP_FACTOR})


def regions_verified(run, obs: Observation) -> Check:
    desc = run.descriptor
    if desc.regions is None:
        return Check("regions-verified", False, "the run has no regions")
    home = run.store
    tail = CommitLog(home).tail()
    results = {}
    for spec in desc.regions.regions:
        if spec.name == desc.regions.home:
            continue
        # read directly (an observer, not a side: the link would only slow the check down)
        region = run.topology.open_direct(spec.name) if run.topology is not None else open_region(spec)
        check = verify_region(home, region, spec.name, tail)
        results[spec.name] = {"ok": check.ok, "checked": check.checked, "tail": check.tail,
                              "missing": check.missing[:5], "mismatched": check.mismatched[:5]}
    ok = bool(results) and all(r["ok"] and r["tail"] == tail for r in results.values())
    detail = "; ".join(f"{n}: {r['checked']} commits match the home log up to {r['tail']}" if r["ok"] else
                       f"{n}: missing {r['missing']}, differ {r['mismatched']}, region tail {r['tail']} vs home {tail}"
                       for n, r in results.items())
    return Check("regions-verified", ok, detail, {"home_tail": tail, "regions": results})


REGION_CHECKS: dict[str, Callable] = {"region-kept-training": region_kept_training,
                                      "regions-verified": regions_verified}
