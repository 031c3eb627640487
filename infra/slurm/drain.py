"""``ddiloco slurm drain OUT``: wait until the syncer has committed everything the learners made durable.

The stop job runs it before it SIGTERMs the syncer, as ``ddiloco launch`` waits for
``LocalCluster.drain_status`` (workers/cluster.py): a learner's last deltas are often spilled to
storage in its final steps, and a syncer stopped before its next inbox listing would leave them
durable but neither merged nor dropped (seen on the first SLURM test runs: the token ledger did not
balance). Drained means: no learner's delta left in the inbox, the last durable delta (acked or
spilled, from its event log) of every learner named by a commit, and the syncer's event log
reporting the log's tail. A polled condition; it gives up after ``timeout_s`` and says why.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Sequence

from storage.layout import SPILL_PREFIX, parse_spill_key
from storage.log import CommitLog
from storage.store import ObjectStore
from workers.cluster import DURABLE_EVENTS
from workers.common.events import read_events

RECENT = 1000


def _events(logs: Path, name: str) -> list[dict]:
    path = logs / f"{name}.jsonl"
    return read_events(path) if path.exists() else []


def not_drained(store: ObjectStore, logs: Path, learners: Sequence[str]) -> str:
    """Why the run is not drained yet; '' once it is."""
    ids = set(learners)
    inbox = []
    for key in store.list(SPILL_PREFIX):
        try:
            if parse_spill_key(key)[0] in ids:
                inbox.append(key)
        except ValueError:
            continue
    if inbox:
        return f"the inbox holds {len(inbox)} learner deltas (e.g. {inbox[0]})"
    log = CommitLog(store)
    tail = log.tail()
    start = max(0, tail - RECENT + 1)     # the newest commits: retention keeps at least 1000 (--keep-commits)
    named = {d for r in log.read_range(start, tail + 1) for d in [*(i.delta_id for i in r.inputs),
                                                                   *(x.delta_id for x in r.dropped)]}
    for lid in learners:
        last = next((e["delta"] for e in reversed(_events(logs, lid))
                     if e.get("event") in DURABLE_EVENTS and "delta" in e), None)
        if last is not None and last not in named:
            return f"{lid}'s last durable delta {last} is in no commit yet"
    reported = max((int(e.get("seq", -1)) for e in _events(logs, "syncer") if e.get("event") == "commit"), default=-1)
    if tail >= 0 and reported < tail and log.read(tail).kind != "init":
        return f"the syncer has not logged commit {tail} yet"
    return ""


def wait_drained(store: ObjectStore, logs: Path, learners: Sequence[str], timeout_s: float,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 poll_s: float = 1.0) -> str:
    """Poll ``not_drained`` until it is '' (returned) or ``timeout_s`` passes (the last reason)."""
    deadline = clock() + timeout_s
    while True:
        why = not_drained(store, logs, learners)
        if not why or clock() >= deadline:
            return why
        sleep(poll_s)
