"""Signatures on everything that can change the model (docs/security.md).

Ed25519 (RFC 8032, via ``cryptography``): a learner signs every delta it writes or sends; the
syncer signs every fragment version, commit record, checkpoint and membership record it makes.
Every signature covers a domain-separated message

    b"ddiloco-sig-v1\\0" + purpose + b"\\0" + run_id + b"\\0" + payload

so a signature made for one purpose (a delta) or one run can never be replayed as another.
Checks are pure functions of stored bytes and the run's public keys: the live syncer and replay
reach the same decision about the same object. Nothing here knows who is listed in a run; callers
pass the public key (hex) they trust. Formats (docs/formats.md):

- ``signed-delta`` v1: envelope whose body is the msgpack map {learner, delta, sig}; ``delta`` is
  the codec blob of kind ``delta``; ``sig`` signs sha256(delta) (purpose ``delta``).
- commit records: ``info["sig"]`` (hex) signs the canonical bytes of the record's map without it:
  the map as stored when checking a record read back (``CommitRecord.stored``), never a re-encoding.
- version blobs: ``meta["sig"]`` (hex) signs {fragment, version, seq, epoch, digest} where
  ``digest`` is the tensor digest of the values (the commit's ``output_checksum``).
- ``signed-checkpoint`` v1: envelope {seq, state, sig}; ``sig`` signs seq + sha256(state).
"""
from __future__ import annotations

import dataclasses
import hashlib
from functools import lru_cache
from typing import Any

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from pipeline.envelope import pack_record, unpack_record
from pipeline.errors import FormatError
from pipeline.types import CommitRecord

DOMAIN = b"ddiloco-sig-v1\0"
PURPOSES = ("delta", "version", "commit", "checkpoint", "member", "endpoints")
SIG_BYTES = 64
SIGNED_DELTA_KIND, SIGNED_DELTA_VERSION = "signed-delta", 1
SIGNED_CHECKPOINT_KIND, SIGNED_CHECKPOINT_VERSION = "signed-checkpoint", 1


def _message(purpose: str, run_id: str, payload: bytes) -> bytes:
    if purpose not in PURPOSES:
        raise ValueError(f"signature purpose {purpose!r} not one of {PURPOSES}")
    return DOMAIN + purpose.encode() + b"\0" + run_id.encode() + b"\0" + bytes(payload)


class Signer:
    """An Ed25519 secret key and the public key (hex) that verifies it. Its repr shows only the
    public key: a Signer may appear in logs or tracebacks without leaking the secret."""

    def __init__(self, secret: bytes):
        if not isinstance(secret, bytes) or len(secret) != 32:
            raise ValueError("an Ed25519 secret key is 32 bytes")
        self._key = Ed25519PrivateKey.from_private_bytes(secret)
        self.public = self._key.public_key().public_bytes_raw().hex()

    @classmethod
    def generate(cls) -> "Signer":
        return cls(Ed25519PrivateKey.generate().private_bytes_raw())

    def secret_bytes(self) -> bytes:
        """The raw secret (for writing a key file only)."""
        return self._key.private_bytes_raw()

    def sign(self, purpose: str, run_id: str, payload: bytes) -> bytes:
        return self._key.sign(_message(purpose, run_id, payload))

    def __repr__(self) -> str:
        return f"Signer(public={self.public[:16]}…)"


@lru_cache(maxsize=1024)
def _public_key(public_hex: str) -> Ed25519PublicKey | None:
    try:
        raw = bytes.fromhex(public_hex)
        return Ed25519PublicKey.from_public_bytes(raw) if len(raw) == 32 else None
    except (ValueError, TypeError):
        return None


def verify(public_hex: str, purpose: str, run_id: str, payload: bytes, sig: bytes) -> bool:
    """True iff ``sig`` is ``public_hex``'s signature of (purpose, run_id, payload)."""
    key = _public_key(public_hex) if isinstance(public_hex, str) else None
    if key is None or not isinstance(sig, (bytes, bytearray)) or len(sig) != SIG_BYTES:
        return False
    try:
        key.verify(bytes(sig), _message(purpose, run_id, payload))
        return True
    except InvalidSignature:
        return False


def canonical(obj: Any) -> bytes:
    """Deterministic bytes of a plain value: maps with sorted keys, tuples as lists, floats as
    float64. Signatures over records use this, so a record signs the same after a round trip."""
    def norm(x: Any) -> Any:
        if isinstance(x, dict):
            if not all(isinstance(k, str) for k in x):
                raise ValueError("canonical maps need string keys")
            return {k: norm(x[k]) for k in sorted(x)}
        if isinstance(x, (list, tuple)):
            return [norm(v) for v in x]
        return x
    return msgpack.packb(norm(obj), use_bin_type=True)


# -- deltas (learner -> syncer) -------------------------------------------------------------------

def seal_delta(blob: bytes, learner: str, signer: Signer, run_id: str) -> bytes:
    """Wrap a codec delta blob with its learner's signature: the stored object verifies itself."""
    sig = signer.sign("delta", run_id, hashlib.sha256(blob).digest())
    return pack_record(SIGNED_DELTA_KIND, SIGNED_DELTA_VERSION, {"learner": learner, "delta": bytes(blob), "sig": sig})


def open_delta(blob: bytes, max_bytes: int, what: str) -> tuple[str, bytes, bytes]:
    """``(learner, inner delta blob, signature)`` of a signed delta; FormatError if it is not one."""
    _, body = unpack_record(blob, SIGNED_DELTA_KIND, SIGNED_DELTA_VERSION, max_bytes=max_bytes, what=what)
    learner, inner, sig = body.get("learner"), body.get("delta"), body.get("sig")
    if set(body) != {"learner", "delta", "sig"} or not isinstance(learner, str) \
            or not isinstance(inner, bytes) or not isinstance(sig, bytes):
        raise FormatError(f"{what}: signed delta needs exactly learner (str), delta (bytes) and sig (bytes)")
    return learner, inner, sig


def delta_signature_ok(public_hex: str, run_id: str, inner: bytes, sig: bytes) -> bool:
    return verify(public_hex, "delta", run_id, hashlib.sha256(inner).digest(), sig)


# -- commit records (syncer, launcher for init commits) ---------------------------------------------

def _commit_payload(record: CommitRecord) -> bytes:
    """What a commit's signature covers: the record's map without ``info["sig"]`` - for a record
    read from storage the map exactly as stored (``record.stored``), never a re-encoding of the
    parsed record (issue 26: a field added to ``to_dict`` since an old run was written made every
    one of its signatures fail); for a record made in memory, what ``to_bytes`` writes."""
    return _map_payload(dict(record.stored) if record.stored is not None else record.to_dict())


def _map_payload(d: dict) -> bytes:
    info = d.get("info")
    d["info"] = {k: v for k, v in info.items() if k != "sig"} if isinstance(info, dict) else info
    return canonical(d)


def sign_commit(record: CommitRecord, signer: Signer, run_id: str) -> CommitRecord:
    """The same record with ``info["sig"]``: the syncer's signature over everything else in it."""
    sig = signer.sign("commit", run_id, _map_payload(record.to_dict())).hex()   # what to_bytes writes
    return dataclasses.replace(record, info={**{k: v for k, v in record.info.items() if k != "sig"}, "sig": sig})


def _verify_hex(sig, public_hex: str, domain: str, run_id: str, payload: bytes) -> bool:
    """``verify`` for a signature stored as hex text; anything that is not valid hex is simply bad."""
    if not isinstance(sig, str):
        return False
    try:
        raw = bytes.fromhex(sig)
    except ValueError:
        return False
    return verify(public_hex, domain, run_id, payload, raw)


def verify_hex(sig, public_hex: str, purpose: str, run_id: str, payload: bytes) -> bool:
    """Whether ``sig`` (hex text, as records store it) is ``public_hex``'s signature of the payload."""
    return _verify_hex(sig, public_hex, purpose, run_id, payload)


def commit_signature_ok(record: CommitRecord, public_hex: str, run_id: str) -> bool:
    return _verify_hex(record.info.get("sig"), public_hex, "commit", run_id, _commit_payload(record))


def check_commit_signature(record: CommitRecord, public_hex: str, run_id: str, what: str = "") -> None:
    """FormatError unless the record carries a valid signature of the run's syncer."""
    if not commit_signature_ok(record, public_hex, run_id):
        state = "missing" if "sig" not in record.info else "bad"
        raise FormatError(f"{what or f'commit {record.seq}'}: {state} syncer signature on a {record.kind!r} "
                          "commit (forged or altered; refused)")


# -- fragment versions ---------------------------------------------------------------------------

def _version_payload(meta: dict, digest_hex: str) -> bytes:
    return canonical({"fragment": meta.get("fragment"), "version": meta.get("version"), "seq": meta.get("seq"),
                      "epoch": meta.get("epoch"), "digest": digest_hex})


def sign_version_meta(meta: dict, digest_hex: str, signer: Signer, run_id: str) -> dict:
    """``meta`` plus ``sig``: the syncer's signature of the version's identity and value digest."""
    return {**meta, "sig": signer.sign("version", run_id, _version_payload(meta, digest_hex)).hex()}


def version_signature_ok(meta: dict, digest_hex: str, public_hex: str, run_id: str) -> bool:
    return _verify_hex(meta.get("sig"), public_hex, "version", run_id, _version_payload(meta, digest_hex))


# -- checkpoints ---------------------------------------------------------------------------------

def _checkpoint_payload(seq: int, state: bytes) -> bytes:
    return canonical({"seq": seq, "state": hashlib.sha256(state).hexdigest()})


def seal_checkpoint(state: bytes, seq: int, signer: Signer, run_id: str) -> bytes:
    sig = signer.sign("checkpoint", run_id, _checkpoint_payload(seq, state))
    return pack_record(SIGNED_CHECKPOINT_KIND, SIGNED_CHECKPOINT_VERSION, {"seq": seq, "state": state, "sig": sig})


def open_checkpoint(payload: bytes, seq: int, public_hex: str, run_id: str, what: str) -> bytes:
    """The syncer state inside a signed checkpoint payload; FormatError if unsigned, forged or for
    another seq (a restored state decides every later merge, so it must be the syncer's own)."""
    _, body = unpack_record(payload, SIGNED_CHECKPOINT_KIND, SIGNED_CHECKPOINT_VERSION, max_bytes=1 << 31, what=what)
    state, sig, got = body.get("state"), body.get("sig"), body.get("seq")
    if not isinstance(state, bytes) or not isinstance(sig, bytes) or got != seq:
        raise FormatError(f"{what}: signed checkpoint is malformed or for seq {got!r}, not {seq}")
    if not verify(public_hex, "checkpoint", run_id, _checkpoint_payload(seq, state), sig):
        raise FormatError(f"{what}: bad syncer signature on the checkpoint (forged or altered; ignored)")
    return state
