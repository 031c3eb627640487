"""Keep freed memory in the process, for the syncer's large per-round arrays (docs/scale.md).

A syncer round at real sizes allocates hundreds of MB of fresh arrays (decoded deltas, outer
gradients, the merge's float64 direction, the new parameters and momentum) and frees them at the
end of the round. glibc serves every block above its mmap threshold (at most 32 MiB) with its own
``mmap`` and returns it to the kernel on ``free``, so each round the kernel zeroes and maps those
pages again: measured with ``python -m infra.lab.bench_cli load`` at 100M parameters, more kernel CPU time than
the round's own arithmetic. ``keep_freed_memory`` tells glibc (``mallopt``) to serve large blocks
from its heap (``M_MMAP_MAX = 0``), never to give the heap's free top back (``M_TRIM_THRESHOLD
= -1``) and to use that one heap from every thread (``M_ARENA_MAX = 1``: a pool thread's large
block would otherwise go to a per-thread arena of at most 64 MiB, which cannot hold it): the next
round reuses the same, already mapped pages. The cost: the process keeps its
peak memory (its resident size does not shrink after a round), which is what a dedicated syncer
process wants. Elsewhere than glibc it does nothing and says so. Nothing about results changes:
it only decides where the bytes live.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD = -1   # glibc malloc.h
M_MMAP_MAX = -4
M_ARENA_MAX = -8


def keep_freed_memory() -> bool:
    """Apply the policy above to this process; True if glibc took both settings."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(param, value) for param, value in ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1)))
