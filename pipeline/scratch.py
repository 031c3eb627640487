"""Reusable scratch buffers for the codec's intermediates (issue 15, docs/scale.md "The codec").

A tensor blob's raw payload and its compressed frames are only intermediates of an encode or a
decode. Allocated fresh per call, their pages come back from the kernel zeroed on many calls with
glibc's default allocator (``ddiloco bench codec`` without ``--keep-memory``: several thousand
page faults, ~1.9 us each, per 16M-value int4 encode). ``borrow`` lends a uint8 buffer from a
small pool and takes it back after, so later calls reuse pages already mapped.

No locks and no thread-locals (pipeline/ imports no threading: tests/test_layering.py): ``list.pop``
and ``list.append`` are atomic, so concurrent callers never get the same buffer. The cost: the
process keeps up to ``KEEP`` buffers, each as large as the largest payload it held (9.4 MB per
16M int4 values). A buffer's contents are whatever its last user left: callers write every byte
they read.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np

KEEP = 8           # buffers kept: a caller's raw payload and frames, for a few threads at once


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


def _give(b: _Buf) -> None:
    _pool.append(b)
    while len(_pool) > KEEP:   # keep the largest: they serve every smaller request too
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
