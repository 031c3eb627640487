"""The syncer's inbox (SPEC §7, docs/protocol.md): deltas from the bus and from the spill inboxes,
checked and admitted to the per-fragment pending sets that rounds are made of.

:class:`Ingest` owns the pending sets, the inbox keys it refused (``bad``) and the refusal counts
since the last commit; it is handed everything else it uses in its constructor: the store and
region inboxes, the run's descriptor and key list, the round book (a delta or heartbeat is a sign
of life and a pace sample, workers/syncer/rounds.py) and a view of the merged high-water marks,
which the committer owns (workers/syncer/committer.py), with its verdict on a delta below the mark
(``merged_before``, issue 25). Everything here runs on the syncer's one loop thread. A bus delta is
acked ``durable`` only after it is in the inbox.

What cannot be attributed to a listed learner (undecodable, oversized, unknown learner or
fragment, peer mismatch) is refused here (:class:`~workers.syncer.records.Refusal`): counted,
logged, left in the inbox as evidence. What can is admitted - possibly held out of every quorum
with a reason - and is named in the next commit of its fragment, merged or dropped.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Callable, Sequence

from pipeline.commit import PENDING_OVERFLOW
from pipeline.envelope import digest
from pipeline.errors import FormatError
from pipeline.fold import DropReason
from pipeline.descriptor import RunDescriptor
from pipeline.types import DeltaHeader
from storage.errors import AlreadyExists, NotFound, StoreError
from storage.layout import SPILL_PREFIX, parse_spill_key, spill_key
from storage.shards import owned_fragments
from storage.store import ObjectStore
from workers.bus.bus import Message, SyncerBus
from workers.bus.keys import Roster
from workers.common.deltas import UNKNOWN_LEARNER, Opened, max_delta_bytes, open_stored
from workers.syncer.remote_inbox import RemoteInbox
from workers.syncer.records import BELOW_HIGH_WATER, Held, InboxRef, PendingKey, Refusal, Source
from workers.syncer.rounds import RoundBook

HighWater = Callable[[int, str], Sequence[int] | None]   # (fragment, learner) -> merged (incarnation, seq)
MergedBefore = Callable[[DeltaHeader], str]              # why the merged history rules it out ("" = never merged)


@dataclass
class IngestStats:
    duplicates: int = 0
    rejected: int = 0              # refused at ingest (bad message / header / unknown fragment)
    rejections: Counter = dataclasses.field(default_factory=Counter)   # Refusal -> count (never in a commit)
    from_bus: int = 0
    from_spill: int = 0
    evicted: int = 0               # dropped "pending-overflow" while a quorum was not met


class Ingest:
    """``inboxes``: every region's store whose inbox is read (None: ``store`` alone).
    ``wake_members``: called when an inbox holds a delta of an unlisted learner (the membership
    records are re-read soon). ``io``: runs the inbox clean-up after a commit. ``merged_before``:
    the fold's verdict on a delta below its learner's mark (``Committer.merged_before``; None: every
    delta below the mark is held out, the issue-11 rule)."""

    def __init__(self, store: ObjectStore, descriptor: RunDescriptor, roster: Roster | None, rounds: RoundBook,
                 high_water: HighWater, events, clock: Callable[[], float], sleep: Callable[[float], None],
                 io: Executor, *, max_pending: int, max_per_poll: int,
                 inboxes: Sequence[ObjectStore] | None = None, wake_members: Callable[[], None] | None = None,
                 remote_threads: int = 4, merged_before: MergedBefore | None = None):
        self.store, self.descriptor, self.roster, self.rounds = store, descriptor, roster, rounds
        self.high_water, self.events, self.clock, self.sleep, self.io = high_water, events, clock, sleep, io
        self.max_pending, self.max_per_poll = max_pending, max_per_poll
        self.inboxes = list(inboxes) if inboxes else [store]
        self.wake_members = wake_members
        self.merged_before = merged_before
        # Other regions' inboxes are listed and fetched off the loop (workers/syncer/remote_inbox.py);
        # 0: read on the loop, as the home inbox is.
        self.remote_threads = remote_threads
        self.remote: dict[int, RemoteInbox] = {}    # id(store) -> its background reader
        self.max_delta = max_delta_bytes(descriptor)
        self.bus: SyncerBus | None = None
        self.pending: list[dict[PendingKey, Held]] = [{} for _ in range(descriptor.num_fragments)]
        self.owned = frozenset(owned_fragments(store, descriptor))   # a syncer shard's fragments
        self.bad: set[str] = set()          # inbox keys refused: never read again
        self.unknown: set[str] = set()      # refused for an unlisted learner: read again when members join
        self.since_commit: Counter = Counter()   # Refusal -> count since the last commit, for its info
        self.stats = IngestStats()

    def attach(self, bus: SyncerBus | None) -> None:
        """The bus, once open (acks go back on it)."""
        self.bus = bus

    # -- refusals ----------------------------------------------------------------------------------
    def refuse(self, why: Refusal, detail: str, header: DeltaHeader | None = None, ident: bytes | None = None,
               delta: str = "") -> None:
        """Refused at ingest (never in a round): counted by ``why``, logged with the detail, and
        answered with a ``rejected`` ack when it came from a peer and names a delta."""
        self.stats.rejected += 1
        self.stats.rejections[why] += 1
        self.since_commit[why] += 1
        self.events.emit("delta-rejected", delta=delta or (header.id if header else ""), reason=why.value,
                         detail=detail)
        if ident is not None and self.bus is not None and (delta or header):
            self.bus.send_to(ident, Message("ack", {"delta_id": delta or header.id, "status": "rejected",
                                                    "reason": detail}))

    def rejected_since_commit(self) -> dict[str, int]:
        """Refusal counts since the last commit, by category, sorted (a commit's ``info["rejected"]``)."""
        return {why.value: n for why, n in sorted(self.since_commit.items(), key=lambda kv: kv[0].value)}

    def members_added(self) -> None:
        """New learners were listed: their refused inbox objects are read again."""
        self.bad -= self.unknown
        self.unknown.clear()

    # -- the bus -----------------------------------------------------------------------------------
    def poll_bus(self, timeout_s: float) -> None:
        """Handle what the bus holds, waiting up to ``timeout_s`` for the first message (just sleep
        when there is no bus). Remote inbox objects fetched meanwhile are admitted first."""
        for store in self.inboxes:      # between spill polls too: a remote delta waits <= one loop turn
            if id(store) in self.remote:
                self._take_remote(store, self.remote[id(store)])
        if self.bus is None:
            self.sleep(timeout_s)
            return
        got = self.bus.recv(timeout_s)
        # Drain what is queued, but return to close rounds at least every 50 ms: a flood of deltas
        # (or of hostile messages) must not keep every round open.
        until = self.clock() + 0.05
        while got is not None:
            ident, msg = got
            if isinstance(msg, FormatError):
                self.refuse(Refusal.BAD_MESSAGE, str(msg), ident=ident)
            elif msg.peer is not None and msg.fields.get("learner", msg.peer) != msg.peer:
                self.refuse(Refusal.PEER_MISMATCH,
                            f"peer {msg.peer} sent a {msg.type} as {msg.fields.get('learner')!r}")
            elif msg.type == "heartbeat":
                self._heartbeat(msg.fields)
            elif msg.type == "delta":
                self.bus_delta(ident, msg)
            got = self.bus.recv(0) if self.clock() < until else None

    def _heartbeat(self, f: dict) -> None:
        learner, st = f.get("learner"), f.get("step_time_s")
        if isinstance(learner, str) and isinstance(st, (int, float)) and not isinstance(st, bool) \
                and 0 <= st < 3600:
            if f.get("leaving") is True:       # a clean stop, after its last delta was acked
                self.rounds.left(learner)
                self.events.emit("learner-left", learner=learner, incarnation=f.get("incarnation"))
            else:
                self.rounds.heartbeat(learner, float(st), self.clock())

    def _ack(self, ident: bytes, delta_id: str, opened: Opened) -> None:
        if self.bus is not None:
            self.bus.send_to(ident, Message("ack", {"delta_id": delta_id, "status": "rejected" if opened.reason
                                                    else "durable", "reason": opened.reason}))

    def _open_bus_delta(self, ident: bytes, msg: Message) -> tuple[Opened, str] | None:
        """The delta a bus message carries, opened, and its spill key; None when refused."""
        blob = msg.blob or b""
        claimed = msg.fields.get("header", {})
        claimed_id = ""
        if isinstance(claimed, dict):
            try:
                claimed_id = DeltaHeader.from_dict(claimed).id
            except FormatError:
                pass
        if digest(blob) != msg.fields.get("checksum"):
            return self.refuse(Refusal.BAD_CHECKSUM, "checksum of the delta frame does not match", None, ident,
                               claimed_id)
        try:
            opened = open_stored(blob, self.descriptor, self.roster, f"bus delta {claimed_id}")
        except FormatError as exc:
            return self.refuse(Refusal.UNDECODABLE, str(exc), None, ident, claimed_id)
        header = opened.header
        if header.id != claimed_id:
            return self.refuse(Refusal.HEADER_MISMATCH, f"message header {claimed_id} != blob header {header.id}",
                               header, ident, claimed_id)
        if msg.peer is not None and header.learner != msg.peer:
            return self.refuse(Refusal.PEER_MISMATCH, f"peer {msg.peer} sent a delta of {header.learner}",
                               header, ident, claimed_id)
        if opened.reason == UNKNOWN_LEARNER:
            return self.refuse(Refusal.UNKNOWN_LEARNER, f"learner {header.learner} is not listed", header, ident,
                               header.id)
        try:
            return opened, spill_key(header.learner, header.incarnation, header.seq)
        except ValueError as exc:    # a valid header whose numbers do not fit the run's keys
            return self.refuse(Refusal.BAD_HEADER, str(exc), header, ident, header.id)

    def bus_delta(self, ident: bytes, msg: Message) -> None:
        """One ``delta`` message: open and check it, admit it, write it to the home inbox, ack it."""
        got = self._open_bus_delta(ident, msg)
        if got is None:
            return
        opened, key = got
        header, blob = opened.header, msg.blob or b""
        held = self.admit(header, blob, InboxRef(key), Source.BUS, opened)
        if held is None:
            if header.fragment in self.owned:
                # Already merged: durable as can be. Ack so the learner forgets it instead of spilling it.
                self._ack(ident, header.id, opened)
            return
        try:
            self.store.put_if_absent(key, blob)
        except AlreadyExists:
            try:   # first writer wins (the learner's own spill, or an earlier resend): merge what is stored
                stored = self.store.get(key)
            except StoreError:
                stored = blob
            if stored != blob:
                # Other bytes under this id: the inbox object is judged on its own when the inbox is
                # listed; this copy stays in memory only (not durable, so not acked).
                held.inbox = None
                self.events.emit("inbox-conflict", delta=header.id, key=key)
                return
        except StoreError as exc:
            # Not durable, so no ack: the learner will spill or resend. Keep it pending only if we can merge it
            # safely later: we cannot (replay needs it stored), so forget it.
            self.pending[header.fragment].pop(held.pkey, None)
            self.events.emit("ingest-store-error", delta=header.id, error=str(exc))
            return
        self.stats.from_bus += 1
        self._ack(ident, header.id, opened)

    # -- admission ---------------------------------------------------------------------------------
    def admit(self, header: DeltaHeader, blob: bytes, inbox: InboxRef, source: Source,
              opened: Opened | None = None) -> Held | None:
        """Place a delta in its fragment's pending set; None (and a clean-up) when it is not new.
        A bus delta already held comes back as the held entry (its inbox copy is checked again)."""
        if header.fragment not in self.owned:
            why = f"unknown fragment {header.fragment}" if not 0 <= header.fragment < self.descriptor.num_fragments \
                else f"fragment {header.fragment} belongs to syncer shard {header.fragment % self.descriptor.syncers}"
            self.refuse(Refusal.UNKNOWN_FRAGMENT, why, header, None, header.id)
            if source is Source.SPILL:
                self.bad.add(inbox.key)
            return None
        hw = self.high_water(header.fragment, header.learner)
        below = self._below(header, hw) and not (opened is not None and opened.reason)
        # What the merged history rules out (below the mark, issue 11 item 13) is held out of every
        # quorum and goes to the next commit, whose fold records why ("duplicate", "superseded: ...",
        # "stale-incarnation", "unaccounted: ...", "base-too-old"): a copy alone proves nothing, and
        # nothing vanishes unrecorded. An answer overtaken by its learner's newer merged one was
        # never merged: it counts.
        held = Held(header, blob, inbox, self.clock(), source, opened, hold=BELOW_HIGH_WATER if below else None)
        pend = self.pending[header.fragment]
        if held.candidate and hw is not None and header.order == tuple(hw):
            # Exactly the newest merged delta of its learner: merged for certain, tidy the inbox.
            self.stats.duplicates += 1
            if source is Source.SPILL:
                delete_quietly(inbox, self.store)
            return None
        if held.pkey in pend:
            self.stats.duplicates += 1
            if source is Source.SPILL and pend[held.pkey].blob != blob:
                self.bad.add(inbox.key)     # other bytes under a held id: evidence, never merged
                self.events.emit("inbox-conflict", delta=header.id, key=inbox.key)
            return pend[held.pkey] if source is Source.BUS else None
        pend[held.pkey] = held
        if held.candidate:
            self.rounds.delta_arrived(header.learner, header.learner_step, held.arrived_at)
            self.rounds.answered(header.learner, header.fragment, header.round, held.arrived_at)
        return self._bound_pending(header.fragment).get(held.pkey, held)

    def _below(self, header: DeltaHeader, hw: Sequence[int] | None) -> bool:
        """Held out as below the mark: ruled out by the merged history (the fold's verdict), or,
        without one, below the mark at all. The delta *at* the mark is not: it is tidied instead."""
        if hw is None or header.order >= tuple(hw):
            return False
        return self.merged_before is None or bool(self.merged_before(header))

    def _bound_pending(self, p: int) -> dict[PendingKey, Held]:
        """Keep at most ``max_pending`` candidates of fragment ``p``: while its
        quorum is not met they would pile up without bound. The excess - superseded deltas first (an
        older delta of the same learner life on the same base, whose progress a newer one holds),
        then the oldest arrivals - is dropped with reason ``pending-overflow: ...`` in the next commit
        (rejected deltas are bounded by their own flush, REJECTED_FLUSH in workers/syncer/syncer.py).
        Returns the evicted entries by their former pending key (they are re-keyed by content)."""
        pend = self.pending[p]
        valid = [h for h in pend.values() if h.candidate]
        excess = len(valid) - self.max_pending
        moved: dict[PendingKey, Held] = {}
        if excess <= 0:
            return moved
        newest: dict[tuple, int] = {}
        for h in valid:
            lineage = (h.header.learner, h.header.incarnation, h.header.base_version)
            newest[lineage] = max(newest.get(lineage, -1), h.header.seq)

        def superseded(h: Held) -> bool:
            return h.header.seq < newest[(h.header.learner, h.header.incarnation, h.header.base_version)]
        for h in sorted(valid, key=lambda h: (not superseded(h), h.arrived_at, h.header.id))[:excess]:
            reason = DropReason(PENDING_OVERFLOW, "superseded" if superseded(h) else "oldest")
            opened = dataclasses.replace(h.opened, reason=str(reason)) if h.opened is not None else \
                Opened(h.header, h.blob, str(reason))
            pend.pop(h.pkey, None)
            evicted = Held(h.header, h.blob, h.inbox, h.arrived_at, h.source, opened, hold=reason)
            moved[h.pkey] = pend.setdefault(evicted.pkey, evicted)
            self.stats.evicted += 1
            self.events.emit("delta-evicted", delta=h.header.id, fragment=p, reason=str(reason),
                             pending=len(valid), limit=self.max_pending)
        return moved

    # -- the spill inboxes ---------------------------------------------------------------------------
    def poll_inboxes(self) -> None:
        """Every region's inbox (just the home store's in a single-region run). A region
        that fails is reported and skipped: the others are still read. Keys are compared across
        regions: the same spill key in two regions is the same delta id (learner/incarnation/seq)."""
        known = {h.inbox_key for pend in self.pending for h in pend.values()} | self.bad
        for store in self.inboxes:
            self._poll_inbox(store, known)

    def _poll_inbox(self, store: ObjectStore, known: set[str]) -> None:
        home = store is self.store
        if not home and self.remote_threads:
            self._poll_remote(store)
            return
        try:
            keys = store.list(SPILL_PREFIX)
        except StoreError as exc:
            self.events.emit("store-error", op="list-inbox", error=str(exc), **({} if home else {"store": store.uri}))
            return
        n = 0
        for key in keys:
            if key in known:
                continue
            if n >= self.max_per_poll:
                break
            n += 1
            try:
                got = self._read_inbox_object(store, key)
            except StoreError as exc:
                self.events.emit("store-error", op="read-inbox", key=key, error=str(exc), store=store.uri)
                return
            if got is not None:
                self._admit_spill(store, key, *got)

    def _poll_remote(self, store: ObjectStore) -> None:
        """Another region's inbox: what its background reader fetched is checked and admitted here
        (never waiting on the link); then it lists again, skipping what is now held or refused."""
        reader = self.remote.get(id(store))
        if reader is None:
            reader = self.remote[id(store)] = RemoteInbox(store, self.max_delta, threads=self.remote_threads,
                                                          max_held=self.max_per_poll)
        self._take_remote(store, reader)
        reader.refresh({h.inbox_key for pend in self.pending for h in pend.values()} | self.bad)

    def close(self, wait_s: float = 2.0) -> None:
        """Stop the remote inbox readers (a stopping syncer), waiting up to ``wait_s`` in all."""
        for reader in self.remote.values():
            reader.close(wait_s)
        self.remote.clear()

    def _take_remote(self, store: ObjectStore, reader: RemoteInbox) -> None:
        fetched, error = reader.take()
        if error is not None:
            self.events.emit("store-error", op="list-inbox", error=str(error), store=store.uri)
        for f in fetched:
            if f.error is not None:
                if not isinstance(f.error, NotFound):
                    self.events.emit("store-error", op="read-inbox", key=f.key, error=str(f.error), store=store.uri)
            elif f.blob is None:
                self.refuse(Refusal.OVERSIZE, f"{f.key}: {f.size} bytes exceeds the run's delta size limit "
                                              f"{self.max_delta}", delta=f.key)
                self.bad.add(f.key)
            else:
                got = self._open_inbox_object(f.key, f.blob)
                if got is not None:
                    self._admit_spill(store, f.key, *got)

    def _admit_spill(self, store: ObjectStore, key: str, opened: Opened, blob: bytes) -> None:
        """An inbox object of ``store`` that passed its checks: admitted, or refused for an unlisted learner."""
        if opened.reason == UNKNOWN_LEARNER:
            self.refuse(Refusal.UNKNOWN_LEARNER, f"learner {opened.header.learner} is not listed",
                        opened.header, delta=key)
            self.bad.add(key)
            self.unknown.add(key)
            if self.wake_members is not None:
                self.wake_members()
            return
        if self.admit(opened.header, blob, InboxRef(key, None if store is self.store else store), Source.SPILL,
                      opened) is not None:
            self.stats.from_spill += 1

    def _read_inbox_object(self, store: ObjectStore, key: str) -> tuple[Opened, bytes] | None:
        """The inbox object ``key``, opened and checked against the id its key names, and its bytes;
        None when it is refused (or gone). StoreError: the store failed (the caller stops listing it)."""
        try:
            parse_spill_key(key)
            size = store.head(key).size
            if size > self.max_delta:   # checked before reading: a planted huge object must not exhaust memory
                self.refuse(Refusal.OVERSIZE, f"{key}: {size} bytes exceeds the run's delta size limit "
                                              f"{self.max_delta}", delta=key)
                self.bad.add(key)
                return None
            blob = store.get(key)
        except NotFound:
            return None
        except ValueError as exc:
            return self._undecodable(key, exc)
        return self._open_inbox_object(key, blob)

    def _open_inbox_object(self, key: str, blob: bytes) -> tuple[Opened, bytes] | None:
        """Inbox object ``key``'s bytes, opened and checked against the id its key names; None when refused."""
        try:
            named = parse_spill_key(key)
            opened = open_stored(blob, self.descriptor, self.roster, key)
            if (opened.header.learner, opened.header.incarnation, opened.header.seq) != tuple(named):
                raise FormatError(f"{key}: holds delta {opened.header.id}, not the one its key names")
            return opened, blob
        except (FormatError, ValueError) as exc:
            return self._undecodable(key, exc)

    def _undecodable(self, key: str, exc: Exception) -> None:
        # A damaged or foreign object in the inbox: logged once and left untouched (never
        # deleted: it is evidence), and kept out of every round.
        self.refuse(Refusal.UNDECODABLE, str(exc), delta=key)
        self.bad.add(key)

    # -- after a commit ------------------------------------------------------------------------------
    def committed(self, p: int, held: Sequence[Held]) -> None:
        """A commit named ``held`` (fragment ``p``): forget them, tidy their inbox objects in the
        background, and start counting refusals for the next commit afresh."""
        self.since_commit.clear()
        for h in held:
            self.pending[p].pop(h.pkey, None)
            if h.inbox is not None:
                self.io.submit(delete_quietly, h.inbox, self.store)

    def reused_id(self, p: int, key: str, held: Sequence[Held]) -> None:
        """A candidate's permanent key ``key`` already holds other bytes (a learner reused a delta id):
        that copy is refused (left in the inbox as evidence); the round is decided again without it."""
        for h in held:
            if h.candidate and h.stored_key == key:
                self.pending[p].pop(h.pkey, None)
                self.refuse(Refusal.ID_REUSED, f"{key} holds other bytes", h.header, None, h.header.id)
                if h.inbox is not None:
                    self.bad.add(h.inbox.key)


def delete_quietly(inbox: InboxRef, home: ObjectStore | None = None) -> None:
    """Delete an inbox object (from ``inbox.store``, else ``home``), best effort: a leftover one is
    recognised as a duplicate next time."""
    try:
        (inbox.store if inbox.store is not None else home).delete(inbox.key)
    except StoreError:
        pass
