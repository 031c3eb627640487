"""Tensor blobs: quantise, pack and compress a set of named tensors into one sealed, checked blob.

SPEC §6: outer deltas travel as int4 (symmetric, per-block absmax scale, round half to even, never
stochastic so replay is exact), int8, bf16 or fp32, then zstd; merged versions travel as fp32 or
bf16. The byte layout is in docs/formats.md ("Tensor blobs"); the blob is sealed with
``pipeline.envelope.seal(kind, 1, body)`` so it carries a version and a checksum.

Decoding trusts nothing in the body: it checks every field, bounds the decoded size before it
allocates, bounds zstd's output, checks the payload length against what the shapes imply, checks
scales and codes, and raises ``FormatError`` naming the problem — never a numpy/msgpack/zstd
traceback and never a silently wrong tensor.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import msgpack
import numpy as np
import zstandard

from .envelope import seal, unseal
from .errors import FormatError
from .types import TensorSpec

SCHEMES = ("int4", "int8", "bf16", "fp32")
VERSION = 1
_QMAX = {"int4": 7, "int8": 127}
_IN_DTYPES = ("float16", "float32", "float64")   # what encode accepts; fp32 passthrough keeps it
_BODY_KEYS = frozenset({"meta", "scheme", "block_size", "zstd", "tensors", "raw_len", "payload"})
_F32_MAX = float(np.finfo(np.float32).max)
_MAX_TENSORS = 1 << 20
_MAX_NDIM = 32
# byte -> its two int4 values (low nibble first), offset binary: code c means c - 8
_INT4_LUT = np.stack([np.arange(256) & 0x0F, np.arange(256) >> 4], axis=1).astype(np.float32) - 8


@dataclass(frozen=True)
class CodecConfig:
    """How to encode: ``scheme`` in SCHEMES, int4/int8 ``block_size`` (even), ``zstd_level`` (0 = off)."""

    scheme: str = "int4"
    block_size: int = 64
    zstd_level: int = 3

    def __post_init__(self) -> None:
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


# ----------------------------------------------------------------------------------------- bf16

def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), round to nearest even; NaN -> 0x7FC0/0xFFC0 (stays NaN)."""
    a = np.ascontiguousarray(x, dtype=np.float32)
    u = a.view(np.uint32)
    # Adding 0x7FFF plus the lowest kept bit rounds half to even; carries into the exponent are right
    # (they round up to the next binade or to inf). NaN would carry into garbage, so it is set apart.
    r = ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        r[nan] = ((u[nan] >> 16) & 0x8000 | 0x7FC0).astype(np.uint16)
    return r


def from_bf16_bits(b: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) -> float32 (exact)."""
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """What a bf16 round trip gives, as float32 (used for bf16-published versions)."""
    a = np.asarray(x, dtype=np.float32)
    return from_bf16_bits(bf16_bits(a)).reshape(a.shape)


# -------------------------------------------------------------------------------- int4 / int8

def _nblocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def _encoded_len(scheme: str, numel: int, block_size: int, itemsize: int) -> int:
    """Bytes one tensor takes in the payload; the decoder checks the payload against the sum."""
    if scheme == "fp32":
        return numel * itemsize
    if scheme == "bf16":
        return numel * 2
    nb = _nblocks(numel, block_size)
    codes = nb * block_size // 2 if scheme == "int4" else nb * block_size
    return nb * 4 + codes


def quantize(x: np.ndarray, scheme: str, block_size: int) -> bytes:
    """Encode one flat float tensor (finite values; not checked here) as bytes of ``scheme``.

    int4/int8: ``nblocks`` little-endian float32 scales (absmax/qmax, 0 for an all-zero block), then
    the codes q = clip(rint(x/scale), -qmax, qmax) of the zero-padded blocks. int8 stores q as int8;
    int4 stores q+8 (offset binary, 1..15; nibble 0 never occurs) two per byte, element 2i in the
    low nibble and 2i+1 in the high one. bf16: uint16 LE bits; fp32: the values as float32 LE.
    """
    if scheme == "fp32":
        return np.ascontiguousarray(x, dtype="<f4").tobytes()
    if scheme == "bf16":
        return bf16_bits(np.ravel(x)).astype("<u2", copy=False).tobytes()
    if scheme not in _QMAX:
        raise ValueError(f"codec scheme {scheme!r} not one of {SCHEMES}")
    flat = np.ravel(np.asarray(x, dtype=np.float32))
    n, nb = flat.size, _nblocks(flat.size, block_size)
    if n == nb * block_size:
        blocks = flat.reshape(nb, block_size)
    else:  # zero-pad the last block
        blocks = np.zeros((nb, block_size), dtype=np.float32)
        blocks.reshape(-1)[:n] = flat
    qmax = _QMAX[scheme]
    scale = (np.abs(blocks).max(axis=1) / np.float32(qmax)).astype(np.float32) if nb else \
        np.zeros(0, np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))  # an all-zero block keeps scale 0 and codes 0
    q = blocks / safe[:, None]
    np.rint(q, out=q)  # half to even: deterministic, never stochastic (SPEC §6)
    np.clip(q, -qmax, qmax, out=q)
    if scheme == "int8":
        codes = q.astype(np.int8).tobytes()
    else:
        q += 8
        u = q.astype(np.uint8).reshape(-1, 2)
        codes = (u[:, 0] | (u[:, 1] << 4)).tobytes()
    return scale.astype("<f4", copy=False).tobytes() + codes


def dequantize(buf: bytes, scheme: str, block_size: int, numel: int) -> np.ndarray:
    """Inverse of ``quantize``: a flat float32 array of ``numel`` values. Raises FormatError on
    a wrong length, non-finite/negative/too large scales, or codes that quantize never writes."""
    expected = _encoded_len(scheme, numel, block_size, 4)
    if len(buf) != expected:
        raise FormatError(f"{scheme} data has {len(buf)} bytes, expected {expected} for {numel} values")
    if scheme == "fp32":
        return np.frombuffer(buf, dtype="<f4").astype(np.float32)
    if scheme == "bf16":
        return from_bf16_bits(np.frombuffer(buf, dtype="<u2"))
    if scheme not in _QMAX:
        raise FormatError(f"unknown codec scheme {scheme!r}")
    qmax = _QMAX[scheme]
    nb = _nblocks(numel, block_size)
    scale = np.frombuffer(buf, dtype="<f4", count=nb).astype(np.float32)
    if not (np.isfinite(scale).all() and (scale >= 0).all() and (scale <= _F32_MAX / qmax).all()):
        raise FormatError(f"{scheme} data has a non-finite, negative or out-of-range block scale")
    raw = np.frombuffer(buf, dtype=np.uint8, offset=nb * 4)
    if scheme == "int8":
        q = raw.view(np.int8)
        if nb and q.min() < -qmax:
            raise FormatError("int8 data has code -128, which the encoder never writes")
        qf = q.astype(np.float32)
    else:
        # a low nibble of 0 means (raw & 15) == 0; a high one means raw < 16
        if nb and (raw.min() < 16 or np.bitwise_and(raw, 0x0F).min() == 0):
            raise FormatError("int4 data has nibble 0, which the encoder never writes")
        qf = np.take(_INT4_LUT, raw, axis=0)  # one gather: byte -> (low - 8, high - 8)
    qf = qf.reshape(nb, block_size)
    qf *= scale[:, None]
    return qf.reshape(-1)[:numel]


# ------------------------------------------------------------------------------------- encode

def encode(kind: str, meta: dict, tensors: Mapping[str, np.ndarray], cfg: CodecConfig) -> bytes:
    """One sealed blob of ``kind`` holding ``meta`` and ``tensors`` (in the given order).

    Raises ValueError naming the tensor for non-float dtypes or non-finite values (NaN/Inf must never
    be quantised silently; float64 beyond float32's range counts as non-finite for lossy schemes).
    """
    if not isinstance(cfg, CodecConfig):
        raise ValueError(f"cfg must be a CodecConfig, got {type(cfg).__name__}")
    if not isinstance(meta, dict):
        raise ValueError(f"meta must be a plain dict, got {type(meta).__name__}")
    specs, parts = [], []
    for name, value in tensors.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
        a = np.asarray(value)
        if a.dtype.name not in _IN_DTYPES:
            raise ValueError(f"tensor {name}: dtype {a.dtype.name} not one of {_IN_DTYPES}")
        with np.errstate(over="ignore"):  # float64 beyond float32's range becomes inf, caught below
            x = a if cfg.scheme == "fp32" else a.astype(np.float32, copy=False)
        if not np.isfinite(x).all():
            raise ValueError(f"tensor {name}: has non-finite values (NaN/Inf or beyond float32 range); "
                             f"refusing to encode it")
        specs.append({"name": name, "shape": list(a.shape), "dtype": a.dtype.name})
        if cfg.scheme == "fp32":
            parts.append(np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).tobytes())
        else:
            parts.append(quantize(x, cfg.scheme, cfg.block_size))
    raw = b"".join(parts)
    use_zstd = cfg.zstd_level > 0
    payload = zstandard.ZstdCompressor(level=cfg.zstd_level, write_content_size=True).compress(raw) \
        if use_zstd else raw
    try:
        body = msgpack.packb({"meta": meta, "scheme": cfg.scheme, "block_size": cfg.block_size,
                              "zstd": use_zstd, "tensors": specs, "raw_len": len(raw), "payload": payload},
                             use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"meta is not plain msgpack-able data: {exc}") from None
    return seal(kind, VERSION, body)


# ------------------------------------------------------------------------------------- decode

def _field(body: dict, key: str, typ: type, name: str) -> Any:
    v = body[key]
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise FormatError(f"{name}: field {key!r} has type {type(v).__name__}, expected {typ.__name__}")
    return v


def _tensor_entries(entries: list, name: str) -> list[tuple[str, tuple[int, ...], str]]:
    out, seen = [], set()
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or set(e) != {"name", "shape", "dtype"}:
            raise FormatError(f"{name}: tensor entry {i} is not a map of name, shape, dtype")
        tname, shape, dtype = e["name"], e["shape"], e["dtype"]
        if not isinstance(tname, str) or not tname:
            raise FormatError(f"{name}: tensor entry {i} has a bad name {tname!r}")
        if tname in seen:
            raise FormatError(f"{name}: tensor {tname} appears twice")
        seen.add(tname)
        if not isinstance(shape, list) or len(shape) > _MAX_NDIM or not all(
                isinstance(d, int) and not isinstance(d, bool) and 0 <= d < (1 << 40) for d in shape):
            raise FormatError(f"{name}: tensor {tname} has a bad shape {shape!r}")
        if dtype not in _IN_DTYPES:
            raise FormatError(f"{name}: tensor {tname} has unsupported dtype {dtype!r}")
        out.append((tname, tuple(shape), dtype))
    return out


def _check_expect(entries: list[tuple[str, tuple[int, ...], str]], expect: Sequence[TensorSpec],
                  name: str) -> None:
    got = {t: shape for t, shape, _ in entries}
    want = {s.name: tuple(s.shape) for s in expect}
    for t in want:
        if t not in got:
            raise FormatError(f"{name}: expected tensor {t} is missing")
    for t, shape in got.items():
        if t not in want:
            raise FormatError(f"{name}: unexpected tensor {t}")
        if shape != want[t]:
            raise FormatError(f"{name}: tensor {t} has shape {shape}, expected {want[t]}")


def _open_body(blob: bytes, kind: str, max_bytes: int, what: str | None) -> dict:
    """Check the envelope and the body's top-level fields' presence (not yet their values)."""
    name = what or kind
    # The sealed blob is at most the decoded size plus scales and metadata; allow generous slack.
    _, body_bytes = unseal(blob, kind, VERSION, max_bytes=2 * max_bytes + (16 << 20), what=what)
    try:
        body = msgpack.unpackb(body_bytes, raw=False, strict_map_key=False, max_bin_len=len(body_bytes),
                               max_str_len=1 << 20, max_array_len=_MAX_TENSORS, max_map_len=1 << 16,
                               max_ext_len=0)
    except Exception as exc:  # msgpack raises several types; never leak them
        raise FormatError(f"{name}: tensor blob body does not decode ({exc.__class__.__name__})") from None
    if not isinstance(body, dict):
        raise FormatError(f"{name}: tensor blob body is not a map")
    if set(body) != _BODY_KEYS:
        missing, extra = sorted(_BODY_KEYS - set(body), key=str), sorted(set(body) - _BODY_KEYS, key=str)
        raise FormatError(f"{name}: tensor blob fields wrong (missing {missing}, unknown {extra})")
    return body


def peek_meta(blob: bytes, kind: str, *, max_bytes: int = 1 << 30, what: str | None = None) -> dict:
    """The ``meta`` of a blob (e.g. a delta's header) after the envelope checks, without decompressing
    or dequantising its tensors. ``decode`` later checks the rest."""
    return _field(_open_body(blob, kind, max_bytes, what), "meta", dict, what or kind)


def decode(blob: bytes, kind: str, *, max_bytes: int = 1 << 30, expect: Sequence[TensorSpec] | None = None,
           what: str | None = None) -> Decoded:
    """Open a blob written by ``encode``; ``max_bytes`` bounds the decoded tensors' total size.

    ``expect`` (if given) must match the blob's tensor names and shapes exactly. ``what`` names the
    object (a key) in error messages. Raises FormatError on anything wrong.
    """
    name = what or kind
    body = _open_body(blob, kind, max_bytes, what)
    meta = _field(body, "meta", dict, name)
    scheme = _field(body, "scheme", str, name)
    if scheme not in SCHEMES:
        raise FormatError(f"{name}: unknown codec scheme {scheme!r}")
    block_size = _field(body, "block_size", int, name)
    if block_size < 2 or block_size % 2 or block_size > (1 << 24):
        raise FormatError(f"{name}: bad block_size {block_size}")
    use_zstd = _field(body, "zstd", bool, name)
    raw_len = _field(body, "raw_len", int, name)
    payload = _field(body, "payload", bytes, name)
    entries = _tensor_entries(_field(body, "tensors", list, name), name)
    if expect is not None:
        _check_expect(entries, expect, name)

    # Sizes from the shapes alone, checked before anything is allocated.
    out_bytes, expected_raw, lengths = 0, 0, []
    for tname, shape, dtype in entries:
        numel = math.prod(shape)
        itemsize = np.dtype(dtype).itemsize if scheme == "fp32" else 4
        out_bytes += numel * itemsize
        if out_bytes > max_bytes:
            raise FormatError(f"{name}: decoded tensors exceed the limit of {max_bytes} bytes "
                              f"(at tensor {tname})")
        lengths.append((numel, _encoded_len(scheme, numel, block_size, itemsize)))
        expected_raw += lengths[-1][1]
        if expected_raw > 2 * max_bytes + (16 << 20):  # padding of huge blocks on tiny tensors
            raise FormatError(f"{name}: encoded size exceeds the limit (block_size {block_size} too large)")
    if raw_len != expected_raw:
        raise FormatError(f"{name}: payload length {raw_len} does not match the {expected_raw} bytes "
                          f"the shapes and scheme {scheme} imply")
    if use_zstd:
        try:
            declared = zstandard.frame_content_size(payload)
        except zstandard.ZstdError:
            raise FormatError(f"{name}: payload is not a zstd frame") from None
        if declared != raw_len:  # zstd would allocate the declared size, so check it first
            raise FormatError(f"{name}: zstd frame declares {declared} bytes, expected {raw_len}")
        try:
            raw = zstandard.ZstdDecompressor().decompress(payload, max_output_size=raw_len)
        except zstandard.ZstdError as exc:
            raise FormatError(f"{name}: zstd payload does not decompress ({exc})") from None
    else:
        raw = payload
    if len(raw) != raw_len:
        raise FormatError(f"{name}: payload has {len(raw)} bytes, expected {raw_len}")

    tensors: dict[str, np.ndarray] = {}
    view, pos = memoryview(raw), 0
    for (tname, shape, dtype), (numel, length) in zip(entries, lengths):
        chunk = view[pos:pos + length]
        pos += length
        try:
            if scheme == "fp32":
                arr = np.frombuffer(chunk, dtype=np.dtype(dtype).newbyteorder("<")).astype(dtype)
            else:
                arr = dequantize(chunk, scheme, block_size, numel)
        except FormatError as exc:
            raise FormatError(f"{name}: tensor {tname}: {exc}") from None
        if scheme in ("fp32", "bf16") and not np.isfinite(arr).all():
            raise FormatError(f"{name}: tensor {tname} decodes to non-finite values (the encoder refuses those)")
        tensors[tname] = arr.reshape(shape)
    return Decoded(meta=meta, tensors=tensors, scheme=scheme)
