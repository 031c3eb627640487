"""The syncer's committer (SPEC §4 'commit the new version, then tell learners', §7): decides a
commit with ``pipeline.commit.apply_commit`` (the very function replay and recovery verify with),
persists its data, appends it to the log, announces it, and checkpoints the state.

:class:`Committer` owns the syncer state, the norm window, the epoch and the log handle it appends
with (all set by :meth:`Committer.begin` after recovery), whether this syncer was fenced, and the
commit statistics. Storage is the truth: every commit names inputs persisted under their
permanent ``delta_key`` (or ``quarantine/<sha256>``) and the version object it publishes, written
*before* the commit (data before the commit that names it); a refused append (``Fenced``) stops
this syncer because a newer epoch owns the run. Runs on the syncer's loop thread; object writes
of one commit go in parallel on the shared ``io`` pool, and checkpoints are written there.
"""
from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Callable, Sequence

from pipeline.commit import Commit, CommitMeta, apply_commit, initial_window
from pipeline.envelope import digest
from pipeline.errors import FormatError
from pipeline.fold import DropReason, RoundInput, SyncerState, merged_before
from pipeline.guard import NormWindow
from pipeline.descriptor import RunDescriptor
from pipeline.types import CommitRecord, DeltaHeader
from pipeline.version_chain import needs_snapshot
from storage.checkpoints import write_checkpoint
from storage.errors import AlreadyExists, Fenced, StoreError
from storage.layout import SNAPSHOT_INFO, commit_key, version_key
from storage.log import CommitLog
from storage.store import ObjectStore
from workers.bus.bus import Message
from workers.bus.signing import seal_checkpoint, sign_commit
from workers.common.aggregate import RunningMean
from workers.common.heap import HeapTrimmer, trim_heap
from workers.common.versions import version_blobs


class KeyConflict(Exception):
    """A delta's permanent key already holds other bytes (a learner reused an id)."""

    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


@dataclass
class CommitStats:
    commits: int = 0
    merged: int = 0
    dropped: int = 0
    drops: Counter = field(default_factory=Counter)   # recorded drops by category (in commits)
    # running aggregates, not one entry per commit
    grace_waits: RunningMean = field(default_factory=RunningMean)
    round_sizes: RunningMean = field(default_factory=RunningMean)   # learners merged per commit


@dataclass(frozen=True)
class CommitterConfig:
    retry_s: float = 0.5          # first backoff when the store is unavailable
    max_retry_s: float = 2.0      # SyncerConfig's (workers/syncer/syncer.py says why)
    checkpoint_every: int = 25    # commits between checkpoints


class Committer:
    """``signer``: the syncer's key (None: an unsigned run). ``announce``: sends a message to the
    learners (a no-op without a bus). ``on_retry``: called between attempts while the store is
    unavailable (the syncer keeps hearing heartbeats). ``after_checkpoint``: retention, in the
    background. ``noted``: tells the replicator a commit is in the log (None: one region).
    ``before_commit``: the test-only fault hook (infra/chaos/faulty_syncer.py), None in production."""

    def __init__(self, store: ObjectStore, descriptor: RunDescriptor, cfg: CommitterConfig, events, io: Executor,
                 sleep: Callable[[float], None], *, signer=None, announce: Callable[[Message], None],
                 on_retry: Callable[[], None], after_checkpoint: Callable[[int], None],
                 noted: Callable[[int, int], None] | None = None,
                 before_commit: Callable[[CommitRecord], None] | None = None,
                 map_fn: Callable | None = None):
        self.store, self.descriptor, self.cfg, self.events, self.io, self.sleep = \
            store, descriptor, cfg, events, io, sleep
        self.signer, self.announce, self.on_retry = signer, announce, on_retry
        self.after_checkpoint, self.noted, self.before_commit = after_checkpoint, noted, before_commit
        self.map_fn = map_fn          # the syncer's compute pool (same bits at any thread count; None: serial)
        self.state: SyncerState | None = None
        self.window: NormWindow | None = initial_window(descriptor)   # the norm guard's; recovery rebuilds it
        self.log = CommitLog(store)
        self.epoch = -1
        self.fenced = False
        self.stats = CommitStats()
        self._published: set[int] = set()
        self._written: dict[str, bytes] = {}   # the version blob of the commit being persisted, by key
        self._ckpt_lock = threading.Lock()      # guards the two below (``checkpoint_soon``)
        self._ckpt_next: SyncerState | None = None   # the state waiting to be checkpointed
        self._ckpt_busy = False                 # a checkpoint write is queued or running on ``io``
        # A fold's transients back to the OS after each commit (workers/common/heap.py), on real
        # time: a simulated clock would trim at every simulated second.
        self.trim_heap = HeapTrimmer(1.0)

    def begin(self, epoch: int, log: CommitLog, state: SyncerState, window: NormWindow | None) -> None:
        """Take over the run at ``epoch`` (claimed with ``log``) from the recovered state and window."""
        self.epoch, self.log, self.state, self.window = epoch, log, state, window
        self._published = set()     # fragments with a version in this epoch (int4 runs: snapshot rule)

    def high_water(self, fragment: int, learner: str) -> list[int] | None:
        """The newest merged (incarnation, seq) of ``learner`` on ``fragment`` (None: none yet)."""
        return self.state.high_water[fragment].get(learner)

    def merged_before(self, header: DeltaHeader) -> str:
        """Why the merged history rules ``header`` out, by the fold's own rule ("" = never merged,
        e.g. an answer overtaken by its learner's newer merged one, issue 25)."""
        return merged_before(self.state, self.descriptor, header)

    def next_version_key(self, fragment: int) -> str:
        return version_key(fragment, self.state.fragments[fragment].version + 1, self.epoch)

    # -- one commit --------------------------------------------------------------------------------
    def decide(self, fragment: int, inputs: Sequence[RoundInput], meta: CommitMeta) -> Commit:
        """The commit of ``inputs`` (pure: nothing is stored or changed), signed in a signed run."""
        commit = apply_commit(self.state, self.window, self.descriptor, fragment, inputs, meta, map_fn=self.map_fn)
        if commit.link is not None and needs_snapshot(commit.record.version, self.descriptor.versions.full_every,
                                                      fragment not in self._published):
            rec = commit.record   # replay and recovery take the flag from the record, as all its info
            commit = dataclasses.replace(commit, record=dataclasses.replace(rec, info={**rec.info,
                                                                                       SNAPSHOT_INFO: True}))
        if self.signer is not None:
            commit = dataclasses.replace(commit, record=sign_commit(commit.record, self.signer,
                                                                    self.descriptor.run_id))
        return commit

    def persist(self, commit: Commit, inputs: Sequence[tuple[str, bytes]]) -> bool:
        """Inputs (``(key, bytes)``), then the version blob, then the commit (data before the commit
        that names it). Retries while the store is unavailable; False when fenced; KeyConflict
        when an input's key holds other bytes (nothing was appended)."""
        rec = commit.record
        blobs = list(inputs)
        self._written = {}
        if commit.published is not None:
            written = version_blobs(self.descriptor, rec, commit.published, commit.link, self.signer, self.map_fn)
            blobs += written
            self._written = dict(written)   # handed to the replicator (no read back)
        backoff = self.cfg.retry_s
        while True:
            try:
                for _ in self.io.map(lambda kb: self._put_same(*kb), blobs):
                    pass
                if self.before_commit is not None:
                    self.before_commit(rec)
                self.log.append(rec, hint=False)   # the advisory head hint follows off the latency path
                if commit.published is not None:
                    self._published.add(rec.fragment)
                return True
            except Fenced as exc:
                self._fenced(rec.seq, exc)
                return False
            except StoreError as exc:
                if not exc.retryable:
                    raise
                self.events.emit("store-error", op="commit", seq=rec.seq, error=str(exc), retry_in_s=backoff)
                self.sleep(backoff)
                backoff = min(backoff * 2, self.cfg.max_retry_s)
                self.on_retry()

    def _put_same(self, key: str, blob: bytes) -> None:
        """Create ``key``; if it exists it must hold these very bytes (a retry, or the learner's spill)."""
        try:
            self.store.put_if_absent(key, blob)
        except AlreadyExists:
            if digest(self.store.get(key)) != digest(blob):
                raise KeyConflict(key) from None

    def adopt(self, commit: Commit) -> None:
        """The appended commit's state and window become this syncer's; counted."""
        self.state, self.window = commit.state, commit.window
        rec, s = commit.record, self.stats
        s.commits += 1
        s.merged += len(rec.inputs)
        s.dropped += len(rec.dropped)
        s.drops.update(DropReason.parse(d.reason).category for d in rec.dropped)
        s.round_sizes.append(rec.round_size)
        s.grace_waits.append(rec.grace_wait_s)

    def publish(self, rec: CommitRecord) -> None:
        """Tell the learners about a new version (SPEC §4), write the log's head hint in the
        background and note the commit for replication to other regions."""
        if rec.kind == "merge":
            self.announce(Message("version", {"seq": rec.seq, "fragment": rec.fragment, "version": rec.version,
                                              "key": rec.output_key, "checksum": rec.output_checksum,
                                              "epoch": self.epoch, "round": rec.round}))
        self.io.submit(self.log.write_hint, rec.seq, self.epoch)
        if self.noted is not None:   # with the bytes just written: the replicator copies them as they are
            self.noted(rec.seq, self.epoch, {commit_key(rec.seq): rec.to_bytes(),
                                             **self._written})
            self._written = {}
        self.trim_heap()

    # -- checkpoints and fencing -------------------------------------------------------------------
    def checkpoint_due(self, seq: int) -> bool:
        return seq % self.cfg.checkpoint_every == 0

    def checkpoint(self) -> None:
        """Checkpoint the current state now, on the calling thread (recovery's salvaged state)."""
        self._write_checkpoint(self.state)

    def checkpoint_soon(self) -> None:
        """Checkpoint the current state on the ``io`` pool: serialising, sealing and writing a
        state (1.5 MB for the chaos model) took 100-150 ms of the loop thread beside two busy
        loops, every ``checkpoint_every`` commits, and each such stall cost every learner that
        many steps of its next answer. States are immutable (pipeline/fold.py), so the snapshot
        is this one; one write at a time, in order, and a checkpoint due while one is written
        replaces any older one still waiting (the newest state is the one worth having)."""
        with self._ckpt_lock:
            self._ckpt_next = self.state
            if self._ckpt_busy:
                return
            self._ckpt_busy = True
        self.io.submit(self._drain_checkpoints)

    def _drain_checkpoints(self) -> None:
        try:
            while True:
                with self._ckpt_lock:
                    state, self._ckpt_next = self._ckpt_next, None
                    if state is None:
                        return
                self._write_checkpoint(state)
                trim_heap()          # a checkpoint's serialised copies: the largest transient there is
        finally:
            with self._ckpt_lock:
                self._ckpt_busy = False

    def _write_checkpoint(self, state: SyncerState) -> None:
        try:
            payload = state.to_bytes()
            if self.signer is not None:   # a restored state decides every later merge: only our own is trusted
                payload = seal_checkpoint(payload, state.last_seq, self.signer, self.descriptor.run_id)
            write_checkpoint(self.store, state.last_seq, payload)
            self.events.emit("checkpoint", seq=state.last_seq)
            self.after_checkpoint(state.last_seq)   # in the background; never blocks merging
        except StoreError as exc:
            self.events.emit("store-error", op="checkpoint", error=str(exc))

    def check_fenced(self) -> None:
        """An idle syncer learns that a newer epoch took over from the log's tail:
        an active one learns it from its next append; an idle one would otherwise run forever."""
        try:
            self.log.check_fenced()
        except Fenced as exc:
            self._fenced(self.state.last_seq, exc)
        except (StoreError, FormatError) as exc:     # unreachable or a damaged tail: ask again later
            self.events.emit("store-error", op="check-fenced", error=str(exc))

    def _fenced(self, seq: int, exc: Fenced) -> None:
        self.fenced = True
        self.events.emit("syncer-fenced", seq=seq, epoch=self.epoch, error=str(exc))
