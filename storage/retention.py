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
  orphan). Version 0, the run's initial model, is kept, and in an int4 run (issue 31) the
  newest full snapshot at or below the oldest version that stays, with every version after it
  (a kept delta is readable only from a snapshot before it).

- **a byte budget** (``keep_bytes``, issue 26): the horizon also moves forward - to the oldest
  candidate checkpoint whose *footprint* fits the budget, or the newest candidate when none does,
  but never past ``floor_horizon`` (the syncer's newest ``min_commits`` always keep what they
  name). A checkpoint's footprint is what a replay from it and a restart read: that checkpoint,
  the newest ``keep_checkpoints`` and those after the floor (later horizons), the deltas and
  spilled deltas the commits after it name and the versions they produced (the newest
  ``keep_versions`` of each fragment and version 0 stay whatever the budget). Under a budget the
  other checkpoints *after* the horizon go too: a replay from the horizon recomputes their states
  and a restart reads the newest, and each holds ~18 model sizes (params, momentum, retained
  versions). Sizes
  come from ``size_of`` (a HEAD per object; the syncer caches them). The commit rule and the
  budget are both limits: the horizon is the newer of the two. ``default_keep_bytes`` is the
  syncer's default.
- **an age** (``older_than``, a wall time; issue 26): the horizon also moves to the newest
  candidate checkpoint (not past ``floor_horizon``) whose commit was made at or before it (merge
  commits record ``info["committed_at"]``), so what only older commits name goes. Off by default.

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
from typing import Callable, Sequence

from pipeline.errors import FormatError

from .errors import NotFound
from .checkpoints import list_checkpoints
from .layout import (DELTA_PREFIX, RETENTION_KEY, SNAPSHOT_SUFFIX, SPILL_PREFIX, VERSION_PREFIX, checkpoint_key,
                     pack_retention_hint, parse_version_key, published_keys, read_descriptor)
from .log import CommitLog
from .store import ObjectStore

BUDGET_MODEL_SIZES = 8      # the default budget: this many fp32 model sizes of deltas and versions ...
BUDGET_CHECKPOINTS = 2      # ... plus this many of the newest checkpoint (what a restart must keep)


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


def default_keep_bytes(store: ObjectStore, model_bytes: int, size_of: Callable[[str], int] | None = None) -> int:
    """The default byte budget: BUDGET_MODEL_SIZES fp32 model sizes (``model_bytes``) plus
    BUDGET_CHECKPOINTS times the newest checkpoint's size (a restart keeps two; issue 26)."""
    newest = list_checkpoints(store)[-1:]
    size = (size_of or (lambda k: object_size(store, k)))(checkpoint_key(newest[0])) if newest else 0
    return BUDGET_MODEL_SIZES * model_bytes + BUDGET_CHECKPOINTS * size


def object_size(store: ObjectStore, key: str) -> int:
    """An object's stored size (0 once it is gone)."""
    try:
        return store.head(key).size
    except NotFound:
        return 0


def parse_size(text: str) -> int:
    """``"512MB"``, ``"2GiB"``, ``"1e9"``, ``"0"`` -> bytes (decimal and binary units); ValueError
    naming the text otherwise."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    t = str(text).strip().upper().replace(" ", "")
    number = t.rstrip("KMGTIB")
    try:
        value = float(number) * units[t[len(number):]]
    except (KeyError, ValueError):
        raise ValueError(f"not a size: {text!r} (e.g. 500MB, 2GiB, 0)") from None
    if not value >= 0 or value != value or value == float("inf"):
        raise ValueError(f"not a size: {text!r} (must be >= 0)")
    return int(value)


def _budget_horizon(records: Sequence, candidates: Sequence[int], newest: Sequence[int], keep_bytes: int,
                    size_of: Callable[[str], int]) -> int:
    """The oldest of ``candidates`` (ascending checkpoint seqs) whose footprint fits ``keep_bytes``
    (module docstring; ``newest``: the checkpoints kept whatever the horizon), or the newest
    candidate when none fits."""
    newest_first = sorted(records, key=lambda r: r.seq, reverse=True)
    seen: set[str] = set()
    named, i, best = 0, 0, candidates[-1]
    always = sum(size_of(checkpoint_key(x)) for x in newest)
    for c in reversed(candidates):
        while i < len(newest_first) and newest_first[i].seq > c:
            r = newest_first[i]
            for key in _named(r) + ([r.output_key] if r.output_key else []):
                if key not in seen:
                    seen.add(key)
                    named += size_of(key)
            i += 1
        if named + always + (0 if c in newest else size_of(checkpoint_key(c))) > keep_bytes:
            break
        best = c
    return best


def _age_horizon(records: Sequence, candidates: Sequence[int], older_than: float) -> int:
    """The newest of ``candidates`` whose commit (or the newest timed commit before it) was made at
    or before wall time ``older_than``; -1 when none is known to be that old."""
    at: dict[int, float] = {}
    last = None
    for r in sorted(records, key=lambda r: r.seq):
        t = r.info.get("committed_at")
        if isinstance(t, (int, float)) and not isinstance(t, bool):
            last = float(t)
        if last is not None:
            at[r.seq] = last
    old = [c for c in candidates if c in at and at[c] <= older_than]
    return old[-1] if old else -1


def parse_duration(text: str) -> float:
    """``"7d"``, ``"12h"``, ``"30m"``, ``"90s"``, ``"3600"`` -> seconds; ValueError naming the text."""
    units = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
    t = str(text).strip().lower()
    number = t.rstrip("smhdw")
    try:
        value = float(number) * units[t[len(number):]]
    except (KeyError, ValueError):
        raise ValueError(f"not a duration: {text!r} (e.g. 7d, 12h, 30m, 3600s)") from None
    if not value > 0 or value == float("inf"):
        raise ValueError(f"not a duration: {text!r} (must be > 0)")
    return value


def _named(record) -> list[str]:
    return [i.key for i in record.inputs] + [d.key for d in record.dropped if d.key]


def plan_retention(store: ObjectStore, keep_checkpoints: int = 2, keep_versions: int | None = None, *,
                   scan_from: int = 0, newest_horizon: int | None = None, keep_bytes: int | None = None,
                   floor_horizon: int | None = None, older_than: float | None = None,
                   size_of: Callable[[str], int] | None = None) -> RetentionPlan:
    """List what could be deleted (see the module docstring). ``keep_versions`` defaults to the
    run descriptor's ``retain_versions`` (16 if the descriptor cannot be read). ``scan_from``: the
    first commit read (an earlier plan's horizon + 1). ``newest_horizon``: the horizon is at most
    this commit (the syncer keeps the newest ``keep_commits`` commits whole: the horizon is then
    the newest checkpoint that old enough, and every checkpoint after it is kept). ``keep_bytes``:
    the byte budget (None: none), which moves the horizon at most to ``floor_horizon`` (None: no
    limit); ``older_than``: a wall time - what only commits made before it name may go too (None:
    no age limit); ``size_of``: an object's size (default: a HEAD)."""
    if not isinstance(keep_checkpoints, int) or keep_checkpoints < 1:
        raise ValueError(f"keep_checkpoints must be an int >= 1, got {keep_checkpoints!r}")
    if not isinstance(scan_from, int) or scan_from < 0:
        raise ValueError(f"scan_from must be an int >= 0, got {scan_from!r}")
    if keep_bytes is not None and (not isinstance(keep_bytes, int) or isinstance(keep_bytes, bool) or keep_bytes < 0):
        raise ValueError(f"keep_bytes must be an int >= 0 or None, got {keep_bytes!r}")
    size_of = size_of or (lambda key: object_size(store, key))
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
    candidates = checkpoints[:len(checkpoints) - keep_checkpoints + 1] if len(checkpoints) >= keep_checkpoints else []
    eligible = [c for c in candidates if newest_horizon is None or c <= newest_horizon]
    horizon = eligible[-1] if eligible else -1
    # Kept whatever the budget: the newest keep_checkpoints (a restart), and those after the floor
    # (the horizons of later passes: thinning them would leave later passes no horizon to move to).
    newest = [c for c in checkpoints[len(checkpoints) - keep_checkpoints:]] + \
        [c for c in checkpoints if floor_horizon is not None and c > floor_horizon]
    later = [c for c in candidates if c >= horizon and (floor_horizon is None or c <= floor_horizon)]
    budgeted = keep_bytes is not None and bool(later)
    aged = older_than is not None and bool(later)
    log = CommitLog(store)
    records = list(log.read_range(scan_from)) if (horizon >= 0 or budgeted or aged) and scan_from <= log.tail() else []
    if budgeted:              # the budget only ever moves the horizon on
        horizon = max(horizon, _budget_horizon(records, later, newest, keep_bytes, size_of))
    if aged:                  # and so does the age
        horizon = max(horizon, _age_horizon(records, later, older_than))
    kept = tuple(c for c in checkpoints if c == horizon or c in newest or (c > horizon and not budgeted))
    for seq in checkpoints:
        if seq < horizon:
            items.append(RetentionItem(checkpoint_key(seq), f"superseded checkpoint: keeping "
                                                             f"{', '.join(map(str, kept))}"))
        elif seq not in kept:
            items.append(RetentionItem(checkpoint_key(seq), f"between the horizon {horizon} and the newest "
                                                             f"commits (byte budget): keeping "
                                                             f"{', '.join(map(str, kept))}"))

    settled: dict[str, int] = {}       # delta key -> last commit <= horizon naming it
    named_later: set[str] = set()      # delta keys named by a commit after the horizon
    produced_at: dict[str, int] = {}   # version key -> commit seq that produced it
    for record in records if horizon >= 0 else ():
        for key in _named(record):
            if record.seq <= horizon:
                settled[key] = record.seq
            else:
                named_later.add(key)
        for out in published_keys(record):
            produced_at[out] = record.seq

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
            doomed: list[tuple[int, str, str]] = []
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
                doomed.append((version, key, reason))
            # An int4 run's versions are deltas on a full snapshot (docs/algorithm.md "Versions down"):
            # what stays must stay readable, so the newest snapshot at or below the oldest version that
            # stays is kept, with every delta after it.
            snapshots = [v for v, key in versions if key.endswith(SNAPSHOT_SUFFIX)]
            if snapshots:
                gone = {key for _, key, _ in doomed}
                oldest = min([v for v, key in versions if v > 0 and key not in gone] + [max(snapshots)])
                floor = max((v for v in snapshots if v <= oldest), default=0)
                doomed = [d for d in doomed if d[0] < floor]
            items += [RetentionItem(key, reason) for _, key, reason in doomed]
    return RetentionPlan(store.uri, horizon, kept, tuple(items))


def apply_retention(store: ObjectStore, plan: RetentionPlan) -> int:
    """Delete every key of ``plan`` (made for this store); returns how many were deleted. The
    horizon is written first (``hints/retention``), so that a replay knows where the run can be
    verified from even when a deletion stops part way."""
    if plan.uri != store.uri:
        raise ValueError(f"retention plan was made for {plan.uri}, not {store.uri}")
    if plan.items and plan.horizon >= 0:
        store.put(RETENTION_KEY, pack_retention_hint(plan.horizon, list(plan.kept_checkpoints)))
    for item in plan.items:
        store.delete(item.key)
    return len(plan.items)
