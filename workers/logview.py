"""`ddiloco log RUN_URI`: a run's commit log, one line per commit, and totals (SPEC §4, §7).

Each line says what the syncer decided and why: sequence, epoch, kind, fragment and version; every
merged delta with its normalised token weight, token and step counts and base version (staleness);
every dropped delta with its reason; the quorum size and the grace wait. The totals at the end are
tokens and deltas merged and dropped per learner (the same numbers as a run's summary.json).
``--json`` prints JSON Lines instead: ``{"type": "commit", ...CommitRecord.to_dict()}`` per commit,
then one ``{"type": "totals", ...}`` (docs/replay.md).
"""
from __future__ import annotations

import argparse
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, TextIO

from pipeline.errors import FormatError
from pipeline.types import CommitRecord
from storage.errors import StoreError
from storage.log import CommitLog
from .replay_verify import open_run
from .replay_cli import EXIT_DAMAGED, EXIT_USAGE, add_location_args, pipe_safe


@dataclass
class LearnerTotals:
    merged: int = 0               # deltas merged
    tokens_merged: int = 0
    steps_merged: int = 0
    dropped: int = 0              # deltas dropped
    tokens_dropped: int = 0
    reasons: Counter = field(default_factory=Counter)   # drop reason -> count

    def to_dict(self) -> dict[str, Any]:
        return {"deltas_merged": self.merged, "tokens_merged": self.tokens_merged, "steps_merged": self.steps_merged,
                "deltas_dropped": self.dropped, "tokens_dropped": self.tokens_dropped,
                "drop_reasons": dict(sorted(self.reasons.items()))}


@dataclass
class LogTotals:
    """Sums over the commits shown (``learner``: count only that learner's deltas)."""

    learner: str | None = None
    kinds: Counter = field(default_factory=Counter)       # commit kind -> count
    versions: dict[int, int] = field(default_factory=dict)  # fragment -> newest version seen
    learners: dict[str, LearnerTotals] = field(default_factory=dict)
    first_seq: int = -1
    last_seq: int = -1

    def add(self, rec: CommitRecord) -> None:
        self.kinds[rec.kind] += 1
        self.first_seq = rec.seq if self.first_seq < 0 else self.first_seq
        self.last_seq = rec.seq
        if rec.kind in ("init", "merge"):
            self.versions[rec.fragment] = max(self.versions.get(rec.fragment, -1), rec.version)
        for i in rec.inputs:
            if self.learner in (None, i.learner):
                t = self.learners.setdefault(i.learner, LearnerTotals())
                t.merged += 1
                t.tokens_merged += i.c_tokens
                t.steps_merged += i.c_steps
        for d in rec.dropped:
            if self.learner in (None, d.learner):
                t = self.learners.setdefault(d.learner, LearnerTotals())
                t.dropped += 1
                t.tokens_dropped += d.c_tokens
                t.reasons[_reason_class(d.reason)] += 1

    @property
    def all(self) -> LearnerTotals:
        out = LearnerTotals()
        for t in self.learners.values():
            out.merged += t.merged
            out.tokens_merged += t.tokens_merged
            out.steps_merged += t.steps_merged
            out.dropped += t.dropped
            out.tokens_dropped += t.tokens_dropped
            out.reasons.update(t.reasons)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"type": "totals", "first_seq": self.first_seq, "last_seq": self.last_seq,
                "commits": sum(self.kinds.values()), "commits_by_kind": dict(sorted(self.kinds.items())),
                "versions_per_fragment": {str(p): v for p, v in sorted(self.versions.items())},
                **self.all.to_dict(),
                "per_learner": {m: t.to_dict() for m, t in sorted(self.learners.items())}}


def _reason_class(reason: str) -> str:
    """'shape-mismatch: wte.weight' counts as 'shape-mismatch' in totals."""
    return reason.split(":", 1)[0]


def selected(rec: CommitRecord, fragment: int | None, learner: str | None) -> bool:
    """Whether a commit is shown under ``--fragment``/``--learner``."""
    if fragment is not None and rec.fragment != fragment:
        return False
    if learner is not None:
        return any(i.learner == learner for i in rec.inputs) or any(d.learner == learner for d in rec.dropped)
    return True


def commit_line(rec: CommitRecord) -> str:
    """One commit as one line (see the module docstring)."""
    head = f"#{rec.seq:<5} e{rec.epoch} {rec.kind:<5}"
    if rec.kind == "fence":
        who = rec.info.get("syncer", "?")
        return f"{head} syncer {who!r} takes over (epoch {rec.epoch})"
    head += f" f{rec.fragment} v{rec.version}"
    if rec.kind == "init":
        return f"{head} initial model"
    parts = [head, f"quorum {rec.quorum} grace {rec.grace_wait_s:.3f}s"]
    if rec.inputs:
        parts.append("merged " + "; ".join(
            f"{i.delta_id} w={i.weight:.3f} tok={i.c_tokens} steps={i.c_steps} base=v{i.base_version}"
            f" stale={i.staleness}" for i in rec.inputs))
    if rec.dropped:
        parts.append("dropped " + "; ".join(f"{d.delta_id} ({d.reason})" for d in rec.dropped))
    rejected = rec.info.get("rejected")
    if isinstance(rejected, dict) and rejected:   # refused at ingest (bad messages, no stored blob)
        parts.append("rejected at ingest " + ", ".join(f"{k} x{v}" for k, v in sorted(rejected.items())))
    return " | ".join(parts)


def totals_lines(t: LogTotals) -> list[str]:
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(t.kinds.items()))
    versions = ", ".join(f"f{p} v{v}" for p, v in sorted(t.versions.items()))
    lines = [f"totals: {sum(t.kinds.values())} commits ({kinds or 'none'}); newest versions: {versions or 'none'}",
             f"  {'learner':<16} {'merged':>7} {'tokens merged':>14} {'dropped':>8} {'tokens dropped':>15}  reasons"]
    rows = sorted(t.learners.items()) + ([("all", t.all)] if t.learner is None else [])
    for name, r in rows:
        reasons = ", ".join(f"{k} {n}" for k, n in sorted(r.reasons.items())) or "-"
        lines.append(f"  {name:<16} {r.merged:>7} {r.tokens_merged:>14} {r.dropped:>8} {r.tokens_dropped:>15}  {reasons}")
    return lines


def show_log(records: Iterable[CommitRecord], out: TextIO, *, as_json: bool = False, fragment: int | None = None,
             learner: str | None = None) -> LogTotals:
    """Print the selected commits and their totals; returns the totals."""
    totals = LogTotals(learner=learner)
    for rec in records:
        if not selected(rec, fragment, learner):
            continue
        totals.add(rec)
        print(json.dumps({"type": "commit", **rec.to_dict()}) if as_json else commit_line(rec), file=out)
    if as_json:
        print(json.dumps(totals.to_dict()), file=out)
    else:
        print("\n".join(totals_lines(totals)), file=out)
    return totals


def configure(parser: argparse.ArgumentParser):
    """Show a run's commit log: per commit the merged and dropped deltas, weights and staleness; totals."""
    add_location_args(parser)
    parser.add_argument("--json", action="store_true", help="JSON Lines: one object per commit, then the totals")
    parser.add_argument("--fragment", type=int, default=None, metavar="P", help="only commits of fragment P")
    parser.add_argument("--learner", default=None, metavar="ID", help="only commits that merged or dropped a delta "
                        "of this learner (totals count only its deltas)")
    parser.add_argument("--from", dest="start", type=int, default=0, metavar="SEQ", help="first commit shown")
    parser.add_argument("--to", dest="end", type=int, default=None, metavar="SEQ", help="last commit shown")
    return pipe_safe(log_command)


def log_command(args, out: TextIO, err: TextIO) -> int:
    try:
        store, descriptor = open_run(args.run_uri, s3_endpoint=args.s3_endpoint)
        if args.fragment is not None and not 0 <= args.fragment < descriptor.num_fragments:
            raise ValueError(f"--fragment {args.fragment}: the run has fragments 0..{descriptor.num_fragments - 1}")
        if args.start < 0 or (args.end is not None and args.end < args.start):
            raise ValueError(f"--from {args.start} --to {args.end}: need 0 <= from <= to")
    except (ValueError, StoreError, FormatError) as exc:
        print(f"error: {exc}", file=err)
        return EXIT_USAGE
    log = CommitLog(store)
    try:
        end = log.tail() if args.end is None else args.end
        show_log(log.read_range(args.start, end + 1), out, as_json=args.json, fragment=args.fragment,
                 learner=args.learner)
    except (StoreError, FormatError) as exc:
        out.flush()
        print(f"log FAILED: {exc}", file=err)
        return EXIT_DAMAGED
    return 0
