"""workers/common/heap.py: freed heap pages go back to the OS (issue 31, the syncer's memory)."""
from __future__ import annotations

import platform

import numpy as np
import pytest

from workers.common.heap import HeapTrimmer, trim_heap


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                    reason="malloc_trim is glibc's (elsewhere trim_heap is a no-op, tested below)")
def test_freed_heap_below_a_live_block_is_returned():
    # Blocks under glibc's mmap threshold live in the heap; one live block at its top keeps
    # free() from shrinking it (what a fold's transients did to the syncer).
    blocks = [np.ones(100_000 // 8) for _ in range(2000)]    # ~200 MB of 100 kB blocks, touched
    top = np.ones(100_000 // 8)
    del blocks
    before = _rss()
    assert trim_heap()
    after = _rss()
    assert before - after > 100e6, (before, after)
    assert top.sum() == top.size


def test_trimmer_rate_limits_and_validates():
    now = [0.0]
    t = HeapTrimmer(1.0, clock=lambda: now[0])
    first = t()
    assert t() is False                      # within the interval: nothing
    now[0] = 1.5
    assert t() == first                      # due again (True where the C library can trim)
    assert t.trims == (2 if first else 0)
    with pytest.raises(ValueError, match="min_interval_s"):
        HeapTrimmer(-1)
