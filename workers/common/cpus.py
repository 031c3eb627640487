"""CPU sets as users write them (``0``, ``0,2``, ``1-3``), and pinning a process's threads to one.

Used by ``ddiloco learner --agent-cpus`` (the sync agent's cores, workers/learner/agent_main.py)
and by the overhead benchmark (infra/lab/overhead_roles.py); ``process_cpu`` by the benchmarks. Linux only where it pins
(``os.sched_setaffinity``); parsing works everywhere.
"""
from __future__ import annotations

import os
from pathlib import Path


def parse_cpus(text: str | None) -> tuple[int, ...] | None:
    """``"0"``, ``"0,1"``, ``"0-3"`` -> sorted core numbers; None or "" -> None (no pinning)."""
    if not text:
        return None
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            first, last = int(lo), int(hi or lo)
            if last < first:
                raise ValueError
            cpus.update(range(first, last + 1))
    except ValueError:
        raise ValueError(f"cpus must look like 0 or 0,1 or 0-3, got {text!r}") from None
    if not cpus or min(cpus) < 0:
        raise ValueError(f"cpus must name cores >= 0, got {text!r}")
    return tuple(sorted(cpus))


def pin(cpus, pid: int = 0) -> None:
    """Every thread of process ``pid`` (0: this one) to the cores ``cpus`` (None: leave it); threads
    started later inherit it, and those some library started at import (a BLAS pool) are moved too.
    OSError when the cores cannot be used (e.g. one the machine lacks)."""
    if cpus is None:
        return
    base = Path(f"/proc/{pid or os.getpid()}/task")
    for tid in ([int(t) for t in os.listdir(base)] if base.exists() else [pid]):
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:
            pass   # a thread that just ended


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` so far (Linux /proc), 0.0 if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
