"""Reading committed fragment versions: learners, the evaluator and export all go through here.

Only versions named by a commit are ever used (a version blob without a commit is an orphan of a
crashed syncer). A version blob is a codec blob of kind ``version`` whose meta names its fragment,
version, seq and epoch; its values' digest must equal the commit's ``output_checksum``.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from pipeline.checksum import tensor_digest
from pipeline.codec import CodecConfig, decode, encode
from pipeline.errors import FormatError
from pipeline.types import CommitRecord, RunDescriptor
from storage.errors import NotFound
from storage.log import CommitLog
from storage.store import ObjectStore

VERSION_KIND = "version"


def version_codec(descriptor: RunDescriptor) -> CodecConfig:
    return CodecConfig(scheme="bf16" if descriptor.version_dtype == "bf16" else "fp32", block_size=descriptor.block_size,
                       zstd_level=descriptor.zstd_level)


def encode_version(descriptor: RunDescriptor, fragment: int, version: int, seq: int, epoch: int,
                   published: Mapping[str, np.ndarray]) -> bytes:
    meta = {"fragment": fragment, "version": version, "seq": seq, "epoch": epoch}
    return encode(VERSION_KIND, meta, {n: published[n] for n in descriptor.fragments[fragment]},
                  version_codec(descriptor))


def max_fragment_bytes(descriptor: RunDescriptor) -> int:
    """Upper bound on a fragment's decoded float32 bytes (plus slack), for decode limits."""
    return max(sum(4 * descriptor.spec(n).numel for n in frag) for frag in descriptor.fragments) + (1 << 20)


def decode_version(blob: bytes, descriptor: RunDescriptor, record: CommitRecord) -> dict[str, np.ndarray]:
    """Decode and check a committed version against its commit record (FormatError if anything differs)."""
    what = record.output_key
    dec = decode(blob, VERSION_KIND, max_bytes=max_fragment_bytes(descriptor),
                 expect=descriptor.fragment_specs(record.fragment), what=what)
    meta = dec.meta
    if meta.get("fragment") != record.fragment or meta.get("version") != record.version:
        raise FormatError(f"{what}: holds fragment {meta.get('fragment')} version {meta.get('version')}, "
                          f"but commit {record.seq} names fragment {record.fragment} version {record.version}")
    tensors = {n: np.asarray(a, dtype=np.float32) for n, a in dec.tensors.items()}
    got = tensor_digest(tensors)
    if got != record.output_checksum:
        raise FormatError(f"{what}: value digest {got[:16]}… does not match commit {record.seq}'s "
                          f"output_checksum {record.output_checksum[:16]}…")
    return tensors


class VersionTracker:
    """Follows the commit log from a cursor and loads the versions it names."""

    def __init__(self, store: ObjectStore, descriptor: RunDescriptor):
        self.store = store
        self.descriptor = descriptor
        self.log = CommitLog(store)
        self.cursor = -1   # seq of the last commit seen

    def latest(self) -> dict[int, CommitRecord]:
        """The newest version-carrying commit of every fragment, scanning back from the tail.
        Moves the cursor to the tail."""
        tail = self.log.tail()
        found: dict[int, CommitRecord] = {}
        seq = tail
        P = self.descriptor.num_fragments
        while seq >= 0 and len(found) < P:
            rec = self.log.read(seq)
            if rec.kind in ("init", "merge") and rec.fragment not in found:
                found[rec.fragment] = rec
            seq -= 1
        missing = sorted(set(range(P)) - set(found))
        if missing:
            raise FormatError(f"{self.store.uri}: the log has no version of fragments {missing}")
        self.cursor = max(self.cursor, tail)
        return found

    def poll(self, limit: int = 256) -> list[CommitRecord]:
        """Commits after the cursor (at most ``limit``); advances the cursor."""
        out = []
        while len(out) < limit:
            try:
                rec = self.log.read(self.cursor + 1)
            except NotFound:
                break
            self.cursor += 1
            out.append(rec)
        return out

    def load(self, record: CommitRecord) -> dict[str, np.ndarray]:
        return decode_version(self.store.get(record.output_key), self.descriptor, record)

    def load_all(self) -> tuple[dict[str, np.ndarray], dict[int, int]]:
        """The full global model as it stands now: values and the version of each fragment."""
        values: dict[str, np.ndarray] = {}
        versions: dict[int, int] = {}
        for p, rec in sorted(self.latest().items()):
            values.update(self.load(rec))
            versions[p] = rec.version
        return values, versions
