"""workers/common/memory.py (issue 15): with ``keep_freed_memory`` a large array freed and allocated
again reuses pages that are already mapped (no page faults the second time); without it glibc
hands the block back to the kernel and every new array faults its pages in again. Each case runs
in its own process: the setting is process wide."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = r"""
import json, resource, sys
import numpy as np
from workers.common.memory import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
for k in range(2):
    a = np.empty(64 << 20, np.float32)        # 256 MiB, far above glibc's mmap threshold
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a.fill(1.0)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    del a
print(json.dumps({"applied": applied, "faults_second_time": faults}))
"""


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_freed_memory_is_reused_without_faults_only_when_kept():
    kept, default = _probe("keep"), _probe("default")
    assert kept["applied"] is True
    assert kept["faults_second_time"] < 16
    assert default["faults_second_time"] >= 64     # 256 MiB: 65,536 pages of 4 KiB, or 128 huge ones


def test_the_syncer_keeps_freed_memory_unless_told_not_to():
    """A dedicated syncer keeps its freed memory by default (docs/scale.md: at the demo's size its
    rounds otherwise faulted ~7,600 pages a second, work the kernel did beside a learner's core)."""
    import argparse
    from workers.commands import configure_syncer
    parser = argparse.ArgumentParser()
    configure_syncer(parser)
    assert parser.parse_args(["--store", "runs/x"]).keep_freed_memory is True
    assert parser.parse_args(["--store", "runs/x", "--keep-freed-memory"]).keep_freed_memory is True
    assert parser.parse_args(["--store", "runs/x", "--no-keep-freed-memory"]).keep_freed_memory is False
