"""The syncer's ingest half (SPEC §7, docs/protocol.md): deltas from the bus and from the spill
inbox, checked and admitted to the per-fragment pending sets that rounds are made of.

A mixin of ``Syncer`` (workers/syncer/syncer.py), split out so each file reads top to bottom: everything
here runs on the syncer's one loop thread and uses its state (``pending``, ``state``, ``bus``,
``store``, ``stats``, ``events``). A bus delta is acked ``durable`` only after it is in the inbox.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pipeline.envelope import digest
from pipeline.errors import FormatError
from pipeline.types import DeltaHeader
from storage.errors import AlreadyExists, NotFound, StoreError
from pipeline.commit import PENDING_OVERFLOW
from pipeline.fold import DropReason
from storage.layout import SPILL_PREFIX, delta_key, parse_spill_key, quarantine_key, spill_key
from workers.bus.bus import Message
from workers.common.deltas import UNKNOWN_LEARNER, Opened, open_stored

BELOW_HIGH_WATER = "below-high-water"   # held out of the quorum; the fold records the reason


@dataclass(frozen=True)
class Quarantined:
    """The pending-set key of a rejected delta: its content digest, never the id it claims (which
    its real owner may still need); it is persisted under ``quarantine/<sha256>``."""

    sha256: str


@dataclass
class _Held:
    header: DeltaHeader
    blob: bytes
    inbox_key: str         # "" when it is held in memory only
    arrived_at: float
    source: str            # "bus" | "spill"
    opened: Opened | None = None   # the verdict on these bytes (workers/common/deltas.py), reused at merge
    pkey: str | Quarantined = ""   # its key in the pending set: the delta id, or Quarantined (below)
    hold: str = ""                 # why the syncer keeps it out of every quorum (issue 11 items 5, 13)
    inbox_store: object = None     # the region store whose inbox holds it (None: the home store)

    @property
    def reason(self) -> str:
        """Why it will be dropped or kept out of the quorum ("" = a candidate for merging)."""
        return (self.opened.reason if self.opened is not None else "") or self.hold

    def __post_init__(self) -> None:
        # Rejected deltas are keyed by content, so a forgery never shadows the real delta's id.
        self.pkey = Quarantined(digest(self.blob)) if self.reason else self.header.id

    @property
    def stored_key(self) -> str:
        """Where the delta is persisted before the commit that names it."""
        if isinstance(self.pkey, Quarantined):
            return quarantine_key(self.pkey.sha256)
        return delta_key(self.header.learner, self.header.incarnation, self.header.seq)



class SyncerIngest:
    def _ingest_bus(self, timeout_s: float) -> None:
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
                self._reject(None, ident, "", str(msg), "bad-message")
            elif msg.peer is not None and msg.fields.get("learner", msg.peer) != msg.peer:
                self._reject(None, None, "", f"peer {msg.peer} sent a {msg.type} as {msg.fields.get('learner')!r}",
                             "peer-mismatch")
            elif msg.type == "heartbeat":
                self._heartbeat(msg.fields)
            elif msg.type == "delta":
                self._ingest_bus_delta(ident, msg)
            got = self.bus.recv(0) if self.clock() < until else None

    def _heartbeat(self, f: dict) -> None:
        learner, st = f.get("learner"), f.get("step_time_s")
        if isinstance(learner, str) and isinstance(st, (int, float)) and not isinstance(st, bool) \
                and 0 <= st < 3600:
            self.rounds.heartbeat(learner, float(st), self.clock())

    def _reject(self, header: DeltaHeader | None, ident: bytes | None, delta: str, reason: str,
                category: str) -> None:
        """Refused at ingest (never in a round): counted by ``category``, logged with the detail."""
        self.stats.rejected += 1
        self.stats.rejections[category] += 1
        self._since_commit[category] += 1
        self.events.emit("delta-rejected", delta=delta or (header.id if header else ""), reason=category,
                         detail=reason)
        if ident is not None and self.bus is not None and (delta or header):
            self.bus.send_to(ident, Message("ack", {"delta_id": delta or header.id, "status": "rejected",
                                                    "reason": reason}))

    def _ingest_bus_delta(self, ident: bytes, msg: Message) -> None:
        blob = msg.blob or b""
        claimed = msg.fields.get("header", {})
        claimed_id = ""
        if isinstance(claimed, dict):
            try:
                claimed_id = DeltaHeader.from_dict(claimed).id
            except FormatError:
                pass
        if digest(blob) != msg.fields.get("checksum"):
            return self._reject(None, ident, claimed_id, "checksum of the delta frame does not match", "bad-checksum")
        try:
            opened = open_stored(blob, self.descriptor, self.roster, f"bus delta {claimed_id}")
        except FormatError as exc:
            return self._reject(None, ident, claimed_id, str(exc), "undecodable")
        header = opened.header
        if header.id != claimed_id:
            return self._reject(header, ident, claimed_id, f"message header {claimed_id} != blob header {header.id}",
                                "header-mismatch")
        if msg.peer is not None and header.learner != msg.peer:
            return self._reject(header, ident, claimed_id, f"peer {msg.peer} sent a delta of {header.learner}",
                                "peer-mismatch")
        if opened.reason == UNKNOWN_LEARNER:
            return self._reject(header, ident, header.id, f"learner {header.learner} is not listed", "unknown-learner")
        try:
            key = spill_key(header.learner, header.incarnation, header.seq)
        except ValueError as exc:    # a valid header whose numbers do not fit the run's keys
            return self._reject(header, ident, header.id, str(exc), "bad-header")
        held = self._admit(header, blob, key, "bus", opened)
        status = "rejected" if opened.reason else "durable"
        if held is None:
            if self.bus is not None and header.fragment < self.descriptor.num_fragments:
                # Already merged: durable as can be. Ack so the learner forgets it instead of spilling it.
                self.bus.send_to(ident, Message("ack", {"delta_id": header.id, "status": status,
                                                        "reason": opened.reason}))
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
                held.inbox_key = ""
                self.events.emit("inbox-conflict", delta=header.id, key=key)
                return
        except StoreError as exc:
            # Not durable, so no ack: the learner will spill or resend. Keep it pending only if we can merge it
            # safely later: we cannot (replay needs it stored), so forget it.
            self.pending[header.fragment].pop(held.pkey, None)
            self.events.emit("ingest-store-error", delta=header.id, error=str(exc))
            return
        self.stats.from_bus += 1
        if self.bus is not None:
            self.bus.send_to(ident, Message("ack", {"delta_id": header.id, "status": status, "reason": opened.reason}))

    def _admit(self, header: DeltaHeader, blob: bytes, key: str, source: str,
               opened: Opened | None = None, inbox_store=None) -> _Held | None:
        """Place a delta in its fragment's pending set; None (and a clean-up) when it is not new."""
        if not 0 <= header.fragment < self.descriptor.num_fragments:
            self._reject(header, None, header.id, f"unknown fragment {header.fragment}", "unknown-fragment")
            if source == "spill":
                self.bad_inbox.add(key)
            return None
        hw = self.state.high_water[header.fragment].get(header.learner)
        below = hw is not None and header.order < tuple(hw) and not (opened is not None and opened.reason)
        # Anything *below* the mark is held out of every quorum (issue 11 item 13) and goes to the
        # next commit, whose fold records why ("duplicate", or "stale-incarnation" when a newer life
        # of the learner was merged): it may have been merged before, or overtaken, or persisted by a
        # syncer fenced before its commit - a copy alone proves nothing, and nothing vanishes unrecorded.
        held = _Held(header, blob, key, self.clock(), source, opened, hold=BELOW_HIGH_WATER if below else "",
                     inbox_store=inbox_store)
        pend = self.pending[header.fragment]
        if not held.reason and hw is not None and header.order == tuple(hw):
            # Exactly the newest merged delta of its learner: merged for certain, tidy the inbox.
            self.stats.duplicates += 1
            if source == "spill":
                self._delete(key, inbox_store)
            return None
        if held.pkey in pend:
            self.stats.duplicates += 1
            if source == "spill" and pend[held.pkey].blob != blob:
                self.bad_inbox.add(key)     # other bytes under a held id: evidence, never merged
                self.events.emit("inbox-conflict", delta=header.id, key=key)
            return pend[held.pkey] if source == "bus" else None
        pend[held.pkey] = held
        if not held.reason:
            self.rounds.delta_arrived(header.learner, header.learner_step, held.arrived_at)
        return self._bound_pending(header.fragment).get(held.pkey, held)

    def _bound_pending(self, p: int) -> dict[str, _Held]:
        """Keep at most ``cfg.max_pending`` candidates of fragment ``p`` (issue 11 item 5): while its
        quorum is not met they would pile up without bound. The excess - superseded deltas first (an
        older delta of the same learner life on the same base, whose progress a newer one holds),
        then the oldest arrivals - is dropped with reason ``pending-overflow: ...`` in the next commit
        (rejected deltas are bounded by their own flush, REJECTED_FLUSH in workers/syncer/syncer.py).
        Returns the evicted entries by their former pending key (they are re-keyed by content)."""
        pend = self.pending[p]
        valid = [h for h in pend.values() if not h.reason]
        excess = len(valid) - self.cfg.max_pending
        moved: dict[str, _Held] = {}
        if excess <= 0:
            return moved
        newest: dict[tuple, int] = {}
        for h in valid:
            lineage = (h.header.learner, h.header.incarnation, h.header.base_version)
            newest[lineage] = max(newest.get(lineage, -1), h.header.seq)

        def superseded(h: _Held) -> bool:
            return h.header.seq < newest[(h.header.learner, h.header.incarnation, h.header.base_version)]
        for h in sorted(valid, key=lambda h: (not superseded(h), h.arrived_at, h.header.id))[:excess]:
            reason = str(DropReason(PENDING_OVERFLOW, "superseded" if superseded(h) else "oldest"))
            opened = dataclasses.replace(h.opened, reason=reason) if h.opened is not None else \
                Opened(h.header, h.blob, reason)
            pend.pop(h.pkey, None)
            evicted = _Held(h.header, h.blob, h.inbox_key, h.arrived_at, h.source, opened, hold=reason,
                            inbox_store=h.inbox_store)
            moved[h.pkey] = pend.setdefault(evicted.pkey, evicted)
            self.stats.evicted += 1
            self.events.emit("delta-evicted", delta=h.header.id, fragment=p, reason=reason,
                             pending=len(valid), limit=self.cfg.max_pending)
        return moved

    def _ingest_spill(self) -> None:
        """Every region's inbox (issue 14; just the home store's in a single-region run). A region
        that fails is reported and skipped: the others are still read. Keys are compared across
        regions: the same spill key in two regions is the same delta id (learner/incarnation/seq)."""
        known = {h.inbox_key for pend in self.pending for h in pend.values()} | self.bad_inbox
        for store in getattr(self, "inboxes", None) or [self.store]:
            self._ingest_inbox(store, known)

    def _ingest_inbox(self, store, known: set[str]) -> None:
        home = store is self.store
        try:
            keys = store.list(SPILL_PREFIX)
        except StoreError as exc:
            self.events.emit("store-error", op="list-inbox", error=str(exc), **({} if home else {"store": store.uri}))
            return
        n = 0
        for key in keys:
            if key in known:
                continue
            if n >= self.cfg.max_ingest_per_poll:
                break
            n += 1
            try:
                named = parse_spill_key(key)
                size = store.head(key).size
                if size > self.max_delta:   # checked before reading: a planted huge object must not exhaust memory
                    self._reject(None, None, key, f"{key}: {size} bytes exceeds the run's delta size limit "
                                                  f"{self.max_delta}", "oversize")
                    self.bad_inbox.add(key)
                    continue
                blob = store.get(key)
                opened = open_stored(blob, self.descriptor, self.roster, key)
                if (opened.header.learner, opened.header.incarnation, opened.header.seq) != tuple(named):
                    raise FormatError(f"{key}: holds delta {opened.header.id}, not the one its key names")
            except NotFound:
                continue
            except (FormatError, ValueError) as exc:
                # A damaged or foreign object in the inbox: logged once and left untouched (never
                # deleted: it is evidence), and kept out of every round.
                self._reject(None, None, key, str(exc), "undecodable")
                self.bad_inbox.add(key)
                continue
            except StoreError as exc:
                self.events.emit("store-error", op="read-inbox", key=key, error=str(exc), store=store.uri)
                return
            if opened.reason == UNKNOWN_LEARNER:
                self._reject(opened.header, None, key, f"learner {opened.header.learner} is not listed",
                             "unknown-learner")
                self.bad_inbox.add(key)
                self.unknown_inbox.add(key)
                self.gate.soon()
                continue
            if self._admit(opened.header, blob, key, "spill", opened, None if home else store) is not None:
                self.stats.from_spill += 1

    def _delete(self, key: str, store=None) -> None:
        try:
            (store if store is not None else self.store).delete(key)
        except StoreError:
            pass   # best effort: a leftover inbox object is recognised as a duplicate next time

