"""How much of each learner's work entered the global model, and how late versions arrive
(issue "Rounds"; the paper's §3 argument that a learner loses only the ≈ τ steps between its
answer and the version's arrival, so utilisation ≈ (H − τ)/H).

Both figures come from what a run leaves behind: the commit log (which deltas a version merged,
with each delta's ``learner_step`` and ``c_steps``) and the learners' event logs (when each delta
was produced and each version applied). Used by ``ddiloco run``'s summary, ``ddiloco benchmark``
and the chaos experiments.
"""
from __future__ import annotations

import statistics
from typing import Iterable, Mapping, Sequence

from pipeline.types import CommitRecord


def useful_steps(records: Iterable[CommitRecord], fragments: int,
                 produced: set[str] | None = None) -> dict[str, float]:
    """Per learner: inner steps whose progress entered the global model. A merged delta of fragment
    p carries that learner's steps (learner_step - c_steps, learner_step] on p; consecutive deltas
    of p may overlap, so steps are a union per (learner life, fragment), and a fragment counts 1/P
    of a step. ``produced``: only these delta ids."""
    spans: dict[tuple[str, int, int], list[tuple[int, int]]] = {}
    for r in records:
        if r.kind != "merge":
            continue
        for i in r.inputs:
            if produced is None or i.delta_id in produced:
                spans.setdefault((i.learner, i.incarnation, r.fragment), []).append(
                    (i.learner_step + 1 - i.c_steps, i.learner_step + 1))
    out: dict[str, float] = {}
    for (learner, _, _), iv in spans.items():
        covered, end = 0, -1
        for a, b in sorted(iv):
            if b > end:
                covered += b - max(a, end)
                end = b
        out[learner] = out.get(learner, 0.0) + covered / fragments
    return out


def utilisation(records: Sequence[CommitRecord], fragments: int, steps: Mapping[str, int]) -> dict[str, float]:
    """Per learner: useful steps / steps taken (``steps``: learner -> inner steps it took)."""
    useful = useful_steps(records, fragments)
    return {m: round(useful.get(m, 0.0) / n, 4) for m, n in sorted(steps.items()) if n}


def latency_steps(records: Sequence[CommitRecord], events: Mapping[str, Sequence[dict]]) -> dict[str, list[int]]:
    """Per learner: for every version it applied that merged one of its own deltas, the inner steps
    taken between producing that delta (its answer) and applying the version - the work the
    overwrite discards (``events``: learner -> its event log; a delta event's ``step`` is the last
    step it holds, a version-applied event's ``step`` the steps taken so far)."""
    by_seq = {r.seq: r for r in records if r.kind == "merge"}
    out: dict[str, list[int]] = {}
    for learner, ev in events.items():
        made = {e["delta"]: e["step"] for e in ev if e.get("event") == "delta"}
        lat = []
        for e in ev:
            rec = by_seq.get(e.get("seq")) if e.get("event") == "version-applied" else None
            if rec is None:
                continue
            mine = [made[i.delta_id] for i in rec.inputs if i.delta_id in made]
            if mine:     # steps counted at application minus the steps the answer held
                lat.append(e["step"] - (max(mine) + 1))
        out[learner] = lat
    return out


def p50(xs: Sequence[float]) -> float | None:
    return float(statistics.median(xs)) if xs else None
