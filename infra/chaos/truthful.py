"""Progress invariants (d) and (e) (SPEC §11 "Progress"; infra/chaos/progress.py holds (a)-(c) and
runs all five): what the commit log says about drops and merges, judged against what the learners
produced.

- ``drops_truthful`` (d): every recorded drop has a reason, and its count is true both ways. A drop
  counted harmless (``duplicate``, ``superseded``: workers/tools/logview.py HARMLESS) really is: the
  same delta, or a newer delta of its lineage (learner, incarnation, base version; it holds the
  older one's work), was merged - a harmless drop of never-merged work is a lie the ledger would
  believe. And a delta its learner evicted (counted lost) is not carried by a newer merged delta of
  its lineage - superseded work called lost.
- ``quorum_minimum`` (e): every merge commit merged at least K distinct learners.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from pipeline.types import CommitRecord
from workers.tools.logview import HARMLESS     # what ddiloco log counts harmless: (d) holds it to that
from .invariants import Check, Observation


# -- (d) -------------------------------------------------------------------------------------------

def drops_truthful(records: Sequence[CommitRecord], bases: Mapping[str, int] | None = None,
                   evicted: Iterable[str] = ()) -> Check:
    """(d), both ways. ``bases``: each produced delta's base version (from the learners' ``delta``
    events; a drop record does not hold it), so "a newer delta of its lineage was merged" is checked
    on the lineage itself; without it, any newer merged delta of the same learner life is taken.

    ``evicted``: the deltas a learner's sender evicted to bound its memory, which the ledger counts
    lost. If a newer delta of the same lineage (learner life and base) was merged, it carried the
    evicted one's steps (a delta is cumulative since its base, SPEC §3): the work was not lost and
    the sender should have superseded it. Counting carried work lost is the mirror lie of calling
    lost work harmless; it is how a sender that keeps sent-but-unacked deltas instead of
    superseding them shows (while the store is down nothing is acked, the bound fills, and every
    new answer is evicted though the next one carries it)."""
    bases = bases or {}
    merged_ids = {i.delta_id for r in records if r.kind == "merge" for i in r.inputs}
    newest: dict[tuple, int] = {}          # (learner, incarnation, base) -> newest merged seq
    for r in records:
        if r.kind == "merge":
            for i in r.inputs:
                key = (i.learner, i.incarnation, i.base_version)
                newest[key] = max(newest.get(key, -1), i.seq)
    problems, harmless, lost = [], 0, 0
    for r in records:
        for d in r.dropped:
            category = d.reason.split(":")[0].strip()
            if not category:
                problems.append(f"commit {r.seq}: {d.delta_id} dropped without a reason")
                continue
            if category not in HARMLESS:
                lost += 1
                continue
            harmless += 1
            if d.delta_id in merged_ids:
                continue
            learner, inc, seq = _parse_id(d.delta_id)
            base = bases.get(d.delta_id)
            if any(k[0] == learner and k[1] == inc and s > seq and (base is None or k[2] == base)
                   for k, s in newest.items()):
                continue
            problems.append(f"commit {r.seq}: {d.delta_id} dropped {category!r} (counted harmless) but neither it "
                            f"nor a newer delta of its lineage was ever merged: lost work")
    evicted = sorted(set(evicted))
    for did in evicted:
        learner, inc, seq = _parse_id(did)
        base = bases.get(did)
        if did not in merged_ids and base is not None and newest.get((learner, inc, base), -1) > seq:
            problems.append(f"{did} evicted at its learner (counted lost) but a newer delta of its lineage (base "
                            f"{base}) was merged and carries its steps: superseded work called lost")
    return Check("progress-drops-truthful", not problems, problems[0] if problems else
                 f"{harmless} harmless drops each carried by a merged copy or a newer delta of its lineage; "
                 f"{lost} drops counted lost; {len(evicted)} evicted at a learner, none of them carried by a "
                 f"newer merged delta", {"harmless": harmless, "lost": lost, "evicted": len(evicted),
                                         "violations": problems[:10]})


def _parse_id(delta_id: str) -> tuple[str, int, int]:
    learner, inc, seq = delta_id.rsplit("/", 2)
    return learner, int(inc), int(seq)


def evicted_deltas(obs: Observation) -> set[str]:
    """Every delta a learner's sender evicted (its ``delta-evicted`` events)."""
    return {e["delta"] for ev in obs.learner_events.values() for e in ev
            if e.get("event") == "delta-evicted" and "delta" in e}


def produced_bases(obs: Observation) -> dict[str, int]:
    """Every produced delta's base version, from its producer's ``delta`` event."""
    return {e["delta"]: int(e.get("base", -1)) for ev in obs.learner_events.values() for e in ev
            if e.get("event") == "delta"}


# -- (e) -------------------------------------------------------------------------------------------

def quorum_minimum(records: Sequence[CommitRecord], K: int) -> Check:
    small = [(r.seq, len({i.learner for i in r.inputs})) for r in records if r.kind == "merge"
             and len({i.learner for i in r.inputs}) < K]
    sizes = [len({i.learner for i in r.inputs}) for r in records if r.kind == "merge"]
    return Check("progress-quorum", not small,
                 f"{len(small)} merges of fewer than K = {K} learners, e.g. commit {small[0][0]} "
                 f"({small[0][1]})" if small else f"every merge had >= K = {K} distinct learners "
                 f"(min {min(sizes, default=0)}, mean {sum(sizes) / max(len(sizes), 1):.2f})",
                 {"K": K, "below": small[:20], "merges": len(sizes)})
