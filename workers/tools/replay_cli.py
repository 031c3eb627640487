"""`ddiloco replay RUN_URI [--from SEQ] [--to SEQ]`: verify a run's log bit for bit (SPEC §7 'Replay').

Recomputes every committed fragment version from the inputs the log names, with the same pure fold
and code path the syncer's recovery uses (``workers.tools.replay_verify.replay_run`` over
``workers.common.refold.rebuild``), and checks each commit, each stored version and each checkpoint. Exit status: 0 verified, 1 a divergence (a recomputed value or decision differs from
the recorded one), 3 damage (a missing, truncated or altered object, a gap in the log), 2 bad
arguments, no run at RUN_URI, or a ``--from`` before what retention kept (not damage: issue 26).
Without ``--from``, replay starts after the horizon retention wrote (``hints/retention``) and says
so. Progress: a bar on a terminal, plain lines otherwise.
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import time
from typing import Callable, TextIO

from pipeline.errors import FormatError
from pipeline.fold import ReplayMismatch
from pipeline.types import CommitRecord
from storage.checkpoints import list_checkpoints
from storage.errors import NotFound, StoreError
from storage.layout import DELTA_PREFIX, SPILL_PREFIX, VERSION_PREFIX
from storage.regions import open_region, verify_region
from storage.shards import shard_stores
from storage.store import open_store
from workers.common.refold import ReplayStats
from workers.tools.replay_verify import log_bounds, replay_run, retention_horizon
from workers.common.runs import open_run, run_output

EXIT_OK, EXIT_DIVERGED, EXIT_USAGE, EXIT_DAMAGED = 0, 1, 2, 3


def pipe_safe(command: Callable[..., int]) -> Callable[[argparse.Namespace], int]:
    """A handler printing to stdout/stderr that ends quietly when the reader goes away
    (``ddiloco log RUN | head``) instead of with a BrokenPipeError traceback."""
    def handler(args: argparse.Namespace) -> int:
        try:
            return command(args, sys.stdout, sys.stderr)
        except BrokenPipeError:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # Python's documented recipe
            return 0
    return handler


def add_location_args(parser: argparse.ArgumentParser) -> None:
    """RUN_URI and --s3-endpoint, shared by the inspection commands."""
    parser.add_argument("run_uri", metavar="RUN_URI",
                        help="the run: a directory (also a local mirror of an S3 run, or a `ddiloco run` output "
                             "directory), file:///path or s3://bucket/prefix")
    parser.add_argument("--s3-endpoint", default=None, help="S3 endpoint URL (default: AWS_ENDPOINT_URL or AWS)")


class PlainProgress:
    """Progress as plain lines: about ten per phase, and at least every ``every_s`` seconds."""

    def __init__(self, out: TextIO, every_s: float = 2.0, clock: Callable[[], float] = time.monotonic):
        self.out, self.every_s, self.clock = out, every_s, clock
        self.totals: dict[str, int] = {}
        self._last_t = clock()
        self._last_n: dict[str, int] = {}

    def __enter__(self) -> "PlainProgress":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def set_total(self, phase: str, total: int) -> None:
        self.totals[phase] = total

    def __call__(self, phase: str, rec: CommitRecord, stats: ReplayStats) -> None:
        total = self.totals.get(phase)   # None: not known in advance (catching up from a checkpoint)
        now = self.clock()
        due = now - self._last_t >= self.every_s
        if total is not None:
            due = due or stats.commits == total or stats.commits - self._last_n.get(phase, 0) >= max(1, -(-total // 10))
        if due:
            of = f"/{total}" if total is not None else ""
            print(f"  {phase}: {stats.commits}{of} commits (at commit {rec.seq}, {stats.versions} versions)",
                  file=self.out, flush=True)
            self._last_t, self._last_n[phase] = now, stats.commits


class BarProgress:
    """Progress as a rich bar (on a terminal)."""

    def __init__(self, out: TextIO):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            console=Console(file=out), transient=False)
        self.tasks: dict[str, int] = {}

    def __enter__(self) -> "BarProgress":
        self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)

    def set_total(self, phase: str, total: int) -> None:
        if total:
            self.tasks[phase] = self.bar.add_task(phase, total=total)

    def __call__(self, phase: str, rec: CommitRecord, stats: ReplayStats) -> None:
        if phase in self.tasks:
            self.bar.update(self.tasks[phase], completed=stats.commits, description=f"{phase} (commit {rec.seq})")


def describe_mismatch(exc: ReplayMismatch) -> list[str]:
    """The divergence, one fact per line (commit, fragment, tensor, max abs diff, cause)."""
    lines = [f"replay DIVERGED at commit {exc.seq}"]
    if exc.fragment >= 0:
        lines.append(f"  fragment:      {exc.fragment}")
    if exc.tensor:
        lines.append(f"  tensor:        {exc.tensor}")
    if exc.max_abs_diff is not None:
        lines.append(f"  max abs diff:  {exc.max_abs_diff:.6g}")
    lines.append(f"  cause:         {exc.detail}")
    return lines


def _naming_commit(exc: NotFound) -> int | None:
    """The commit that named a missing delta, spill or version (replay's message says), else None."""
    named = re.search(r"named by commit (\d+)", str(exc))
    retainable = (exc.key or "").startswith((DELTA_PREFIX, SPILL_PREFIX, VERSION_PREFIX))
    return int(named.group(1)) if named and retainable else None


def _removed_by_retention(exc: NotFound, horizon: int | None) -> bool:
    """Whether a missing object was named only by commits at or before the retention horizon."""
    seq = _naming_commit(exc)
    return horizon is not None and seq is not None and seq <= horizon


def _retention_hint(store, exc: NotFound) -> str:
    """A missing delta below a kept checkpoint was most likely removed by retention on purpose."""
    seq = _naming_commit(exc)
    if seq is None:
        return ""
    try:
        later = [c for c in list_checkpoints(store) if c >= seq]
    except StoreError:
        return ""
    return (f"\n  hint: checkpoint {later[0]} lies after this commit; if retention removed old objects, "
            f"replay from after it (--from {later[0] + 1})") if later else ""


def configure(parser: argparse.ArgumentParser):
    """Verify a run bit for bit by recomputing every committed version from the log's recorded inputs."""
    add_location_args(parser)
    parser.add_argument("--from", dest="start", type=int, default=None, metavar="SEQ",
                        help="first commit to verify (default: the first after the init commits, or after the "
                             "oldest kept checkpoint once retention removed older deltas; 0: from the start); "
                             "replay starts from the nearest checkpoint before it and checks everything on the way")
    parser.add_argument("--to", dest="end", type=int, default=None, metavar="SEQ",
                        help="last commit to verify (default: the end of the log)")
    parser.add_argument("--plain", action="store_true", help="plain progress lines even on a terminal")
    parser.add_argument("--shard", type=int, default=None, metavar="I",
                        help="a sharded run (ddiloco run --syncers N): verify only shard I's log (default: every "
                             "shard's, one after the other; --from/--to need --shard there: seqs are per shard)")
    parser.add_argument("--regions", action="store_true",
                        help="also check that every other region's store holds the home log's commit records and "
                             "versions byte for byte (docs/regions.md)")
    return pipe_safe(replay_command)


def verify_regions(store, descriptor, tail: int, out: TextIO, err: TextIO,
                   copies: dict[str, str] | None = None) -> bool:
    """Each non-home region's copy against the authoritative log (commits 0..``tail``), by sha256
    of every object; one line per region. True if every copy matches. ``copies``: region
    name -> a local copy of its store to read instead (a ``--wan`` run's ``OUT/stores``, issue 26)."""
    if descriptor.regions is None:
        print("regions: this run has one region (no regions section): nothing to compare", file=out)
        return True
    ok = True
    for spec in descriptor.regions.others:
        try:
            where = f"{spec.uri}, the run's copy at {copies[spec.name]}" if spec.name in (copies or {}) else spec.uri
            region = open_store(copies[spec.name], create=False) if spec.name in (copies or {}) else open_region(spec)
            check = verify_region(store, region, spec.name, tail)
        except (StoreError, FormatError) as exc:
            print(f"region {spec.name} ({where}): FAILED: {exc}", file=err)
            ok = False
            continue
        if check.ok:
            print(f"region {spec.name} ({where}): {check.checked} commits match the home log", file=out)
            continue
        ok = False
        lag = f"; its log ends at commit {check.tail} of {tail} (replication behind?)" if check.tail < tail else ""
        print(f"region {spec.name} ({where}): {len(check.missing)} objects missing, {len(check.mismatched)} "
              f"differ{lag}; first: {(check.mismatched + check.missing)[:3]}", file=err)
    return ok


def replay_command(args, out: TextIO, err: TextIO) -> int:
    """Verify the run's log; in a sharded run every shard's log (or ``--shard I``'s), each on its
    own: shards own disjoint fragments, so each log replays alone (storage/shards.py). The exit
    status is the worst of them."""
    logging.basicConfig(level=logging.WARNING, format="warning: %(message)s", stream=err)
    try:
        store, descriptor = open_run(args.run_uri, s3_endpoint=args.s3_endpoint)
        stores = shard_stores(store, descriptor)
        shard = getattr(args, "shard", None)
        if descriptor.syncers == 1 and shard is not None:
            raise ValueError(f"run {descriptor.run_id} is not sharded: drop --shard")
        if shard is not None and not 0 <= shard < len(stores):
            raise ValueError(f"--shard {shard}: run {descriptor.run_id} has shards 0..{len(stores) - 1}")
        if len(stores) > 1 and shard is None and (args.start is not None or args.end is not None):
            raise ValueError("--from/--to in a sharded run name one shard's seqs: add --shard I")
    except (ValueError, StoreError, FormatError) as exc:
        print(f"error: {exc}", file=err)
        return EXIT_USAGE
    if len(stores) == 1:
        return _replay_log(store, descriptor, args, out, err)
    codes = []
    for i, s in enumerate(stores):
        if shard is None or shard == i:
            print(f"syncer shard {i}/{len(stores)} (fragments {list(s.fragments)}):", file=out, flush=True)
            codes.append(_replay_log(s, descriptor, args, out, err))
    worst = max(codes, key=lambda c: (c != EXIT_OK, c == EXIT_DIVERGED, c))
    print(f"{sum(c == EXIT_OK for c in codes)} of {len(codes)} shard logs verified", file=out)
    return worst


def _replay_log(store, descriptor, args, out: TextIO, err: TextIO) -> int:
    """Verify one commit log (the run's, or one shard's). By default from the retention horizon on
    when retention removed what older commits named: a plain replay of a healthy run
    after retention verifies, and says where it started."""
    horizon = retention_horizon(store)
    try:
        lo, hi, tail = log_bounds(store, descriptor, args.start, args.end)
    except (ValueError, StoreError, FormatError) as exc:
        print(f"error: {exc}", file=err)
        return EXIT_USAGE
    print(f"run {descriptor.run_id} at {store.uri}: {tail + 1} commits, {descriptor.num_fragments} fragments; "
          f"verifying commits {lo}..{hi}", file=out, flush=True)
    if args.start is None and horizon is not None and lo == horizon + 1:
        print(f"  from checkpoint {horizon}: retention removed the deltas older commits named (--from 0 "
              "replays from the start, which needs them)", file=out, flush=True)
    progress = PlainProgress(out) if args.plain or not out.isatty() else BarProgress(out)
    progress.set_total("verify", hi - lo + 1)
    try:
        with progress:
            report = replay_run(store, descriptor, args.start, args.end, progress=progress,
                                notify=lambda line: print(line, file=out, flush=True))
    except ReplayMismatch as exc:
        print("\n".join(describe_mismatch(exc)), file=err)
        return EXIT_DIVERGED
    except NotFound as exc:
        if _removed_by_retention(exc, horizon):    # asked for, not damage: say so, exit 2
            print(f"error: cannot verify from commit {lo}: retention removed what it needs ({exc}); the run "
                  f"verifies from checkpoint {horizon} on: `ddiloco replay {args.run_uri}`", file=err)
            return EXIT_USAGE
        print(f"replay FAILED: {exc}{_retention_hint(store, exc)}", file=err)
        return EXIT_DAMAGED
    except (FormatError, StoreError) as exc:
        print(f"replay FAILED: {exc}", file=err)
        return EXIT_DAMAGED
    for w in report.warnings:
        print(f"warning: {w}", file=err)
    print(f"verified {report.commits} commits, {report.versions} versions (commits {report.start}..{report.end}, "
          f"checkpoints matched: {report.checkpoints}, {report.seconds:.2f} s)", file=out, flush=True)
    copies = (run_output(args.run_uri) or {}).get("region_stores")
    if getattr(args, "regions", False) and not verify_regions(store, descriptor, hi, out, err,
                                                              copies if isinstance(copies, dict) else None):
        return EXIT_DAMAGED
    return EXIT_OK
