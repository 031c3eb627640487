"""The syncer (SPEC §4, §7, paper §3): collects deltas, closes rounds with the quorum + grace
policy, decides each commit with ``pipeline.commit.apply_commit`` (norm guard, fold, norm window:
the very function replay and recovery verify with), commits versions to the log, announces them.

:class:`Syncer` wires three parts that each own their state, and runs the loop:

* :class:`~workers.syncer.ingest.Ingest` - the bus and the spill inboxes, admission, the pending
  sets and the refusal counts (workers/syncer/ingest.py);
* :class:`~workers.syncer.rounds.RoundBook` - the global step, the open rounds and the learners'
  pace (workers/syncer/rounds.py);
* :class:`~workers.syncer.committer.Committer` - the state, the norm window, the epoch and the log:
  decide, persist, append, announce, checkpoint (workers/syncer/committer.py).

One thread runs the loop below; the bus sockets and the pending sets belong to it. Storage is
the truth: a delta is acked only after it is in the inbox (``spill_key``), every commit names
inputs persisted under their permanent ``delta_key``, and a refused append (``Fenced``) stops this
syncer because a newer epoch owns the run. Restart recovery goes through ``recovery.recover_state``
(the replay code, salvaging damage).

Hostile input (docs/security.md): in a signed run the bus is CURVE-encrypted and
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
import os
import time
from collections import Counter
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from pipeline.commit import BELOW_QUORUM, CommitMeta
from pipeline.errors import FormatError
from pipeline.fold import DropReason, RoundInput, SyncerState, fold_fence
from pipeline.policy import (Decision, Ewma, Pending, Timing, Verdict, decide, expire_late, late_answers,
                             late_deadline)
from pipeline.schedule import ClockRecord
from pipeline.descriptor import RunDescriptor
from pipeline.types import CommitRecord
from storage.errors import StoreError
from storage.layout import CLOCK_KEY, read_descriptor
from storage.log import CommitLog, claim_epoch
from storage.probe import probe_conditional_writes
from storage.shards import owned_fragments, syncer_store
from storage.store import ObjectStore, open_store
from workers.bus.bus import HEAD_MAX_BYTES, ZMQ, BusConfig, Message, SyncerBus, Transport
from workers.bus.keys import Gate, KeyRing, Roster, check_syncer_keys
from workers.bus.signing import sign_commit
from workers.common.aggregate import RunningMean
from workers.common.deltas import Opened, max_delta_bytes, round_input
from workers.common.events import EventLog
from workers.syncer.committer import Committer, CommitterConfig, KeyConflict
from workers.syncer.gc import RetentionConfig, SizeNoting, SyncerRetention
from workers.syncer.home import start_home
from workers.syncer.ingest import Ingest
from workers.syncer.records import Held, PendingKey
from workers.syncer.recovery import Recovery, recover_state, republish_damaged
from workers.syncer.replicate import replication
from workers.syncer.rounds import OpenRound, RoundBook
from workers.common.refold import trusted_commits

REJECTED_FLUSH = 16                   # rejected deltas of one fragment that force a drop commit

@dataclass(frozen=True)
class SyncerConfig:
    syncer_id: str = "syncer"
    spill_poll_s: float = 0.5          # how often the inbox is listed for spilled deltas
    heartbeat_s: float = 1.0
    live_timeout_s: float = 5.0        # a learner unheard for this long is not live
    checkpoint_every: int = 25         # commits between checkpoints
    retry_s: float = 0.5               # first backoff when the store is unavailable
    # Longest pause between attempts: the first commit after a store outage waits up to this long
    # after the store is back (5 s kept a 4 s outage's merges stopped for 2.9 s more), and one PUT
    # a second costs a down store nothing. The learners' spill retry has the same cap.
    max_retry_s: float = 2.0
    max_ingest_per_poll: int = 256
    members_poll_s: float = 5.0        # how often membership records are re-read (signed runs)
    retention: RetentionConfig = RetentionConfig()   # after each checkpoint (workers/syncer/gc.py, docs/storage.md)
    initial_step_s: float = 0.1        # the global clock's pace before any learner's was measured
    fence_check_s: float = 1.0         # how often an idle syncer checks whether it was fenced (item 8)
    max_pending: int = 64              # candidate deltas held per fragment
    shard: int | None = None           # a sharded run's shard this syncer is (None: unsharded)
    threads: int = 1                   # compute pool for decode, guard, fold, version encode
    # Publish the bus endpoints in the store for learners that discover the syncer (workers/bus/
    # discovery.py): the host written for a wildcard bind ("": this host's FQDN); None: not published.
    advertise: str | None = None

    def __post_init__(self) -> None:
        for name in ("spill_poll_s", "heartbeat_s", "live_timeout_s", "retry_s", "max_retry_s", "members_poll_s",
                     "fence_check_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SyncerConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {self.checkpoint_every}")
        if not isinstance(self.max_pending, int) or isinstance(self.max_pending, bool) or self.max_pending < 1:
            raise ValueError(f"SyncerConfig.max_pending must be an int >= 1, got {self.max_pending!r}")
        if not isinstance(self.threads, int) or isinstance(self.threads, bool) or self.threads < 1:
            raise ValueError(f"SyncerConfig.threads must be an int >= 1, got {self.threads!r}")


@dataclass
class SyncerStats:
    """What the syncer did, for tests and its summary: a snapshot of its parts' counters
    (``Syncer.stats``); ingest refusals by category value."""

    commits: int = 0
    merged: int = 0
    dropped: int = 0
    duplicates: int = 0
    rejected: int = 0          # refused at ingest (bad message / header / unknown fragment)
    rejections: Counter = field(default_factory=Counter)   # ingest refusals by reason (never in a commit)
    drops: Counter = field(default_factory=Counter)        # recorded drops by reason (in commits)
    from_bus: int = 0
    from_spill: int = 0
    evicted: int = 0           # dropped "pending-overflow" while a quorum was not met
    # running aggregates, not one entry per commit
    grace_waits: RunningMean = field(default_factory=RunningMean)
    round_sizes: RunningMean = field(default_factory=RunningMean)   # learners counted per commit


class Syncer:
    """``before_commit``: called with each commit record right before every attempt to append it,
    when its inputs and version object are already stored - the one point where a crash leaves data
    no commit names. Production passes None; fault injection passes a hook from outside
    (infra/chaos/faulty_syncer.py, docs/chaos.md), so no environment variable changes this class."""

    def __init__(self, store: str | ObjectStore, cfg: SyncerConfig = SyncerConfig(), bus: BusConfig | None = None,
                 events: EventLog | None = None, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep,
                 keys: KeyRing | None = None, before_commit: Callable[[CommitRecord], None] | None = None,
                 regions: Mapping[str, ObjectStore] | None = None, io: Executor | None = None,
                 transport: Transport = ZMQ):
        self.store = open_store(store, create=False) if isinstance(store, str) else store   # never a new empty dir
        self.transport = transport   # what builds the bus (ZeroMQ; the fault simulation's own)
        self.cfg = cfg
        self.events = events or EventLog(None, "syncer", cfg.syncer_id)
        self.clock, self.wall, self.sleep = clock, wall, sleep   # injected: tests drive time (style guide)
        self.descriptor: RunDescriptor = read_descriptor(self.store)
        self.descriptor.check_writable("syncer")   # issue 26: refused by the feature's name, before any claim
        # Issue 15: shard i of a sharded run sees its own partition as the run (storage/shards.py).
        self.store = syncer_store(self.store, self.descriptor, cfg.shard)
        # what retention's byte budget needs, noted as objects pass (gc.py); only under a budget: the
        # map holds a size per object until retention deletes it, which --keep-all never does
        self.sizes: dict[str, int] = {}
        if cfg.retention.enabled and cfg.retention.keep_bytes is not None:
            self.store = SizeNoting(self.store, self.sizes)
        self.policy = self.descriptor.policy
        self.security = check_syncer_keys(self.descriptor, keys)
        self.signer = keys.own.signer() if keys is not None else None
        self.curve = keys.own.curve_keys() if keys is not None else None
        self.gate = None if self.security is None else \
            Gate(Roster(self.descriptor, self.security), cfg.members_poll_s, clock)
        self.roster = self.gate.roster if self.gate is not None else None
        # Bus messages above the largest delta this run can produce are dropped by libzmq unread.
        self.bus_cfg = None if bus is None else dataclasses.replace(bus, max_message_bytes=max(
            HEAD_MAX_BYTES, min(bus.max_message_bytes, max_delta_bytes(self.descriptor))))
        self.bus: SyncerBus | None = None
        self.sync_time = Ewma(0.2)
        self._next_spill = self._next_beat = 0.0       # the loop's due times (``turn``)
        self._next_fence_check: float | None = None
        self._short: tuple[float, int | None] | None = None   # K above every learner heard: since, warned at
        # Object writes of one commit are independent until the commit itself: do them in parallel
        # (each is an fsync or an HTTP round trip), and tidy the inbox in the background.
        # ``io``: injected by the fault simulation (an inline executor: infra/faultsim, issue 25).
        self.io = io if io is not None else ThreadPoolExecutor(max_workers=8, thread_name_prefix="syncer-io")
        self.retention = SyncerRetention(self.store, cfg.retention, self.events, self.io, wall=self.wall,
                                         sizes=self.sizes, pace=time.sleep if io is None else None)
        # A round's arithmetic on a pool of its own: bit-identical at any thread count
        # (tests/test_threads.py), so it is a pure speed setting that replay never needs to know.
        self.compute = ThreadPoolExecutor(cfg.threads, thread_name_prefix="syncer-compute") if cfg.threads > 1 else None
        self.map_fn = self.compute.map if self.compute is not None else map
        # Issue 14: ingest every region's inbox; copy each commit to the other regions (``regions``:
        # stores by name that override the descriptor's, e.g. wrapped in tests).
        inboxes, self.replicator = replication(self.store, self.descriptor, self.events, regions)
        # The global step, open rounds and the learners' pace (syncer-driven rounds, SPEC §2-4).
        self.rounds = RoundBook(self.descriptor, cfg.live_timeout_s, cfg.initial_step_s,
                                owned=owned_fragments(self.store, self.descriptor))
        self.committer = Committer(
            self.store, self.descriptor, CommitterConfig(cfg.retry_s, cfg.max_retry_s, cfg.checkpoint_every),
            self.events, self.io, sleep, signer=self.signer, announce=self._announce, on_retry=self._hear_bus,
            after_checkpoint=self.retention.after_checkpoint, before_commit=before_commit,
            map_fn=self.compute.map if self.compute is not None else None, noted=self.replicator.committed if self.replicator is not None else None)
        self.ingest = Ingest(self.store, self.descriptor, self.roster, self.rounds, self.committer.high_water,
                             self.events, clock, sleep, self.io, max_pending=cfg.max_pending,
                             max_per_poll=cfg.max_ingest_per_poll, inboxes=inboxes,
                             wake_members=self.gate.soon if self.gate is not None else None,
                             merged_before=self.committer.merged_before)

    # -- the parts' state, read where tests, metrics and tools read it ------------------------------
    @property
    def state(self) -> SyncerState | None:
        return self.committer.state

    @property
    def epoch(self) -> int:
        return self.committer.epoch

    @property
    def log(self) -> CommitLog:
        return self.committer.log

    @property
    def fenced(self) -> bool:
        return self.committer.fenced

    @property
    def pending(self) -> list[dict[PendingKey, Held]]:
        return self.ingest.pending

    @property
    def stats(self) -> SyncerStats:
        i, c = self.ingest.stats, self.committer.stats
        return SyncerStats(c.commits, c.merged, c.dropped, i.duplicates, i.rejected,
                           Counter({why.value: n for why, n in i.rejections.items()}), c.drops, i.from_bus,
                           i.from_spill, i.evicted, c.grace_waits, c.round_sizes)

    # -- start-up --------------------------------------------------------------------------------
    def recover(self, failover_from: str | None = None) -> None:
        """Refuse a store that is not the run's home region's, unless ``failover_from`` names the
        home region this one takes over from (workers/syncer/home.py); prove the store
        enforces create-if-absent (fencing depends on it), rebuild the state from
        the log *read-only* (issue 11 item 9: a rebuild that fails leaves the old syncer running),
        then claim a new epoch with a signed fence (item 14), fold whatever an older syncer committed
        in between, and repair what can be recomputed (item 10, workers/syncer/recovery.py)."""
        t0 = self.clock()
        home = start_home(self.store, self.descriptor, self.replicator.stores() if self.replicator else {},
                          failover_from, self.events)   # before any write: a region's copy is refused
        probe_conditional_writes(self.store)   # raises, naming the store, on one that does not
        self._refresh_members(force=True)
        before = recover_state(self.store, self.descriptor, CommitLog(self.store).tail(), roster=self.roster,
                               finish=False)
        sign = None if self.signer is None else (lambda r: sign_commit(r, self.signer, self.descriptor.run_id))
        epoch, fence_seq, log = claim_epoch(self.store, self.cfg.syncer_id, sign=sign,
                                            info={**before.fence_info(), **home.fence_info},
                                            trusted=trusted_commits(self.descriptor), floor=home.epoch_floor)
        home.claimed(self.store, self.descriptor, fence_seq, self.events)   # a failover's record, once fenced
        rs = recover_state(self.store, self.descriptor, fence_seq - 1, roster=self.roster, start=before)
        self.committer.begin(epoch, log, fold_fence(rs.state, fence_seq, epoch).state, rs.window)
        self._report_recovery(rs)
        # Round ids are global steps: a new syncer goes on after the newest round in the log, so
        # that (epoch, round) orders every opening learners ever heard.
        self.rounds.clock.step = self._last_round(fence_seq - 1) + 1
        paced = self.rounds.resume_pace(self._stored_clock())
        self.events.emit("syncer-recovered", epoch=epoch, fence_seq=fence_seq, shard=self.cfg.shard, pid=os.getpid(),
                         replayed=before.stats.commits + rs.stats.commits, from_checkpoint=before.stats.from_checkpoint,
                         salvaged=len(rs.notes), seconds=round(self.clock() - t0, 3),
                         pace_s=round(self.rounds.period.value, 5) if paced else None)

    def _report_recovery(self, rs: Recovery) -> None:
        """Say loudly what recovery salvaged; checkpoint a salvaged state at the fence (so a later
        restart or ``replay --from`` starts there) and republish damaged newest versions."""
        for note in rs.notes:
            self.events.emit("recovery-salvaged", detail=note)
        if rs.salvaged or rs.gaps:
            self.committer.checkpoint()
        for note in republish_damaged(self.store, self.descriptor, self.state, self.signer):
            self.events.emit("version-republished", detail=note)

    def _stored_clock(self) -> ClockRecord | None:
        """The round clock an earlier syncer left in storage, or None (none, unreadable: advisory)."""
        try:
            return ClockRecord.from_bytes(self.store.get(CLOCK_KEY), CLOCK_KEY)
        except (StoreError, FormatError):
            return None

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
            self.bus = self.transport.syncer(self.bus_cfg, curve=self.curve, authorize=auth, denied=self._on_denied)
            self.ingest.attach(self.bus)
            self.events.emit("syncer-bus", ingest=self.bus.ingest_endpoint, announce=self.bus.announce_endpoint,
                             curve=self.curve is not None, max_message_bytes=self.bus_cfg.max_message_bytes)
            if self.cfg.advertise is not None:
                self._advertise()

    def _advertise(self) -> None:
        """Where learners reach this syncer, in the store (advisory: a failure is reported, not fatal)."""
        from workers.bus.discovery import advertised, publish
        host = self.cfg.advertise
        try:
            ep = publish(self.store, self.descriptor, self.epoch, self.cfg.syncer_id,
                         advertised(self.bus.ingest_endpoint, host), advertised(self.bus.announce_endpoint, host),
                         self.signer, self.wall())
            self.events.emit("syncer-advertised", ingest=ep.ingest, announce=ep.announce, epoch=ep.epoch)
        except StoreError as exc:
            self.events.emit("syncer-advertise-failed", error=str(exc)[:300])

    def _announce(self, msg: Message) -> None:
        if self.bus is not None:
            self.bus.announce(msg)

    def _hear_bus(self) -> None:
        """While a commit waits for the store: keep hearing heartbeats (new deltas wait in pending)."""
        if self.bus is not None:
            self.ingest.poll_bus(0)

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
            self.ingest.members_added()     # their spilled deltas are read again

    # -- main loop -------------------------------------------------------------------------------
    def run(self, should_stop: Callable[[], bool] = lambda: False) -> int:
        """Loop until ``should_stop()`` or fenced. Returns 0, or 3 when fenced by a newer syncer."""
        if self.state is None:
            self.recover()
        if self.bus is None:
            self.open_bus()
        if self.replicator is not None:
            self.replicator.start(self.state.last_seq)
        try:
            while not should_stop() and not self.fenced:
                timeout = self.turn()
                if not self.fenced:
                    self.ingest.poll_bus(timeout)
        finally:
            if self.bus is not None:
                self.bus.close()
            self.ingest.close()
            self.io.shutdown(wait=True)
            if self.compute is not None:
                self.compute.shutdown(wait=True)
            if self.replicator is not None:
                self.replicator.stop(self.replicator.cfg.drain_s)
            self.events.emit("syncer-stop", fenced=self.fenced, **self.summary())
        return 3 if self.fenced else 0

    def turn(self) -> float:
        """One turn of the loop without its wait: the fence check, the inbox, the heartbeat, the
        rounds. Returns how long the loop may wait for the bus before the next turn. ``run`` loops
        over it; the fault simulation calls it on simulated time (infra/faultsim, issue 25)."""
        now = self.clock()
        if self._next_fence_check is None:        # the first turn: the first check is one period away
            self._next_fence_check = now + self.cfg.fence_check_s
        elif now >= self._next_fence_check:
            self.committer.check_fenced()
            self._next_fence_check = self.clock() + self.cfg.fence_check_s
            if self.fenced:
                return 0.0
        self._refresh_members()
        if now >= self._next_spill:
            self.ingest.poll_inboxes()
            self._next_spill = self.clock() + self.cfg.spill_poll_s
        if self.bus is not None and now >= self._next_beat:
            self.bus.announce(Message("syncer-heartbeat", {"epoch": self.epoch, "tail": self.state.last_seq}))
            self._next_beat = now + self.cfg.heartbeat_s
        # Close what may close *before* the clock moves: after a turn that took long (a slow commit,
        # the process descheduled), the clock catches up several steps at once and would replace
        # rounds whose quorum and grace were already met, making their answers wait H more steps.
        # Only on turns where the clock is due: otherwise the close after the tick sees the same.
        if self.rounds.clock.wait_s(self.clock()) == 0.0:
            self.close_rounds()
        self._tick_rounds()
        wait = self.close_rounds()
        return min(wait if wait is not None else 1.0, max(0.0, self._next_spill - self.clock()), 0.2,
                   self.rounds.clock.wait_s(self.clock()))

    # -- rounds ----------------------------------------------------------------------------------
    def _timing(self) -> Timing:
        return Timing(self.rounds.period.value, self.sync_time.value or 0.0, self.rounds.answer_spread(self.clock()))

    def _live_count(self) -> int | None:
        return len(self.rounds.live(self.clock())) or None

    def _tick_rounds(self) -> None:
        """Open the rounds that fall due on the global clock and tell the learners: over the bus,
        and in storage (the round clock) for learners without one (SPEC §4)."""
        self.rounds.step_time(self.clock())   # the learners' pace, measured once per loop
        if self.descriptor.schedule.driver != "syncer" or self.fenced:
            return
        for r, p in self.rounds.tick(self.clock()):
            self._announce(Message("round", {"epoch": self.epoch, "round": r, "fragment": p}))
        rec = self.rounds.clock_record(self.epoch, self.wall(), self.clock())
        if rec is not None:
            self.io.submit(self._put_clock, rec.to_bytes())

    def _put_clock(self, blob: bytes) -> None:
        try:
            self.store.put(CLOCK_KEY, blob)
            if self.replicator is not None:
                self.replicator.advisory(CLOCK_KEY, blob)   # learners of other regions read theirs
        except StoreError as exc:   # advisory: learners with a bus do not need it
            self.events.emit("store-error", op="round-clock", error=str(exc))

    def _decide_round(self, p: int, candidates: Sequence[Held], timing: Timing, live: int | None,
                      waits: list[float]) -> Decision:
        """What fragment ``p``'s round should do now with its candidates (pipeline/policy.py); in a
        syncer-driven run, answers to a round that was closed or replaced wait for the next one,
        until they expire (``expire_late``). Answers to the open round never expire: below its
        quorum they are held, and become late when the round is replaced (issue 25: K is a minimum)."""
        syncer_driven = self.descriptor.schedule.driver == "syncer"
        items = [Pending(h.header.id, h.header.learner, h.header.order, h.arrived_at, h.header.c_steps,
                         h.header.c_tokens, h.header.round) for h in candidates]
        opened = self.rounds.open[p]
        round_id = opened.round if opened is not None else None
        if syncer_driven and opened is None:
            d = Decision((), (), None, None, None, Verdict.NO_ROUND)   # late answers wait for p's next round
        else:
            d = decide(items, self.clock(), self.policy, timing, live, round_id=round_id if syncer_driven else None)
        late = late_answers(items, round_id) if syncer_driven and not d.merge else []
        if late:
            due = late_deadline(min(i.arrived_at for i in late), timing.step_time_s or self.cfg.initial_step_s,
                                self.descriptor.schedule.sync_every)
            if self.clock() >= due:
                d = expire_late(items, self.policy, round_id)
            else:
                waits.append(due - self.clock())
        return d

    def close_rounds(self) -> float | None:
        """Merge every fragment whose round may close; return the shortest wait for the others.
        Rejected deltas never count toward a quorum; they join the next commit of their fragment,
        or force a drop commit when nothing else was pending for a round (or too many piled up)."""
        waits: list[float] = []
        timing = self._timing()
        live = self._live_count()
        self._watch_quorum(timing)
        for p, pend in enumerate(self.pending):
            if not pend or self.fenced:
                continue
            valid = [h for h in pend.values() if h.candidate]
            rejected = [h.pkey for h in pend.values() if not h.candidate]
            d = self._decide_round(p, valid, timing, live, waits)
            if d.merge or d.dropped:
                self.merge(p, list(d.merge) + list(d.superseded) + list(d.dropped) + rejected, d)
            elif rejected and (len(rejected) >= REJECTED_FLUSH or not valid and self._refusals_due(pend, timing, waits)):
                self.merge(p, rejected, Decision((), (), None, None, None, Verdict.REJECTED_ONLY))
            elif d.wait_s is not None:
                waits.append(d.wait_s)
        return min(waits) if waits else None

    def _refusals_due(self, pend: dict[PendingKey, Held], timing: Timing, waits: list[float]) -> bool:
        """Whether a fragment's refused deltas, with no answer pending beside them, get a commit of
        their own now: once the oldest has waited a round (H global steps). Until then they may ride
        along with the fragment's next merge. Committed at once, a flood of stale bus deltas after a
        blackhole's restore (already merged through the inbox: duplicates) made a drop commit every
        loop turn and delayed a merge by 36 global steps (chaos bus-blackhole, issue 25)."""
        oldest = min(h.arrived_at for h in pend.values() if not h.candidate)
        due = oldest + self.descriptor.schedule.sync_every * (timing.step_time_s or self.cfg.initial_step_s)
        if self.clock() >= due:
            return True
        waits.append(due - self.clock())
        return False

    def _watch_quorum(self, timing: Timing) -> None:
        """A standalone syncer cannot know M: once K has exceeded the number of learners
        it ever heard of for two round periods, say so (``quorum-unreachable``, again whenever that
        number changes): no round can close until more learners answer."""
        heard, k = len(self.rounds.learners), self.policy.quorum
        if heard >= k:
            self._short = None
            return
        now = self.clock()
        since, warned = self._short or (now, None)
        self._short = (since, warned)
        if warned != heard and now >= late_deadline(since, timing.step_time_s or self.cfg.initial_step_s,
                                                    self.descriptor.schedule.sync_every):
            self._short = (since, heard)
            self.events.emit("quorum-unreachable", quorum=k, learners_heard=heard, learners=sorted(self.rounds.learners),
                             detail=f"the run's quorum K={k} exceeds the {heard} learner(s) this syncer has heard of: "
                                    f"no round closes until {k - heard} more answer (K is a minimum)")

    # -- commits ---------------------------------------------------------------------------------
    def _commit_meta(self, p: int, held: list[Held], decision: Decision, t0: float,
                     opened: OpenRound | None) -> CommitMeta:
        """What this syncer decides about a commit besides its inputs (seq, keys, timings, info);
        ``opened``: the round it closes (None: none, e.g. a drop of rejected deltas only). The round
        size counts the distinct learners of its candidates, less those dropped ``below-quorum``."""
        grace = max(0.0, t0 - decision.quorum_met_at) if decision.quorum_met_at is not None else 0.0
        info = {"syncer": self.cfg.syncer_id, "decided": decision.reason.value, "live": self._live_count() or 0,
                "committed_at": round(self.wall(), 4)}
        rejected = self.ingest.rejected_since_commit()
        if rejected:
            info["rejected"] = rejected   # ingest refusals since the last commit
        dropped = set(decision.dropped)
        return CommitMeta(seq=self.state.last_seq + 1, epoch=self.epoch, output_key=self.committer.next_version_key(p),
                          round_size=len({h.header.learner for h in held if h.candidate and h.header.id not in dropped}),
                          grace_wait_s=round(grace, 4), info=info, round=opened.round if opened is not None else -1)

    def _round_input(self, h: Held, reason: str) -> RoundInput:
        """``h`` as a fold input; ``reason``: a drop this syncer decided about the round's set
        (``below-quorum``), which replay takes from the record (pipeline/commit.py RECORDED_REASONS):
        its bytes are then not decoded."""
        opened = h.opened
        if reason:
            opened = dataclasses.replace(opened, reason=reason) if opened is not None else Opened(h.header, h.blob, reason)
        return round_input(h.blob, h.stored_key, self.descriptor, self.roster, opened)

    def _below_quorum(self, p: int, decision: Decision) -> str:
        """The recorded reason of ``decision.dropped``, naming K and the learners that had work."""
        working = {h.header.learner for h in self.pending[p].values()
                   if h.candidate and h.header.c_steps > 0 and h.header.c_tokens > 0}
        return str(DropReason(BELOW_QUORUM, f"K={self.policy.quorum}, {len(working)} learner(s) answered "
                                            f"in {2 * self.descriptor.schedule.sync_every} steps"))

    def _short_of_quorum(self, commit) -> set[str]:
        """The learners of a merge commit whose fold left fewer than K of them (empty: none, or K met)."""
        rec = commit.record
        learners = {i.learner for i in rec.inputs}
        return learners if rec.kind == "merge" and len(learners) < self.policy.quorum else set()

    def merge(self, p: int, keys: Sequence[PendingKey], decision: Decision) -> None:
        """Commit fragment ``p``'s round of the pending deltas ``keys`` as ``decision`` decided it
        (the policy is ``close_rounds``'s; tests call this directly). A merge of fewer than K
        distinct learners is never committed: when the fold drops answers (norm outliers,
        stale bases ...) and leaves fewer, only its drops are committed, and the survivors' learners'
        deltas stay pending for this round (still open) or a later one."""
        t0 = self.clock()
        held = [self.pending[p][k] for k in keys if k in self.pending[p]]
        drop = set(decision.dropped)
        why = self._below_quorum(p, decision) if drop else ""
        inputs = list(self.map_fn(lambda h: self._round_input(h, why if h.candidate and h.header.id in drop else ""),
                                  held))
        opened = self.rounds.open[p] if decision.merge else None
        commit = self.committer.decide(p, inputs, self._commit_meta(p, held, decision, t0, opened))
        short = self._short_of_quorum(commit)
        if short:
            rest = [(h, i) for h, i in zip(held, inputs) if not (h.candidate and h.header.learner in short)]
            self.events.emit("merge-below-quorum", fragment=p, quorum=self.policy.quorum, learners=sorted(short),
                             kept=len(held) - len(rest), dropped=len(rest))
            held, inputs = [h for h, _ in rest], [i for _, i in rest]
            decision, opened = Decision((), (), 0.0, None, None, Verdict.FOLD_BELOW_QUORUM), None
            commit = self.committer.decide(p, inputs, self._commit_meta(p, held, decision, t0, None)) if held else None
            if commit is None or self._short_of_quorum(commit):
                return
        try:
            if not self.committer.persist(commit, [(inp.key, h.blob) for inp, h in zip(inputs, held)]):
                return
        except KeyConflict as exc:
            # A learner reused a delta id with other bytes: that copy is refused (left in the inbox as
            # evidence) and the round is decided again without it.
            self.ingest.reused_id(p, exc.key, held)
            return
        self.committer.adopt(commit)
        if opened is not None:
            self.rounds.close(p)
        self.ingest.committed(p, held)
        self.sync_time = self.sync_time.update(self.clock() - t0)
        rec = commit.record
        self.committer.publish(rec)
        self.events.emit("commit", seq=rec.seq, kind=rec.kind, fragment=p, version=rec.version,
                         inputs=[i.delta_id for i in rec.inputs], weights=[round(i.weight, 4) for i in rec.inputs],
                         staleness=[i.staleness for i in rec.inputs],
                         dropped=[[d.delta_id, d.reason] for d in rec.dropped], quorum=rec.round_size, round=rec.round,
                         grace_s=rec.grace_wait_s, reason=decision.reason.value, rejected=rec.info.get("rejected", {}),
                         tokens=sum(i.c_tokens for i in rec.inputs), sync_s=round(self.clock() - t0, 4))
        if self.committer.checkpoint_due(rec.seq):
            self.committer.checkpoint_soon()

    def summary(self) -> dict:
        s = self.stats
        return {"epoch": self.epoch, "commits": s.commits, "merged": s.merged, "dropped": s.dropped,
                "duplicates": s.duplicates, "rejected": s.rejected, "from_bus": s.from_bus,
                "from_spill": s.from_spill, "evicted": s.evicted, "last_seq": self.state.last_seq if self.state else -1,
                "versions": [f.version for f in self.state.fragments] if self.state else [],
                "mean_quorum": s.round_sizes.mean, "mean_grace_s": s.grace_waits.mean,
                "retention_deleted": self.retention.deleted,
                "security": "signed" if self.security is not None else "off",
                "rejections": dict(sorted((s.rejections + Counter(
                    {"unknown-key": self.gate.denied_total() if self.gate else 0})).items())),
                "drops": dict(sorted(s.drops.items())),
                "regions": self.replicator.stats() if self.replicator is not None else {}}
