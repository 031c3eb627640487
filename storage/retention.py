"""Retention planning: which objects of a run could be deleted, and why (SPEC §7). Deletes nothing
unless ``apply_retention`` is called with the plan.

Rules (conservative; commits, epochs, the descriptor and the head hint are never deleted):

- **checkpoints**: all but the newest ``keep_checkpoints``.
- The **horizon** is the oldest kept checkpoint's seq, set only when ``keep_checkpoints`` of them
  exist (so one damaged checkpoint still leaves a fallback). Without a horizon nothing below is
  deletable: recovery may have to fold from the start.
- **deltas and spilled deltas** named (merged or dropped) by a commit ``<= horizon`` and by no
  later commit: recovery and replay start at a kept checkpoint and never read them again.
  Deltas no commit names (in flight, or orphaned by a crash) are kept.
- **fragment versions** outside the newest ``keep_versions`` version numbers of their fragment
  whose producing commit is ``<= horizon``, or that no commit names (e.g. a fenced syncer's
  orphan). Version 0, the run's initial model, is kept.

Planning reads the log (one GET per commit) from ``scan_from`` (default: the start). The syncer
plans incrementally after each checkpoint with ``scan_from`` = the previous horizon + 1: keys
named only by earlier commits were dealt with then (or are kept: never deleted by mistake), and
versions produced before ``scan_from`` lie behind an earlier horizon. ``ddiloco gc`` scans it all.

Safe for replay from any kept checkpoint (docs/storage.md "Retention"): everything a replay or a
restart folding from the oldest kept checkpoint reads is kept - the commits, the deltas and
versions they name, the checkpoints. A full replay from the start needs the deleted deltas: use
``ddiloco replay --from <a kept checkpoint + 1>`` after retention.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from pipeline.errors import FormatError

from .errors import NotFound
from .checkpoints import list_checkpoints
from .layout import (DELTA_PREFIX, SPILL_PREFIX, VERSION_PREFIX, checkpoint_key, parse_version_key,
                     read_descriptor)
from .log import CommitLog
from .store import ObjectStore


@dataclass(frozen=True)
class RetentionItem:
    key: str
    reason: str


@dataclass(frozen=True)
class RetentionPlan:
    """Keys that could be deleted, each with its reason. ``horizon`` is -1 when none is set."""

    uri: str
    horizon: int
    kept_checkpoints: tuple[int, ...]
    items: tuple[RetentionItem, ...]

    def keys(self) -> list[str]:
        return [item.key for item in self.items]

    def summary(self) -> dict[str, int]:
        """Number of deletable objects per top-level prefix (``checkpoints``, ``deltas``, ...)."""
        counts: dict[str, int] = defaultdict(int)
        for item in self.items:
            counts[item.key.split("/", 1)[0]] += 1
        return dict(counts)


def plan_retention(store: ObjectStore, keep_checkpoints: int = 2, keep_versions: int | None = None, *,
                   scan_from: int = 0, newest_horizon: int | None = None) -> RetentionPlan:
    """List what could be deleted (see the module docstring). ``keep_versions`` defaults to the
    run descriptor's ``retain_versions`` (16 if the descriptor cannot be read). ``scan_from``: the
    first commit read (an earlier plan's horizon + 1). ``newest_horizon``: the horizon is at most
    this commit (the syncer keeps the newest ``keep_commits`` commits whole: the horizon is then
    the newest checkpoint that old enough, and every checkpoint after it is kept)."""
    if not isinstance(keep_checkpoints, int) or keep_checkpoints < 1:
        raise ValueError(f"keep_checkpoints must be an int >= 1, got {keep_checkpoints!r}")
    if not isinstance(scan_from, int) or scan_from < 0:
        raise ValueError(f"scan_from must be an int >= 0, got {scan_from!r}")
    if keep_versions is None:
        try:
            keep_versions = read_descriptor(store).versions.retain
        except (NotFound, FormatError):
            keep_versions = 16
    if not isinstance(keep_versions, int) or keep_versions < 1:
        raise ValueError(f"keep_versions must be an int >= 1, got {keep_versions!r}")

    items: list[RetentionItem] = []
    checkpoints = list_checkpoints(store)
    # candidates: checkpoints with at least keep_checkpoints - 1 newer ones (a fallback if one is damaged)
    eligible = checkpoints[:len(checkpoints) - keep_checkpoints + 1] if len(checkpoints) >= keep_checkpoints else []
    if newest_horizon is not None:
        eligible = [c for c in eligible if c <= newest_horizon]
    horizon = eligible[-1] if eligible else -1
    kept = tuple(c for c in checkpoints if c >= horizon)
    for seq in checkpoints:
        if seq < horizon:
            items.append(RetentionItem(checkpoint_key(seq), f"superseded checkpoint: keeping "
                                                             f"{', '.join(map(str, kept))}"))

    settled: dict[str, int] = {}       # delta key -> last commit <= horizon naming it
    named_later: set[str] = set()      # delta keys named by a commit after the horizon
    produced_at: dict[str, int] = {}   # version key -> commit seq that produced it
    log = CommitLog(store)
    records = log.read_range(scan_from) if horizon >= 0 and scan_from <= log.tail() else ()
    for record in records:
        names = [i.key for i in record.inputs] + [d.key for d in record.dropped if d.key]
        for key in names:
            if record.seq <= horizon:
                settled[key] = record.seq
            else:
                named_later.add(key)
        if record.output_key:
            produced_at[record.output_key] = record.seq

    if horizon >= 0:
        for prefix in (DELTA_PREFIX, SPILL_PREFIX):
            for key in store.list(prefix):
                if key in settled and key not in named_later:
                    items.append(RetentionItem(key, f"named by commit {settled[key]} <= horizon {horizon} "
                                                    "and by no later commit"))
        by_fragment: dict[int, list[tuple[int, str]]] = defaultdict(list)
        for key in store.list(VERSION_PREFIX):
            try:
                fragment, version = parse_version_key(key)
            except FormatError:
                continue  # not ours: never delete what we cannot name
            by_fragment[fragment].append((version, key))
        for fragment, versions in sorted(by_fragment.items()):
            newest = set(sorted({v for v, _ in versions})[-keep_versions:])
            for version, key in sorted(versions):
                if version == 0 or version in newest:
                    continue
                seq = produced_at.get(key)
                if seq is None and scan_from > 0:
                    reason = (f"produced before commit {scan_from} (behind an earlier horizon) or by no commit; "
                              f"fragment {fragment} keeps its newest {keep_versions} versions")
                elif seq is None:
                    reason = f"no commit names it; fragment {fragment} keeps its newest {keep_versions} versions"
                elif seq <= horizon:
                    reason = (f"produced by commit {seq} <= horizon {horizon}; fragment {fragment} keeps "
                              f"its newest {keep_versions} versions")
                else:
                    continue
                items.append(RetentionItem(key, reason))
    return RetentionPlan(store.uri, horizon, kept, tuple(items))


def apply_retention(store: ObjectStore, plan: RetentionPlan) -> int:
    """Delete every key of ``plan`` (made for this store); returns how many were deleted."""
    if plan.uri != store.uri:
        raise ValueError(f"retention plan was made for {plan.uri}, not {store.uri}")
    for item in plan.items:
        store.delete(item.key)
    return len(plan.items)
