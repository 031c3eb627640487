"""Tensor blobs: quantise, pack and compress a set of named tensors into one sealed, checked blob.

SPEC §6: outer deltas travel as int4 (symmetric, per-block absmax scale, round half to even, never
stochastic so replay is exact), int8, bf16 or fp32, then zstd; merged versions travel as fp32 or
bf16. The byte layout is in docs/formats.md ("Tensor blobs"); the blob is sealed with
``pipeline.envelope.seal(kind, version, body)`` so it carries a version and a checksum. Version 1
holds one zstd frame of the raw payload; version 2 cuts the same raw payload into frames, each
zstd'd on ``map_fn`` or stored where zstd does not pay (pipeline/codec_frames.py); version 3 is
version 2's body sealed with an xxh3-128 checksum instead of sha256 (sha256 was the largest cost
left on one core, docs/scale.md). ``decode`` reads all three; ``encode`` writes ``CodecConfig.format`` (new runs 3).

Speed: vectorised kernels go through a tensor in steps of ``_STEP`` values whose
temporaries stay in cache; steps form jobs of ``_JOB`` values that a caller may run on its threads
(``map_fn``, e.g. ``ThreadPoolExecutor.map``: numpy releases the GIL). Version 1's zstd is the
one-shot call used before issue 15: a blob's bytes are what they were, whatever ``map_fn``
(docs/formats.md). Decoding version 1 streams zstd's output and starts each job as soon as its
bytes are out; version 2 decompresses its frames on ``map_fn`` first.

Decoding trusts nothing in the body: it checks every field, bounds the decoded size before it
allocates, bounds zstd's output, checks the payload length against what the shapes imply, checks
scales and codes, and raises ``FormatError`` naming the problem — never a numpy/msgpack/zstd
traceback and never a silently wrong tensor.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import msgpack
import numpy as np
import zstandard

from . import codec_frames as frames
from . import codec_body, codec_into, kernels, scratch
from .codec_checks import IN_DTYPES as _IN_DTYPES, check_expect, field, tensor_entries, v1_payload
from .envelope import seal, seal_parts, unseal_view
from .errors import FormatError
from .types import TensorSpec

SCHEMES = ("int4", "int8", "bf16", "fp32")
VERSION = 1               # the bytes written before issue 15 (docs/formats.md); a run descriptor without codec.format
VERSIONS = (1, 2, 3)      # what decode reads; 2: framed payload (pipeline/codec_frames.py); 3: 2 + xxh3-128
RUN_FORMAT = 3            # a CodecConfig's format unless told: what new runs write (docs/scale.md)
CHECKSUMS = {3: "xxh3-128"}   # the envelope checksum a version carries (others: sha256)
_QMAX = {"int4": 7, "int8": 127}
_COMMON_KEYS = frozenset({"meta", "scheme", "block_size", "tensors", "raw_len"})
_FRAMED = _COMMON_KEYS | {"frame_bytes", "frames"}
_BODY_KEYS = {1: _COMMON_KEYS | {"zstd", "payload"}, 2: _FRAMED, 3: _FRAMED}
_F32_MAX = float(np.finfo(np.float32).max)
_F32_MIN_NORMAL = float(np.finfo(np.float32).tiny)
_F32_INF_FROM = 2.0**128 - 2.0**103   # float32 rounds reals from here up to inf (qmax * scale is exact in float64)
_MAX_TENSORS = 1 << 20
_STEP = 1 << 17           # values per kernel step: its temporaries (512 KiB at most) stay in L2/L3
_ROWS = (1 << 15) - 1     # values per torch reduction call: below torch's grain size, so it runs serially
_JOB = 1 << 20            # values per job handed to map_fn: the unit of parallelism
# y + MAGIC, in float32, is MAGIC + rint(y) exactly (half to even) for |y| < 2**22: the spacing of
# float32 at 1.5 * 2**23 is 1 and MAGIC is even. The low byte of its bits is then the code: q + 8
# for int4 (offset binary) and q mod 256 (two's complement) for int8.
_MAGIC = {"int4": np.float32(1.5 * 2**23 + 8), "int8": np.float32(1.5 * 2**23)}
_BAD_CODE = {"int4": "int4 data has nibble 0, which the encoder never writes",
             "int8": "int8 data has code -128, which the encoder never writes"}
_NON_FINITE = "has non-finite values (NaN/Inf or beyond float32 range); refusing to encode it"


MapFn = Callable[[Callable[[Any], Any], Iterable[Any]], Iterable[Any]]   # map, ThreadPoolExecutor.map ...


@dataclass(frozen=True)
class CodecConfig:
    """How to encode: ``scheme`` in SCHEMES, int4/int8 ``block_size`` (even), ``zstd_level`` (0 = off), ``format``
    the blob format ``encode`` writes (a run's: its descriptor's ``codec.format``)."""

    scheme: str = "int4"
    block_size: int = 64
    zstd_level: int = 3
    format: int = RUN_FORMAT

    def __post_init__(self) -> None:
        if self.format not in VERSIONS or isinstance(self.format, bool):
            raise ValueError(f"codec format must be a tensor blob format version, one of {VERSIONS}, "
                             f"got {self.format!r}")
        if self.scheme not in SCHEMES:
            raise ValueError(f"codec scheme {self.scheme!r} not one of {SCHEMES}")
        if not isinstance(self.block_size, int) or isinstance(self.block_size, bool) \
                or self.block_size < 2 or self.block_size % 2:
            raise ValueError(f"codec block_size must be an even int >= 2, got {self.block_size!r}")
        if not isinstance(self.zstd_level, int) or isinstance(self.zstd_level, bool) \
                or not 0 <= self.zstd_level <= 22:
            raise ValueError(f"codec zstd_level must be an int in 0..22 (0 = no zstd), got {self.zstd_level!r}")


@dataclass(frozen=True)
class Decoded:
    """A decoded blob: ``tensors`` are float32, except fp32 passthrough restores float16/float64."""

    meta: dict
    tensors: dict[str, np.ndarray]
    scheme: str


@dataclass(frozen=True)
class _Slot:
    """A tensor's flat values (read by encode, written by decode) and its bytes in the raw payload."""

    name: str
    flat: np.ndarray
    offset: int
    length: int


def _ranges(numel: int, step: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + step, numel)) for lo in range(0, numel, step)]


def _whole_blocks(values: int, block_size: int) -> int:   # at least one block
    return block_size * max(1, values // block_size)


def _f32(x: np.ndarray) -> np.ndarray:   # float64 beyond float32's range becomes inf
    with np.errstate(over="ignore"):
        return x.astype(np.float32, copy=False)


def _finite(x: np.ndarray) -> bool:   # two read-only reductions: max and min propagate NaN
    return x.size == 0 or (math.isfinite(float(x.max())) and math.isfinite(float(x.min())))


def _bf16_step(u: np.ndarray, out: np.ndarray, t: np.ndarray, keep_low: bool = False) -> None:
    """float32 bits -> bf16 bits (uint16), or with ``keep_low`` the rounded float32 bits (uint32).
    Adding 0x7FFF plus the lowest kept bit rounds half to even; carries into the exponent are right."""
    np.bitwise_and(np.right_shift(u, 16, out=t), 1, out=t)
    np.add(np.add(t, 0x7FFF, out=t), u, out=t)
    if keep_low:
        np.bitwise_and(t, 0xFFFF0000, out=out)
    else:
        np.right_shift(t, 16, out=t)
        np.copyto(out, t, casting="unsafe")


def _bf16_round(x: np.ndarray, keep_low: bool) -> np.ndarray:
    a = np.ascontiguousarray(x, dtype=np.float32).reshape(np.shape(x))   # (ascontiguousarray makes 0-d 1-d)
    u = a.reshape(-1).view(np.uint32)
    r = np.empty(u.size, np.uint32 if keep_low else np.uint16)
    t = np.empty(min(_STEP, u.size), np.uint32)
    for lo, hi in _ranges(u.size, _STEP):
        _bf16_step(u[lo:hi], r[lo:hi], t[:hi - lo], keep_low)
    if a.size and np.isnan(a.max()):   # NaN would carry into garbage: quiet NaN of the same sign
        nan = np.isnan(a.reshape(-1))
        sign_nan = ((u[nan] >> 16) & 0x8000 | 0x7FC0).astype(np.uint32)
        r[nan] = sign_nan << 16 if keep_low else sign_nan
    return r.reshape(a.shape)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), round to nearest even; NaN -> 0x7FC0/0xFFC0 (stays NaN)."""
    return _bf16_round(x, keep_low=False)


def from_bf16_bits(b: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) -> float32 (exact)."""
    b = np.asarray(b, dtype=np.uint16)
    return np.left_shift(b, 16, out=np.empty(b.shape, np.float32).view(np.uint32), dtype=np.uint32).view(np.float32)


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """What a bf16 round trip gives, as float32 (used for bf16-published versions)."""
    return _bf16_round(x, keep_low=True).view(np.float32)


def _nblocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def _encoded_len(scheme: str, numel: int, block_size: int, itemsize: int) -> int:
    """Bytes one tensor takes in the payload (decode checks the payload against the sum)."""
    if scheme == "fp32":
        return numel * itemsize
    if scheme == "bf16":
        return numel * 2
    nb = _nblocks(numel, block_size)
    codes = nb * block_size // 2 if scheme == "int4" else nb * block_size
    return nb * 4 + codes


def _int_views(buf: np.ndarray, slot: _Slot, scheme: str, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    nb = _nblocks(slot.flat.size, block_size)   # a tensor's scales and codes in the raw payload
    return buf[slot.offset:slot.offset + 4 * nb].view("<f4"), buf[slot.offset + 4 * nb:slot.offset + slot.length]


def _block_absmax(t: np.ndarray, out: np.ndarray) -> None:
    """``out[i] = max(t[i])``: exact, so torch (if this process imported it, as learners do: its row
    reduction is several times faster) and numpy give the same values."""
    torch = sys.modules.get("torch")
    if torch is None:
        np.maximum.reduceat(t.reshape(-1), np.arange(0, t.size, t.shape[1]), out=out)
        return
    rows = max(1, _ROWS // t.shape[1])
    tt, ot = torch.from_numpy(t), torch.from_numpy(out)
    for r in range(0, t.shape[0], rows):
        torch.amax(tt[r:r + rows], dim=1, out=ot[r:r + rows])


def _quantize_step(x: np.ndarray, scheme: str, bs: int, sc: np.ndarray, codes: np.ndarray, tmp: np.ndarray,
                   amax: np.ndarray, u8: np.ndarray, u16: np.ndarray) -> bool:
    """The values ``x`` of ``sc.size`` blocks (the last one zero-padded) into scales ``sc`` and
    ``codes``; False if one, or a block's ``qmax * scale``, is not finite as float32. With a normal scale
    |x / scale| <= qmax (1 + 2**-23) rounds to at most qmax: only subnormal scales need the clip (same integers)."""
    k, n = sc.size, sc.size * bs
    if x.dtype != np.float32 or x.size != n:
        pad = np.zeros(n, np.float32)
        with np.errstate(over="ignore"):
            pad[:x.size] = x
        x = pad
    xb, t, m = x.reshape(k, bs), tmp[:n].reshape(k, bs), amax[:k]
    qmax = _QMAX[scheme]
    np.abs(xb, out=t)
    _block_absmax(t, m)
    np.divide(m, np.float32(qmax), out=sc)
    if not m.max() <= _F32_MAX:                       # NaN/Inf in a block (max propagates NaN)
        return False
    if not float(sc.max()) * qmax < _F32_INF_FROM:    # decode's qmax * scale must be finite: int8's scale
        return False                                  # of 3.4028235e38 rounds up, 127 times it is inf
    safe = np.where(sc > 0, sc, np.float32(1))        # an all-zero block keeps scale 0 and codes 0
    np.divide(xb, safe[:, None], out=t)
    if safe.min() < _F32_MIN_NORMAL:
        np.clip(t, -qmax, qmax, out=t)
    np.add(t, _MAGIC[scheme], out=t)                  # round half to even: never stochastic (SPEC §6)
    bits = t.reshape(-1).view(np.uint32)
    if scheme == "int8":
        np.copyto(codes, bits, casting="unsafe")      # the low byte: q as two's complement
        return True
    low = u8[:n]
    np.copyto(low, bits, casting="unsafe")            # q + 8, one value per byte
    pairs, packed = low.view("<u2"), u16[:n // 2]     # pair i = value 2i + 256 * value 2i+1
    np.right_shift(pairs, 4, out=packed)
    np.bitwise_or(packed, pairs, out=packed)          # low byte: value 2i | value 2i+1 << 4
    np.copyto(codes, packed, casting="unsafe")
    return True


def _quantize_range(x: np.ndarray, lo: int, hi: int, scheme: str, bs: int, scales: np.ndarray,
                    codes: np.ndarray) -> bool:
    """Values ``lo:hi`` (``lo`` on a block boundary) of ``x`` into ``scales``, ``codes``; False if not finite.
    The C kernel when built (pipeline/kernels.py), else numpy steps: the same bytes."""
    if kernels.enabled():
        b0, b1, per_byte = lo // bs, _nblocks(hi, bs), 2 if scheme == "int4" else 1
        xs = x[lo:hi] if x.dtype == np.float32 else _f32(x[lo:hi])   # float64 beyond range: inf, refused
        return kernels.quantize(xs, _QMAX[scheme], bs, scales[b0:b1], codes[b0 * bs // per_byte:b1 * bs // per_byte])
    step = _whole_blocks(min(_STEP, hi - lo), bs)
    tmp, amax = np.empty(step, np.float32), np.empty(step // bs, np.float32)
    u8, u16 = np.empty(step, np.uint8), np.empty(step // 2, np.uint16)
    per_byte = 2 if scheme == "int4" else 1
    for s, e in _ranges(hi - lo, step):
        b0, b1 = (lo + s) // bs, _nblocks(lo + e, bs)
        c = codes[b0 * bs // per_byte:b1 * bs // per_byte]
        if not _quantize_step(x[lo + s:lo + e], scheme, bs, scales[b0:b1], c, tmp, amax, u8, u16):
            return False
    return True


def _dequantize_range(scales: np.ndarray, codes: np.ndarray, out: np.ndarray, lo: int, hi: int, scheme: str,
                      bs: int) -> str:
    """Values ``lo:hi`` into ``out[lo:hi]`` (scales checked before); an error for bad codes, or "".
    The C kernel when built (pipeline/kernels.py), else numpy steps: the same values."""
    per_byte = 2 if scheme == "int4" else 1
    if kernels.enabled():
        b0, b1 = lo // bs, _nblocks(hi, bs)
        if kernels.dequantize(scales[b0:b1], codes[b0 * bs // per_byte:b1 * bs // per_byte], out[lo:hi],
                              _QMAX[scheme], bs):
            return ""
        return _BAD_CODE[scheme]
    step = _whole_blocks(min(_STEP, hi - lo), bs)
    w, t = np.empty(step // 2, np.uint16), np.empty(step // 2, np.uint16)
    for s, e in _ranges(hi - lo, step):
        b0, b1 = (lo + s) // bs, _nblocks(lo + e, bs)
        k, n = b1 - b0, (b1 - b0) * bs
        c = codes[b0 * bs // per_byte:b1 * bs // per_byte]
        if scheme == "int8":
            if c.view(np.int8).min() < -_QMAX["int8"]:
                return _BAD_CODE["int8"]
            q = c.view(np.int8)
        else:   # byte c -> uint16 (c & 15) | (c >> 4) << 8: the two values' codes, low one first
            v = w[:n // 2]
            np.copyto(v, c)
            np.bitwise_and(np.bitwise_or(v, np.left_shift(v, 4, out=t[:n // 2]), out=v), 0x0F0F, out=v)
            q = v.view(np.uint8)
            if q.min() == 0:
                return _BAD_CODE["int4"]
            np.subtract(q, 8, out=q)                   # offset binary -> two's complement
            q = q.view(np.int8)
        dst = out[lo + s:lo + e]
        if dst.size == n:
            np.multiply(q.reshape(k, bs), scales[b0:b1, None], out=dst.reshape(k, bs), dtype=np.float32)
        else:   # the zero-padded last block
            dst[:] = np.multiply(q.reshape(k, bs), scales[b0:b1, None], dtype=np.float32).reshape(-1)[:dst.size]
    return ""


def _scale_error(scales: np.ndarray, scheme: str) -> str:
    """An error for scales encode never writes (non-finite, negative, qmax * scale overflows), or ""."""
    if scales.size and not (scales.min() >= 0 and scales.max() <= _F32_MAX / _QMAX[scheme]):
        return f"{scheme} data has a non-finite, negative or out-of-range block scale"
    return ""


def quantize(x: np.ndarray, scheme: str, block_size: int) -> bytes:
    """One flat float tensor as bytes of ``scheme`` (docs/formats.md "Tensor blobs"): int4/int8
    block scales then codes, bf16 bits, or float32 values. ValueError for non-finite input."""
    if scheme not in SCHEMES:
        raise ValueError(f"codec scheme {scheme!r} not one of {SCHEMES}")
    flat = np.ravel(np.asarray(x, dtype=np.float32 if scheme == "fp32" else None))
    slot = _Slot("", flat, 0, _encoded_len(scheme, flat.size, block_size, 4))
    buf = np.empty(slot.length, np.uint8)
    if not all([_encode_job(j, buf, [slot], scheme, block_size) for j in _jobs([slot], block_size)]):
        raise ValueError(f"quantize: {_NON_FINITE}")
    return buf.tobytes()


def dequantize(buf: bytes, scheme: str, block_size: int, numel: int) -> np.ndarray:
    """Inverse of ``quantize``: a flat float32 array of ``numel`` values. Raises FormatError on
    a wrong length, non-finite/negative/too large scales, or codes or values encode never writes."""
    expected = _encoded_len(scheme, numel, block_size, 4)
    if len(buf) != expected:
        raise FormatError(f"{scheme} data has {len(buf)} bytes, expected {expected} for {numel} values")
    if scheme not in SCHEMES:
        raise FormatError(f"unknown codec scheme {scheme!r}")
    slots, raw = [_Slot("", np.empty(numel, np.float32), 0, expected)], np.frombuffer(buf, np.uint8)
    err = next(filter(None, (_decode_job(j, raw, slots, scheme, block_size) for j in _jobs(slots, block_size))), "")
    if err:
        raise FormatError("non-finite values" if err == "non-finite" else err)
    return slots[0].flat


def _plan(tensors: Mapping[str, np.ndarray], scheme: str, block_size: int
          ) -> tuple[list[_Slot], list[dict], ValueError | None]:
    """Slots and specs up to the first tensor refused by name or dtype (returned, to be raised if no
    earlier tensor has non-finite values)."""
    slots: list[_Slot] = []
    specs: list[dict] = []
    for name, value in tensors.items():
        if not isinstance(name, str) or not name:
            return slots, specs, ValueError(f"tensor names must be non-empty strings, got {name!r}")
        a = np.asarray(value)
        if a.dtype.name not in _IN_DTYPES:
            return slots, specs, ValueError(f"tensor {name}: dtype {a.dtype.name} not one of {_IN_DTYPES}")
        length = _encoded_len(scheme, a.size, block_size, a.dtype.itemsize if scheme == "fp32" else 4)
        slots.append(_Slot(name, np.ravel(a), slots[-1].offset + slots[-1].length if slots else 0, length))
        specs.append({"name": name, "shape": list(a.shape), "dtype": a.dtype.name})
    return slots, specs, None


def _jobs(slots: list[_Slot], block_size: int) -> list[tuple[int, int, int]]:
    """(tensor index, lo, hi) of every job, in payload order; jobs start on block boundaries."""
    step = _whole_blocks(_JOB, block_size)
    return [(i, lo, hi) for i, s in enumerate(slots) for lo, hi in _ranges(s.flat.size, step)]


def _encode_job(job: tuple[int, int, int], raw: np.ndarray, slots: list[_Slot], scheme: str, bs: int) -> bool:
    """Values ``lo:hi`` of tensor ``i`` into its bytes of ``raw``; False if one is not finite."""
    i, lo, hi = job
    slot, x = slots[i], slots[i].flat
    if scheme == "fp32":   # passthrough in the original dtype, little-endian
        size = x.dtype.itemsize
        np.copyto(raw[slot.offset + lo * size:slot.offset + hi * size].view(x.dtype.newbyteorder("<")), x[lo:hi])
        return _finite(x[lo:hi])
    if scheme == "bf16":
        out = raw[slot.offset + 2 * lo:slot.offset + 2 * hi].view("<u2")
        t = np.empty(min(_STEP, hi - lo), np.uint32)
        for s, e in _ranges(hi - lo, _STEP):
            if not _finite(xs := _f32(x[lo + s:lo + e])):
                return False
            _bf16_step(xs.view(np.uint32), out[s:e], t[:e - s])
        return True
    return _quantize_range(x, lo, hi, scheme, bs, *_int_views(raw, slot, scheme, bs))


def _fill_raw(raw: np.ndarray, slots: list[_Slot], cfg: CodecConfig, map_fn: MapFn) -> int | None:
    """Fill ``raw`` by jobs run through ``map_fn``; the index of the first tensor with a non-finite
    value, or None."""
    work = partial(_encode_job, raw=raw, slots=slots, scheme=cfg.scheme, bs=cfg.block_size)
    jobs = _jobs(slots, cfg.block_size)
    return next((i for (i, _, _), ok in zip(jobs, list(map_fn(work, jobs))) if not ok), None)


def _payload_fields(raw: np.ndarray, version: int, level: int, framing: tuple[int, float], map_fn: MapFn,
                    zout: np.ndarray | None = None) -> dict:
    """Version 1: one zstd call on this thread (``level`` 0: none), the bytes written before issue 15.
    Versions 2 and 3: frames compressed on ``map_fn``, each kept only where zstd pays (codec_frames)."""
    if version == 1:
        if level:
            return {"zstd": True, "payload": zstandard.ZstdCompressor(level=level, write_content_size=True)
                    .compress(raw)}
        return {"zstd": False, "payload": memoryview(raw)}
    frame_bytes, min_saving = framing
    return {"frame_bytes": frame_bytes,
            "frames": frames.compress_frames(raw, frame_bytes, level, min_saving, map_fn, version, out=zout)}


def encode(kind: str, meta: dict, tensors: Mapping[str, np.ndarray], cfg: CodecConfig, *,
           map_fn: MapFn | None = None, version: int | None = None, min_saving: float = frames.MIN_SAVING,
           frame_bytes: int = frames.FRAME_BYTES) -> bytes:
    """One sealed blob of ``kind`` holding ``meta`` and ``tensors`` (in the given order), in format
    ``version`` (None: ``cfg.format``). ``map_fn`` runs the quantisation jobs and, for versions 2
    and 3, the frames' zstd (default ``map``: this thread) and never changes the bytes. Versions 2
    and 3 only: ``min_saving``, the share of a frame zstd must save to be kept; ``frame_bytes``, raw
    bytes per frame (runs write the defaults). ValueError naming the tensor for non-float dtypes or
    non-finite values (never quantised silently; float64 beyond float32's range, or an int4/int8
    block whose largest code would decode beyond it, counts as non-finite for lossy schemes)."""
    version = _check_args(cfg, meta, version, frame_bytes, min_saving)
    slots, specs, refused = _plan(tensors, cfg.scheme, cfg.block_size)
    raw_len = sum(s.length for s in slots)
    # the raw payload and the zstd'd frames are intermediates: pooled buffers (pipeline/scratch.py)
    with scratch.borrow(raw_len) as raw, \
            scratch.borrow(frames.out_bytes(raw_len, frame_bytes, cfg.zstd_level, version)) as zout:
        bad = _fill_raw(raw, slots, cfg, map_fn or map)
        if bad is not None:
            raise ValueError(f"tensor {slots[bad].name}: {_NON_FINITE}")
        if refused is not None:
            raise refused
        return _seal_payload(kind, meta, specs, raw, cfg, version, (frame_bytes, min_saving), map_fn or map, zout)


def _check_args(cfg: CodecConfig, meta: dict, version: int | None, frame_bytes: int, min_saving: float) -> int:
    """``encode``'s (and pipeline/codec_raw.py ``seal_raw``'s) arguments checked; the format to write."""
    if not isinstance(cfg, CodecConfig):
        raise ValueError(f"cfg must be a CodecConfig, got {type(cfg).__name__}")
    version = cfg.format if version is None else version
    if not isinstance(meta, dict):
        raise ValueError(f"meta must be a plain dict, got {type(meta).__name__}")
    if version not in VERSIONS or isinstance(version, bool):
        raise ValueError(f"codec format version must be one of {VERSIONS}, got {version!r}")
    frames.check_framing(frame_bytes, min_saving)
    return version


def _seal_payload(kind: str, meta: dict, specs: list, raw: np.ndarray, cfg: CodecConfig, version: int,
                  framing: tuple[int, float], map_fn: MapFn, zout: np.ndarray) -> bytes:
    """The blob of a filled raw payload: compressed (``zout``: the frames' scratch) and sealed."""
    try:
        msgpack.packb(meta, use_bin_type=True)   # before compressing: a bad meta fails fast
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"meta is not plain msgpack-able data: {exc}") from None
    fields = {"meta": meta, "scheme": cfg.scheme, "block_size": cfg.block_size, "tensors": specs, "raw_len": raw.size}
    fields.update(_payload_fields(raw, version, cfg.zstd_level, framing, map_fn, zout))
    if version == 1:   # the key order of the bytes written before issue 15
        fields = {k: fields[k] for k in ("meta", "scheme", "block_size", "zstd", "tensors", "raw_len", "payload")}
        return seal(kind, version, msgpack.packb(fields, use_bin_type=True))
    return seal_parts(kind, version, codec_body.pack(fields), checksum=CHECKSUMS.get(version, "sha256"))


# ------------------------------------------------------------------------------------- decode


def _open_body(blob: bytes, kind: str, max_bytes: int, what: str | None) -> tuple[int, dict]:
    """Check the envelope and the body's top-level fields' presence (not yet their values);
    ``(format version, body)``."""
    name = what or kind
    # The sealed blob is at most the decoded size plus scales and metadata; allow generous slack.
    version, body_bytes = unseal_view(blob, kind, VERSIONS, max_bytes=2 * max_bytes + (16 << 20), what=what,
                                      checksums=CHECKSUMS)   # views, not copies, of the body and its frames
    try:
        body = codec_body.unpack(body_bytes, raw=False, strict_map_key=False, max_bin_len=len(body_bytes),
                               max_str_len=1 << 20, max_array_len=_MAX_TENSORS, max_map_len=1 << 16,
                               max_ext_len=0)
    except Exception as exc:  # msgpack raises several types; never leak them
        raise FormatError(f"{name}: tensor blob body does not decode ({exc.__class__.__name__})") from None
    if not isinstance(body, dict):
        raise FormatError(f"{name}: tensor blob body is not a map")
    keys = _BODY_KEYS[version]
    if set(body) != keys:
        missing, extra = sorted(keys - set(body), key=str), sorted(set(body) - keys, key=str)
        raise FormatError(f"{name}: tensor blob fields wrong (missing {missing}, unknown {extra})")
    return version, body


def peek_meta(blob: bytes, kind: str, *, max_bytes: int = 1 << 30, what: str | None = None) -> dict:
    """The ``meta`` of a blob (e.g. a delta's header) after the envelope checks, without decompressing
    or dequantising its tensors. ``decode`` later checks the rest."""
    return field(_open_body(blob, kind, max_bytes, what)[1], "meta", dict, what or kind)


def _decode_job(job: tuple[int, int, int], buf: np.ndarray, slots: list[_Slot], scheme: str, bs: int) -> str:
    """Values ``lo:hi`` of tensor ``i`` into its output; an error for data encode never writes, or ""."""
    i, lo, hi = job
    slot, out = slots[i], slots[i].flat
    if scheme == "fp32":
        size = out.dtype.itemsize
        np.copyto(out[lo:hi], buf[slot.offset + lo * size:slot.offset + hi * size].view(out.dtype.newbyteorder("<")))
        return "" if _finite(out[lo:hi]) else "non-finite"
    if scheme == "bf16":
        bits = buf[slot.offset + 2 * lo:slot.offset + 2 * hi].view("<u2")
        t = np.empty(min(_STEP, hi - lo), np.uint16)
        for s, e in _ranges(hi - lo, _STEP):
            if np.bitwise_and(bits[s:e], 0x7F80, out=t[:e - s]).max() == 0x7F80:   # exponent all ones
                return "non-finite"
            np.left_shift(bits[s:e], 16, out=out[lo + s:lo + e].view(np.uint32), dtype=np.uint32)
        return ""
    scales, codes = _int_views(buf, slot, scheme, bs)   # a tensor's first job checks all its scales
    b0, b1 = (0, scales.size) if lo == 0 else (lo // bs, _nblocks(hi, bs))
    return _scale_error(scales[b0:b1], scheme) or _dequantize_range(scales, codes, out, lo, hi, scheme, bs)


def _when_ready(jobs: list[tuple[int, int, int]], slots: list[_Slot], ready: Iterator[int], scheme: str,
                bs: int) -> Iterator[tuple[int, int, int]]:
    """The jobs, each once the raw bytes it reads are decompressed (``ready``: how many are, growing)."""
    have = 0
    for i, lo, hi in jobs:
        slot = slots[i]
        end = slot.offset + hi * (slot.length // slot.flat.size)   # bf16, fp32: fixed bytes per value
        if scheme in _QMAX:   # the scales, then the codes of the job's blocks
            end = slot.offset + 4 * _nblocks(slot.flat.size, bs) + _nblocks(hi, bs) * bs // (1 + (scheme == "int4"))
        while have < end:
            have = next(ready)
        yield i, lo, hi


def _decode_tensors(buf: np.ndarray, ready: Iterator[int], entries: list[tuple[str, tuple[int, ...], str]],
                    lengths: list[int], scheme: str, bs: int, name: str, map_fn: MapFn,
                    dest: list[np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """The tensors of a checked payload, in ``dest`` (flat arrays, checked) or new arrays; FormatError
    for the first one with bad scales, codes or values."""
    slots: list[_Slot] = []
    errors: dict[int, str] = {}
    for k, ((tname, shape, dtype), length) in enumerate(zip(entries, lengths)):
        out = dest[k] if dest is not None else np.empty(math.prod(shape), dtype if scheme == "fp32" else np.float32)
        slots.append(_Slot(tname, out, slots[-1].offset + slots[-1].length if slots else 0, length))
    jobs = _jobs(slots, bs)
    work = partial(_decode_job, buf=buf, slots=slots, scheme=scheme, bs=bs)
    for (i, _, _), err in zip(jobs, map_fn(work, _when_ready(jobs, slots, ready, scheme, bs))):
        if err and i not in errors:   # jobs come in order: the first error of a tensor wins
            errors[i] = err
    if errors:
        i = min(errors)
        if errors[i] == "non-finite":
            raise FormatError(f"{name}: tensor {slots[i].name} decodes to non-finite values "
                              f"(the encoder refuses those)")
        raise FormatError(f"{name}: tensor {slots[i].name}: {errors[i]}")
    return {s.name: s.flat.reshape(shape) for s, (_, shape, _) in zip(slots, entries)}


def _payload_sizes(entries: list[tuple[str, tuple[int, ...], str]], scheme: str, block_size: int,
                   max_bytes: int, raw_len: int, name: str) -> list[int]:
    """Each tensor's bytes in the raw payload from the shapes alone, checked before allocating."""
    out_bytes, expected_raw, lengths = 0, 0, []
    for tname, shape, dtype in entries:
        numel = math.prod(shape)
        itemsize = np.dtype(dtype).itemsize if scheme == "fp32" else 4
        out_bytes += numel * itemsize
        if out_bytes > max_bytes:
            raise FormatError(f"{name}: decoded tensors exceed the limit of {max_bytes} bytes "
                              f"(at tensor {tname})")
        lengths.append(_encoded_len(scheme, numel, block_size, itemsize))
        expected_raw += lengths[-1]
        if expected_raw > 2 * max_bytes + (16 << 20):  # padding of huge blocks on tiny tensors
            raise FormatError(f"{name}: encoded size exceeds the limit (block_size {block_size} too large)")
    if raw_len != expected_raw:
        raise FormatError(f"{name}: payload length {raw_len} does not match the {expected_raw} bytes "
                          f"the shapes and scheme {scheme} imply")
    return lengths


def decode(blob: bytes, kind: str, *, max_bytes: int = 1 << 30, expect: Sequence[TensorSpec] | None = None,
           what: str | None = None, map_fn: MapFn | None = None,
           out: Mapping[str, np.ndarray] | None = None) -> Decoded:
    """Open a blob written by ``encode``; ``max_bytes`` bounds the decoded tensors' total size.
    ``expect`` (if given) must match the blob's tensor names and shapes exactly; ``what`` names the
    object (a key) in error messages; ``map_fn`` runs the decoding jobs (default ``map``: this
    thread) and never changes the result. ``out`` (name -> array) decodes into the caller's arrays
    (pipeline/codec_into.py: checked first; the result's tensors are views of them; after a
    FormatError raised while decoding their contents are unspecified). Raises FormatError on anything wrong."""
    name = what or kind
    version, body = _open_body(blob, kind, max_bytes, what)
    meta = field(body, "meta", dict, name)
    scheme = field(body, "scheme", str, name)
    if scheme not in SCHEMES:
        raise FormatError(f"{name}: unknown codec scheme {scheme!r}")
    block_size = field(body, "block_size", int, name)
    if block_size < 2 or block_size % 2 or block_size > (1 << 24):
        raise FormatError(f"{name}: bad block_size {block_size}")
    raw_len = field(body, "raw_len", int, name)
    entries = tensor_entries(field(body, "tensors", list, name), name)
    if expect is not None:
        check_expect(entries, expect, name)
    lengths = _payload_sizes(entries, scheme, block_size, max_bytes, raw_len, name)
    dest = None if out is None else codec_into.destinations(out, entries, scheme, name)
    with scratch.borrow(raw_len if version > 1 else 0) as raw:   # the frames' raw payload: an intermediate
        if version == 1:   # one zstd frame, streamed: the first jobs start while it decompresses
            buf, ready = v1_payload(field(body, "payload", bytes, name), field(body, "zstd", bool, name), raw_len,
                                    name)
        else:              # frames, decompressed on map_fn, then the jobs
            checked = frames.check_frames(body["frames"], raw_len, body["frame_bytes"], name)
            buf = frames.inflate_frames(checked, raw_len, body["frame_bytes"], name, map_fn or map, out=raw)
            ready = iter([raw_len])
        tensors = _decode_tensors(buf, ready, entries, lengths, scheme, block_size, name, map_fn or map, dest)
    return Decoded(meta=meta, tensors=tensors, scheme=scheme)
