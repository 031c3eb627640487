"""Where each learner of a launched run lives: its region and its data shard, as explicit data.

A launcher that starts M learners ``l0..l(M-1)`` places them with ``Placement.round_robin``:
learner m in region m mod N (docs/regions.md) and on data shard m. Everything that needs to know
where a learner is - the launcher starting it, the chaos harness checking it, a benchmark reading a
finished run's summary (``placement``) - asks the placement, never the digits of an id.
``default_shard`` is the one reading of an id, for a learner started on its own without ``--shard``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


def learner_names(count: int) -> list[str]:
    """The ids a launcher gives its ``count`` learners."""
    return [f"l{m}" for m in range(count)]


def default_shard(learner_id: str) -> int:
    """The data shard of a learner started without one: the number in its id (``l3`` -> 3), else 0."""
    digits = "".join(c for c in learner_id if c.isdigit())
    return int(digits) if digits else 0


@dataclass(frozen=True)
class Placement:
    """``learner -> (region or None, data shard)``, in launch order."""

    where: tuple[tuple[str, str | None, int], ...]

    @classmethod
    def round_robin(cls, learners: Sequence[str], regions: Sequence[str] = ()) -> "Placement":
        """Learner i (in order) in region i mod len(regions) (None without regions), on shard i."""
        return cls(tuple((lid, regions[i % len(regions)] if regions else None, i) for i, lid in enumerate(learners)))

    def _row(self, learner: str) -> tuple[str, str | None, int]:
        for row in self.where:
            if row[0] == learner:
                return row
        raise KeyError(f"learner {learner!r} is not placed (placed: {', '.join(r[0] for r in self.where)})")

    def region(self, learner: str) -> str | None:
        return self._row(learner)[1]

    def shard(self, learner: str) -> int:
        return self._row(learner)[2]

    def in_region(self, region: str) -> list[str]:
        return [lid for lid, r, _ in self.where if r == region]

    def to_dict(self) -> dict[str, dict]:
        """``{learner: {"region": ..., "shard": ...}}`` (summary.json's ``placement``)."""
        return {lid: {"region": r, "shard": s} for lid, r, s in self.where}

    @classmethod
    def from_dict(cls, d: dict[str, dict]) -> "Placement":
        return cls(tuple((lid, v.get("region"), int(v["shard"])) for lid, v in d.items()))
