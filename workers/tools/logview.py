"""`ddiloco log RUN_URI`: a run's commit log, one line per commit, and totals (SPEC §4, §7).

Each line says what the syncer decided and why: sequence, epoch, kind, fragment and version; every
merged delta with its normalised token weight, token and step counts and base version (staleness);
every dropped delta with its reason; the quorum size and the grace wait. The totals at the end are
tokens and deltas merged and dropped per learner (the same numbers as a run's summary.json):
tokens count training that entered the model once, however many deltas repeated it (``LogTotals``),
and harmless drops (duplicates, superseded deltas) are told apart from lost work.
``--json`` prints JSON Lines instead: ``{"type": "commit", ...CommitRecord.to_dict()}`` per commit,
then one ``{"type": "totals", ...}`` (docs/replay.md).

Traffic: ``--accounting`` reads the run's event logs (``--events DIR``, which implies
it; by default ``OUT/logs`` next to a run stored in ``OUT/store``, ``ddiloco run``'s layout) and
prints after the totals the requests and bytes per region, link, learner and outer step, the
estimated monthly cost (``--prices``) and the data-parallel comparison
(workers/tools/accounting.py); with ``--json`` as one more line after the totals,
``{"type": "accounting", ...}`` (docs/regions.md "The accounting report"). Opt-in, so that
without it the totals stay the last line tools read.
"""
from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, TextIO

from pipeline.errors import FormatError
from pipeline.types import CommitRecord, DroppedRecord
from storage.errors import StoreError
from storage.log import CommitLog
from storage.shards import shard_stores
from workers.tools.accounting import default_event_dir, read_event_dir, report_lines, traffic_report
from workers.tools.cost import parse_prices
from workers.common.runs import open_run
from workers.tools.replay_cli import EXIT_DAMAGED, EXIT_USAGE, add_location_args, pipe_safe


HARMLESS = ("duplicate", "superseded")   # another copy, or a newer delta of the same lineage, carried the work
# Every other reason is lost work: ``stale-incarnation``, ``base-too-old`` ... An overtaken answer
# (below its learner's mark, never merged) is merged in runs with merged marks, and
# ``superseded: seq S of its lineage was merged`` names a merged delta of an earlier commit.


@dataclass
class LearnerTotals:
    merged: int = 0               # deltas merged
    tokens_merged: float = 0.0    # tokens of training that entered the model (fragment-averaged)
    steps_merged: int = 0
    dropped: int = 0              # deltas dropped, for any reason
    harmless: int = 0             # of which duplicates or superseded (their work is in another delta)
    tokens_dropped: float = 0.0   # tokens of training lost (fragment-averaged): see ``LogTotals``
    reasons: Counter = field(default_factory=Counter)   # drop reason -> count

    def to_dict(self) -> dict[str, Any]:
        return {"deltas_merged": self.merged, "tokens_merged": round(self.tokens_merged, 1),
                "steps_merged": self.steps_merged, "deltas_dropped": self.dropped,
                "deltas_harmless": self.harmless, "deltas_lost": self.dropped - self.harmless,
                "tokens_dropped": round(self.tokens_dropped, 1), "drop_reasons": dict(sorted(self.reasons.items()))}


@dataclass
class LogTotals:
    """Sums over the commits shown (``learner``: count only that learner's deltas).

    Tokens: a delta's ``c_tokens`` counts every token since the learner last
    received a version of the fragment, so consecutive deltas on one base repeat each other's
    tokens and summing them over-counts (a 102k-token run showed 401k merged). Here the deltas of
    one learner life, fragment and base form a *lineage*; the tokens that entered the model are
    the largest ``c_tokens`` merged in it (every earlier delta of the lineage is inside that one),
    the tokens lost the rest of its largest ``c_tokens`` (work only dropped deltas held).
    A dropped delta's record has no base: a ``superseded`` one belongs to the lineage of the delta
    that superseded it (merged in the same commit); another (lost) one gets its base from its
    stored blob when ``base_of`` can read it, else it joins the lineage of the previous delta of its
    learner life and fragment if its counter grew since, and is a lineage of its own otherwise.
    Duplicates (one delta twice: bus and spill) and deltas superseded by a delta of their lineage
    merged in an earlier commit (``superseded: seq S ...``, issue 25) are not counted. Every step trains all
    ``fragments`` fragments, so token totals are divided by their number: "tokens merged" then
    reads as tokens of training, comparable with the tokens the learners trained.
    """

    learner: str | None = None
    fragments: int = 1
    base_of: Callable[[DroppedRecord], int | None] | None = field(default=None, repr=False)
    kinds: Counter = field(default_factory=Counter)       # commit kind -> count
    versions: dict[int, int] = field(default_factory=dict)  # fragment -> newest version seen
    learners: dict[str, LearnerTotals] = field(default_factory=dict)
    first_seq: int = -1
    last_seq: int = -1
    # (learner, incarnation, fragment) -> seq -> (c_tokens, base or None, merged)
    _lives: dict[tuple, dict[int, tuple[int, int | None, bool]]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.fragments, int) or self.fragments < 1:
            raise ValueError(f"fragments must be an int >= 1, got {self.fragments!r}")

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
                t.steps_merged += i.c_steps
                self._note((i.learner, i.incarnation, rec.fragment), i.seq, i.c_tokens, i.base_version, True)
        for d in rec.dropped:
            if self.learner in (None, d.learner):
                t = self.learners.setdefault(d.learner, LearnerTotals())
                t.dropped += 1
                reason = _reason_class(d.reason)
                t.reasons[reason] += 1
                t.harmless += reason in HARMLESS
                life = _life(d.delta_id)
                if reason == "duplicate" or life is None or (reason == "superseded" and d.reason != reason):
                    continue       # the work is in a delta merged before (issue 25: "superseded: seq S ...")
                if reason == "superseded":    # the fold keeps the newest of a lineage, merged right here
                    base = next((i.base_version for i in rec.inputs if (i.learner, i.incarnation) ==
                                 (d.learner, life[0]) and i.seq > life[1]), None)
                else:
                    base = self.base_of(d) if self.base_of is not None else None
                self._note((d.learner, life[0], rec.fragment), life[1], d.c_tokens, base, False)

    def _note(self, life: tuple, seq: int, c_tokens: int, base: int | None, merged: bool) -> None:
        deltas = self._lives.setdefault(life, {})
        old = deltas.get(seq)
        if old is None or (merged and not old[2]):
            deltas[seq] = (c_tokens, base if base is not None else (old[1] if old else None), merged)

    def _tokens(self) -> None:
        """Fill every learner's token totals from the lineages (see the class docstring)."""
        for t in self.learners.values():
            t.tokens_merged = t.tokens_dropped = 0.0
        for life, deltas in self._lives.items():
            lineages: dict[tuple, list[int]] = {}     # key -> [largest merged, largest seen]
            prev: tuple[int, tuple] | None = None
            for seq in sorted(deltas):
                c, base, merged = deltas[seq]
                if base is not None:
                    key = ("base", base)
                elif prev is not None and c >= prev[0]:
                    key = prev[1]                     # its counter kept growing: the previous delta's base
                else:
                    key = ("seq", seq)
                lin = lineages.setdefault(key, [0, 0])
                lin[1] = max(lin[1], c)
                if merged:
                    lin[0] = max(lin[0], c)
                prev = (c, key)
            t = self.learners[life[0]]
            for best_merged, best_seen in lineages.values():
                t.tokens_merged += best_merged / self.fragments
                t.tokens_dropped += (best_seen - best_merged) / self.fragments

    @property
    def all(self) -> LearnerTotals:
        self._tokens()
        out = LearnerTotals()
        for t in self.learners.values():
            out.merged += t.merged
            out.tokens_merged += t.tokens_merged
            out.steps_merged += t.steps_merged
            out.dropped += t.dropped
            out.harmless += t.harmless
            out.tokens_dropped += t.tokens_dropped
            out.reasons.update(t.reasons)
        return out

    def to_dict(self) -> dict[str, Any]:
        total = self.all
        return {"type": "totals", "first_seq": self.first_seq, "last_seq": self.last_seq,
                "commits": sum(self.kinds.values()), "commits_by_kind": dict(sorted(self.kinds.items())),
                "versions_per_fragment": {str(p): v for p, v in sorted(self.versions.items())},
                "token_fragments": self.fragments, **total.to_dict(),
                "per_learner": {m: t.to_dict() for m, t in sorted(self.learners.items())}}


def _life(delta_id: str) -> tuple[int, int] | None:
    """(incarnation, seq) from ``learner/incarnation/seq``; None for an id that is not one."""
    parts = delta_id.rsplit("/", 2)
    try:
        return int(parts[1]), int(parts[2])
    except (IndexError, ValueError):
        return None


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
    every = t.all
    lines = [f"totals: {sum(t.kinds.values())} commits ({kinds or 'none'}); newest versions: {versions or 'none'}",
             f"  {'learner':<16} {'merged':>7} {'tokens merged':>14} {'dropped':>8} {'harmless':>9} {'lost':>5} "
             f"{'tokens lost':>12}  reasons"]
    rows = sorted(t.learners.items()) + ([("all", every)] if t.learner is None else [])
    for name, r in rows:
        reasons = ", ".join(f"{k} {n}" for k, n in sorted(r.reasons.items())) or "-"
        lines.append(f"  {name:<16} {r.merged:>7} {r.tokens_merged:>14,.0f} {r.dropped:>8} {r.harmless:>9} "
                     f"{r.dropped - r.harmless:>5} {r.tokens_dropped:>12,.0f}  {reasons}")
    per = f"averaged over the run's {t.fragments} fragments" if t.fragments > 1 else "of this fragment"
    lines.append(f"  tokens: training that entered the model (merged) or was lost (only dropped deltas held it), "
                 f"{per}; harmless drops are duplicates and superseded deltas, whose work another delta carried")
    return lines


def show_log(records: Iterable[CommitRecord], out: TextIO, *, as_json: bool = False, fragment: int | None = None,
             learner: str | None = None, fragments: int = 1,
             base_of: Callable[[DroppedRecord], int | None] | None = None) -> LogTotals:
    """Print the selected commits and their totals; returns the totals. ``fragments``: the run's
    P, over which token totals are averaged (1 when one fragment is shown); ``base_of``: see
    ``LogTotals``."""
    totals = LogTotals(learner=learner, fragments=1 if fragment is not None else fragments, base_of=base_of)
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
    parser.add_argument("--shard", type=int, default=None, metavar="I",
                        help="a sharded run (ddiloco run --syncers N): only shard I's log (default: every shard's "
                             "in turn; --from/--to apply to each shard's own seqs)")
    parser.add_argument("--to", dest="end", type=int, default=None, metavar="SEQ", help="last commit shown")
    parser.add_argument("--accounting", action="store_true",
                        help="after the totals, the traffic report: requests and bytes per region, link, learner "
                             "and outer step, the monthly cost estimate, data parallelism for comparison")
    parser.add_argument("--events", default=None, metavar="DIR",
                        help="the run's event logs (*.jsonl) for --accounting, which it implies (default: OUT/logs "
                             "next to a run in OUT/store, as ddiloco run lays it out)")
    parser.add_argument("--prices", default=None, metavar="FILE|JSON",
                        help="price table overrides for the cost estimate: a JSON file or inline JSON "
                             "(docs/regions.md \"The price table\")")
    return pipe_safe(log_command)


def log_command(args, out: TextIO, err: TextIO) -> int:
    try:
        store, descriptor = open_run(args.run_uri, s3_endpoint=args.s3_endpoint)
        if args.fragment is not None and not 0 <= args.fragment < descriptor.num_fragments:
            raise ValueError(f"--fragment {args.fragment}: the run has fragments 0..{descriptor.num_fragments - 1}")
        shard = getattr(args, "shard", None)
        if shard is not None and not 0 <= shard < descriptor.syncers:
            raise ValueError(f"--shard {shard}: run {descriptor.run_id} has syncer shards 0..{descriptor.syncers - 1}")
        if args.start < 0 or (args.end is not None and args.end < args.start):
            raise ValueError(f"--from {args.start} --to {args.end}: need 0 <= from <= to")
        prices = parse_prices(getattr(args, "prices", None))
        wanted = getattr(args, "accounting", False) or getattr(args, "events", None) is not None
        events_dir = _events_dir(args) if wanted else None
    except (ValueError, StoreError, FormatError) as exc:
        print(f"error: {exc}", file=err)
        return EXIT_USAGE
    try:
        show_log(_records(store, descriptor, args.start, args.end, getattr(args, "shard", None), out, args.json),
                 out, as_json=args.json, fragment=args.fragment,
                 learner=args.learner, fragments=descriptor.num_fragments, base_of=stored_base(store, descriptor))
    except (StoreError, FormatError) as exc:
        out.flush()
        print(f"log FAILED: {exc}", file=err)
        return EXIT_DAMAGED
    if not wanted:
        return 0
    return show_traffic(events_dir, descriptor, prices, out, err, as_json=args.json)


def _records(store, descriptor, start: int, end: int | None, shard: int | None, out: TextIO,
             as_json: bool) -> Iterator[CommitRecord]:
    """The commits to show: ``start..end`` of the run's log; in a sharded run of every
    shard's log in shard order (or ``shard``'s alone), each with a header line, the shared init
    commits once (their totals count each commit once)."""
    stores = shard_stores(store, descriptor)
    for i, s in enumerate(stores):
        if shard is not None and shard != i:
            continue
        log = CommitLog(s)
        if len(stores) > 1 and not as_json:
            print(f"syncer shard {i}/{len(stores)} (fragments {list(s.fragments)}), its own commit seqs:", file=out)
        stop = log.tail() if end is None else end
        yield from (r for r in log.read_range(start, stop + 1) if i == 0 or shard == i or r.kind != "init")


def _events_dir(args):
    """``--events`` (refused when it is no directory) or ``ddiloco run``'s ``OUT/logs`` (None: none found)."""
    given = getattr(args, "events", None)
    if given is None:
        return default_event_dir(args.run_uri)
    if not Path(given).is_dir():
        raise ValueError(f"--events {given}: not a directory of event logs")
    return Path(given)


def show_traffic(events_dir, descriptor, prices, out: TextIO, err: TextIO, *, as_json: bool = False) -> int:
    """The traffic report after the totals (module docstring); 0, or EXIT_USAGE for logs it cannot read."""
    if events_dir is None:
        print("error: --accounting: no event logs found next to the run (give --events DIR)", file=err)
        return EXIT_USAGE
    try:
        rep = traffic_report(read_event_dir(events_dir), params=sum(t.numel for t in descriptor.layout.tensors),
                             sync_every=descriptor.schedule.sync_every, prices=prices)
    except (ValueError, KeyError, TypeError) as exc:
        print(f"error: accounting events in {events_dir}: {exc}", file=err)
        return EXIT_USAGE
    if rep is None:
        print(f"error: --accounting: no accounting events in {events_dir} (written by this version's learners "
              "and syncer)", file=err)
        return EXIT_USAGE
    if as_json:
        print(json.dumps({"type": "accounting", "events": str(events_dir), **rep}), file=out)
    else:
        print("\n".join([f"event logs: {events_dir}", *report_lines(rep)]), file=out)
    return 0


def stored_base(store, descriptor) -> Callable[[DroppedRecord], int | None]:
    """``LogTotals.base_of`` reading a dropped delta's base version from its stored blob (None
    when it is gone - retention - or unreadable)."""
    from workers.common.deltas import peek_header

    def base_of(d: DroppedRecord) -> int | None:
        if not d.key:
            return None
        try:
            return peek_header(store.get(d.key), descriptor, d.key).base_version
        except (StoreError, FormatError, ValueError):
            return None
    return base_of


def token_figures(records: Iterable[CommitRecord], fragments: int,
                  base_of: Callable[[DroppedRecord], int | None] | None = None) -> dict[str, Any]:
    """The run summary's honest figures from the commit log (the same numbers ``ddiloco log``
    prints): tokens of training that entered the model or were lost, and drops split into
    harmless ones (duplicates, superseded) and lost work."""
    totals = LogTotals(fragments=fragments, base_of=base_of)
    for rec in records:
        totals.add(rec)
    t = totals.all.to_dict()
    return {"tokens_merged": t["tokens_merged"], "tokens_lost": t["tokens_dropped"],
            "deltas_dropped": t["deltas_dropped"], "deltas_harmless": t["deltas_harmless"],
            "deltas_lost": t["deltas_lost"], "drop_reasons": t["drop_reasons"]}
