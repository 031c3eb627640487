"""Recompute a run's state from its log with the same pure fold the syncer uses (SPEC §7 'Replay').

``rebuild`` starts from the newest checkpoint at or before the start (or from the init commits),
then re-folds every commit after it from the inputs the log names, checking each one bit for bit,
norms included (``pipeline.commit.verify_commit``: the same ``apply_commit`` as the live syncer;
this module only fetches what it needs). The syncer's restart recovery calls it, so every restart is a
replay check; ``ddiloco replay`` calls it through ``workers.tools.replay_verify.replay_run``, which
also checks every stored version object and every checkpoint it passes against the recomputed state
(through the optional ``load_output`` and ``on_commit`` hooks).

Nothing here writes to the store: a damaged, missing or altered object stops the replay with an
error naming the object, the commit that names it and what is wrong (never a silent repair).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping

import numpy as np

from pipeline.commit import (PENDING_OVERFLOW, RECORDED_REASONS, Commit, backfill_window, initial_window,
                             verify_commit, with_recorded_decisions)
from pipeline.errors import FormatError
from pipeline.fold import ReplayMismatch, SyncerState, initial_state
from pipeline.guard import NormWindow
from pipeline.descriptor import RunDescriptor
from pipeline.types import CommitRecord
from storage.checkpoints import latest_checkpoint
from storage.errors import NotFound
from storage.layout import commit_key
from storage.log import CommitLog
from storage.shards import owned_fragments, shard_of
from storage.store import ObjectStore
from workers.common.deltas import load_inputs
from workers.common.versions import VersionTracker, decode_version
# issue "Security": signatures, checkpoints the syncer signed
from workers.bus.keys import Roster, RunSecurity
from workers.bus.signing import check_commit_signature, commit_signature_ok, open_checkpoint

__all__ = ["PENDING_OVERFLOW", "RECORDED_REASONS", "with_recorded_decisions", "ReplayStats", "Refolder", "rebuild",
           "init_state", "origin_state", "older_commits", "commit_signed", "trusted_commits", "security_of"]


@dataclass
class ReplayStats:
    start_seq: int = -1         # first commit re-folded
    end_seq: int = -1           # last commit re-folded
    commits: int = 0
    versions: int = 0
    from_checkpoint: int | None = None
    signatures: int = 0                      # commit signatures verified (signed runs)
    rejected_checkpoints: list[str] = field(default_factory=list)


@contextmanager
def _naming(seq: int, what: str) -> Iterator[None]:
    """Give a store or format error the commit that led to the object (types are kept, so callers
    such as the syncer see the same exceptions as before)."""
    try:
        yield
    except ReplayMismatch:
        raise
    except NotFound as exc:
        raise NotFound(f"missing: {what} named by commit {seq}", uri=exc.uri, key=exc.key) from None
    except FormatError as exc:
        raise FormatError(f"commit {seq} ({what}): {exc}") from None


def init_state(store: ObjectStore, descriptor: RunDescriptor, log: CommitLog) -> SyncerState:
    """State after the init commits (seq 0..P-1, one per fragment, version 0)."""
    P = descriptor.num_fragments
    values = {}
    for seq in range(P):
        try:
            rec = log.read(seq)
        except NotFound:
            raise NotFound(f"missing: the init commit of fragment {seq}", uri=store.uri, key=commit_key(seq)) from None
        if rec.kind != "init" or rec.fragment != seq or rec.version != 0:
            raise FormatError(f"commit {seq}: expected the init commit of fragment {seq}, found a "
                              f"{rec.kind!r} commit of fragment {rec.fragment}")
        with _naming(seq, f"version 0 of fragment {seq}"):
            values.update(decode_version(store.get(rec.output_key), descriptor, rec))
    return initial_state(descriptor, values, last_seq=P - 1)


def _load_checkpoint(store: ObjectStore, descriptor: RunDescriptor, sec: RunSecurity | None, upto: int,
                     stats: ReplayStats) -> SyncerState | None:
    """The newest usable checkpoint at or before ``upto``: in a signed run, only one the syncer signed."""
    at = upto
    while at >= 0:
        found = latest_checkpoint(store, at_or_before=at, skipped=stats.rejected_checkpoints)
        if found is None:
            return None
        seq, blob = found
        try:
            if sec is not None:
                blob = open_checkpoint(blob, seq, sec.syncer.sign, descriptor.run_id, f"checkpoint {seq}")
            state = SyncerState.from_bytes(blob, descriptor, what=f"checkpoint {seq}")
        except FormatError as exc:
            stats.rejected_checkpoints.append(str(exc))
            at = seq - 1
            continue
        stats.from_checkpoint = seq
        return state
    return None


def older_commits(log: CommitLog, before: int) -> Iterator[CommitRecord | None]:
    """The commits before ``before``, newest first, read one at a time as they are asked for (what
    ``pipeline.commit.backfill_window`` fills the norm window from); None for one that is missing
    or damaged."""
    for seq in range(before - 1, -1, -1):
        try:
            yield log.read(seq)
        except (NotFound, FormatError):
            yield None


def commit_signed(descriptor: RunDescriptor, record: CommitRecord) -> bool:
    """Whether ``record`` must carry the syncer's signature in a signed run: merges and drops
    always; fences in runs created with syncer-driven rounds (issue 11 item 14: fences were unsigned
    before, and the log of such a run replays as written)."""
    return record.kind in ("merge", "drop") or (record.kind == "fence" and descriptor.schedule.driver != "learner")


def trusted_commits(descriptor: RunDescriptor) -> Callable[[CommitRecord], bool] | None:
    """In a signed run, whether a commit is the syncer's own (what must be signed is signed and
    verifies): forged records never fence a syncer (storage/log.py ``CommitLog``). None: unsigned."""
    sec = descriptor.security
    if sec is None:
        return None
    return lambda rec: not commit_signed(descriptor, rec) or commit_signature_ok(rec, sec.syncer.sign,
                                                                                 descriptor.run_id)


@dataclass
class Refolder:
    """What re-folding one commit needs besides the state: the store, the run, its keys, and the
    norm window as it stands (None: the run has no guard), replaced after each commit verified."""

    store: ObjectStore
    descriptor: RunDescriptor
    sec: RunSecurity | None
    roster: Roster | None
    window: NormWindow | None

    def check_signature(self, rec: CommitRecord) -> bool:
        """Raise FormatError on a missing or bad syncer signature; True if one was verified."""
        if self.sec is None or not commit_signed(self.descriptor, rec):
            return False
        check_commit_signature(rec, self.sec.syncer.sign, self.descriptor.run_id)
        return True

    def refold(self, state: SyncerState, rec: CommitRecord,
               recorded: Mapping[str, np.ndarray] | None = None) -> Commit:
        """Fetch the inputs one commit names and verify it (``verify_commit``: bit for bit, norms
        included); the norm window advances only when it reproduces."""
        if rec.kind == "init":
            raise FormatError(f"commit {rec.seq}: an init commit after the start of the run")
        if rec.kind in ("merge", "drop") and not 0 <= rec.fragment < self.descriptor.num_fragments:
            raise FormatError(f"commit {rec.seq}: fragment {rec.fragment} is not one of the run's "
                              f"{self.descriptor.num_fragments}")
        if rec.kind in ("merge", "drop") and rec.fragment not in owned_fragments(self.store, self.descriptor):
            shard, n = shard_of(self.store)      # issue 15: a shard's log holds only its own fragments
            raise FormatError(f"commit {rec.seq} of syncer shard {shard}/{n}: fragment {rec.fragment} belongs to "
                              f"shard {rec.fragment % n}")
        inputs = load_inputs(self.store, self.descriptor, rec, self.roster) if rec.kind in ("merge", "drop") else []
        result = verify_commit(state, self.window, self.descriptor, rec, with_recorded_decisions(rec, inputs),
                               recorded_output=recorded)
        self.window = result.window
        return result


def origin_state(store: ObjectStore, descriptor: RunDescriptor, log: CommitLog, upto: int, *,
                use_checkpoint: bool, sec: RunSecurity | None, stats: ReplayStats) -> SyncerState:
    """The newest usable checkpoint at or before ``upto``, else the init commits."""
    state = _load_checkpoint(store, descriptor, sec, upto, stats) if use_checkpoint else None
    return state if state is not None else init_state(store, descriptor, log)


def rebuild(store: ObjectStore, descriptor: RunDescriptor, upto: int, *, use_checkpoint: bool = True,
            start_state: SyncerState | None = None,
            progress: Callable[[CommitRecord, ReplayStats], None] | None = None,
            verify_outputs: bool = False, roster: Roster | None = None,
            load_output: Callable[[CommitRecord], Mapping[str, np.ndarray]] | None = None,
            on_commit: Callable[[CommitRecord, Commit], None] | None = None) -> tuple[SyncerState, ReplayStats]:
    """Fold commits up to ``upto`` (inclusive) and return the state; raises ReplayMismatch or
    FormatError naming the first commit that does not reproduce (or, in a signed run, the first
    commit or version whose signature does not verify).

    ``roster``: the signed run's key list (default: the descriptor's plus the membership records
    in the store). With the norm guard on, its window is filled from the log before the start.
    ``load_output(record)``: the stored values of a merge commit's version, handed to
    ``verify_commit`` so that a mismatch names the tensor (replay's loader, instead of
    ``verify_outputs``' checksum-checked one). ``on_commit(record, result)``: called after each
    commit reproduced, with the commit's result (replay checks stored versions and checkpoints)."""
    log = CommitLog(store)
    stats = ReplayStats()
    sec, roster = security_of(store, descriptor, roster)
    state = start_state
    if state is None:
        state = origin_state(store, descriptor, log, upto, use_checkpoint=use_checkpoint, sec=sec, stats=stats)
    stats.start_seq = state.last_seq + 1
    window = initial_window(descriptor)
    if window is not None:
        window = backfill_window(window, older_commits(log, stats.start_seq))
    folder = Refolder(store, descriptor, sec, roster, window)
    outputs = VersionTracker(store, descriptor)   # an int4 run's versions along their chain
    if upto > state.last_seq:
        for rec in log.read_range(state.last_seq + 1, upto + 1):
            stats.signatures += folder.check_signature(rec)
            recorded = None
            if verify_outputs and rec.kind == "merge":
                recorded = outputs.load(rec)
            elif load_output is not None and rec.kind == "merge":
                recorded = load_output(rec)
            result = folder.refold(state, rec, recorded)
            state = result.state
            if on_commit is not None:
                on_commit(rec, result)
            stats.commits += 1
            stats.versions += rec.kind == "merge"
            stats.end_seq = rec.seq
            if progress is not None:
                progress(rec, stats)
    return state, stats


def security_of(store: ObjectStore, descriptor: RunDescriptor,
                roster: Roster | None) -> tuple[RunSecurity | None, Roster | None]:
    """The run's keys and its roster (the descriptor's plus the membership records in the store)."""
    sec = descriptor.security
    if sec is not None and roster is None:
        roster = Roster(descriptor, sec)
        roster.refresh(store)
    return sec, roster
