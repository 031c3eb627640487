"""Delta blobs as the syncer and replay see them: a codec blob of kind ``delta`` whose meta is the
DeltaHeader. Decoding here is deterministic, so replay reaches the same drop decisions as the live
syncer did from the same stored bytes.
"""
from __future__ import annotations

import numpy as np

from pipeline.codec import decode, peek_meta
from pipeline.envelope import digest
from pipeline.errors import FormatError
from pipeline.fold import RoundInput
from pipeline.types import CommitRecord, DeltaHeader, RunDescriptor
from storage.store import ObjectStore
from .versions import max_fragment_bytes

DELTA_KIND = "delta"


def peek_header(blob: bytes, descriptor: RunDescriptor, what: str) -> DeltaHeader:
    """The header inside a delta blob, without decompressing its tensors (FormatError if damaged)."""
    meta = peek_meta(blob, DELTA_KIND, max_bytes=max_fragment_bytes(descriptor), what=what)
    return DeltaHeader.from_dict(meta)


def decode_delta(blob: bytes, descriptor: RunDescriptor, what: str) -> dict[str, np.ndarray] | None:
    """The delta's tensors as float32, or None if the blob does not decode (the fold records
    'undecodable'). Shapes are not checked here: the fold names a mismatching tensor."""
    try:
        dec = decode(blob, DELTA_KIND, max_bytes=max_fragment_bytes(descriptor), what=what)
    except FormatError:
        return None
    return {n: np.asarray(a, dtype=np.float32) for n, a in dec.tensors.items()}


def round_input(blob: bytes, key: str, descriptor: RunDescriptor) -> RoundInput:
    """A fold input from stored bytes (header from the blob itself)."""
    header = peek_header(blob, descriptor, key)
    return RoundInput(header, key, digest(blob), decode_delta(blob, descriptor, key))


def load_inputs(store: ObjectStore, descriptor: RunDescriptor, record: CommitRecord) -> list[RoundInput]:
    """Every input a commit names (merged and dropped), fetched and checked against its checksum."""
    out = []
    refs = [(i.key, i.checksum, i.delta_id) for i in record.inputs] + \
           [(d.key, d.checksum, d.delta_id) for d in record.dropped]
    for key, checksum, did in refs:
        blob = store.get(key)
        got = digest(blob)
        if got != checksum:
            raise FormatError(f"{key}: checksum {got[:16]}… does not match commit {record.seq}'s record "
                              f"{checksum[:16]}… for delta {did} (the object was altered or replaced)")
        inp = round_input(blob, key, descriptor)
        if inp.header.id != did:
            raise FormatError(f"{key}: holds delta {inp.header.id}, commit {record.seq} names {did}")
        out.append(inp)
    return out
