"""The run's commit log and syncer fencing (SPEC §7; after Delta Lake's log and SlateDB's manifest).

One serial history of immutable commit objects ``log/<20-digit seq>``, each created with
create-if-absent, so at most one record ever exists per seq and the log is the single point of
truth. Whatever a commit references (versions, deltas) is written before it.

Fencing with epochs: a starting syncer claims epoch ``e = max(claimed) + 1`` (create-if-absent
on ``epochs/<e>``), then appends a *fence* commit at ``tail + 1``. An older syncer keeps writing
at its own next seq; the first seq it tries that already holds someone else's record (at the
latest, the fence) is refused, and on reading it back it sees a newer epoch and raises ``Fenced``.
Two syncers started at once: whichever claims the higher epoch wins; the other's fence or next
commit collides with a newer-epoch record. Everything below the winner's fence seq is history
it recovers from.

Ambiguous writes: a create that timed out may have landed. ``append`` retries; a refused retry
reads the key back, and identical bytes mean the earlier attempt was ours (success).
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Callable, Iterator, NamedTuple, TypeVar

from pipeline.envelope import pack_record
from pipeline.errors import FormatError
from pipeline.types import CommitRecord

from .errors import AlreadyExists, Conflict, Fenced, NotFound, StoreError, Unavailable
from .layout import (EPOCH_PREFIX, HEAD_HINT_KEY, LOG_PREFIX, EpochRecord, commit_key, epoch_key,
                     incarnation_key, incarnation_prefix, pack_head_hint, parse_commit_key, parse_epoch_key,
                     parse_incarnation_key, unpack_head_hint)
from .store import ObjectStore

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How often a log operation retries a retryable store error (Unavailable, Conflict)."""

    attempts: int = 4          # tries in total
    backoff_s: float = 0.2     # wait before the second try; doubles each time
    max_backoff_s: float = 2.0

    def __post_init__(self) -> None:
        if not isinstance(self.attempts, int) or self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be an int >= 1, got {self.attempts!r}")
        if self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError(f"RetryPolicy needs 0 <= backoff_s <= max_backoff_s, got "
                             f"{self.backoff_s} and {self.max_backoff_s}")

    def run(self, fn: Callable[[], T], sleep: Callable[[float], None]) -> T:
        for attempt in range(self.attempts):
            try:
                return fn()
            except (Unavailable, Conflict):
                if attempt == self.attempts - 1:
                    raise
                sleep(min(self.max_backoff_s, self.backoff_s * 2 ** attempt))
        raise AssertionError("unreachable")


class CommitLog:
    """Read and append the commit log of one run location.

    ``epoch``: when set (by ``claim_epoch``), ``append`` refuses records of any other epoch.
    ``sleep`` is injected so tests run retries without waiting. ``trusted``: in a signed run, whether
    a record carries the syncer's signature; a record that does not (a forged fence, issue 11 item
    14) never counts as a newer epoch, so it can neither stop an idle syncer nor a starting one.
    """

    def __init__(self, store: ObjectStore, *, epoch: int | None = None, retry: RetryPolicy = RetryPolicy(),
                 sleep: Callable[[float], None] = time.sleep, probe_limit: int = 8,
                 trusted: Callable[[CommitRecord], bool] | None = None) -> None:
        if probe_limit < 0:
            raise ValueError(f"probe_limit must be >= 0, got {probe_limit}")
        self.store = store
        self.epoch = epoch
        self.retry = retry
        self.probe_limit = probe_limit
        self._sleep = sleep
        self.trusted = trusted
        self._known = -1       # highest seq known to exist (the log only grows)
        self._max_epoch = 0    # highest epoch seen in any record read or refused

    @property
    def last_known(self) -> int:
        """Highest seq this object has seen exist (-1: none); ``tail()`` refreshes it."""
        return self._known

    # -- reading -------------------------------------------------------------------------------

    def tail(self) -> int:
        """Seq of the last commit, -1 if the log is empty: advisory hint, then a few HEAD
        probes forward, then one LIST after the furthest known commit."""
        seq = self._known
        hinted = self._read_hint()
        if hinted > seq and self._do(lambda: self.store.exists(commit_key(hinted))):
            seq = hinted
        for _ in range(self.probe_limit):
            if not self._do(lambda: self.store.exists(commit_key(seq + 1))):
                self._known = max(self._known, seq)
                return seq
            seq += 1
        after = commit_key(seq) if seq >= 0 else None
        keys = self._do(lambda: self.store.list(LOG_PREFIX, start_after=after))
        if keys:
            seq = max(seq, parse_commit_key(keys[-1]))
        self._known = max(self._known, seq)
        return seq

    def read(self, seq: int) -> CommitRecord:
        """The commit at ``seq``; ``NotFound`` or ``FormatError`` naming the key."""
        key = commit_key(seq)
        blob = self._do(lambda: self.store.get(key))
        record = CommitRecord.from_bytes(blob, what=f"{self.store.uri}/{key}")
        if record.seq != seq:
            raise FormatError(f"{self.store.uri}/{key}: holds a commit for seq {record.seq}")
        self._observe(record)
        return record

    def read_range(self, start: int, end: int | None = None) -> Iterator[CommitRecord]:
        """Commits ``start <= seq < end`` (``end=None``: up to the tail), in order, lazily.

        A missing seq with later commits after it is a gap (``FormatError`` naming it); with
        ``end`` past the tail, ``NotFound`` names the first seq not written yet.
        """
        if not isinstance(start, int) or start < 0:
            raise ValueError(f"read_range start must be an int >= 0, got {start!r}")
        if end is not None and (not isinstance(end, int) or end < start):
            raise ValueError(f"read_range end must be None or an int >= start ({start}), got {end!r}")
        expected = start
        after = commit_key(start - 1) if start > 0 else None
        while end is None or expected < end:
            page = 1000 if end is None else min(1000, end - expected)
            keys = self._do(lambda: self.store.list(LOG_PREFIX, start_after=after, limit=page))
            if not keys:
                break
            for key in keys:
                seq = parse_commit_key(key)
                if seq != expected:
                    raise FormatError(f"{self.store.uri}: the commit log has a gap: {commit_key(expected)} "
                                      f"is missing but {key} exists")
                yield self.read(seq)
                expected += 1
            after = keys[-1]
        if end is not None and expected < end:
            raise NotFound(f"commit {expected} does not exist yet (asked for commits {start}..{end - 1})",
                           uri=self.store.uri, key=commit_key(expected))

    def gaps(self, upto: int) -> list[int]:
        """Seqs ``<= upto`` that have no commit object although a later one exists (one LIST of
        the whole log, paged). A deleted or lost commit makes replay before it impossible; recovery
        reports every gap loudly rather than appending silently after it."""
        missing: list[int] = []
        expected, after = 0, None
        while expected <= upto:
            keys = self._do(lambda: self.store.list(LOG_PREFIX, start_after=after, limit=1000))
            if not keys:
                break
            for key in keys:
                seq = parse_commit_key(key)
                if seq > upto:
                    return missing
                missing.extend(range(expected, seq))
                expected = seq + 1
            after = keys[-1]
        return missing

    def check_fenced(self) -> None:
        """Raise ``Fenced`` if the log's last commit carries a newer epoch than ours (a cheap
        check for an idle syncer; an active one learns it from its next ``append``)."""
        if self.epoch is None:
            raise ValueError("check_fenced needs a CommitLog bound to an epoch (see claim_epoch)")
        tail = self.tail()
        if tail >= 0:
            try:
                self.read(tail)
            except FormatError:
                pass           # a damaged tail proves nothing; our next append settles it
        if self._max_epoch > self.epoch:
            raise Fenced(f"epoch {self.epoch} was superseded by epoch {self._max_epoch}; stop this syncer",
                         uri=self.store.uri)

    # -- appending -----------------------------------------------------------------------------

    def append(self, record: CommitRecord, hint: bool = True) -> None:
        """Create commit ``record.seq``. Raises ``Fenced`` if another record holds that seq
        (a newer syncer, or anyone else); ``Unavailable`` after retries: the outcome is then
        unknown, and appending the same record again settles it. ``hint=False``: the caller writes
        the (advisory) head hint itself, e.g. off its latency path (``write_hint``)."""
        if not isinstance(record, CommitRecord):
            raise TypeError(f"append takes a CommitRecord, got {type(record).__name__}")
        if self.epoch is not None and record.epoch != self.epoch:
            raise ValueError(f"this log writes epoch {self.epoch}, the record has epoch {record.epoch}")
        if record.epoch < self._max_epoch:
            raise Fenced(f"epoch {record.epoch} was superseded by epoch {self._max_epoch}; stop this syncer",
                         uri=self.store.uri, key=commit_key(record.seq))
        existing = self._create(record, hint)
        if existing is not None:
            raise Fenced(f"commit {record.seq} already holds another record (epoch {existing.epoch}, kind "
                         f"{existing.kind!r}); this writer (epoch {record.epoch}) no longer owns the log",
                         uri=self.store.uri, key=commit_key(record.seq))

    def _create(self, record: CommitRecord, hint: bool = True) -> CommitRecord | None:
        """Create-if-absent; ``None`` if the record is (now) ours, else the record that holds the seq."""
        key, data, seq = commit_key(record.seq), record.to_bytes(), record.seq
        if seq > 0 and self._known < seq - 1:
            if not self._do(lambda: self.store.exists(commit_key(seq - 1))):
                raise ValueError(f"commit {seq} would leave a gap in {self.store.uri}: "
                                 f"commit {seq - 1} does not exist")
            self._known = seq - 1

        def attempt() -> CommitRecord | None:
            try:
                self.store.put_if_absent(key, data)
                return None
            except AlreadyExists:
                blob = self.store.get(key)
            if blob == data:
                return None  # an earlier attempt of ours landed before it timed out
            return CommitRecord.from_bytes(blob, what=f"{self.store.uri}/{key}")

        existing = self._do(attempt)
        self._known = max(self._known, seq)
        if existing is not None:
            self._observe(existing)
        elif hint:
            self.write_hint(seq, record.epoch)
        return existing

    # -- helpers -------------------------------------------------------------------------------

    def _do(self, fn: Callable[[], T]) -> T:
        return self.retry.run(fn, self._sleep)

    def _observe(self, record: CommitRecord) -> None:
        self._known = max(self._known, record.seq)
        if self.trusts(record):
            self._max_epoch = max(self._max_epoch, record.epoch)

    def trusts(self, record: CommitRecord) -> bool:
        return self.trusted is None or self.trusted(record)

    def _read_hint(self) -> int:
        try:
            return unpack_head_hint(self.store.get(HEAD_HINT_KEY), what=f"{self.store.uri}/{HEAD_HINT_KEY}")
        except (NotFound, FormatError):
            return -1  # advisory only: probing and listing find the tail without it
        except StoreError:
            return -1

    def write_hint(self, seq: int, epoch: int) -> None:
        """Best effort: the head hint saves readers probes; a stale or missing one costs a few more."""
        try:
            self.store.put(HEAD_HINT_KEY, pack_head_hint(seq, epoch))
        except StoreError:
            pass  # best effort: a stale or missing hint only costs a few more probes


class SyncerClaim(NamedTuple):
    """What ``claim_epoch`` returns: the epoch, the seq of its fence commit, and a log bound to it.
    The syncer recovers from commits ``< fence_seq`` and appends from ``fence_seq + 1``."""

    epoch: int
    fence_seq: int
    log: CommitLog


def current_epoch(store: ObjectStore) -> int:
    """The highest claimed syncer epoch (0 if none was ever claimed)."""
    return max((parse_epoch_key(k) for k in store.list(EPOCH_PREFIX)), default=0)


def claim_epoch(store: ObjectStore, syncer_id: str, *, retry: RetryPolicy = RetryPolicy(),
                sleep: Callable[[float], None] = time.sleep, max_races: int = 64,
                sign: Callable[[CommitRecord], CommitRecord] | None = None,
                info: dict | None = None, trusted: Callable[[CommitRecord], bool] | None = None,
                floor: int = 1) -> SyncerClaim:
    """Claim a new syncer epoch and fence every older syncer (see the module docstring).

    ``sign``: returns the fence record signed (a signed run's syncer key, workers/bus/signing.py
    ``sign_commit``), so that nobody who can merely write to the bucket can forge a fence (issue 11
    item 14; recovery and replay verify it), and ``trusted`` tells such records from forged ones (see
    ``CommitLog``). ``info``: more to record in the fence (e.g. what recovery had to salvage);
    ``syncer`` and ``nonce`` are always there. A damaged tail commit is not a newer epoch.
    ``floor``: the lowest epoch to claim (a region failover claims one above every region's,
    issue 25, workers/syncer/home.py); the claim is still above every epoch claimed here.

    Raises ``Fenced`` if a newer syncer claimed and fenced meanwhile (lost the start race),
    ``Conflict`` if an older syncer won ``max_races`` seqs in a row against our fence.
    """
    if not isinstance(syncer_id, str) or not 0 < len(syncer_id) <= 128:
        raise ValueError(f"syncer_id must be a non-empty string of at most 128 characters, got {syncer_id!r}")
    nonce = uuid.uuid4().hex  # makes our claim's and fence's bytes unique: recognisable after a timeout
    if not isinstance(floor, int) or isinstance(floor, bool) or floor < 1:
        raise ValueError(f"epoch floor must be an int >= 1, got {floor!r}")
    log = CommitLog(store, retry=retry, sleep=sleep, trusted=trusted)
    epoch = _claim_epoch_object(store, syncer_id, nonce, log, floor)
    log.epoch = epoch
    for _ in range(max_races):
        tail = log.tail()
        if tail >= 0 and _newer(log, tail, epoch):
            raise Fenced(f"syncer {syncer_id!r}: epoch {epoch} is already superseded by epoch "
                         f"{log._max_epoch} (commit {tail})", uri=store.uri)
        fence = CommitRecord(seq=tail + 1, epoch=epoch, kind="fence",
                             info={**(info or {}), "syncer": syncer_id, "nonce": nonce})
        if sign is not None:
            fence = sign(fence)
        existing = log._create(fence)
        if existing is None:
            return SyncerClaim(epoch, fence.seq, log)
        if existing.epoch > epoch and log.trusts(existing):
            raise Fenced(f"syncer {syncer_id!r}: epoch {epoch} lost the start race to epoch {existing.epoch}",
                         uri=store.uri, key=commit_key(fence.seq))
        # An older syncer committed first (or someone forged a record): that commit is history; fence after it.
    raise Conflict(f"syncer {syncer_id!r}: an older syncer won {max_races} seqs in a row; could not place "
                   "the fence commit", uri=store.uri)


def _newer(log: CommitLog, seq: int, epoch: int) -> bool:
    """Whether commit ``seq`` is a trusted record of an epoch newer than ``epoch``."""
    try:
        rec = log.read(seq)
    except FormatError:
        return False
    return rec.epoch > epoch and log.trusts(rec)


def _claim_epoch_object(store: ObjectStore, syncer_id: str, nonce: str, log: CommitLog, floor: int = 1) -> int:
    epoch = max(log._do(lambda: current_epoch(store)) + 1, floor)
    while True:
        key, data = epoch_key(epoch), EpochRecord(epoch, syncer_id, nonce).to_bytes()

        if log._do(lambda: _created_or_ours(store, key, data)):
            return epoch
        epoch += 1


def _created_or_ours(store: ObjectStore, key: str, data: bytes) -> bool:
    """Create ``key`` if absent; True if it now holds ``data`` (ours, maybe from an earlier attempt
    whose reply was lost), False if another claimant got there first."""
    try:
        store.put_if_absent(key, data)
        return True
    except AlreadyExists:
        return store.get(key) == data


INCARNATION_KIND, INCARNATION_VERSION = "learner-incarnation", 1


def claim_incarnation(store: ObjectStore, learner: str, *, floor: int = 1, retry: RetryPolicy = RetryPolicy(),
                      sleep: Callable[[float], None] = time.sleep, max_races: int = 64) -> int:
    """Claim a new incarnation of ``learner`` from storage, never from a clock.

    The incarnation is one above every life claimed before (and at least ``floor``: a run whose
    learners once took wall-clock incarnations passes the newest one it merged, plus one), created
    with create-if-absent on ``incarnations/<learner>/i<n>``: two processes started under one id
    get different incarnations, and a host whose clock is behind cannot go back in a learner's
    history. The claim object is a sealed ``learner-incarnation`` v1 record {learner, incarnation,
    nonce} (the nonce recognises our own claim after an ambiguous write)."""
    if not isinstance(floor, int) or isinstance(floor, bool) or floor < 0:
        raise ValueError(f"incarnation floor must be an int >= 0, got {floor!r}")
    nonce = uuid.uuid4().hex
    keys = retry.run(lambda: store.list(incarnation_prefix(learner)), sleep)
    n = max([parse_incarnation_key(k)[1] for k in keys] + [floor - 1, 0]) + 1
    for _ in range(max_races):
        key = incarnation_key(learner, n)   # ValueError past 10 digits: the id's lives are used up
        data = pack_record(INCARNATION_KIND, INCARNATION_VERSION, {"learner": learner, "incarnation": n,
                                                                   "nonce": nonce})

        if retry.run(lambda: _created_or_ours(store, key, data), sleep):
            return n
        n += 1
    raise Conflict(f"learner {learner!r}: {max_races} incarnations in a row were claimed by others",
                   uri=store.uri, key=incarnation_prefix(learner))
