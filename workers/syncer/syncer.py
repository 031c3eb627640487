"""The syncer (SPEC §4, §7, paper §3): collects deltas, closes rounds with the quorum + grace
policy, decides each commit with ``pipeline.commit.apply_commit`` (norm guard, fold, norm window:
the very function replay and recovery verify with), commits versions to the log, announces them.

One thread runs the loop below; the bus sockets and the pending sets belong to it. Storage is
the truth: a delta is acked only after it is in the inbox (``spill_key``), every commit names
inputs persisted under their permanent ``delta_key``, and a refused append (``Fenced``) stops this
syncer because a newer epoch owns the run. Restart recovery goes through ``recovery.recover_state``
(the replay code, salvaging damage).

Hostile input (issue "Security", docs/security.md): in a signed run the bus is CURVE-encrypted and
admits only listed learners (ZAP), each message's claimed learner must be its authenticated peer,
and every delta's signature is judged from its bytes (workers/common/deltas.py). A delta that fails
(``bad-signature``, ``unsigned``, ``dtype-mismatch``, ``norm-outlier``, and the fold's own reasons)
is a *recorded* drop: it never counts toward a quorum, is persisted under a content-addressed
``quarantine/<sha256>`` key (never under the id it claims, which its real owner may still need)
and named in the next commit. What cannot be attributed to a listed learner (undecodable,
oversized, unknown learner or fragment, peer mismatch) is refused at ingest: counted by reason,
logged, left in the inbox as evidence, and counted in the next commit's ``info["rejected"]``.
Commits, versions and checkpoints carry the syncer's signatures.
"""
from __future__ import annotations

import dataclasses
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Mapping

from pipeline.commit import Commit, CommitMeta, apply_commit, initial_window
from pipeline.envelope import digest
from pipeline.errors import FormatError
from pipeline.fold import DropReason, SyncerState, fold_fence
from pipeline.policy import Decision, Ewma, Pending, Timing, decide, late_deadline
from pipeline.types import CommitRecord, RunDescriptor
from storage.checkpoints import write_checkpoint
from storage.errors import AlreadyExists, Fenced, StoreError
from storage.layout import CLOCK_KEY, delta_key, read_descriptor, version_key
from storage.log import CommitLog, claim_epoch
from storage.probe import probe_conditional_writes
from storage.store import ObjectStore, open_store
from workers.bus.bus import HEAD_MAX_BYTES, BusConfig, Message, SyncerBus
from workers.common.deltas import max_delta_bytes, round_input
from workers.common.aggregate import RunningMean
from workers.common.events import EventLog
from workers.syncer.gc import RetentionConfig, SyncerRetention
from workers.bus.keys import Gate, KeyRing, Roster, check_syncer_keys
from workers.syncer.recovery import Recovery, recover_state, republish_damaged
from workers.syncer.replicate import replication
from workers.tools.replay import trusted_commits
from workers.syncer.rounds import OpenRound, RoundBook
from workers.bus.signing import seal_checkpoint, sign_commit
from workers.syncer.ingest import Quarantined, SyncerIngest, _Held
from workers.common.versions import encode_version

REJECTED_FLUSH = 16                   # rejected deltas of one fragment that force a drop commit


class _KeyConflict(Exception):
    """A delta's permanent key already holds other bytes (a learner reused an id)."""

    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


@dataclass(frozen=True)
class SyncerConfig:
    syncer_id: str = "syncer"
    spill_poll_s: float = 0.5          # how often the inbox is listed for spilled deltas
    heartbeat_s: float = 1.0
    live_timeout_s: float = 5.0        # a learner unheard for this long is not live
    checkpoint_every: int = 25         # commits between checkpoints
    retry_s: float = 0.5               # first backoff when the store is unavailable
    max_retry_s: float = 5.0
    max_ingest_per_poll: int = 256
    members_poll_s: float = 5.0        # how often membership records are re-read (signed runs)
    retention: RetentionConfig = RetentionConfig()   # after each checkpoint (workers/syncer/gc.py, docs/storage.md)
    initial_step_s: float = 0.1        # the global clock's pace before any learner's was measured
    fence_check_s: float = 1.0         # how often an idle syncer checks whether it was fenced (item 8)
    max_pending: int = 64              # candidate deltas held per fragment (issue 11 item 5)

    def __post_init__(self) -> None:
        for name in ("spill_poll_s", "heartbeat_s", "live_timeout_s", "retry_s", "max_retry_s", "members_poll_s",
                     "fence_check_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SyncerConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {self.checkpoint_every}")
        if not isinstance(self.max_pending, int) or isinstance(self.max_pending, bool) or self.max_pending < 1:
            raise ValueError(f"SyncerConfig.max_pending must be an int >= 1, got {self.max_pending!r}")


@dataclass
class SyncerStats:
    commits: int = 0
    merged: int = 0
    dropped: int = 0
    duplicates: int = 0
    rejected: int = 0          # refused at ingest (bad message / header / unknown fragment)
    rejections: Counter = field(default_factory=Counter)   # ingest refusals by reason (never in a commit)
    drops: Counter = field(default_factory=Counter)        # recorded drops by reason (in commits)
    from_bus: int = 0
    from_spill: int = 0
    evicted: int = 0           # dropped "pending-overflow" while a quorum was not met (issue 11 item 5)
    # running aggregates, not one entry per commit (issue 11 item 6)
    grace_waits: RunningMean = field(default_factory=RunningMean)
    quorum_sizes: RunningMean = field(default_factory=RunningMean)


class Syncer(SyncerIngest):
    """``before_commit``: called with each commit record right before every attempt to append it,
    when its inputs and version object are already stored - the one point where a crash leaves data
    no commit names. Production passes None; fault injection passes a hook from outside
    (infra/chaos/faulty_syncer.py, docs/chaos.md), so no environment variable changes this class."""

    def __init__(self, store: str | ObjectStore, cfg: SyncerConfig = SyncerConfig(), bus: BusConfig | None = None,
                 events: EventLog | None = None, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep,
                 keys: KeyRing | None = None, before_commit: Callable[[CommitRecord], None] | None = None,
                 regions: Mapping[str, ObjectStore] | None = None):
        self.store = open_store(store, create=False) if isinstance(store, str) else store   # never a new empty dir
        self.cfg = cfg
        self.events = events or EventLog(None, "syncer", cfg.syncer_id)
        self.clock, self.wall, self.sleep = clock, wall, sleep   # injected: tests drive time (style guide)
        self.descriptor: RunDescriptor = read_descriptor(self.store)
        self.security = check_syncer_keys(self.descriptor, keys)
        self.signer = keys.own.signer() if keys is not None else None
        self.curve = keys.own.curve_keys() if keys is not None else None
        self.gate = None if self.security is None else \
            Gate(Roster(self.descriptor, self.security), cfg.members_poll_s, clock)
        self.roster = self.gate.roster if self.gate is not None else None
        self.max_delta = max_delta_bytes(self.descriptor)
        # Bus messages above the largest delta this run can produce are dropped by libzmq unread.
        self.bus_cfg = None if bus is None else dataclasses.replace(
            bus, max_message_bytes=max(HEAD_MAX_BYTES, min(bus.max_message_bytes, self.max_delta)))
        self.window = initial_window(self.descriptor)   # the norm guard's; recovery rebuilds it from the log
        self.log = CommitLog(self.store)
        self.policy = self.descriptor.policy
        self.pending: list[dict[str, _Held]] = [{} for _ in range(self.descriptor.num_fragments)]
        self.quorum_met: list[float | None] = [None] * self.descriptor.num_fragments
        # The global step, open rounds and the learners' pace (syncer-driven rounds, SPEC §2-4).
        self.rounds = RoundBook(self.descriptor, cfg.live_timeout_s, cfg.initial_step_s)
        self.sync_time = Ewma(0.2)
        self.stats = SyncerStats()
        self.state: SyncerState | None = None
        self.epoch = -1
        self.bus: SyncerBus | None = None
        self.fenced = False
        self.bad_inbox: set[str] = set()
        self.unknown_inbox: set[str] = set()     # refused for an unlisted learner: retried when members join
        self._since_commit: Counter = Counter()  # ingest refusals since the last commit, for its info
        # Object writes of one commit are independent until the commit itself: do them in parallel
        # (each is an fsync or an HTTP round trip), and tidy the inbox in the background.
        self.io = ThreadPoolExecutor(max_workers=8, thread_name_prefix="syncer-io")
        self.retention = SyncerRetention(self.store, cfg.retention, self.events, self.io)
        self.before_commit = before_commit
        # Issue 14: ingest every region's inbox; copy each commit to the other regions (``regions``:
        # stores by name that override the descriptor's, e.g. wrapped in tests).
        self.inboxes, self.replicator = replication(self.store, self.descriptor, self.events, regions)

    # -- start-up --------------------------------------------------------------------------------
    def recover(self) -> None:
        """Prove the store enforces create-if-absent (fencing depends on it), rebuild the state from
        the log *read-only* (issue 11 item 9: a rebuild that fails leaves the old syncer running),
        then claim a new epoch with a signed fence (item 14), fold whatever an older syncer committed
        in between, and repair what can be recomputed (item 10, workers/syncer/recovery.py)."""
        t0 = self.clock()
        probe_conditional_writes(self.store)   # raises, naming the store, on one that does not
        self._refresh_members(force=True)
        before = recover_state(self.store, self.descriptor, CommitLog(self.store).tail(), roster=self.roster,
                               finish=False)
        sign = None if self.signer is None else (lambda r: sign_commit(r, self.signer, self.descriptor.run_id))
        self.epoch, fence_seq, self.log = claim_epoch(self.store, self.cfg.syncer_id, sign=sign,
                                                      info=before.fence_info(),
                                                      trusted=trusted_commits(self.descriptor))
        rs = recover_state(self.store, self.descriptor, fence_seq - 1, roster=self.roster, start=before)
        self.state = fold_fence(rs.state, fence_seq, self.epoch).state
        self.window = rs.window
        self._report_recovery(rs)
        # Round ids are global steps: a new syncer goes on after the newest round in the log, so
        # that (epoch, round) orders every opening learners ever heard.
        self.rounds.clock.step = self._last_round(fence_seq - 1) + 1
        self.events.emit("syncer-recovered", epoch=self.epoch, fence_seq=fence_seq,
                         replayed=before.stats.commits + rs.stats.commits, from_checkpoint=before.stats.from_checkpoint,
                         salvaged=len(rs.notes), seconds=round(self.clock() - t0, 3))

    def _report_recovery(self, rs: Recovery) -> None:
        """Say loudly what recovery salvaged; checkpoint a salvaged state at the fence (so a later
        restart or ``replay --from`` starts there) and republish damaged newest versions."""
        for note in rs.notes:
            self.events.emit("recovery-salvaged", detail=note)
        if rs.salvaged or rs.gaps:
            self._checkpoint()
        for note in republish_damaged(self.store, self.descriptor, self.state, self.signer):
            self.events.emit("version-republished", detail=note)

    def _last_round(self, tail: int) -> int:
        """The newest round closed by the last few commits (-1: none; old learner-driven runs)."""
        best, seq = -1, tail
        while seq >= 0 and tail - seq < 4 * self.descriptor.num_fragments:
            try:
                best = max(best, self.log.read(seq).round)
            except (StoreError, FormatError):
                break
            seq -= 1
        return best

    def open_bus(self) -> None:
        if self.security is None:
            self.events.emit("security-off", detail="unsigned run (--insecure): no CURVE on the bus, no signatures; "
                                                    "anyone who reaches the bus or the bucket can change the model")
        if self.bus_cfg is not None:
            auth = self.roster.learner_of_curve if self.roster is not None else None
            self.bus = SyncerBus(self.bus_cfg, curve=self.curve, authorize=auth, denied=self._on_denied)
            self.events.emit("syncer-bus", ingest=self.bus.ingest_endpoint, announce=self.bus.announce_endpoint,
                             curve=self.curve is not None, max_message_bytes=self.bus_cfg.max_message_bytes)

    def _on_denied(self, key: str) -> None:
        """ZAP thread: an unlisted CURVE key tried to connect (logged at its 1st, 2nd, 4th... try)."""
        n = self.gate.denied(key)
        if n & (n - 1) == 0:
            self.events.emit("peer-denied", curve_public=key, attempts=n, reason="unknown-key")

    def _refresh_members(self, force: bool = False) -> None:
        if self.gate is None:
            return
        added, problems = self.gate.refresh(self.store, force)
        for note in problems:
            self.events.emit("member-refused", error=note)
        if added:
            self.events.emit("members-added", learners=added)
            self.bad_inbox -= self.unknown_inbox     # their spilled deltas are read again
            self.unknown_inbox.clear()

    # -- main loop -------------------------------------------------------------------------------
    def run(self, should_stop: Callable[[], bool] = lambda: False) -> int:
        """Loop until ``should_stop()`` or fenced. Returns 0, or 3 when fenced by a newer syncer."""
        if self.state is None:
            self.recover()
        if self.bus is None:
            self.open_bus()
        if self.replicator is not None:
            self.replicator.start(self.state.last_seq)
        next_spill = next_beat = 0.0
        next_fence_check = self.clock() + self.cfg.fence_check_s
        try:
            while not should_stop() and not self.fenced:
                now = self.clock()
                if now >= next_fence_check:
                    self._check_fenced()
                    next_fence_check = self.clock() + self.cfg.fence_check_s
                    if self.fenced:
                        break
                self._refresh_members()
                if now >= next_spill:
                    self._ingest_spill()
                    next_spill = self.clock() + self.cfg.spill_poll_s
                if self.bus is not None and now >= next_beat:
                    self.bus.announce(Message("syncer-heartbeat", {"epoch": self.epoch, "tail": self.state.last_seq}))
                    next_beat = now + self.cfg.heartbeat_s
                self._tick_rounds()
                wait = self._close_rounds()
                timeout = min(wait if wait is not None else 1.0, max(0.0, next_spill - self.clock()), 0.2,
                              self.rounds.clock.wait_s(self.clock()))
                self._ingest_bus(timeout)
        finally:
            if self.bus is not None:
                self.bus.close()
            self.io.shutdown(wait=True)
            if self.replicator is not None:
                self.replicator.stop(self.replicator.cfg.drain_s)
            self.events.emit("syncer-stop", fenced=self.fenced, **self.summary())
        return 3 if self.fenced else 0

    def _check_fenced(self) -> None:
        """An idle syncer learns that a newer epoch took over from the log's tail (issue 11 item 8):
        an active one learns it from its next append; an idle one would otherwise run forever."""
        try:
            self.log.check_fenced()
        except Fenced as exc:
            self.fenced = True
            self.events.emit("syncer-fenced", seq=self.state.last_seq, epoch=self.epoch, error=str(exc))
        except (StoreError, FormatError) as exc:     # unreachable or a damaged tail: ask again later
            self.events.emit("store-error", op="check-fenced", error=str(exc))

    # -- rounds ----------------------------------------------------------------------------------
    def _timing(self) -> Timing:
        return Timing(self.rounds.period.value, self.sync_time.value or 0.0)

    def _live_count(self) -> int | None:
        return len(self.rounds.live(self.clock())) or None

    def _tick_rounds(self) -> None:
        """Open the rounds that fall due on the global clock and tell the learners: over the bus,
        and in storage (the round clock) for learners without one (SPEC §4)."""
        self.rounds.step_time(self.clock())   # the learners' pace, measured once per loop
        if self.descriptor.schedule.driver != "syncer" or self.fenced:
            return
        for r, p in self.rounds.tick(self.clock()):
            if self.bus is not None:
                self.bus.announce(Message("round", {"epoch": self.epoch, "round": r, "fragment": p}))
        rec = self.rounds.clock_record(self.epoch, self.wall())
        if rec is not None:
            self.io.submit(self._put_clock, rec.to_bytes())

    def _put_clock(self, blob: bytes) -> None:
        try:
            self.store.put(CLOCK_KEY, blob)
            if self.replicator is not None:
                self.replicator.advisory(CLOCK_KEY, blob)   # learners of other regions read theirs
        except StoreError as exc:   # advisory: learners with a bus do not need it
            self.events.emit("store-error", op="round-clock", error=str(exc))

    def _close_rounds(self) -> float | None:
        """Merge every fragment whose round may close; return the shortest wait for the others.
        Rejected deltas never count toward a quorum; they join the next commit of their fragment,
        or force a drop commit when nothing else is pending (or too many have piled up)."""
        waits = []
        timing = self._timing()
        live = self._live_count()
        syncer_driven = self.descriptor.schedule.driver == "syncer"
        for p, pend in enumerate(self.pending):
            if not pend or self.fenced:
                continue
            valid = [h for h in pend.values() if not h.reason]
            rejected = [h.pkey for h in pend.values() if h.reason]
            items = [Pending(h.header.id, h.header.learner, h.header.order, h.arrived_at, h.header.c_steps,
                             h.header.c_tokens, h.header.round) for h in valid]
            opened = self.rounds.open[p]
            if syncer_driven and opened is None:
                d = Decision((), (), None, None, None, "no-round")   # late answers wait for p's next round
            else:
                d = decide(items, self.clock(), self.policy, timing, live,
                           round_id=opened.round if syncer_driven else None)
            if syncer_driven and not d.merge and items:
                due = late_deadline(min(i.arrived_at for i in items), timing.step_time_s or self.cfg.initial_step_s,
                                    self.descriptor.schedule.sync_every)
                if self.clock() >= due:
                    d = Decision(tuple(i.delta_id for i in items), (), 0.0, None, None, "late-expired")
                else:
                    waits.append(due - self.clock())
            if d.merge:
                self._merge(p, list(d.merge) + list(d.superseded) + rejected, d)
            elif rejected and (not valid or len(rejected) >= REJECTED_FLUSH):
                self._merge(p, rejected, Decision((), (), None, None, None, "rejected-only"))
            elif d.wait_s is not None:
                waits.append(d.wait_s)
        return min(waits) if waits else None

    def _commit_meta(self, p: int, held: list[_Held], decision: Decision, t0: float,
                     opened: OpenRound | None) -> CommitMeta:
        """What this syncer decides about a commit besides its inputs (seq, keys, timings, info);
        ``opened``: the round it closes (None: none, e.g. a drop of rejected deltas only)."""
        grace = max(0.0, t0 - decision.quorum_met_at) if decision.quorum_met_at is not None else 0.0
        info = {"syncer": self.cfg.syncer_id, "decided": decision.reason, "live": self._live_count() or 0,
                "committed_at": round(self.wall(), 4)}
        if self._since_commit:
            info["rejected"] = dict(sorted(self._since_commit.items()))   # ingest refusals since the last commit
        return CommitMeta(seq=self.state.last_seq + 1, epoch=self.epoch,
                          output_key=version_key(p, self.state.fragments[p].version + 1, self.epoch),
                          quorum=len(set(h.header.learner for h in held if not h.reason)),
                          grace_wait_s=round(grace, 4), info=info, round=opened.round if opened is not None else -1)

    def _merge(self, p: int, keys: list[str | Quarantined], decision: Decision) -> None:
        t0 = self.clock()
        held = [self.pending[p][k] for k in keys if k in self.pending[p]]
        inputs = [round_input(h.blob, h.stored_key, self.descriptor, self.roster, h.opened) for h in held]
        opened = self.rounds.open[p] if decision.merge else None
        commit = apply_commit(self.state, self.window, self.descriptor, p, inputs,
                              self._commit_meta(p, held, decision, t0, opened))
        if self.signer is not None:
            commit = dataclasses.replace(commit, record=sign_commit(commit.record, self.signer,
                                                                    self.descriptor.run_id))
        rec = commit.record
        try:
            if not self._persist_and_commit(commit, held, inputs):
                return
        except _KeyConflict as exc:
            # A learner reused a delta id with other bytes: that copy is refused (left in the inbox as
            # evidence) and the round is decided again without it.
            for h in held:
                if delta_key(h.header.learner, h.header.incarnation, h.header.seq) == exc.key and not h.reason:
                    self.pending[p].pop(h.pkey, None)
                    self._reject(h.header, None, h.header.id, f"{exc.key} holds other bytes", "id-reused")
                    if h.inbox_key:
                        self.bad_inbox.add(h.inbox_key)
            return
        self.state, self.window = commit.state, commit.window
        if opened is not None:
            self.rounds.close(p)
        self._since_commit.clear()
        for h in held:
            self.pending[p].pop(h.pkey, None)
            if h.inbox_key:
                self.io.submit(self._delete, h.inbox_key, h.inbox_store)
        self.stats.commits += 1
        self.stats.merged += len(rec.inputs)
        self.stats.dropped += len(rec.dropped)
        self.stats.drops.update(DropReason.parse(d.reason).category for d in rec.dropped)
        self.stats.quorum_sizes.append(rec.quorum)
        self.stats.grace_waits.append(rec.grace_wait_s)
        self.sync_time = self.sync_time.update(self.clock() - t0)
        if rec.kind == "merge" and self.bus is not None:
            self.bus.announce(Message("version", {"seq": rec.seq, "fragment": p, "version": rec.version,
                                                  "key": rec.output_key, "checksum": rec.output_checksum,
                                                  "epoch": self.epoch, "round": rec.round}))
        self.io.submit(self.log.write_hint, rec.seq, self.epoch)
        if self.replicator is not None:
            self.replicator.committed(rec.seq, self.epoch)
        self.events.emit("commit", seq=rec.seq, kind=rec.kind, fragment=p, version=rec.version,
                         inputs=[i.delta_id for i in rec.inputs], weights=[round(i.weight, 4) for i in rec.inputs],
                         staleness=[i.staleness for i in rec.inputs],
                         dropped=[[d.delta_id, d.reason] for d in rec.dropped], quorum=rec.quorum, round=rec.round,
                         grace_s=rec.grace_wait_s, reason=decision.reason, rejected=rec.info.get("rejected", {}),
                         tokens=sum(i.c_tokens for i in rec.inputs), sync_s=round(self.clock() - t0, 4))
        if rec.seq % self.cfg.checkpoint_every == 0:
            self._checkpoint()

    def _persist_and_commit(self, res: Commit, held: list[_Held], inputs) -> bool:
        """Inputs, then the version blob, then the commit (data before the commit that names it).
        Retries while the store is unavailable; False when fenced."""
        rec = res.record
        blobs = [(inp.key, h.blob) for inp, h in zip(inputs, held)]
        if res.published is not None:
            blobs.append((rec.output_key, encode_version(self.descriptor, rec.fragment, rec.version, rec.seq,
                                                         self.epoch, res.published, self.signer, rec.output_checksum)))
        backoff = self.cfg.retry_s
        while True:
            try:
                for _ in self.io.map(lambda kb: self._put_same(*kb), blobs):
                    pass
                if self.before_commit is not None:
                    self.before_commit(rec)
                self.log.append(rec, hint=False)   # the advisory head hint follows off the latency path
                return True
            except Fenced as exc:
                self.fenced = True
                self.events.emit("syncer-fenced", seq=rec.seq, epoch=self.epoch, error=str(exc))
                return False
            except StoreError as exc:
                if not exc.retryable:
                    raise
                self.events.emit("store-error", op="commit", seq=rec.seq, error=str(exc), retry_in_s=backoff)
                self.sleep(backoff)
                backoff = min(backoff * 2, self.cfg.max_retry_s)
                if self.bus is not None:
                    self._ingest_bus(0)   # keep hearing heartbeats; new deltas wait in pending

    def _put_same(self, key: str, blob: bytes) -> None:
        """Create ``key``; if it exists it must hold these very bytes (a retry, or the learner's spill)."""
        try:
            self.store.put_if_absent(key, blob)
        except AlreadyExists:
            if digest(self.store.get(key)) != digest(blob):
                raise _KeyConflict(key) from None

    def _checkpoint(self) -> None:
        try:
            payload = self.state.to_bytes()
            if self.signer is not None:   # a restored state decides every later merge: only our own is trusted
                payload = seal_checkpoint(payload, self.state.last_seq, self.signer, self.descriptor.run_id)
            write_checkpoint(self.store, self.state.last_seq, payload)
            self.events.emit("checkpoint", seq=self.state.last_seq)
            self.retention.after_checkpoint(self.state.last_seq)   # in the background; never blocks merging
        except StoreError as exc:
            self.events.emit("store-error", op="checkpoint", error=str(exc))

    def summary(self) -> dict:
        s = self.stats
        return {"epoch": self.epoch, "commits": s.commits, "merged": s.merged, "dropped": s.dropped,
                "duplicates": s.duplicates, "rejected": s.rejected, "from_bus": s.from_bus,
                "from_spill": s.from_spill, "evicted": s.evicted, "last_seq": self.state.last_seq if self.state else -1,
                "versions": [f.version for f in self.state.fragments] if self.state else [],
                "mean_quorum": s.quorum_sizes.mean, "mean_grace_s": s.grace_waits.mean,
                "retention_deleted": self.retention.deleted,
                "security": "signed" if self.security is not None else "off",
                "rejections": dict(sorted((s.rejections + Counter(
                    {"unknown-key": self.gate.denied_total() if self.gate else 0})).items())),
                "drops": dict(sorted(s.drops.items())),
                "regions": self.replicator.stats() if self.replicator is not None else {}}
