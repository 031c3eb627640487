"""The codec's fused C kernels (pipeline/_ckernels.c), or None of them where they were not built.

Issue 15 ("codec at line rate"): int4/int8 quantise+pack and unpack+dequantise in one pass over
the values, bit for bit what pipeline/codec.py's numpy kernels compute (docs/formats.md "Tensor
blobs"; SPEC §6: round half to even, never stochastic, so replay is exact). The extension is built
by ``pip install`` (setup.py, an optional Extension); where it was not built (no compiler) the codec
uses its numpy path, which writes the same bytes. Both kernels release the GIL while they run.

``enabled()`` says which path the codec takes now; ``use(False)`` (a context manager) or
``set_enabled(False)`` switches to the numpy path, e.g. for tests that compare the two. This
module reads no environment (pipeline/ is pure: tests/test_layering.py).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np

try:
    from . import _ckernels as _c
except ImportError:   # not built: the numpy path (same bytes, slower)
    _c = None

AVAILABLE = _c is not None
_state = {"enabled": AVAILABLE}


def enabled() -> bool:
    """Whether the codec uses the C kernels now."""
    return _state["enabled"]


def set_enabled(flag: bool) -> bool:
    """Use the C kernels (True) or the numpy path (False); the previous setting. ValueError when
    asked for kernels that were not built."""
    if flag and not AVAILABLE:
        raise ValueError("the C codec kernels were not built (pipeline/_ckernels.c; reinstall with a compiler)")
    before, _state["enabled"] = _state["enabled"], bool(flag)
    return before


@contextlib.contextmanager
def use(flag: bool) -> Iterator[None]:
    """Within the block, the C kernels (True) or the numpy path (False); restored after."""
    before = set_enabled(flag)
    try:
        yield
    finally:
        set_enabled(before)


def quantize(x: np.ndarray, qmax: int, block_size: int, scales: np.ndarray, codes: np.ndarray) -> bool:
    """Contiguous float32 ``x`` (the last block zero-padded) into ``scales`` (float32, one per
    block) and ``codes`` (uint8: int4 pairs, or int8) in place; False for a NaN/Inf value or a block
    whose ``qmax * scale`` would overflow float32 (int8 absmax 3.4028235e38: its blob would decode
    to inf)."""
    return _c.quantize(x, scales, codes, qmax, block_size)


def dequantize(scales: np.ndarray, codes: np.ndarray, out: np.ndarray, qmax: int, block_size: int) -> bool:
    """``scales`` and ``codes`` into contiguous float32 ``out`` in place; False for a code encode
    never writes (int4 nibble 0, int8 -128; padding included). Scales are the caller's to check."""
    return _c.dequantize(scales, codes, out, qmax, block_size)
