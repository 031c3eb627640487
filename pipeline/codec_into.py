"""Decoding into arrays the caller owns: ``codec.decode(..., out=...)`` (docs/scale.md "The codec").

A learner applying a version already owns its parameters' buffers, and a syncer folding deltas can
keep its per-delta arrays between rounds; decoding into them spares a fresh float32 output, whose
pages the kernel zeroes on first touch (64 MB per 16M values: ~3 ms of a ~10 ms decode without
``keep_freed_memory``). ``destinations`` checks such arrays against a blob's tensors before a byte
is written: the names must be the blob's, in any order; each array C-contiguous, writable, of the
blob tensor's shape and of the dtype decode would return (float32; fp32 passthrough: the stored
dtype). The values written are exactly those a plain decode returns.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from .errors import FormatError


def destinations(out: Mapping[str, Any], entries: list[tuple[str, tuple[int, ...], str]], scheme: str,
                 name: str) -> list[np.ndarray]:
    """The flat (1-d view) destination of each of ``entries`` (name, shape, stored dtype), in order.
    ValueError for an array decode cannot write into; FormatError for a blob whose tensors are not
    the names and shapes of ``out`` (the blob is not what the caller expects)."""
    if not isinstance(out, Mapping):
        raise ValueError(f"out must map tensor names to arrays, got {type(out).__name__}")
    names = [e[0] for e in entries]
    if sorted(out) != sorted(names):
        raise FormatError(f"{name}: tensors {sorted(names)} do not match out's {sorted(out)}")
    flats = []
    for tname, shape, dtype in entries:
        a = out[tname]
        want = np.dtype(dtype if scheme == "fp32" else np.float32)
        if not isinstance(a, np.ndarray) or a.dtype != want or not a.flags.c_contiguous or not a.flags.writeable:
            raise ValueError(f"out[{tname!r}] must be a writable C-contiguous {want} numpy array")
        if tuple(a.shape) != tuple(shape):
            raise FormatError(f"{name}: tensor {tname} has shape {list(shape)}, out's array {list(a.shape)}")
        flats.append(a.reshape(math.prod(shape)))
    return flats
