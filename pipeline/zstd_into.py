"""zstd straight into buffers the codec owns (docs/scale.md "The codec").

python-zstandard's C backend returns a new ``bytes`` per call: a tensor blob's frames cost a fresh
~1 MiB output each, and with glibc's default allocator those pages come back from the kernel
zeroed on many calls (``ddiloco benchmark codec`` without ``--keep-memory``: ~2,200 page faults and
~3 ms of a 16M-value int4 encode). The same package's cffi backend (``zstandard.backend_cffi``,
the same bundled libzstd) exposes ``ZSTD_compress2`` and ``ZSTD_decompressDCtx``, which write
into any buffer: the codec compresses frames into, and decompresses them from, buffers it reuses.
The bytes are zstd's one-shot output with the parameters the C backend's
``ZstdCompressor(level, write_content_size=True, write_checksum=False).compress`` sets, byte for
byte (tests/test_zstd_into.py checks it against that call; the format goldens pin it). cffi
releases the GIL while zstd runs; contexts are pooled (one per call in flight). Where the cffi backend does not load (no cffi, another zstd),
``AVAILABLE`` is False and the codec uses the C backend's calls: the same bytes, more allocations.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import zstandard

try:   # the cffi backend of the same package: same libzstd, calls that take an output buffer
    from zstandard import backend_cffi as _b
    _ffi, _lib = _b.ffi, _b.lib
    AVAILABLE = _lib.ZSTD_versionNumber() == int("".join(f"{v:02d}" for v in zstandard.ZSTD_VERSION)) \
        if hasattr(zstandard, "ZSTD_VERSION") else False
except Exception:   # ImportError, or cffi's own errors where the backend was not built
    _ffi = _lib = None
    AVAILABLE = False

_cctxs: dict[int, list] = {}   # free contexts per level: list.pop/append are atomic (no threading here)
_dctxs: list = []


def compress_bound(nbytes: int) -> int:
    """The most bytes zstd can write for ``nbytes`` of input."""
    return int(_lib.ZSTD_compressBound(nbytes))


def _new_cctx(level: int) -> Any:
    """A compression context at ``level``, with content size and without checksum."""
    c = _ffi.gc(_lib.ZSTD_createCCtx(), _lib.ZSTD_freeCCtx)
    for param, value in ((_lib.ZSTD_c_compressionLevel, level), (_lib.ZSTD_c_contentSizeFlag, 1),
                         (_lib.ZSTD_c_checksumFlag, 0)):
        if _lib.ZSTD_isError(_lib.ZSTD_CCtx_setParameter(c, param, value)):
            raise ValueError(f"zstd does not take level {level}")
    return c


def compress_into(data: np.ndarray, level: int, out: np.ndarray) -> int:
    """One zstd frame of ``data`` (contiguous uint8) at ``level`` into ``out`` (uint8, at least
    ``compress_bound(data.size)``); the bytes written."""
    free = _cctxs.setdefault(level, [])
    try:
        cctx = free.pop()
    except IndexError:
        cctx = _new_cctx(level)
    try:
        n = _lib.ZSTD_compress2(cctx, _ffi.from_buffer(out, require_writable=True), out.size,
                                _ffi.from_buffer(data), data.size)
    finally:
        free.append(cctx)
    if _lib.ZSTD_isError(n):
        raise RuntimeError(f"zstd: {_ffi.string(_lib.ZSTD_getErrorName(n)).decode()}")
    return int(n)


def decompress_into(frame: bytes, out: np.ndarray) -> str:
    """``frame`` (exactly one zstd frame, nothing after it) into all of ``out`` (uint8); an error, or ""."""
    src = _ffi.from_buffer(frame)
    size = _lib.ZSTD_findFrameCompressedSize(src, len(frame))
    if _lib.ZSTD_isError(size):
        return f"does not decompress ({_ffi.string(_lib.ZSTD_getErrorName(size)).decode()})"
    if size != len(frame):   # ZSTD_decompressDCtx would decode the bytes after it as further frames
        return "decompresses to the wrong size or has bytes after it"
    try:
        dctx = _dctxs.pop()
    except IndexError:
        dctx = _ffi.gc(_lib.ZSTD_createDCtx(), _lib.ZSTD_freeDCtx)
    try:
        n = _lib.ZSTD_decompressDCtx(dctx, _ffi.from_buffer(out, require_writable=True), out.size, src, len(frame))
    finally:
        _dctxs.append(dctx)
    if _lib.ZSTD_isError(n):
        return f"does not decompress ({_ffi.string(_lib.ZSTD_getErrorName(n)).decode()})"
    return "" if n == out.size else "decompresses to the wrong size or has bytes after it"
