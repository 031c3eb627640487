"""Merged marks: which deltas of a fragment were merged, per lineage (issue 25; SPEC §4 late answers,
§7 exactly once).

A learner's delta is cumulative since its base version, so the deltas of one *lineage* (learner,
incarnation, base version) supersede each other, while deltas on different bases carry different
work. One high-water mark per learner (the newest merged (incarnation, seq), issue 11) cannot tell
an answer on base v that arrives after the same learner's answer on base v+1 was merged (never
merged: *overtaken*) from a resent copy of a merged delta: both are below the mark. Under rule 2
the fold also keeps, per fragment, the newest merged seq of every lineage whose base is still in
the retained history (complete for those bases: every merge marks its inputs, and a base never
re-enters the history). A delta at or below its learner's high-water mark is then

* ``duplicate`` - its lineage's mark is its own seq, or it is the high-water delta itself;
* ``superseded: seq S of its lineage was merged`` - a newer delta S of its lineage was merged
  (harmless: its progress is in that one);
* ``stale-incarnation: ...`` - never merged, of an older life of the learner (as in issue 11);
* ``unaccounted: ...`` - at or below the learner's recovery ``floor``: a restart adopted commits it
  could not re-fold (workers/syncer/recovery.py), so the marks may miss merges; it is neither
  merged (it might be twice) nor called harmless (it might be lost), and it counts lost;
* otherwise never merged - overtaken: a candidate like any late answer, merged against the current
  version (SPEC §4), or dropped ``base-too-old`` when its base left the history. A resent copy of a
  merged delta whose base left the history is ``base-too-old`` too: its mark is gone, so nothing
  proves it merged (it counts lost; its tokens, those of a merged delta, do not).

Rule 1 (``versions.marks`` absent from the descriptor: every run written before issue 25) is the
issue-11 rule alone; its states hold no marks (``SyncerState.marks`` is None) and its checkpoints
stay version 1, so old logs replay bit for bit. Pure: no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Collection, Iterable, Mapping, Sequence

from .errors import FormatError

__all__ = ["MergedMarks", "prior_verdict", "marks_from_body", "MARKS_ISSUE_11", "MARKS_LINEAGE"]

MARKS_ISSUE_11 = 1   # one high-water mark per learner and fragment (what a descriptor without the field means)
MARKS_LINEAGE = 2    # plus merged marks per lineage

Lineage = tuple[str, int, int]   # (learner, incarnation, base_version)


@dataclass(frozen=True)
class MergedMarks:
    """One fragment's merged marks (module docstring). ``seqs``: lineage -> newest merged seq, for
    bases in the fragment's retained history; ``floor``: learner -> the (incarnation, seq) at or
    below which recovery could not account for merges. Values, never mutated: changes return new ones."""

    seqs: Mapping[Lineage, int] = field(default_factory=dict)
    floor: Mapping[str, tuple[int, int]] = field(default_factory=dict)

    def merged(self, deltas: Iterable[tuple[str, int, int, int]], keep: Collection[int]) -> "MergedMarks":
        """The marks after a merge of ``deltas`` ((learner, incarnation, seq, base) each) that leaves
        ``keep`` as the retained versions: each raises its lineage's mark, then :meth:`pruned`."""
        seqs = dict(self.seqs)
        for learner, incarnation, seq, base in deltas:
            key = (learner, incarnation, base)
            seqs[key] = max(seqs.get(key, -1), seq)
        return MergedMarks(seqs, self.floor).pruned(keep)

    def pruned(self, keep: Collection[int]) -> "MergedMarks":
        """Without the marks of bases outside ``keep`` (a delta on one is ``base-too-old`` anyway)."""
        if all(k[2] in keep for k in self.seqs):
            return self
        return MergedMarks({k: s for k, s in self.seqs.items() if k[2] in keep}, self.floor)

    def raised_floor(self, high_water: Mapping[str, Iterable[int]]) -> "MergedMarks":
        """Every delta at or below ``high_water`` is ``unaccounted`` from now on unless a mark says
        otherwise: recovery adopted a commit it could not re-fold, and must never merge one twice."""
        floor = dict(self.floor)
        for learner, o in high_water.items():
            o = tuple(o)
            floor[learner] = max(floor.get(learner, (-1, -1)), (int(o[0]), int(o[1])))
        return MergedMarks(self.seqs, floor)

    def to_body(self) -> dict[str, Any]:
        """Checkpoint v2's entry of one fragment (docs/algorithm.md): sorted, so equal marks write equal bytes."""
        return {"seqs": [[m, i, b, s] for (m, i, b), s in sorted(self.seqs.items())],
                "floor": {m: list(o) for m, o in sorted(self.floor.items())}}

    @classmethod
    def from_body(cls, d: Any, where: str, retained: Collection[int]) -> "MergedMarks":
        """Read :meth:`to_body`'s map; FormatError naming ``where`` and the bad entry. A mark of a
        base outside ``retained`` (the fragment's history) is refused: it would have been pruned."""
        if not isinstance(d, dict) or set(d) != {"seqs", "floor"}:
            raise FormatError(f"{where}: merged marks must be a map with fields ['floor', 'seqs']")
        if not isinstance(d["seqs"], list) or not isinstance(d["floor"], dict):
            raise FormatError(f"{where}: merged marks 'seqs' must be a list and 'floor' a map")
        seqs: dict[Lineage, int] = {}
        for e in d["seqs"]:
            if not (isinstance(e, list) and len(e) == 4 and isinstance(e[0], str) and all(_nat(x) for x in e[1:])):
                raise FormatError(f"{where}: bad merged mark {e!r} (expected [learner, incarnation, base, seq])")
            key = (e[0], e[1], e[2])
            if key in seqs or e[2] not in retained:
                raise FormatError(f"{where}: merged mark {e!r} is repeated or its base is not retained "
                                  f"{sorted(retained)}")
            seqs[key] = e[3]
        floor = {}
        for m, o in d["floor"].items():
            if not (isinstance(m, str) and isinstance(o, list) and len(o) == 2 and all(_nat(x) for x in o)):
                raise FormatError(f"{where}: bad floor entry {m!r}: {o!r} (expected [incarnation, seq])")
            floor[m] = (o[0], o[1])
        return cls(seqs, floor)


def marks_from_body(marks: Any, retained: Sequence[Collection[int]], name: str) -> list[MergedMarks]:
    """A v2 checkpoint's ``marks`` field: one map per fragment (``retained``: each one's history)."""
    if not isinstance(marks, list) or len(marks) != len(retained):
        got = f"a list of {len(marks)}" if isinstance(marks, list) else type(marks).__name__
        raise FormatError(f"{name}: field 'marks' must be a list of {len(retained)} merged-mark maps (one per "
                          f"fragment), got {got}")
    return [MergedMarks.from_body(m, f"{name} fragment {p}", r) for p, (m, r) in enumerate(zip(marks, retained))]


def _nat(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def prior_verdict(learner: str, incarnation: int, seq: int, base: int, mark: Iterable[int] | None,
                  marks: MergedMarks | None, retained: Collection[int] = ()) -> tuple[str, str]:
    """What the merged history says about one delta: ``("", "")`` if it was never merged (a
    candidate), else the drop reason as (category, detail) (module docstring). ``mark``: its
    learner's high-water (incarnation, seq) on the fragment; ``marks``: None under rule 1;
    ``retained``: the fragment's retained versions (the recovery floor is judged only on those)."""
    if mark is None:
        return "", ""
    mark = tuple(int(x) for x in mark)
    order = (incarnation, seq)
    if order > mark:
        return "", ""
    stale = ("stale-incarnation", f"incarnation {mark[0]} of {learner} was merged since")
    if marks is None:                                           # rule 1
        return stale if incarnation < mark[0] else ("duplicate", "")
    merged = marks.seqs.get((learner, incarnation, base))
    if merged is not None and seq <= merged:
        return ("duplicate", "") if seq == merged else ("superseded", f"seq {merged} of its lineage was merged")
    if order == mark:
        return "duplicate", ""
    if incarnation < mark[0]:
        return stale
    floor = marks.floor.get(learner)
    if floor is not None and order <= floor and base in retained:
        return "unaccounted", (f"at or below {learner}'s recovery floor {list(floor)}: a restart adopted commits "
                               "it could not re-fold, so whether it was merged is unknown")
    return "", ""                                               # never merged: overtaken
