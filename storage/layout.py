"""Every object key of a run, in one place (SPEC §7; docs/storage.md draws the tree).

Keys are relative to the run location. Numbers are zero-padded to a fixed width so that
listing order equals numeric order, and every listing that relies on order (``log/``,
``checkpoints/``, ``epochs/``, one fragment's ``versions/fNNNNN/``, one learner life's spills)
is one directory level deep, where every backend (SeaweedFS included) lists in byte order.

    run.descriptor                              RunDescriptor (create-if-absent, once)
    epochs/0000000001                           syncer epoch claims (create-if-absent)
    log/00000000000000000000                    commit records (create-if-absent, never deleted)
    hints/log-head                              advisory: last known commit seq (overwritten)
    hints/round-clock                           the syncer's global step, for bus-less learners (overwritten)
    hints/syncer-endpoints                      where the syncer's bus is, for learners that discover it (overwritten)
    hints/retention                             advisory: the retention horizon, written before a deletion (overwritten)
    versions/f00000/v000000000000[-e<epoch>]    fragment versions (written before their commit)
    versions/f00000/v000000000000[-e<epoch>]-full   an int4 run's full snapshot of that version
    deltas/<learner>/i0000000000/s000000000000  deltas a commit merged (written before it)
    spill/<learner>/i0000000000/s000000000000   deltas learners spilled when the fast path failed
    checkpoints/00000000000000000000            syncer state after that commit (written after it)
    incarnations/<learner>/i0000000000          a learner life's claim (create-if-absent, kept)
    probe/<token>                               conformance probe scratch objects (deleted)
    region.marker                               which region's copy of a run this store is (create-if-absent)
    failovers/0000000007                        a region failover's record, by its epoch (create-if-absent)
    proposals/initial-model                     a learner's own initial weights, before the run exists (create-if-absent)
    learner-state/<learner>                     where a learner id stands, for its next life (overwritten, advisory)
    learner-optimizer/<learner>                 its inner optimizer's state, when kept (overwritten, advisory)

A sharded run (descriptor ``syncers`` N >= 2, issue 15) gives syncer shard i its own partition
under ``shards/s<iiii>/``: its ``epochs/``, ``log/``, ``hints/`` (head hint, round clock),
``checkpoints/`` and ``spill/`` inbox, with the same names below it (``shard_key``). Everything
else (descriptor, versions, deltas, incarnations, members, quarantine) stays where it is: a
fragment has one owner (shard ``p % N``), so its versions and the deltas merged into it never
collide. A run with N = 1 has no ``shards/`` and keeps the layout above byte for byte.

The epoch claim and the head hint are small sealed records defined here (kinds ``syncer-epoch``
and ``log-head``, version 1).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from pipeline.envelope import digest, pack_record, unpack_record
from pipeline.errors import FormatError
from pipeline.descriptor import RunDescriptor
from pipeline.types import CommitRecord, check_learner_id

from .errors import AlreadyExists, NotFound
from .store import ObjectStore

DESCRIPTOR_KEY = "run.descriptor"
EPOCH_PREFIX = "epochs/"
LOG_PREFIX = "log/"
HEAD_HINT_KEY = "hints/log-head"
CLOCK_KEY = "hints/round-clock"     # pipeline/schedule.py ClockRecord: where rounds stand (advisory)
ENDPOINTS_KEY = "hints/syncer-endpoints"   # workers/bus/discovery.py: the syncer's bus endpoints (advisory)
RETENTION_KEY = "hints/retention"   # the newest retention horizon: replay starts after it
VERSION_PREFIX = "versions/"
DELTA_PREFIX = "deltas/"
SPILL_PREFIX = "spill/"
CHECKPOINT_PREFIX = "checkpoints/"
PROBE_PREFIX = "probe/"
MEMBER_PREFIX = "members/"          # learners listed after creation (syncer-signed, docs/security.md)
QUARANTINE_PREFIX = "quarantine/"   # rejected delta bytes kept as evidence, by content hash
INCARNATION_PREFIX = "incarnations/"   # learner lives, claimed create-if-absent (storage/log.py)
HINT_PREFIX = "hints/"
REGION_MARKER_KEY = "region.marker"   # which region's copy this store is (storage/regions.py, issue 25)
FAILOVER_PREFIX = "failovers/"        # explicit region failovers (workers/syncer/home.py, issue 25)
PROPOSAL_KEY = "proposals/initial-model"   # storage/proposal.py: version 0 from a learner's model (issue 28)
LEARNER_STATE_PREFIX = "learner-state/"    # storage/learner_state.py: resume records (issue 28)
LEARNER_OPTIMIZER_PREFIX = "learner-optimizer/"   # storage/learner_state.py: kept inner optimizer states
SHARD_PREFIX = "shards/"            # a sharded run's per-shard partitions (shard_key)
# What each syncer shard owns a copy of (the rest of a run is shared by every shard).
SHARDED_PREFIXES = (EPOCH_PREFIX, LOG_PREFIX, HINT_PREFIX, CHECKPOINT_PREFIX, SPILL_PREFIX)

SEQ_DIGITS = 20        # commit and checkpoint sequence numbers (any int64)
EPOCH_DIGITS = 10
FRAGMENT_DIGITS = 5
VERSION_DIGITS = 12
INCARNATION_DIGITS = 10
DELTA_SEQ_DIGITS = 12
SHARD_DIGITS = 4

EPOCH_KIND, EPOCH_VERSION = "syncer-epoch", 1
HINT_KIND, HINT_VERSION = "log-head", 1
RETENTION_KIND, RETENTION_VERSION = "retention-horizon", 1


def _num(value: int, digits: int, what: str) -> str:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 10 ** digits:
        raise ValueError(f"{what} must be an int in 0..{10 ** digits - 1}, got {value!r}")
    return f"{value:0{digits}d}"


def _parse(key: str, pattern: re.Pattern, what: str) -> re.Match:
    m = pattern.match(key) if isinstance(key, str) else None
    if m is None:
        raise FormatError(f"{key!r} is not a {what} key (expected {pattern.pattern})")
    return m


# -- key builders ------------------------------------------------------------------------------

def epoch_key(epoch: int) -> str:
    return EPOCH_PREFIX + _num(epoch, EPOCH_DIGITS, "epoch")


def commit_key(seq: int) -> str:
    return LOG_PREFIX + _num(seq, SEQ_DIGITS, "commit seq")


def checkpoint_key(seq: int) -> str:
    return CHECKPOINT_PREFIX + _num(seq, SEQ_DIGITS, "checkpoint seq")


def version_prefix(fragment: int) -> str:
    return f"{VERSION_PREFIX}f{_num(fragment, FRAGMENT_DIGITS, 'fragment')}/"


def version_key(fragment: int, version: int, epoch: int | None = None) -> str:
    """A fragment version blob. The syncer names the epoch that wrote it: a crashed syncer may
    leave an uncommitted blob for version v behind, and the next epoch's v must not collide with it."""
    key = version_prefix(fragment) + "v" + _num(version, VERSION_DIGITS, "fragment version")
    return key if epoch is None else key + "-e" + _num(epoch, EPOCH_DIGITS, "epoch")


SNAPSHOT_SUFFIX = "-full"
SNAPSHOT_INFO = "snapshot"     # a commit record's info flag: its version is also stored in full


def snapshot_key(output_key: str) -> str:
    """Where an int4 run's commit also stores its version's full values (pipeline/version_chain.py):
    beside the delta at ``output_key``."""
    return output_key + SNAPSHOT_SUFFIX


def published_keys(record: CommitRecord) -> list[str]:
    """The objects a commit record publishes: its version (``output_key``) and, when the record's
    info says so, the full snapshot beside it. Empty for a commit that publishes nothing."""
    if not record.output_key:
        return []
    return [record.output_key] + ([snapshot_key(record.output_key)] if record.info.get(SNAPSHOT_INFO) else [])


def _life(prefix: str, learner: str, incarnation: int) -> str:
    check_learner_id(learner)
    return f"{prefix}{learner}/i{_num(incarnation, INCARNATION_DIGITS, 'incarnation')}/"


def delta_prefix(learner: str, incarnation: int) -> str:
    return _life(DELTA_PREFIX, learner, incarnation)


def delta_key(learner: str, incarnation: int, seq: int) -> str:
    return delta_prefix(learner, incarnation) + "s" + _num(seq, DELTA_SEQ_DIGITS, "delta seq")


def spill_prefix(learner: str, incarnation: int) -> str:
    return _life(SPILL_PREFIX, learner, incarnation)


def spill_key(learner: str, incarnation: int, seq: int) -> str:
    return spill_prefix(learner, incarnation) + "s" + _num(seq, DELTA_SEQ_DIGITS, "delta seq")


def incarnation_prefix(learner: str) -> str:
    """The claimed lives of one learner id (one level deep: lists in numeric order everywhere)."""
    check_learner_id(learner)
    return f"{INCARNATION_PREFIX}{learner}/"


def incarnation_key(learner: str, incarnation: int) -> str:
    """Claim of one life of a learner id: whoever creates it owns the incarnation."""
    return incarnation_prefix(learner) + "i" + _num(incarnation, INCARNATION_DIGITS, "incarnation")


def member_key(learner: str) -> str:
    """The membership record of a learner added after the run was created."""
    check_learner_id(learner)
    return MEMBER_PREFIX + learner


def learner_state_key(learner: str) -> str:
    """The resume record of a learner id (storage/learner_state.py)."""
    check_learner_id(learner)
    return LEARNER_STATE_PREFIX + learner


def learner_optimizer_key(learner: str) -> str:
    """The kept inner optimizer state of a learner id (storage/learner_state.py)."""
    check_learner_id(learner)
    return LEARNER_OPTIMIZER_PREFIX + learner


def quarantine_key(checksum: str) -> str:
    """Where a rejected delta is kept: by its sha256, never under the id it claims."""
    if not re.fullmatch(r"[0-9a-f]{64}", checksum or ""):
        raise ValueError(f"quarantine key needs a hex sha256, got {checksum!r}")
    return QUARANTINE_PREFIX + checksum


def failover_key(epoch: int) -> str:
    """The record of the region failover whose fence claimed ``epoch``."""
    return FAILOVER_PREFIX + _num(epoch, EPOCH_DIGITS, "epoch")


def probe_key(token: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", token or ""):
        raise ValueError(f"probe token {token!r} must be 1-64 characters of [A-Za-z0-9_-]")
    return PROBE_PREFIX + token


def shard_owner(fragment: int, syncers: int) -> int:
    """The syncer shard that owns ``fragment`` in a run of ``syncers`` shards: ``p % N``."""
    if not isinstance(syncers, int) or isinstance(syncers, bool) or syncers < 1:
        raise ValueError(f"syncers must be an int >= 1, got {syncers!r}")
    _num(fragment, FRAGMENT_DIGITS, "fragment")
    return fragment % syncers


def shard_fragments(shard: int, syncers: int, num_fragments: int) -> tuple[int, ...]:
    """The fragments shard ``shard`` of ``syncers`` owns (ascending)."""
    check_shard(shard, syncers)
    return tuple(range(shard, num_fragments, syncers))


def check_shard(shard: int, syncers: int) -> None:
    if not isinstance(syncers, int) or isinstance(syncers, bool) or syncers < 1:
        raise ValueError(f"syncers must be an int >= 1, got {syncers!r}")
    if not isinstance(shard, int) or isinstance(shard, bool) or not 0 <= shard < syncers:
        raise ValueError(f"shard must be an int in 0..{syncers - 1}, got {shard!r}")


def shard_prefix(shard: int) -> str:
    """Where shard ``shard``'s partition lives: ``shards/s0001/``."""
    return f"{SHARD_PREFIX}s{_num(shard, SHARD_DIGITS, 'shard')}/"


def is_sharded_key(key: str) -> bool:
    """Whether ``key`` (as a syncer names it) lives in a shard's partition of a sharded run."""
    return key.startswith(SHARDED_PREFIXES)


def shard_key(shard: int, key: str) -> str:
    """``key`` as shard ``shard`` of a sharded run stores it: its epochs, log, hints, checkpoints
    and spill inbox under ``shard_prefix(shard)``, everything else unchanged."""
    return shard_prefix(shard) + key if is_sharded_key(key) else key


def unshard_key(shard: int, key: str) -> str:
    """Inverse of ``shard_key`` for a key of shard ``shard``'s partition (FormatError otherwise)."""
    pre = shard_prefix(shard)
    if key.startswith(pre) and is_sharded_key(key[len(pre):]):
        return key[len(pre):]
    raise FormatError(f"{key!r} is not in shard {shard}'s partition ({pre}...)")


# -- key parsers (FormatError on anything else) ------------------------------------------------

_EPOCH_RE = re.compile(rf"^epochs/(\d{{{EPOCH_DIGITS}}})$")
_FAILOVER_RE = re.compile(rf"^failovers/(\d{{{EPOCH_DIGITS}}})$")
_COMMIT_RE = re.compile(rf"^log/(\d{{{SEQ_DIGITS}}})$")
_CHECKPOINT_RE = re.compile(rf"^checkpoints/(\d{{{SEQ_DIGITS}}})$")
_VERSION_RE = re.compile(rf"^versions/f(\d{{{FRAGMENT_DIGITS}}})/v(\d{{{VERSION_DIGITS}}})"
                         rf"(?:-e\d{{{EPOCH_DIGITS}}})?(?:-full)?$")      # -full: SNAPSHOT_SUFFIX
_LIFE = rf"([A-Za-z0-9][A-Za-z0-9_.-]{{0,63}})/i(\d{{{INCARNATION_DIGITS}}})/s(\d{{{DELTA_SEQ_DIGITS}}})"
_DELTA_RE = re.compile(rf"^deltas/{_LIFE}$")
_SPILL_RE = re.compile(rf"^spill/{_LIFE}$")
_INCARNATION_RE = re.compile(rf"^incarnations/([A-Za-z0-9][A-Za-z0-9_.-]{{0,63}})/i(\d{{{INCARNATION_DIGITS}}})$")


def parse_epoch_key(key: str) -> int:
    return int(_parse(key, _EPOCH_RE, "syncer epoch").group(1))


def parse_failover_key(key: str) -> int:
    return int(_parse(key, _FAILOVER_RE, "region failover").group(1))


def parse_commit_key(key: str) -> int:
    return int(_parse(key, _COMMIT_RE, "commit").group(1))


def parse_checkpoint_key(key: str) -> int:
    return int(_parse(key, _CHECKPOINT_RE, "checkpoint").group(1))


def parse_version_key(key: str) -> tuple[int, int]:
    """-> (fragment, version)."""
    m = _parse(key, _VERSION_RE, "fragment version")
    return int(m.group(1)), int(m.group(2))


def parse_delta_key(key: str) -> tuple[str, int, int]:
    """-> (learner, incarnation, seq)."""
    m = _parse(key, _DELTA_RE, "delta")
    return m.group(1), int(m.group(2)), int(m.group(3))


def parse_incarnation_key(key: str) -> tuple[str, int]:
    """-> (learner, incarnation)."""
    m = _parse(key, _INCARNATION_RE, "learner incarnation")
    return m.group(1), int(m.group(2))


def parse_spill_key(key: str) -> tuple[str, int, int]:
    """-> (learner, incarnation, seq)."""
    m = _parse(key, _SPILL_RE, "spilled delta")
    return m.group(1), int(m.group(2)), int(m.group(3))


# -- small records owned by the layout ---------------------------------------------------------

@dataclass(frozen=True)
class EpochRecord:
    """The object at ``epoch_key(epoch)``: who claimed the epoch. ``nonce`` makes each claim's
    bytes unique, so a syncer can recognise its own claim after an ambiguous (timed-out) write."""

    epoch: int
    syncer: str
    nonce: str

    def to_bytes(self) -> bytes:
        return pack_record(EPOCH_KIND, EPOCH_VERSION, {"epoch": self.epoch, "syncer": self.syncer, "nonce": self.nonce})

    @classmethod
    def from_bytes(cls, blob: bytes, what: str | None = None) -> "EpochRecord":
        _, d = unpack_record(blob, EPOCH_KIND, EPOCH_VERSION, max_bytes=1 << 16, what=what)
        try:
            epoch, syncer, nonce = d["epoch"], d["syncer"], d["nonce"]
        except KeyError as exc:
            raise FormatError(f"{what or EPOCH_KIND}: missing field {exc.args[0]!r}") from None
        if not (isinstance(epoch, int) and isinstance(syncer, str) and isinstance(nonce, str)):
            raise FormatError(f"{what or EPOCH_KIND}: fields have the wrong types")
        return cls(epoch, syncer, nonce)


def pack_head_hint(seq: int, epoch: int) -> bytes:
    """The advisory head hint: the last commit seq its writer knew of (may lag; never trusted)."""
    return pack_record(HINT_KIND, HINT_VERSION, {"seq": seq, "epoch": epoch})


def unpack_head_hint(blob: bytes, what: str | None = None) -> int:
    """-> the hinted seq; ``FormatError`` if damaged."""
    _, d = unpack_record(blob, HINT_KIND, HINT_VERSION, max_bytes=1 << 12, what=what)
    seq = d.get("seq")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < -1:
        raise FormatError(f"{what or HINT_KIND}: bad seq {seq!r}")
    return seq


def pack_retention_hint(horizon: int, kept_checkpoints: list[int]) -> bytes:
    """The retention horizon: what the commits up to it named may be deleted, so a
    replay starts at the checkpoint ``horizon``. Written before the deletions it allows."""
    return pack_record(RETENTION_KIND, RETENTION_VERSION, {"horizon": horizon, "kept_checkpoints": kept_checkpoints})


def unpack_retention_hint(blob: bytes, what: str | None = None) -> int:
    """-> the horizon (a checkpoint's seq); ``FormatError`` if damaged."""
    _, d = unpack_record(blob, RETENTION_KIND, RETENTION_VERSION, max_bytes=1 << 16, what=what)
    horizon = d.get("horizon")
    if not isinstance(horizon, int) or isinstance(horizon, bool) or horizon < 0:
        raise FormatError(f"{what or RETENTION_KIND}: bad horizon {horizon!r}")
    return horizon


# -- the run descriptor ------------------------------------------------------------------------

def write_descriptor(store: ObjectStore, desc: RunDescriptor) -> None:
    """Create the run (create-if-absent). Writing the same descriptor again is a no-op; a
    different one raises ``AlreadyExists`` naming both run ids."""
    blob = desc.to_bytes()
    try:
        store.put_if_absent(DESCRIPTOR_KEY, blob)
        return
    except AlreadyExists:
        existing = store.get(DESCRIPTOR_KEY)
    if digest(existing) == digest(blob):
        return  # our own earlier (possibly timed-out) write, or an identical relaunch
    try:
        other = RunDescriptor.from_bytes(existing, what=f"{store.uri}/{DESCRIPTOR_KEY}")
        if other == desc:
            return
        detail = f"a different run ({other.run_id!r}) already exists here; this one is {desc.run_id!r}"
    except FormatError as exc:
        detail = f"an unreadable descriptor already exists here ({exc})"
    raise AlreadyExists(f"{detail}: choose a new run location", uri=store.uri, key=DESCRIPTOR_KEY)


def read_descriptor(store: ObjectStore) -> RunDescriptor:
    """The run's descriptor; ``NotFound`` saying there is no run at this location."""
    try:
        blob = store.get(DESCRIPTOR_KEY)
    except NotFound:
        raise NotFound(f"no run at {store.uri} (no {DESCRIPTOR_KEY}); create it with the launcher first",
                       uri=store.uri, key=DESCRIPTOR_KEY) from None
    return RunDescriptor.from_bytes(blob, what=f"{store.uri}/{DESCRIPTOR_KEY}")
