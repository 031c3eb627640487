"""Retention: the store does not grow without bound (SPEC §7, docs/storage.md).

Two users of ``storage.retention`` (which decides what may go, and why):

- the **syncer** (``SyncerRetention``): after each checkpoint it plans and applies retention in
  the background (its I/O pool), incrementally - each plan reads the log only from the previous
  horizon. On by default (``RetentionConfig``): the newest ``keep_commits`` (1000) commits keep
  everything they name, and behind them only the newest 2 checkpoints and the run's
  ``retain_versions`` newest versions per fragment stay. A **byte budget** limits it too (issue 26;
  ``keep_bytes``, default ``storage.retention.default_keep_bytes``: 8 fp32 model sizes plus two of
  the newest checkpoint): when what a replay from the oldest kept checkpoint reads outgrows it, the
  horizon moves to a newer checkpoint (never into the newest ``min_commits`` = 100) and the
  checkpoints between it and the newest two go - so the store stops growing long before 1000
  commits (at the paper's 5B parameters the 1000-commit rule alone kept about a terabyte).
  A failure is reported and retried after the next checkpoint; it never stops the syncer, nor
  crowds it: the pass pauses between its requests so that it takes at most ``duty`` (a quarter)
  of the time (``Paced``).
- an operator: ``ddiloco gc RUN_URI`` lists what would be deleted, one line per object with its
  reason, and deletes only with ``--delete``. Safe while the run is going on (same rules).

What stays is enough to restart the syncer and to replay from any kept checkpoint: ``ddiloco
replay RUN_URI`` starts after the horizon retention wrote (``hints/retention``) and says so. A
full replay from the first commit needs the deleted deltas; turn retention off (``ddiloco syncer
--keep-all``) for runs that must keep that.
"""
from __future__ import annotations

import argparse
import json
import threading
from concurrent.futures import Executor
import math
import time
from dataclasses import dataclass
from typing import Callable, Literal, TextIO

from pipeline.errors import FormatError
from storage.errors import StoreError
from storage.log import CommitLog
from storage.layout import CHECKPOINT_PREFIX, DELTA_PREFIX, SPILL_PREFIX, VERSION_PREFIX, read_descriptor
from storage.retention import (RetentionPlan, apply_retention, default_keep_bytes, object_size, parse_duration,
                               parse_size, plan_retention)
from storage.shards import shard_stores
from storage.store import ObjectStore
from workers.common.events import EventLog

EXIT_OK, EXIT_USAGE, EXIT_STORE = 0, 2, 3


@dataclass(frozen=True)
class RetentionConfig:
    """The syncer's retention. ``keep_versions`` None: the run descriptor's ``retain_versions``."""

    enabled: bool = True
    keep_checkpoints: int = 2
    keep_versions: int | None = None
    keep_commits: int = 1000          # the newest commits whose inputs and versions are never deleted ...
    keep_bytes: int | Literal["auto"] | None = "auto"   # ... unless they outgrow this (None: no byte limit) ...
    min_commits: int = 100            # ... and never fewer than these, whatever the budget (4 checkpoints' worth)
    keep_age_s: float | None = None   # what only commits older than this name goes too (None: no age limit)
    duty: float = 0.25                # the share of time a pass may work; it pauses the rest (``Paced``)

    def __post_init__(self) -> None:
        if self.keep_bytes not in ("auto", None) and (not isinstance(self.keep_bytes, int)
                                                      or isinstance(self.keep_bytes, bool) or self.keep_bytes < 0):
            raise ValueError(f"keep_bytes must be 'auto', None or an int >= 0, got {self.keep_bytes!r}")
        if not isinstance(self.duty, (int, float)) or isinstance(self.duty, bool) or not 0 < self.duty <= 1:
            raise ValueError(f"retention duty must lie in (0, 1] (the share of time a pass may work), got {self.duty!r}")
        if not isinstance(self.min_commits, int) or self.min_commits < 0:
            raise ValueError(f"min_commits must be an int >= 0, got {self.min_commits!r}")
        if self.keep_age_s is not None and not (isinstance(self.keep_age_s, (int, float)) and self.keep_age_s > 0):
            raise ValueError(f"keep_age_s must be > 0 seconds or None, got {self.keep_age_s!r}")
        if not isinstance(self.keep_commits, int) or self.keep_commits < 0:
            raise ValueError(f"keep_commits must be an int >= 0, got {self.keep_commits!r}")
        if not isinstance(self.keep_checkpoints, int) or self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be an int >= 1, got {self.keep_checkpoints!r} "
                             "(one damaged checkpoint must leave a fallback: 2 is the default)")
        if self.keep_versions is not None and (not isinstance(self.keep_versions, int) or self.keep_versions < 1):
            raise ValueError(f"keep_versions must be an int >= 1 or None, got {self.keep_versions!r}")


class SizeNoting:
    """The syncer's store, noting the size of each delta, spill, version and checkpoint it writes
    or reads into ``sizes``, so that retention's byte budget needs no HEAD for them (issue 26: the
    first budgeted pass otherwise sent one HEAD per object of the window through the syncer's I/O).
    Everything else is the wrapped store's."""

    NOTED = (DELTA_PREFIX, SPILL_PREFIX, VERSION_PREFIX, CHECKPOINT_PREFIX)

    def __init__(self, store: ObjectStore, sizes: dict[str, int]):
        self._store, self._sizes, self.uri = store, sizes, store.uri

    def get(self, key: str) -> bytes:
        data = self._store.get(key)
        self._note(key, data)
        return data

    def put_if_absent(self, key: str, data: bytes) -> None:
        self._store.put_if_absent(key, data)
        self._note(key, data)

    def put(self, key: str, data: bytes) -> None:
        self._store.put(key, data)
        self._note(key, data)

    def _note(self, key: str, data) -> None:
        if key.startswith(self.NOTED):
            self._sizes[key] = len(data)

    @property
    def shard_view(self):
        """The wrapped store, for storage/shards.py's checks of a shard's partition."""
        return self._store

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def __repr__(self) -> str:
        return f"SizeNoting({self._store!r})"


class Paced:
    """``store`` as a background pass uses it: after each request it pauses so that the pass works
    at most ``duty`` of the time - the work since its last pause (requests and the pass's own
    reading of them) times (1 - duty) / duty. Why: a pass of 100-200 requests (the log since the
    horizon, listings, deletes) on the syncer's I/O pool took 1.4-3.2 s beside two busy loops, and
    while it ran the loop thread got too little of the process's share of two cores (and of the
    interpreter) to close rounds: a fragment went 36-60 global steps without a merge (bound
    2H = 24) in three of the four s3-outage runs of 900 steps whose syncer began a pass. Paced, a pass
    takes four times as long; nothing waits for it."""

    def __init__(self, store: ObjectStore, duty: float, sleep: Callable[[float], None],
                 clock: Callable[[], float] = time.monotonic):
        self._store, self._duty, self._sleep, self._clock = store, duty, sleep, clock
        self._since = clock()          # when the pass last resumed work
        self.uri = store.uri

    def __getattr__(self, name: str):
        attr = getattr(self._store, name)
        if not callable(attr) or self._duty >= 1:
            return attr

        def paced(*args, **kwargs):
            try:
                return attr(*args, **kwargs)
            finally:
                work = self._clock() - self._since
                self._sleep(max(0.0, work) * (1 - self._duty) / self._duty)
                self._since = self._clock()
        return paced


class SyncerRetention:
    """Runs retention after a checkpoint on ``executor``; at most one pass at a time. ``pace``: the
    sleep a pass pauses with (``Paced``; None: it never pauses - the fault simulation runs its
    passes inline on simulated time, where pausing would stall the syncer's turn instead)."""

    def __init__(self, store: ObjectStore, cfg: RetentionConfig, events: EventLog, executor: Executor,
                 wall: Callable[[], float] = time.time, sizes: dict[str, int] | None = None,
                 pace: Callable[[float], None] | None = time.sleep):
        self.store, self.cfg, self.events, self.executor, self.wall = store, cfg, events, executor, wall
        self.pace = pace
        self._scan_from = 0
        self._busy = threading.Lock()
        self.passes = 0
        self.deleted = 0
        # object sizes seen (objects never change; deleted ones leave): shared with the syncer's
        # SizeNoting store, which fills it as the syncer writes and reads
        self._sizes: dict[str, int] = sizes if sizes is not None else {}
        self._model_bytes: int | None = None

    def after_checkpoint(self, seq: int) -> None:
        if not self.cfg.enabled or not self._busy.acquire(blocking=False):
            return   # a pass is still running: the next checkpoint starts another
        try:
            self.executor.submit(self._pass, seq)
        except RuntimeError:       # the executor is shutting down: the syncer is stopping
            self._busy.release()

    def _pass(self, seq: int) -> None:
        store = self.store if self.pace is None else Paced(self.store, self.cfg.duty, self.pace)
        try:
            plan = plan_retention(store, self.cfg.keep_checkpoints, self.cfg.keep_versions,
                                  scan_from=self._scan_from, newest_horizon=seq - self.cfg.keep_commits,
                                  keep_bytes=self._budget(store), floor_horizon=seq - self.cfg.min_commits,
                                  older_than=None if self.cfg.keep_age_s is None else self.wall() - self.cfg.keep_age_s,
                                  size_of=lambda key: self._size(key, store))
            n = apply_retention(store, plan)
            for key in plan.keys():
                self._sizes.pop(key, None)
            if plan.horizon >= 0:
                self._scan_from = plan.horizon + 1
            self.passes += 1
            self.deleted += n
            if n:
                self.events.emit("retention", after_checkpoint=seq, horizon=plan.horizon, deleted=n,
                                 by_prefix=plan.summary(), kept_checkpoints=list(plan.kept_checkpoints))
        except (StoreError, FormatError) as exc:
            self.events.emit("store-error", op="retention", error=str(exc))
        finally:
            self._busy.release()

    def _size(self, key: str, store: ObjectStore) -> int:
        if key not in self._sizes:
            self._sizes[key] = object_size(store, key)
        return self._sizes[key]

    def _budget(self, store: ObjectStore) -> int | None:
        if self.cfg.keep_bytes != "auto":
            return self.cfg.keep_bytes
        if self._model_bytes is None:        # fixed for the run: read the descriptor once, not every pass
            self._model_bytes = model_bytes(store)
        return default_keep_bytes(store, self._model_bytes, lambda key: self._size(key, store))


def model_bytes(store: ObjectStore) -> int:
    """The run's model as fp32 bytes (the unit of the default budget)."""
    return 4 * sum(math.prod(t.shape) for t in read_descriptor(store).layout.tensors)


def budget_bytes(store: ObjectStore, keep_bytes: int | str | None, size_of=None) -> int | None:
    """``keep_bytes`` resolved: "auto" is ``default_keep_bytes`` for this run's model."""
    if keep_bytes != "auto":
        return keep_bytes
    return default_keep_bytes(store, model_bytes(store), size_of)


# -- ddiloco gc --------------------------------------------------------------------------------------

def configure(parser: argparse.ArgumentParser):
    """List (and with --delete, delete) what retention may remove from a run's store."""
    parser.add_argument("run_uri", metavar="RUN_URI", help="the run's location: a directory or s3://bucket/prefix")
    parser.add_argument("--s3-endpoint", default=None, help="S3 endpoint URL (default: AWS_ENDPOINT_URL or AWS)")
    parser.add_argument("--delete", action="store_true", help="delete them (default: only list them, a dry run)")
    parser.add_argument("--keep-checkpoints", type=int, default=2, metavar="N",
                        help="checkpoints kept (default 2: one damaged checkpoint still leaves a fallback)")
    parser.add_argument("--keep-versions", type=int, default=None, metavar="N",
                        help="newest versions kept per fragment (default: the run's retain_versions)")
    parser.add_argument("--keep-commits", type=int, default=0, metavar="N",
                        help="keep everything the newest N commits name (default 0; the syncer's default is 1000)")
    parser.add_argument("--keep-bytes", default="none", metavar="SIZE",
                        help="also keep what replay from the oldest kept checkpoint reads within SIZE (e.g. 500MB; "
                             "'auto': the syncer's default, 8 fp32 model sizes + 2 newest checkpoints; default none)")
    parser.add_argument("--keep-age", default=None, metavar="DURATION",
                        help="also let go what only commits older than DURATION name (e.g. 7d, 12h; default: no age "
                             "limit)")
    parser.add_argument("--json", action="store_true", help="JSON Lines: one object per key, then a summary")
    parser.add_argument("--quiet", action="store_true", help="only the summary, not every key")

    def handler(args) -> int:
        import sys
        return gc_command(args, sys.stdout, sys.stderr)
    return handler


def gc_command(args, out: TextIO, err: TextIO) -> int:
    """Plan (and apply) retention; in a sharded run for each shard's partition on its
    own (storage/shards.py: a shard's plan sees only its log, checkpoints, inbox and versions)."""
    from workers.common.runs import open_run     # never creates a mistyped local directory
    try:
        root, desc = open_run(args.run_uri, s3_endpoint=args.s3_endpoint)
        if args.keep_commits < 0:
            raise ValueError(f"--keep-commits must be >= 0, got {args.keep_commits}")
        keep = parse_keep_bytes(args.keep_bytes, "--keep-bytes")
        older_than = None if args.keep_age is None else time.time() - parse_duration(args.keep_age)
        plans = []
        for store in shard_stores(root, desc):
            tail = CommitLog(store).tail()
            budget = budget_bytes(store, keep)
            plans.append((store, plan_retention(store, args.keep_checkpoints, args.keep_versions,
                                                newest_horizon=tail - args.keep_commits if args.keep_commits else None,
                                                keep_bytes=budget, older_than=older_than), budget))
    except ValueError as exc:
        print(f"error: {exc}", file=err)
        return EXIT_USAGE
    except (StoreError, FormatError) as exc:
        print(f"error: {exc} — check the location (and for S3 the endpoint and credentials)", file=err)
        return EXIT_USAGE
    for i, (store, plan, budget) in enumerate(plans):
        if len(plans) > 1 and not args.json:
            print(f"syncer shard {i}/{len(plans)}:", file=out)
        code = _apply(store, plan, budget, args, out, err)
        if code != EXIT_OK:
            return code
    return EXIT_OK


def parse_keep_bytes(text: str, flag: str) -> int | str | None:
    """A --keep-bytes / --retain-bytes value: 'auto', 'none' or a size (ValueError naming the flag)."""
    if str(text).lower() in ("auto", "none"):
        return str(text).lower() if str(text).lower() == "auto" else None
    try:
        return parse_size(text)
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}, or 'auto' or 'none'") from None


def _apply(store: ObjectStore, plan: RetentionPlan, budget: int | None, args, out: TextIO, err: TextIO) -> int:
    for item in plan.items if not args.quiet else ():
        print(json.dumps({"type": "key", "key": item.key, "reason": item.reason}) if args.json
              else f"{'delete' if args.delete else 'would delete'} {item.key}  ({item.reason})", file=out)
    deleted = 0
    if args.delete:
        try:
            deleted = apply_retention(store, plan)
        except StoreError as exc:
            print(f"error: deleting failed part way: {exc} — run `ddiloco gc {args.run_uri} --delete` again "
                  "(it only ever deletes what the rules allow)", file=err)
            return EXIT_STORE
    _summary(store, plan, budget, args, deleted, out)
    return EXIT_OK


def _stored_bytes(store: ObjectStore, plan: RetentionPlan) -> tuple[int, int]:
    """(bytes the store holds now, bytes the plan would free), by a listing and one HEAD per object."""
    going = set(plan.keys())
    total = freed = 0
    for key in store.list(""):
        size = object_size(store, key)
        total += size
        freed += size if key in going else 0
    return total, freed


def _summary(store: ObjectStore, plan: RetentionPlan, budget: int | None, args, deleted: int, out: TextIO) -> None:
    counts = plan.summary()
    total, freed = _stored_bytes(store, plan) if not args.delete else (None, None)
    if args.json:
        print(json.dumps({"type": "summary", "dry_run": not args.delete, "deletable": len(plan.items),
                          "deleted": deleted, "by_prefix": counts, "horizon": plan.horizon,
                          "kept_checkpoints": list(plan.kept_checkpoints), "budget_bytes": budget,
                          "stored_bytes": total, "freed_bytes": freed}), file=out)
        return
    auto = budget_bytes(store, "auto")
    print(f"budget: {'none' if budget is None else f'{budget / 1e6:.1f} MB'} for what replay from the oldest kept "
          f"checkpoint reads (the syncer's default: {auto / 1e6:.1f} MB)", file=out)
    if total is not None:
        print(f"store: {total / 1e6:.1f} MB now, {(total - freed) / 1e6:.1f} MB after deleting", file=out)
    what = ", ".join(f"{k} {n}" for k, n in sorted(counts.items())) or "nothing"
    if plan.horizon < 0:
        print(f"nothing below a horizon yet: fewer than {args.keep_checkpoints} checkpoints exist "
              f"({len(plan.kept_checkpoints)}); only what no rule protects could go ({what})", file=out)
    verb = f"deleted {deleted}" if args.delete else f"would delete {len(plan.items)} (dry run: add --delete)"
    print(f"{verb} objects: {what}", file=out)
    if plan.horizon >= 0:   # replay starts at the oldest kept checkpoint and checks the newer ones on the way
        print(f"kept checkpoints {', '.join(map(str, plan.kept_checkpoints))}; verify what is left with "
              f"`ddiloco replay {args.run_uri}` (once deleted, it starts after checkpoint {plan.horizon})", file=out)
