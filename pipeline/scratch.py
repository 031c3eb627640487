"""Reusable scratch buffers for the codec's intermediates (docs/scale.md "The codec").

A tensor blob's raw payload and its compressed frames are only intermediates of an encode or a
decode. Allocated fresh per call, their pages come back from the kernel zeroed on many calls with
glibc's default allocator (``ddiloco benchmark codec`` without ``--keep-memory``: several thousand
page faults, ~1.9 us each, per 16M-value int4 encode). ``borrow`` lends a uint8 buffer from a
small pool and takes it back after, so later calls reuse pages already mapped.

No locks and no thread-locals (pipeline/ imports no threading: tests/test_layering.py): ``list.pop``
and ``list.append`` are atomic, so concurrent callers never get the same buffer. A buffer's
contents are whatever its last user left: callers write every byte they read.

What the pool keeps is bounded (the 100M-parameter load test): at most ``KEEP`` buffers,
none larger than ``MAX_KEPT`` bytes and ``KEEP_BYTES`` bytes in all (192 MiB of address space;
pages only where a caller wrote). A larger request (a syncer's fp32 version: 400 MB of raw payload
and as much zstd output per 100M values) gets a buffer of its own that is freed after the block:
kept, such buffers pinned ~0.9 GB for the process's life, and a learner whose deltas are tens of
MB never needs them. Per 16M int4 values a payload is 9.4 MB: a 50 MB delta's raw payload and
frames fit twice over.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np

KEEP = 8                  # buffers kept: a caller's raw payload and frames, for a few threads at once
MAX_KEPT = 64 << 20       # bytes: a larger buffer is freed after its block, never kept
KEEP_BYTES = 192 << 20    # bytes kept in all (the smallest go first past it)


class _Buf:
    """A pooled buffer (compared by identity: ``list.remove`` must not compare arrays)."""

    __slots__ = ("a",)

    def __init__(self, a: np.ndarray) -> None:
        self.a = a


_pool: list[_Buf] = []


def _take(nbytes: int) -> _Buf:
    """The smallest pooled buffer of at least ``nbytes``, or a new one."""
    for b in sorted(list(_pool), key=lambda b: b.a.size):
        if b.a.size >= nbytes:
            try:
                _pool.remove(b)   # atomic: another thread may have taken it since the copy
            except ValueError:
                continue
            return b
    return _Buf(np.empty(max(nbytes, 1), np.uint8))


def kept_bytes() -> int:
    """Bytes of the buffers the pool keeps now."""
    return sum(b.a.size for b in list(_pool))


def _give(b: _Buf) -> None:
    if b.a.size > MAX_KEPT:   # freed here: its pages go back to the kernel
        return
    _pool.append(b)
    while len(_pool) > KEEP or kept_bytes() > KEEP_BYTES:   # keep the largest: they serve every smaller request too
        try:
            _pool.remove(min(list(_pool), key=lambda b: b.a.size))
        except ValueError:
            pass


@contextlib.contextmanager
def borrow(nbytes: int) -> Iterator[np.ndarray]:
    """A uint8 buffer of exactly ``nbytes`` (a view of a pooled one) for the block's duration; it
    must not be used after the block."""
    b = _take(nbytes)
    try:
        yield b.a[:nbytes]
    finally:
        _give(b)
