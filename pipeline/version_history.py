"""A fragment's retained published versions, held compactly (issue 31: bounded syncer memory).

The syncer keeps the published values of the last ``versions.retain`` versions of every fragment
to reconstruct stale deltas (SPEC §6: a delta's outer gradient is taken against its base). Held as
float32 arrays that is 4 B per parameter per version, 64 B at the default 16. In an int4 run
(pipeline/version_chain.py) version ``v`` is defined as ``pub_{v-1} + D4(q_v)``, so holding ``q_v``
(the raw int4 payload, 0.5 B per parameter plus a float32 scale per block) instead of ``pub_v``
loses nothing: the values are rebuilt bit for bit by the very addition every learner makes.

``VersionHistory`` is a read-only ``Mapping[int, dict[str, ndarray]]`` (what the fold, recovery,
replay and checkpoints read) with this layout:

- the newest version is held **full** (it is every merge's ``current`` and the next link's base);
- the oldest version is held **full** (versions are rebuilt forward from a full entry, because a
  float32 addition cannot be undone exactly);
- every version in between whose link ``q_v`` is known is held as that link alone; a version
  entered without one (an adopted or renumbered version after recovery, bf16 and fp32 runs, a
  checkpoint's history) stays full until it leaves the window.

At the default 16 retained versions and block size 64 that is 8 B + 15 x 0.5625 B = 16.4 B per
fragment parameter instead of 64 B (the newest keeps its link too, for when it is no longer the
newest). Reading a middle version costs one dequantize-and-add per
version between it and the nearest full entry below (the common base, the newest, costs nothing);
``items()`` walks the window forward once. Pure: no I/O.
"""
from __future__ import annotations

from typing import Iterable, Iterator, Mapping

import numpy as np

from .codec import dequantize
from .version_chain import CHAIN_SCHEME as SCHEME

__all__ = ["VersionHistory"]

Values = dict[str, np.ndarray]


def _read_only(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


class VersionHistory(Mapping):
    """Versions -> published values; immutable (``advanced`` returns a new one sharing arrays)."""

    __slots__ = ("_full", "_links", "_block")

    def __init__(self, full: Mapping[int, Values], links: Mapping[int, Mapping[str, bytes]] | None = None,
                 block_size: int = 0):
        self._full: dict[int, Values] = dict(full)
        self._links: dict[int, dict[str, bytes]] = {v: dict(r) for v, r in (links or {}).items()}
        self._block = int(block_size)
        versions = sorted(set(self._full) | set(self._links))
        if versions and versions[0] not in self._full:
            raise ValueError(f"the oldest retained version {versions[0]} must be held full")
        if versions and versions[-1] not in self._full:
            raise ValueError(f"the newest retained version {versions[-1]} must be held full")
        for v in self._links:
            if v not in self._full and v - 1 not in self:
                raise ValueError(f"version {v} is held as a link but version {v - 1}, its base, is not retained")
        if self._links and self._block < 1:
            raise ValueError(f"a history with links needs the codec's block size, got {block_size!r}")

    @classmethod
    def of(cls, entries: "Mapping[int, Values] | VersionHistory") -> "VersionHistory":
        """A history of full entries (a dict, a checkpoint's history); a VersionHistory as is."""
        return entries if isinstance(entries, VersionHistory) else cls(entries)

    # -- Mapping -------------------------------------------------------------------------------

    def __contains__(self, v: object) -> bool:
        return v in self._full or v in self._links

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(set(self._full) | set(self._links)))

    def __len__(self) -> int:
        return len(set(self._full) | set(self._links))

    def __getitem__(self, v: int) -> Values:
        full = self._full.get(v)
        if full is not None:
            return full
        if v not in self._links:
            raise KeyError(v)
        start = max(u for u in self._full if u < v)   # the oldest entry is full: one exists
        values = self._full[start]
        for u in range(start + 1, v + 1):
            values = self._full[u] if u in self._full else self._apply(values, self._links[u])
        return values

    def items(self) -> Iterator[tuple[int, Values]]:          # type: ignore[override]
        """``(version, values)`` oldest first, each rebuilt from the one before (one walk)."""
        prev: tuple[int, Values] | None = None
        for v in self:
            if v in self._full:
                values = self._full[v]
            else:
                assert prev is not None and prev[0] == v - 1
                values = self._apply(prev[1], self._links[v])
            prev = (v, values)
            yield v, values

    def values(self) -> Iterator[Values]:                      # type: ignore[override]
        return (values for _, values in self.items())

    # -- growth --------------------------------------------------------------------------------

    def advanced(self, version: int, values: Values, keep: Iterable[int],
                 link: Mapping[str, bytes] | None = None, block_size: int = 0) -> "VersionHistory":
        """This history with ``version`` -> ``values`` added as the newest and only the versions in
        ``keep`` (plus ``version``) kept. ``link``: the raw int4 payload that makes ``values`` from
        version ``version - 1``'s (pipeline/version_chain.py ``ChainStep.raw``); with it the
        version is held as its link once it is no longer the newest."""
        keep = set(keep) | {version}
        versions = [v for v in self if v in keep]
        if versions and versions[-1] >= version:
            raise ValueError(f"version {version} is not newer than the retained {versions[-1]}")
        # a link is kept while its base is: the oldest version's link would rebuild nothing
        links = {v: r for v, r in self._links.items() if v in keep and v - 1 in keep and v - 1 in self}
        if link is not None:
            links[version] = dict(link)
        full: dict[int, Values] = {}
        for v in versions:
            if v == versions[0] and v not in self._full:   # a new oldest: rebuilt once, held full
                full[v] = self[v]
            elif v in self._full and not (v in links and v - 1 in keep and v - 1 in self):
                full[v] = self._full[v]                  # a version with no link to rebuild it from
        full[version] = values
        return VersionHistory(full, links, block_size or self._block)

    # -- accounting ----------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Bytes of array and link payload held (what the syncer's memory bound counts)."""
        held = {id(a): a.nbytes for vals in self._full.values() for a in vals.values()}
        return sum(held.values()) + sum(len(b) for r in self._links.values() for b in r.values())

    def full_versions(self) -> list[int]:
        """The versions held as full arrays (the rest are links)."""
        return sorted(self._full)

    def held(self, v: int) -> tuple[Values | None, dict[str, bytes] | None]:
        """``(values, link)`` as version ``v`` is held: its full values or None, its int4 link or
        None (the newest holds both). What a checkpoint v3 stores (pipeline/state.py)."""
        if v not in self:
            raise KeyError(v)
        return self._full.get(v), self._links.get(v)

    # -- helpers -------------------------------------------------------------------------------

    def _apply(self, prev: Values, raw: Mapping[str, bytes]) -> Values:
        """``pub_v = pub_{v-1} + D4(q_v)``: the addition of version_chain.chain_step, bit for bit."""
        out = {}
        for n, a in prev.items():
            d = dequantize(raw[n], SCHEME, self._block, a.size).reshape(a.shape)
            out[n] = _read_only(np.add(a, d, dtype=np.float32))
        return out

    def __repr__(self) -> str:
        return f"VersionHistory(versions={list(self)}, full={self.full_versions()})"
