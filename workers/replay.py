"""Recompute a run's state from its log with the same pure fold the syncer uses (SPEC §7 'Replay').

``rebuild`` starts from the newest checkpoint at or before the start (or from the init commits),
then re-folds every commit after it from the inputs the log names, checking each one bit for bit
(``pipeline.fold.check_commit``). The syncer's restart recovery calls it, so every restart is a
replay check; ``ddiloco replay`` calls it over a whole run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pipeline.errors import FormatError
from pipeline.fold import SyncerState, check_commit, initial_state
from pipeline.types import CommitRecord, RunDescriptor
from storage.checkpoints import latest_checkpoint
from storage.log import CommitLog
from storage.store import ObjectStore
from .deltas import load_inputs
from .versions import decode_version


@dataclass
class ReplayStats:
    start_seq: int = -1         # first commit re-folded
    end_seq: int = -1           # last commit re-folded
    commits: int = 0
    versions: int = 0
    from_checkpoint: int | None = None


def init_state(store: ObjectStore, descriptor: RunDescriptor, log: CommitLog) -> SyncerState:
    """State after the init commits (seq 0..P-1, one per fragment, version 0)."""
    P = descriptor.num_fragments
    values = {}
    for seq in range(P):
        rec = log.read(seq)
        if rec.kind != "init" or rec.fragment != seq or rec.version != 0:
            raise FormatError(f"commit {seq}: expected the init commit of fragment {seq}, found a "
                              f"{rec.kind!r} commit of fragment {rec.fragment}")
        values.update(decode_version(store.get(rec.output_key), descriptor, rec))
    return initial_state(descriptor, values, last_seq=P - 1)


def rebuild(store: ObjectStore, descriptor: RunDescriptor, upto: int, *, use_checkpoint: bool = True,
            start_state: SyncerState | None = None,
            progress: Callable[[CommitRecord, ReplayStats], None] | None = None,
            verify_outputs: bool = False) -> tuple[SyncerState, ReplayStats]:
    """Fold commits up to ``upto`` (inclusive) and return the state; raises ReplayMismatch or
    FormatError naming the first commit that does not reproduce."""
    log = CommitLog(store)
    stats = ReplayStats()
    state = start_state
    if state is None and use_checkpoint:
        found = latest_checkpoint(store, at_or_before=upto)
        if found is not None:
            seq, blob = found
            state = SyncerState.from_bytes(blob, descriptor, what=f"checkpoint {seq}")
            stats.from_checkpoint = seq
    if state is None:
        state = init_state(store, descriptor, log)
    stats.start_seq = state.last_seq + 1
    if upto > state.last_seq:
        for rec in log.read_range(state.last_seq + 1, upto + 1):
            recorded = None
            if verify_outputs and rec.kind == "merge":
                recorded = decode_version(store.get(rec.output_key), descriptor, rec)
            inputs = load_inputs(store, descriptor, rec) if rec.kind in ("merge", "drop") else []
            if rec.kind == "init":
                raise FormatError(f"commit {rec.seq}: an init commit after the start of the run")
            state = check_commit(state, descriptor, rec, inputs, recorded_output=recorded).state
            stats.commits += 1
            stats.versions += rec.kind == "merge"
            stats.end_seq = rec.seq
            if progress is not None:
                progress(rec, stats)
    return state, stats
