"""The syncer's restart recovery, which no single damaged object can stop (issue 11 items 9, 10, 14).

SPEC §7-8: the syncer restarts from the log and loses nothing that was committed. Recovery re-folds
every commit after the newest usable checkpoint with the same code as replay (``Refolder`` in
workers/common/refold.py, which calls ``pipeline.commit.verify_commit``), so every restart is a replay
check; the norm window it rebuilds is part of the result (``Recovery.window``). Unlike replay, which stops at the first
problem (it must report, never repair), recovery *salvages* what it can and says so:

- a checkpoint that is damaged, forged or for another commit: the next older one is used
  (``checkpoint ... skipped`` notes);
- a commit that does not re-fold (a deleted or damaged input, a record that no longer reproduces):
  its fragment is **adopted** from the commit's stored version, checked against the commit's
  output checksum and, in a signed run, the syncer's signatures: the published values become the
  fragment's parameters, its outer momentum restarts at zero, its high-water marks are the
  record's (and, issue 25, its merged marks gain the record's inputs and its recovery floor rises to
  the record's high-water marks: a delta at or below them that no mark accounts for is dropped
  ``unaccounted``, never merged a second time); that fragment's later commits are adopted the same
  way (the exact momentum is gone);
- a merge whose version object is lost too: the fragment keeps its values under the recorded
  version number (a number is never reused) and the record's high-water marks;
- a commit that is missing or does not open (a gap, a flipped byte): what it did is unknown;
  every fragment's next merge is adopted, and a fragment with none takes one version number more;
- a fence or drop that cannot be checked (a forged or damaged record) changes nothing but the seq;
- gaps anywhere in the log, before the checkpoint too, are reported: the syncer never appends
  silently after one.

Every note goes into an event, and the notes before the claim into the new fence commit
(``info["recovery"]``); a salvaged state is checkpointed at the fence at once, so that
``ddiloco replay --from`` after it verifies everything the new syncer does. docs/replay.md lists
what cannot be repaired. ``recover_state`` is read-only: the syncer calls it *before* claiming its
epoch (a failed rebuild leaves the old syncer running), then once more after the claim to fold any
commits the old syncer made in between. ``republish_damaged`` is the one writer here (after the
claim): it rewrites a damaged or missing newest version object from the recovered state, when its
values match the commit's checksum.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from pipeline.checksum import tensor_digest
from pipeline.errors import FormatError
from pipeline.commit import backfill_window, initial_window, window_after
from pipeline.fold import FragmentState, SyncerState, fold_fence, published
from pipeline.guard import NormWindow
from pipeline.descriptor import RunDescriptor
from pipeline.types import CommitRecord
from pipeline.version_chain import chain_step, is_chained
from storage.errors import NotFound, StoreError
from storage.layout import published_keys
from storage.log import CommitLog
from storage.store import ObjectStore
from workers.bus.keys import Roster
from workers.common.refold import Refolder, ReplayStats, older_commits, origin_state, security_of
from workers.bus.signing import Signer
from workers.common.versions import VersionTracker, decode_version, decode_version_delta, version_blobs

NOTE_CHARS = 400          # a note is one line of an event or of the fence commit's info
FENCE_NOTES = 16          # notes recorded in the fence commit (all of them go to events)


@dataclass
class Recovery:
    """The recovered state and what it took. ``salvaged``: the state is not a pure re-fold of the
    log (checkpoint it at once); ``uncertain``: fragments whose exact state was lost (their commits
    are adopted); ``to_bump``: fragments a lost commit may have merged, none adopted since;
    ``window``: the norm guard's window after the recovered commits (None: the run has no guard)."""

    state: SyncerState
    stats: ReplayStats
    notes: list[str] = field(default_factory=list)
    salvaged: bool = False
    gaps: list[int] = field(default_factory=list)
    uncertain: set[int] = field(default_factory=set)
    to_bump: set[int] = field(default_factory=set)
    window: NormWindow | None = None

    def fence_info(self) -> dict:
        """What the fence commit records about this recovery ({} when nothing was salvaged)."""
        return {"recovery": self.notes[:FENCE_NOTES]} if self.notes else {}


def _ranges(seqs: list[int]) -> str:
    out, i = [], 0
    while i < len(seqs):
        j = i
        while j + 1 < len(seqs) and seqs[j + 1] == seqs[j] + 1:
            j += 1
        out.append(str(seqs[i]) if i == j else f"{seqs[i]}..{seqs[j]}")
        i = j + 1
    return ", ".join(out[:8]) + (" ..." if len(out) > 8 else "")


def recover_state(store: ObjectStore, descriptor: RunDescriptor, upto: int, *, roster: Roster | None = None,
                  start: Recovery | None = None, finish: bool = True) -> Recovery:
    """Read-only: the syncer state after commit ``upto``, salvaging damage (module docstring).
    ``start``: an earlier recovery to continue (its state and window); ``finish=False`` when
    one will continue this one (a fragment's version number is skipped only at the end). Raises only when no
    starting state exists (no usable checkpoint and a damaged init commit or version 0), or on a
    store error that may pass (``Unavailable``: the caller retries)."""
    log = CommitLog(store)
    sec, roster = security_of(store, descriptor, roster)
    stats = ReplayStats()
    if start is None:
        rec = Recovery(SyncerState([], [], -1), stats, gaps=log.gaps(upto), window=initial_window(descriptor))
        if rec.gaps:
            rec.notes.append(f"the commit log has gaps: commits {_ranges(rec.gaps)} are missing; replay before "
                             "them is impossible (docs/replay.md 'Damage')")
        rec.state = origin_state(store, descriptor, log, upto, use_checkpoint=True, sec=sec, stats=stats)
        rec.notes += stats.rejected_checkpoints
        if rec.window is not None:
            rec.window = backfill_window(rec.window, older_commits(log, rec.state.last_seq + 1))
    else:
        rec = dataclasses.replace(start, stats=stats, notes=list(start.notes), uncertain=set(start.uncertain),
                                  to_bump=set(start.to_bump))
    stats.start_seq = rec.state.last_seq + 1
    folder = Refolder(store, descriptor, sec, roster, rec.window)
    salvage = _Salvage(folder, log, rec)
    for seq in range(rec.state.last_seq + 1, upto + 1):
        rec.state = salvage.step(rec.state, seq)
        stats.commits += 1
        stats.end_seq = seq
    rec.window = folder.window
    for p in sorted(rec.to_bump) if finish else ():
        rec.state = _bump(rec.state, p, descriptor)
        rec.notes.append(f"fragment {p}: no commit after the lost one to adopt; it goes on at version "
                         f"{rec.state.fragments[p].version} (one number skipped, never reused)")
    if finish:
        rec.to_bump.clear()
    rec.notes = [n if len(n) <= NOTE_CHARS else n[:NOTE_CHARS - 1] + "…" for n in rec.notes]
    return rec


class _Salvage:
    """Re-folds one commit at a time, and decides what to do when one cannot be re-folded."""

    def __init__(self, folder: Refolder, log: CommitLog, rec: Recovery):
        self.folder, self.log, self.rec = folder, log, rec
        self.descriptor = folder.descriptor

    def note(self, text: str) -> None:
        self.rec.notes.append(text)
        self.rec.salvaged = True

    def step(self, state: SyncerState, seq: int) -> SyncerState:
        try:
            rec = self.log.read(seq)
        except (NotFound, FormatError) as exc:
            self.note(f"commit {seq} is missing or damaged ({exc}); what it did is lost: each fragment's next "
                      "merge is adopted from its stored version")
            self.rec.uncertain.update(range(self.descriptor.num_fragments))
            self.rec.to_bump.update(range(self.descriptor.num_fragments))
            return _advance(state, seq)
        try:
            self.folder.check_signature(rec)
        except FormatError as exc:
            self.note(f"{exc}: skipped (it changes nothing)")
            return _advance(state, seq)
        if rec.kind == "fence":
            return fold_fence(state, seq, rec.epoch, rec.info).state
        if rec.kind not in ("merge", "drop") or not 0 <= rec.fragment < self.descriptor.num_fragments:
            self.note(f"commit {seq}: a {rec.kind!r} commit of fragment {rec.fragment} here is not valid: skipped")
            return _advance(state, seq)
        if rec.fragment not in self.rec.uncertain:
            try:
                return self.folder.refold(state, rec).state
            except (NotFound, FormatError, ValueError) as exc:   # ReplayMismatch is a FormatError
                self.note(f"commit {seq} (fragment {rec.fragment}) does not re-fold: {exc}")
        if rec.kind == "drop":
            return _advance(state, seq)      # a drop changes nothing else; its drops stand as recorded
        return self.adopt(state, rec)

    def adopt(self, state: SyncerState, rec: CommitRecord) -> SyncerState:
        p, fs = rec.fragment, state.fragments[rec.fragment]
        self.rec.uncertain.add(p)
        self.rec.to_bump.discard(p)
        if rec.version <= fs.version:
            self.note(f"commit {rec.seq}: version {rec.version} of fragment {p} is not newer than {fs.version}: skipped")
            return _advance(state, rec.seq)
        try:
            values = VersionTracker(self.folder.store, self.descriptor).load(rec)   # int4 runs: along the chain
            pub = published(values, self.descriptor.versions.dtype)
            params, momentum = pub, {n: np.zeros(a.shape, np.float32) for n, a in pub.items()}
            self.note(f"fragment {p}: adopted version {rec.version} from commit {rec.seq}'s stored values; "
                      "its outer momentum restarts at zero")
        except (NotFound, FormatError) as exc:
            pub, params, momentum = fs.history[fs.version], fs.params, fs.momentum
            self.note(f"fragment {p}: commit {rec.seq}'s version {rec.version} is lost too ({exc}); it keeps "
                      f"version {fs.version}'s values under number {rec.version}")
        keep = range(rec.version - self.descriptor.versions.retain + 1, rec.version)
        history = fs.history.advanced(rec.version, pub, keep)
        fragments = list(state.fragments)
        fragments[p] = FragmentState(rec.version, _frozen(params), _frozen(momentum), history)
        high_water = list(state.high_water)
        high_water[p] = {m: (int(o[0]), int(o[1])) for m, o in rec.high_water.items()}
        self.folder.window = window_after(self.folder.window, rec)   # as recorded: it was not re-folded
        return SyncerState(fragments, high_water, rec.seq, state.run_id, _adopted_marks(state, rec, history))


def _adopted_marks(state: SyncerState, rec: CommitRecord, history: Mapping) -> list | None:
    """The merged marks after adopting ``rec`` (None in rule-1 runs): its inputs marked,
    bases outside ``history`` pruned, and the floor raised to the record's high-water marks,
    because the commits before it may have merged what the marks do not show."""
    if state.marks is None:
        return None
    marks = list(state.marks)
    merged = [(i.learner, i.incarnation, i.seq, i.base_version) for i in rec.inputs]
    marks[rec.fragment] = marks[rec.fragment].merged(merged, history.keys()).raised_floor(rec.high_water)
    return marks


def _frozen(d: dict) -> dict:
    out = {}
    for n, a in d.items():
        a = np.array(a, dtype=np.float32, copy=True)
        a.flags.writeable = False
        out[n] = a
    return out


def _advance(state: SyncerState, seq: int) -> SyncerState:
    """Only the seq moves (what a fence does)."""
    return state.with_seq(seq)


def _bump(state: SyncerState, p: int, descriptor: RunDescriptor) -> SyncerState:
    """Fragment ``p`` one version number on, same values: the lost commit may have used the number."""
    fs = state.fragments[p]
    version = fs.version + 1
    keep = range(version - descriptor.versions.retain + 1, version)
    history = fs.history.advanced(version, fs.history[fs.version], keep)
    fragments = list(state.fragments)
    fragments[p] = FragmentState(version, fs.params, fs.momentum, history)
    marks = None if state.marks is None else list(state.marks)
    if marks is not None:        # issue 25: the lost commit may have merged what the marks do not show
        marks[p] = marks[p].pruned(history.keys()).raised_floor(state.high_water[p])
    return SyncerState(fragments, list(state.high_water), state.last_seq, state.run_id, marks)


def republish_damaged(store: ObjectStore, descriptor: RunDescriptor, state: SyncerState,
                      signer: Signer | None) -> list[str]:
    """Rewrite the newest version object of every fragment that is missing or damaged, from the
    recovered state, when the state holds exactly the values its commit names (same digest): new
    learners load it again. Returns one note per object repaired or not."""
    tracker = VersionTracker(store, descriptor)
    try:
        newest = tracker.latest()
    except (FormatError, StoreError) as exc:
        return [f"could not check the newest versions: {exc}"]
    notes = []
    for p, rec in sorted(newest.items()):
        fs = state.fragments[p]
        if rec.version != fs.version or rec.version not in fs.history:
            continue
        try:
            _check_published(store, descriptor, rec, fs.history.get(rec.version - 1))
            continue
        except (NotFound, FormatError) as exc:
            damage = exc
        except StoreError as exc:
            notes.append(f"could not check {rec.output_key}: {exc}")
            continue
        values = {n: fs.history[rec.version][n] for n in descriptor.layout.fragments[p]}
        if tensor_digest(values) != rec.output_checksum:
            notes.append(f"{rec.output_key} is damaged ({damage}) and the recovered values differ from commit "
                         f"{rec.seq}'s checksum: not republished; learners use an older version")
            continue
        link = None
        if is_chained(descriptor.versions.dtype) and rec.kind == "merge":
            # the delta again from the master values and the version before (the fold's own step)
            base = fs.history.get(rec.version - 1)
            link = None if base is None else chain_step(fs.params, base, descriptor.codec.block_size)
            if link is None or tensor_digest(link.published) != rec.output_checksum:
                notes.append(f"{rec.output_key} is damaged ({damage}) and its delta cannot be made again from the "
                             "recovered state: not republished; learners start from a snapshot")
                continue
        try:
            for key, blob in version_blobs(descriptor, rec, values, link, signer):
                store.put(key, blob)
            notes.append(f"republished version {rec.version} of fragment {p} at {rec.output_key} ({damage})")
        except StoreError as exc:
            notes.append(f"could not republish {rec.output_key}: {exc}")
    return notes


def _check_published(store: ObjectStore, descriptor: RunDescriptor, rec: CommitRecord,
                     base: dict | None) -> None:
    """Every object ``rec`` publishes decodes to its values (FormatError or NotFound otherwise).
    ``base``: an int4 run's recovered values of the version before (None: not retained)."""
    if not is_chained(descriptor.versions.dtype):
        decode_version(store.get(rec.output_key), descriptor, rec)
        return
    keys = published_keys(rec)
    if rec.kind == "init" or len(keys) > 1:     # the full values: version 0 or the snapshot beside the delta
        decode_version(store.get(keys[-1]), descriptor, rec)
    if rec.kind == "merge" and base is not None:   # the delta on the recovered version before it
        decode_version_delta(store.get(rec.output_key), descriptor, rec, base)
    elif rec.kind == "merge":                      # along the chain, as a reader would
        VersionTracker(store, descriptor).load(rec)
