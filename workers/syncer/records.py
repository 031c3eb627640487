"""The syncer's internal records (SPEC §4, §7; issue 12): what it holds between a delta's arrival
and the commit that names it, typed instead of spelled in strings.

* :class:`Held` - one delta in a fragment's pending set, with where it came from (:class:`Source`),
  the inbox object to tidy after its commit (:class:`InboxRef`), the verdict on its bytes and why,
  if at all, the syncer keeps it out of every quorum (a :class:`~pipeline.fold.DropReason`).
* :class:`Quarantined` - the pending-set key of a rejected or held-out delta: its content digest.
* :class:`Refusal` - why a delta or message was refused at ingest (never in a commit's inputs,
  counted in the next commit's ``info["rejected"]`` under the enum's value).

Nothing here does I/O; the strings written to events and commit records are the enums' values and
``str(DropReason)``, exactly as before these types existed.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Union

from pipeline.envelope import digest
from pipeline.fold import DropReason
from pipeline.types import DeltaHeader
from storage.layout import delta_key, quarantine_key
from storage.store import ObjectStore
from workers.common.deltas import Opened

# Held out of the quorum because the merged history rules it out - below its learner's high-water
# mark and, in runs with merged marks, not an overtaken answer: the
# fold records the real reason ("duplicate", "superseded: ...", "stale-incarnation", "unaccounted: ..."
# or "base-too-old") in the next commit.
BELOW_HIGH_WATER = DropReason("below-high-water")


class Source(enum.Enum):
    """Where the syncer got a delta: its bus, or an inbox (spill) object in storage."""

    BUS = "bus"
    SPILL = "spill"


class Refusal(enum.Enum):
    """Why ingest refused a message or an inbox object (docs/security.md, docs/protocol.md). The
    value is the category written in ``delta-rejected`` events, the syncer's ``rejections`` summary
    and the next commit's ``info["rejected"]`` counts."""

    BAD_MESSAGE = "bad-message"            # the bus frame is not an envelope
    PEER_MISMATCH = "peer-mismatch"        # the claimed learner is not the authenticated peer
    BAD_CHECKSUM = "bad-checksum"          # the delta frame does not match the message's checksum
    UNDECODABLE = "undecodable"            # no header can be read, or an inbox key names another delta
    HEADER_MISMATCH = "header-mismatch"    # the message's header is not the blob's
    UNKNOWN_LEARNER = "unknown-learner"    # signed run: the learner is not listed
    BAD_HEADER = "bad-header"              # a header whose numbers do not fit the run's keys
    UNKNOWN_FRAGMENT = "unknown-fragment"
    OVERSIZE = "oversize"                  # an inbox object above the run's delta size limit
    ID_REUSED = "id-reused"                # the delta's permanent key holds other bytes


@dataclass(frozen=True)
class Quarantined:
    """The pending-set key of a rejected delta: its content digest, never the id it claims (which
    its real owner may still need); it is persisted under ``quarantine/<sha256>``."""

    sha256: str


PendingKey = Union[str, Quarantined]     # a delta id, or the content digest of a rejected delta


@dataclass(frozen=True)
class InboxRef:
    """An inbox object that holds a delta: deleted once a commit names the delta. ``store`` is the
    region store whose inbox holds it (None: the syncer's home store, issue 14)."""

    key: str
    store: ObjectStore | None = None


@dataclass
class Held:
    """One delta in a fragment's pending set (workers/syncer/ingest.py)."""

    header: DeltaHeader
    blob: bytes
    inbox: InboxRef | None          # None: held in memory only
    arrived_at: float               # syncer monotonic time
    source: Source
    opened: Opened | None = None    # the verdict on these bytes (workers/common/deltas.py), reused at merge
    hold: DropReason | None = None  # why the syncer keeps it out of every quorum (issue 11 items 5, 13)
    pkey: PendingKey = ""           # its key in the pending set, set below

    def __post_init__(self) -> None:
        # Rejected deltas are keyed by content, so a forgery never shadows the real delta's id.
        self.pkey = Quarantined(digest(self.blob)) if self.reason else self.header.id

    @property
    def reason(self) -> str:
        """Why it will be dropped or kept out of the quorum ("" = a candidate for merging)."""
        return (self.opened.reason if self.opened is not None else "") or (str(self.hold) if self.hold else "")

    @property
    def candidate(self) -> bool:
        """May count toward a quorum (nothing rejects it and nothing holds it out)."""
        return not self.reason

    @property
    def inbox_key(self) -> str:
        return self.inbox.key if self.inbox is not None else ""

    @property
    def stored_key(self) -> str:
        """Where the delta is persisted before the commit that names it."""
        if isinstance(self.pkey, Quarantined):
            return quarantine_key(self.pkey.sha256)
        return delta_key(self.header.learner, self.header.incarnation, self.header.seq)
