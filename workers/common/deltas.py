"""Delta blobs as the syncer and replay see them (SPEC §3, §7; issue "Security").

In an unsigned run a stored delta is the codec blob of kind ``delta`` whose meta is the
DeltaHeader. In a signed run it is a ``signed-delta`` envelope around that blob, carrying its
learner's Ed25519 signature (workers/bus/signing.py). Everything here is a deterministic function of
the stored bytes and the run's public keys, so replay reaches the same drop decisions as the live
syncer did: ``reject_reason`` of a fold input is, in order,

- ``unsigned``: a plain delta in a signed run (the two kinds of run never mix);
- ``unknown-learner``: a signed delta whose learner is not listed (only replay can see this:
  the live syncer never admits such a delta; an unlisted learner after the fact means the
  membership record was removed);
- ``bad-signature``: the signature does not verify with the listed key, or the wrapper names
  another learner than the header inside;
- ``dtype-mismatch: NAME``: an fp32-scheme tensor whose dtype is not the descriptor's.

A delta whose header cannot be read at all never becomes a fold input (FormatError).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from pipeline.codec import decode, peek_meta
from pipeline.envelope import digest
from pipeline.errors import FormatError
from pipeline.fold import RoundInput
from pipeline.descriptor import RunDescriptor
from pipeline.types import CommitRecord, DeltaHeader
from storage.store import ObjectStore
from workers.bus.keys import Roster
from workers.bus.signing import delta_signature_ok, open_delta
from workers.common.versions import max_fragment_bytes

DELTA_KIND = "delta"
UNSIGNED, UNKNOWN_LEARNER, BAD_SIGNATURE = "unsigned", "unknown-learner", "bad-signature"


def max_delta_bytes(descriptor: RunDescriptor) -> int:
    """The largest delta object this run can legitimately produce, with any scheme (fp32 is the
    largest; int8 can exceed it only through block padding of tiny tensors), zstd's worst-case
    expansion and the envelope, header and signature around it. Bus messages and spilled
    objects above this are refused before they are read."""
    bs = descriptor.codec.block_size
    worst = 0
    for frag in descriptor.layout.fragments:
        raw = 0
        for name in frag:
            spec = descriptor.spec(name)
            nb = -(-spec.numel // bs)
            raw += max(spec.nbytes, nb * 4 + nb * bs) + len(name.encode()) + 64 + 10 * len(spec.shape)
        worst = max(worst, raw + raw // 128)
    return worst + (64 << 10)


@dataclasses.dataclass(frozen=True)
class Opened:
    """A stored delta object, opened: its header, the codec blob inside, and the security verdict."""

    header: DeltaHeader
    inner: bytes
    reason: str          # "" or one of the reasons in the module docstring (not dtype)


def _peek(inner: bytes, descriptor: RunDescriptor, what: str) -> DeltaHeader:
    return DeltaHeader.from_dict(peek_meta(inner, DELTA_KIND, max_bytes=max_fragment_bytes(descriptor), what=what))


def open_stored(blob: bytes, descriptor: RunDescriptor, roster: Roster | None, what: str) -> Opened:
    """Open a delta object of either kind and judge its signature (FormatError if no header can be
    read). ``roster`` is the run's key list (None: an unsigned run)."""
    limit = max_delta_bytes(descriptor)
    if roster is None:
        return Opened(_peek(blob, descriptor, what), blob, "")
    try:
        learner, inner, sig = open_delta(blob, limit, what)
    except FormatError as signed_error:
        try:   # a plain delta in a signed run: readable, so recorded, but never merged
            return Opened(_peek(blob, descriptor, what), blob, UNSIGNED)
        except FormatError:
            raise signed_error from None
    header = _peek(inner, descriptor, what)
    key = roster.sign_key(header.learner)
    if key is None:
        return Opened(header, inner, UNKNOWN_LEARNER)
    if learner != header.learner or not delta_signature_ok(key, descriptor.run_id, inner, sig):
        return Opened(header, inner, BAD_SIGNATURE)
    return Opened(header, inner, "")


def peek_header(blob: bytes, descriptor: RunDescriptor, what: str) -> DeltaHeader:
    """The header inside a delta object of either kind, without decompressing its tensors and
    without judging its signature (FormatError if damaged)."""
    try:
        _, inner, _ = open_delta(blob, max_delta_bytes(descriptor), what)
    except FormatError:
        inner = blob
    return _peek(inner, descriptor, what)


def _decode(inner: bytes, descriptor: RunDescriptor, what: str) -> tuple[dict[str, np.ndarray] | None, str]:
    try:
        dec = decode(inner, DELTA_KIND, max_bytes=max_fragment_bytes(descriptor), what=what)
    except FormatError:
        return None, ""
    names = {t.name: t.dtype for t in descriptor.layout.tensors}
    for n, a in sorted(dec.tensors.items()):
        want = names.get(n)
        if dec.scheme == "fp32" and want in ("float16", "float32", "float64") and a.dtype != np.dtype(want):
            return None, f"dtype-mismatch: {n}"
    return {n: np.asarray(a, dtype=np.float32) for n, a in dec.tensors.items()}, ""


def decode_delta(blob: bytes, descriptor: RunDescriptor, what: str) -> dict[str, np.ndarray] | None:
    """The delta's tensors as float32, or None if the blob does not decode (the fold records
    'undecodable'). Shapes are not checked here: the fold names a mismatching tensor."""
    try:
        _, inner, _ = open_delta(blob, max_delta_bytes(descriptor), what)
    except FormatError:
        inner = blob
    return _decode(inner, descriptor, what)[0]


def round_input(blob: bytes, key: str, descriptor: RunDescriptor, roster: Roster | None = None,
                opened: Opened | None = None) -> RoundInput:
    """A fold input from stored bytes. ``roster`` defaults to the descriptor's own key list;
    ``opened`` is ``open_stored``'s result for these bytes if the caller has it (saves re-hashing)."""
    if opened is None:
        opened = open_stored(blob, descriptor, roster if roster is not None else Roster.for_run(descriptor), key)
    if opened.reason:   # never decoded: a rejected object's contents are not looked at
        return RoundInput(opened.header, key, digest(blob), None, opened.reason)
    tensors, reason = _decode(opened.inner, descriptor, key)
    return RoundInput(opened.header, key, digest(blob), tensors, reason)


def load_inputs(store: ObjectStore, descriptor: RunDescriptor, record: CommitRecord,
                roster: Roster | None = None) -> list[RoundInput]:
    """Every input a commit names (merged and dropped), fetched and checked against its checksum."""
    if roster is None:
        roster = Roster.for_run(descriptor)
    out = []
    refs = [(i.key, i.checksum, i.delta_id) for i in record.inputs] + \
           [(d.key, d.checksum, d.delta_id) for d in record.dropped]
    for key, checksum, did in refs:
        blob = store.get(key)
        got = digest(blob)
        if got != checksum:
            raise FormatError(f"{key}: checksum {got[:16]}… does not match commit {record.seq}'s record "
                              f"{checksum[:16]}… for delta {did} (the object was altered or replaced)")
        inp = round_input(blob, key, descriptor, roster)
        if inp.header.id != did:
            raise FormatError(f"{key}: holds delta {inp.header.id}, commit {record.seq} names {did}")
        out.append(inp)
    return out
