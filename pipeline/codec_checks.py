"""Checks of a tensor blob's body fields (pipeline/codec.py decodes; docs/formats.md "Tensor blobs").

Split from pipeline/codec.py (files < 600 lines): every field of a body is checked before
it is used, and a problem raises ``FormatError`` naming it. ``v1_payload`` reads version 1's one
zstd frame piece by piece so decoding jobs start while it decompresses.
"""
from __future__ import annotations

from typing import Any, Iterator, Sequence

import numpy as np
import zstandard

from .errors import FormatError
from .types import TensorSpec

IN_DTYPES = ("float16", "float32", "float64")   # what encode accepts; fp32 passthrough keeps it
_MAX_NDIM = 32
_PIECE = 1 << 20          # bytes zstd decompresses at a time while decoding jobs start

def field(body: dict, key: str, typ: type, name: str) -> Any:
    v = body[key]
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise FormatError(f"{name}: field {key!r} has type {type(v).__name__}, expected {typ.__name__}")
    return v


def tensor_entries(entries: list, name: str) -> list[tuple[str, tuple[int, ...], str]]:
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
        if dtype not in IN_DTYPES:
            raise FormatError(f"{name}: tensor {tname} has unsupported dtype {dtype!r}")
        out.append((tname, tuple(shape), dtype))
    return out


def check_expect(entries: list[tuple[str, tuple[int, ...], str]], expect: Sequence[TensorSpec],
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


def v1_payload(payload: bytes, use_zstd: bool, raw_len: int, name: str) -> tuple[np.ndarray, Iterator[int]]:
    """The raw payload's buffer, and how many of its bytes are ready: zstd fills it piece by piece
    while the first decoding jobs run."""
    if not use_zstd:
        if len(payload) != raw_len:
            raise FormatError(f"{name}: payload has {len(payload)} bytes, expected {raw_len}")
        return np.frombuffer(payload, np.uint8), iter([raw_len])
    try:
        declared = zstandard.frame_content_size(payload)
    except zstandard.ZstdError:
        raise FormatError(f"{name}: payload is not a zstd frame") from None
    if declared != raw_len:  # zstd would allocate the declared size, so check it first
        raise FormatError(f"{name}: zstd frame declares {declared} bytes, expected {raw_len}")
    buf = np.empty(raw_len, np.uint8)

    def inflate(reader: Any, view: memoryview, pos: int = 0) -> Iterator[int]:
        while pos < raw_len:
            try:
                n = reader.readinto(view[pos:pos + _PIECE])
            except zstandard.ZstdError as exc:
                raise FormatError(f"{name}: zstd payload does not decompress ({exc})") from None
            if not n:
                raise FormatError(f"{name}: zstd payload does not decompress (it ends after {pos} bytes)")
            pos += n
            yield pos
    return buf, inflate(zstandard.ZstdDecompressor().stream_reader(payload), memoryview(buf))

