"""Checkpoints of the syncer's state, so that recovery folds only the commits after one (SPEC §7-8).

``checkpoints/<20-digit seq>`` holds the state *after* commit ``seq``. It is written only once
that commit exists, sealed as kind ``checkpoint`` version 1 with the sha256 of the commit's bytes,
so a checkpoint can never describe a commit other than the one in the log. The payload is opaque
here (the syncer encodes its state). The state after a commit is a pure function of the log, so
the first checkpoint written for a seq is kept and later ones for that seq are dropped.

``latest_checkpoint`` skips checkpoints that are damaged or do not match their commit (logging
why) and falls back to older ones: recovery then folds more commits but never starts from a
wrong state.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from pipeline.envelope import digest, pack_record, unpack_record
from pipeline.errors import FormatError

from .errors import AlreadyExists, NotFound
from .layout import CHECKPOINT_PREFIX, checkpoint_key, commit_key, parse_checkpoint_key
from .store import ObjectStore

log = logging.getLogger(__name__)

KIND, VERSION = "checkpoint", 1
MAX_CHECKPOINT_BYTES = 1 << 31


@dataclass(frozen=True)
class CheckpointPolicy:
    """Write a checkpoint after every ``every``-th commit; retention keeps the newest ``keep``."""

    every: int = 100
    keep: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"CheckpointPolicy.every must be an int >= 1, got {self.every!r}")
        if not isinstance(self.keep, int) or self.keep < 1:
            raise ValueError(f"CheckpointPolicy.keep must be an int >= 1, got {self.keep!r}")

    def due(self, seq: int) -> bool:
        """Whether the state after commit ``seq`` should be checkpointed."""
        return seq >= 0 and (seq + 1) % self.every == 0


def write_checkpoint(store: ObjectStore, seq: int, blob: bytes) -> None:
    """Store the syncer state after commit ``seq``. ``NotFound`` if that commit does not exist;
    a checkpoint already present for ``seq`` is kept (first writer wins)."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise TypeError(f"checkpoint payload must be bytes, got {type(blob).__name__}")
    key = checkpoint_key(seq)
    try:
        commit = store.get(commit_key(seq))
    except NotFound:
        raise NotFound(f"refusing checkpoint {seq}: commit {seq} does not exist (a checkpoint is written "
                       "only after its commit)", uri=store.uri, key=commit_key(seq)) from None
    sealed = pack_record(KIND, VERSION, {"seq": seq, "commit_sha256": digest(commit), "payload": bytes(blob)})
    try:
        store.put_if_absent(key, sealed)
    except AlreadyExists:
        pass


def read_checkpoint(store: ObjectStore, seq: int) -> bytes:
    """The payload of checkpoint ``seq``, verified against commit ``seq``; ``NotFound``/``FormatError``."""
    key = checkpoint_key(seq)
    what = f"{store.uri}/{key}"
    _, d = unpack_record(store.get(key), KIND, VERSION, max_bytes=MAX_CHECKPOINT_BYTES, what=what)
    if d.get("seq") != seq or not isinstance(d.get("payload"), bytes) or not isinstance(d.get("commit_sha256"), str):
        raise FormatError(f"{what}: malformed checkpoint record (seq {d.get('seq')!r})")
    try:
        commit = store.get(commit_key(seq))
    except NotFound:
        raise FormatError(f"{what}: its commit {commit_key(seq)} is missing") from None
    if digest(commit) != d["commit_sha256"]:
        raise FormatError(f"{what}: was written for a different commit {seq} (checksum mismatch)")
    return d["payload"]


def list_checkpoints(store: ObjectStore) -> list[int]:
    """Seqs that have a checkpoint object, ascending (unverified)."""
    return sorted(parse_checkpoint_key(k) for k in store.list(CHECKPOINT_PREFIX))


def latest_checkpoint(store: ObjectStore, at_or_before: int | None = None,
                      skipped: list[str] | None = None) -> tuple[int, bytes] | None:
    """The newest valid checkpoint with seq ``<= at_or_before`` (any, if None): ``(seq, payload)``,
    or ``None`` when there is none (recovery then folds from the start). Every damaged one passed
    over is logged and, when ``skipped`` is given, appended to it: falling back to an older
    checkpoint is never silent (the syncer reports them as events)."""
    for seq in reversed(list_checkpoints(store)):
        if at_or_before is not None and seq > at_or_before:
            continue
        try:
            return seq, read_checkpoint(store, seq)
        except (FormatError, NotFound) as exc:
            log.warning("skipping checkpoint %d: %s", seq, exc)
            if skipped is not None:
                skipped.append(f"checkpoint {seq} skipped: {exc}")
    return None
