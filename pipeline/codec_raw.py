"""Seal an already-quantised raw payload into a tensor blob: the bytes ``codec.encode`` writes.

Issue 15 ("device-agnostic" codec): a learner whose model lives on an accelerator quantises there
(workers/learner/device_quant.py) and copies only the packed bytes to the host. Those bytes are
the raw payload of docs/formats.md "Tensor blobs" (per tensor: int4/int8 block scales, float32
little-endian, then codes); this module does the rest of ``encode``: checks the payload against
the shapes, refuses non-finite input the way ``encode`` does, compresses (version 1: one zstd call;
versions 2 and 3: frames on ``map_fn``) and seals. For the same tensors and ``CodecConfig`` the blob
is byte-identical to ``codec.encode``'s (tests/test_device_quant.py).

Non-finite input needs no extra pass: a block's scale is ``absmax / qmax`` and ``absmax``
propagates NaN and Inf, so a tensor ``encode`` refuses (a NaN/Inf value, or an int8 block whose
``qmax * scale`` overflows float32) is exactly one with a scale that is not finite or too large;
those are read from the payload here, on the host, after the copy.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from . import codec, scratch
from . import codec_frames as frames
from .codec_checks import IN_DTYPES

RAW_SCHEMES = ("int4", "int8")   # the schemes a device quantises (bf16/fp32 stay on the codec's own path)


def payload_layout(shapes: Sequence[Sequence[int]], scheme: str, block_size: int) -> list[tuple[int, int, int]]:
    """``(offset, scale bytes, total bytes)`` of each tensor in the raw payload, in order."""
    out, off = [], 0
    for shape in shapes:
        numel = math.prod(shape)
        length = codec._encoded_len(scheme, numel, block_size, 4)
        out.append((off, 4 * codec._nblocks(numel, block_size), length))
        off += length
    return out


def _check_specs(specs: Sequence[tuple[str, Sequence[int], str]]) -> list[dict]:
    out = []
    for spec in specs:
        if not (isinstance(spec, tuple) and len(spec) == 3):
            raise ValueError(f"tensor specs must be (name, shape, dtype) tuples, got {spec!r}")
        name, shape, dtype = spec
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
        if dtype not in IN_DTYPES:
            raise ValueError(f"tensor {name}: dtype {dtype!r} not one of {IN_DTYPES}")
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ValueError(f"tensor {name}: shape {shape!r} is not a tuple of ints >= 0")
        out.append({"name": name, "shape": list(shape), "dtype": dtype})
    return out


def refused_tensor(raw: np.ndarray, names: Sequence[str], layout: Sequence[tuple[int, int, int]],
                   scheme: str) -> str | None:
    """The first tensor whose scales ``encode`` would never write (NaN/Inf input, or ``qmax * scale``
    beyond float32: the same test as the codec's ``_quantize_step``), or None."""
    qmax = codec._QMAX[scheme]
    for name, (off, nscale, _) in zip(names, layout):
        sc = raw[off:off + nscale].view("<f4")
        if sc.size and not (sc.min() >= 0 and float(sc.max()) * qmax < codec._F32_INF_FROM):
            return name
    return None


def seal_raw(kind: str, meta: dict, specs: Sequence[tuple[str, Sequence[int], str]], raw: np.ndarray,
             cfg: codec.CodecConfig, *, map_fn: codec.MapFn | None = None, version: int | None = None,
             min_saving: float = frames.MIN_SAVING, frame_bytes: int = frames.FRAME_BYTES) -> bytes:
    """The blob ``codec.encode(kind, meta, tensors, cfg, ...)`` writes, from ``raw``: the raw payload
    of the tensors named by ``specs`` ((name, shape, dtype) in order; the dtype the tensors had).
    ``cfg.scheme`` must be int4 or int8. ValueError for a payload of the wrong size, bad specs or
    meta, and, with ``encode``'s message, for a tensor with non-finite values."""
    version = codec._check_args(cfg, meta, version, frame_bytes, min_saving)
    if cfg.scheme not in RAW_SCHEMES:
        raise ValueError(f"seal_raw seals {RAW_SCHEMES} payloads, not {cfg.scheme!r}")
    tensor_specs = _check_specs(specs)
    layout = payload_layout([s["shape"] for s in tensor_specs], cfg.scheme, cfg.block_size)
    raw_len = sum(length for _, _, length in layout)
    if not (isinstance(raw, np.ndarray) and raw.dtype == np.uint8 and raw.ndim == 1 and raw.flags.c_contiguous):
        raise ValueError("raw must be a contiguous 1-d uint8 array")
    if raw.size != raw_len:
        raise ValueError(f"raw payload has {raw.size} bytes, the shapes and scheme {cfg.scheme} "
                         f"(block {cfg.block_size}) imply {raw_len}")
    bad = refused_tensor(raw, [s["name"] for s in tensor_specs], layout, cfg.scheme)
    if bad is not None:
        raise ValueError(f"tensor {bad}: {codec._NON_FINITE}")
    # codec.encode's own tail: the same helper, so the same bytes.
    with scratch.borrow(frames.out_bytes(raw_len, frame_bytes, cfg.zstd_level, version)) as zout:
        return codec._seal_payload(kind, meta, tensor_specs, raw, cfg, version, (frame_bytes, min_saving),
                                   map_fn or map, zout)
