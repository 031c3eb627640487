"""A rogue client: a listed learner key that sends crafted deltas (chaos, docs/security.md).

``Rogue`` holds the run's ``rogue`` identity (listed like any learner: it passes CURVE and ZAP and
signs correctly), so what it sends reaches the syncer's judgement rather than being stopped at the
door. Each attack returns the ``Injection`` records of what was sent and which outcomes would be
correct; ``invariants.bad_inputs_rejected`` checks them against the syncer's log and commits.

| attack | what is sent | correct outcome |
|---|---|---|
| duplicate | one good delta, twice on the bus and once spilled | merged exactly once |
| reorder | seq s+1, then seq s | s+1 merged once; s dropped (duplicate or superseded) |
| truncated | the first half of a good blob (frame checksum matches the half) | rejected undecodable |
| corrupted | bytes flipped inside a good blob (frame checksum recomputed) | rejected undecodable |
| corrupt-frame | bytes flipped, frame checksum of the original | rejected bad-checksum |
| oversized | a bus frame 1 MiB over the run's largest delta | never read (libzmq drops it) |
| oversized-spill | an inbox object 1 MiB over the largest delta | rejected oversize |
| nan, inf | a signed fp32 delta holding NaN / Inf (hand-built: the encoder refuses them) | dropped undecodable (the codec refuses them) or non-finite |
| wrong-shape | a signed delta whose tensors have other shapes | dropped shape-mismatch |
| unknown-fragment | a signed delta for fragment P + 7 | rejected unknown-fragment |
| too-old | a signed delta whose base is outside the retained window | dropped base-too-old |
| tampered-spill | a spilled delta altered after signing (envelopes re-sealed) | dropped bad-signature |
| mislabeled-spill | a good delta under another delta's inbox key | rejected undecodable |

Good deltas are tiny (values ~1e-4, 8 tokens, 1 step) so that merging them barely moves the model.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import msgpack
import numpy as np

from pipeline.codec import VERSION as CODEC_VERSION, CodecConfig, encode
from pipeline.envelope import digest, pack_record, seal, unpack_record, unseal
from pipeline.descriptor import RunDescriptor
from pipeline.types import DeltaHeader
from storage.layout import spill_key
from storage.store import ObjectStore
from workers.bus.bus import BusConfig, LearnerLink, Message
from workers.common.deltas import max_delta_bytes
from workers.bus.keys import SYNCER, key_paths, load_identity, load_public
from workers.learner.learner import INCARNATION_EPOCH_NS
from workers.bus.signing import seal_delta
from workers.common.versions import VersionTracker

# Format 1 blobs: one raw body, which the tampering below edits in place (any format the syncer
# reads is refused the same way).
ROGUE_CODEC = CodecConfig(scheme="int8", format=CODEC_VERSION)

ATTACKS = ("duplicate", "reorder", "truncated", "corrupted", "corrupt-frame", "nan", "inf", "wrong-shape",
           "unknown-fragment", "too-old", "tampered-spill", "mislabeled-spill", "oversized-spill", "oversized")


@dataclass(frozen=True)
class Injection:
    """One crafted object. ``expect``: acceptable outcomes, each ``merged-once``,
    ``rejected:<category>``, ``dropped:<reason prefix>`` or ``unheard`` (dropped before it is read)."""

    attack: str
    delta_id: str
    path: str               # "bus" | "spill"
    key: str                # its inbox key ("" when sent on the bus only)
    checksum: str
    expect: tuple[str, ...]
    t: float
    reply: str = ""         # the syncer's ack on the bus, if one came

    def to_dict(self) -> dict:
        return {"attack": self.attack, "delta_id": self.delta_id, "path": self.path, "key": self.key,
                "checksum": self.checksum, "expect": list(self.expect), "t": round(self.t, 4), "reply": self.reply}


def _flip(blob: bytes, at: float = 0.6) -> bytes:
    b = bytearray(blob)
    i = int(len(b) * at)
    b[i] ^= 0xFF
    b[i + 1] ^= 0x55
    return bytes(b)


def raw_fp32_blob(meta: dict, tensors: dict[str, np.ndarray]) -> bytes:
    """A codec blob written by hand (``encode`` refuses NaN/Inf): scheme fp32, no zstd."""
    specs = [{"name": n, "shape": list(a.shape), "dtype": "float32"} for n, a in tensors.items()]
    raw = b"".join(np.ascontiguousarray(a, dtype="<f4").tobytes() for a in tensors.values())
    body = msgpack.packb({"meta": meta, "scheme": "fp32", "block_size": 64, "zstd": False, "tensors": specs,
                          "raw_len": len(raw), "payload": raw}, use_bin_type=True)
    return seal("delta", CODEC_VERSION, body)


class Rogue:
    def __init__(self, store: ObjectStore, descriptor: RunDescriptor, keydir, bus: BusConfig, name: str = "rogue",
                 clock=time.time, seed: int = 0):
        self.store, self.desc, self.bus, self.name, self.clock = store, descriptor, bus, name, clock
        self.ident = load_identity(key_paths(keydir, name)[1])
        self.syncer_pub = load_public(key_paths(keydir, SYNCER)[0])
        self.signer = self.ident.signer()
        self.incarnation = (time.time_ns() - INCARNATION_EPOCH_NS) // 10**8
        self.seq = 0
        self.rng = np.random.default_rng(seed)
        self.injections: list[Injection] = []
        self._turn = 0
        self._links = 0
        self._link: LearnerLink | None = None

    # -- crafting --------------------------------------------------------------------------------
    def versions(self) -> dict[int, int]:
        return {p: r.version for p, r in VersionTracker(self.store, self.desc).latest().items()}

    def _header(self, fragment: int, base: int, seq: int | None = None) -> DeltaHeader:
        if seq is None:
            seq, self.seq = self.seq, self.seq + 1
        return DeltaHeader(self.name, self.incarnation, seq, fragment, base, 1, 8, seq)

    def _tensors(self, fragment: int, shape_off: bool = False, fill: float | None = None) -> dict[str, np.ndarray]:
        out = {}
        for spec in self.desc.fragment_specs(fragment):
            shape = (max(1, spec.numel // 2),) if shape_off else spec.shape
            a = (self.rng.standard_normal(shape) * 1e-4).astype(np.float32)
            if fill is not None:
                a.flat[0] = fill
            out[spec.name] = a
        return out

    def _sign(self, inner: bytes) -> bytes:
        return seal_delta(inner, self.name, self.signer, self.desc.run_id)

    def good(self, fragment: int = 0, base: int | None = None, seq: int | None = None) -> tuple[DeltaHeader, bytes]:
        h = self._header(fragment, self.versions()[fragment] if base is None else base, seq)
        return h, self._sign(encode("delta", h.to_dict(), self._tensors(fragment), ROGUE_CODEC))

    # -- sending ---------------------------------------------------------------------------------
    def link(self, fresh: bool = False) -> LearnerLink:
        if self._link is None or fresh:
            if self._link is not None:
                self._link.close()
            # A fresh routing id per link: the syncer's ROUTER may still hold the id of a connection
            # libzmq just dropped (oversized). Who we are comes from CURVE + ZAP, not from this id.
            self._links += 1
            self._link = LearnerLink(self.bus, f"{self.name}.{self._links}".encode(),
                                     curve=self.ident.curve_keys(server=self.syncer_pub))
        return self._link

    def connect(self, timeout_s: float = 5.0) -> bool:
        """Wait until the link's CURVE handshake is done (a heartbeat is accepted), so that a delta
        crafted next reaches the syncer at once (its base must not age on the way)."""
        deadline = time.monotonic() + timeout_s
        beat = Message("heartbeat", {"learner": self.name, "incarnation": self.incarnation, "step": 0,
                                     "step_time_s": 0.0, "tokens_per_s": 0.0, "loss": -1.0})
        while not self.link().send(beat):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def send(self, h: DeltaHeader | None, blob: bytes, checksum: str | None = None, wait_s: float = 1.5) -> str:
        """Send on the bus once connected; the ack's ``status[:reason]`` or '' if none came."""
        msg = Message("delta", {"header": h.to_dict() if h else {}, "checksum": checksum or digest(blob)}, blob)
        link = self.link()
        deadline = time.monotonic() + wait_s
        while not link.send(msg):
            if time.monotonic() > deadline:
                return "not-connected"
            time.sleep(0.05)
        reply = link.recv(wait_s)
        while reply is not None and reply.type != "ack":
            reply = link.recv(wait_s)
        if reply is None:
            return ""
        return f"{reply.fields.get('status')}:{reply.fields.get('reason', '')}".rstrip(":")

    def spill(self, h: DeltaHeader, blob: bytes, key: str | None = None) -> str:
        key = key or spill_key(h.learner, h.incarnation, h.seq)
        self.store.put_if_absent(key, blob)
        return key

    def _note(self, attack: str, h: DeltaHeader | None, path: str, key: str, blob: bytes, expect: tuple[str, ...],
              reply: str = "") -> Injection:
        inj = Injection(attack, h.id if h else "", path, key, digest(blob), expect, self.clock(), reply)
        self.injections.append(inj)
        return inj

    # -- attacks ---------------------------------------------------------------------------------
    def attack(self, name: str, fragment: int | None = None) -> list[Injection]:
        """Run one attack. Attacks whose deltas should merge (duplicate, reorder) take turns over the
        fragments by default: two good deltas of one learner in one round would supersede each other."""
        if name not in ATTACKS:
            raise ValueError(f"unknown attack {name!r}; choose from {', '.join(ATTACKS)}")
        self.connect()
        if fragment is None:
            fragment = 0
            if name in ("duplicate", "reorder"):
                fragment, self._turn = self._turn % self.desc.num_fragments, self._turn + 1
        return getattr(self, "_" + name.replace("-", "_"))(fragment)

    def _duplicate(self, p: int) -> list[Injection]:
        h, blob = self.good(p)
        r1 = self.send(h, blob)
        r2 = self.send(h, blob)
        key = spill_key(h.learner, h.incarnation, h.seq)
        try:
            self.spill(h, blob, key)
        except Exception:
            pass   # the syncer already wrote these very bytes there
        return [self._note("duplicate", h, "bus+spill", key, blob, ("merged-once",), f"{r1},{r2}")]

    def _reorder(self, p: int) -> list[Injection]:
        base = self.versions()[p]
        first_seq = self.seq
        self.seq += 2
        h_late, late = self.good(p, base, first_seq + 1)
        h_early, early = self.good(p, base, first_seq)
        r1 = self.send(h_late, late)
        r2 = self.send(h_early, early)
        return [self._note("reorder", h_late, "bus", "", late, ("merged-once",), r1),
                self._note("reorder", h_early, "bus", "", early,
                           ("dropped:duplicate", "dropped:superseded"), r2)]

    def _truncated(self, p: int) -> list[Injection]:
        h, blob = self.good(p)
        cut = blob[: len(blob) // 2]
        return [self._note("truncated", h, "bus", "", cut, ("rejected:undecodable",), self.send(h, cut))]

    def _corrupted(self, p: int) -> list[Injection]:
        h, blob = self.good(p)
        bad = _flip(blob)
        return [self._note("corrupted", h, "bus", "", bad, ("rejected:undecodable",), self.send(h, bad))]

    def _corrupt_frame(self, p: int) -> list[Injection]:
        h, blob = self.good(p)
        bad = _flip(blob)
        return [self._note("corrupt-frame", h, "bus", "", bad, ("rejected:bad-checksum",),
                           self.send(h, bad, checksum=digest(blob)))]

    def _non_finite(self, attack: str, p: int, fill: float) -> list[Injection]:
        h = self._header(p, self.versions()[p])
        blob = self._sign(raw_fp32_blob(h.to_dict(), self._tensors(p, fill=fill)))
        # The codec refuses non-finite values when decoding, so the recorded reason is 'undecodable';
        # the fold's own 'non-finite' check is the second line of defence.
        return [self._note(attack, h, "bus", "", blob, ("dropped:undecodable", "dropped:non-finite"),
                           self.send(h, blob))]

    def _nan(self, p: int) -> list[Injection]:
        return self._non_finite("nan", p, float("nan"))

    def _inf(self, p: int) -> list[Injection]:
        return self._non_finite("inf", p, float("inf"))

    def _wrong_shape(self, p: int) -> list[Injection]:
        h = self._header(p, self.versions()[p])
        blob = self._sign(encode("delta", h.to_dict(), self._tensors(p, shape_off=True), ROGUE_CODEC))
        return [self._note("wrong-shape", h, "bus", "", blob, ("dropped:shape-mismatch",), self.send(h, blob))]

    def _unknown_fragment(self, p: int) -> list[Injection]:
        h = self._header(self.desc.num_fragments + 7, 0)
        blob = self._sign(encode("delta", h.to_dict(), self._tensors(p), ROGUE_CODEC))
        return [self._note("unknown-fragment", h, "bus", "", blob, ("rejected:unknown-fragment",), self.send(h, blob))]

    def _too_old(self, p: int) -> list[Injection]:
        current = self.versions()[p]
        old = current - self.desc.versions.retain
        if old < 0:
            raise RuntimeError(f"too-old needs fragment {p} at version >= {self.desc.versions.retain} "
                               f"(the retained window), it is at {current}")
        h, blob = self.good(p, base=old)
        return [self._note("too-old", h, "bus", "", blob, ("dropped:base-too-old",), self.send(h, blob))]

    def _tampered_spill(self, p: int) -> list[Injection]:
        h, blob = self.good(p)
        _, body = unpack_record(blob, "signed-delta", 1)
        _, raw = unseal(body["delta"], "delta", CODEC_VERSION)
        raw = bytearray(raw)
        raw[-3] ^= 0x01                      # inside the payload; both envelopes re-sealed: only the signature fails
        body["delta"] = seal("delta", CODEC_VERSION, bytes(raw))
        bad = pack_record("signed-delta", 1, body)
        key = self.spill(h, bad)
        return [self._note("tampered-spill", h, "spill", key, bad, ("dropped:bad-signature",))]

    def _mislabeled_spill(self, p: int) -> list[Injection]:
        h, blob = self.good(p)
        other = spill_key(h.learner, h.incarnation, h.seq + 100_000)
        key = self.spill(h, blob, other)
        return [self._note("mislabeled-spill", h, "spill", key, blob, ("rejected:undecodable",))]

    def _oversized_spill(self, p: int) -> list[Injection]:
        h = self._header(p, 0)
        blob = bytes(max_delta_bytes(self.desc) + (1 << 20))
        key = self.spill(h, blob)
        return [self._note("oversized-spill", h, "spill", key, blob, ("rejected:oversize",))]

    def _oversized(self, p: int) -> list[Injection]:
        h = self._header(p, 0)
        blob = bytes(max_delta_bytes(self.desc) + (1 << 20))
        reply = self.send(h, blob, checksum="0" * 64, wait_s=1.0)
        self.link(fresh=True)    # libzmq dropped the connection; later sends need a new one
        return [self._note("oversized", h, "bus", "", blob, ("unheard",), reply)]

    def close(self) -> None:
        if self._link is not None:
            self._link.close()
            self._link = None
