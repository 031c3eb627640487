"""`python -m infra.lab.bench_cli versions`: how long a bucket-only learner takes to find and fetch new versions once
a poll sees them, the serial way (``VersionTracker.poll`` then one ``load`` after the other, as
before issue 15) and the fast way (``poll_fast`` and the loads on a pool, workers/learner/receiver.py),
side by side over one store whose every request waits ``--rtt-ms`` (an object store's round trip:
a local SeaweedFS answers in about 1 ms, S3 from another region in 20-100 ms).

Per case, k commits of k distinct fragments land after the learner's cursor (each with its version
object, as a syncer writes them), then each way polls once and loads every new version; the
figure is the median wall time over ``--repeat`` repetitions and the requests each way made. An
idle poll (nothing new) is measured the same way. What the poll interval adds (on average half
of it) is the same for both and not included.
"""
from __future__ import annotations

import statistics
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from pipeline.checksum import tensor_digest
from pipeline.fold import published
from pipeline.types import CommitRecord
from storage.layout import version_key
from storage.log import CommitLog
from storage.store import ObjectStore, open_store
from storage.wrapper import READS, StoreWrapper
from workers.common.versions import VersionTracker, encode_version
from workers.launch import Schedule


class SlowStore(StoreWrapper):
    """A store whose every read first waits ``rtt_s`` (``sleep`` injected) and is counted (``exists``
    as the HEAD it is); writes pass straight through (the benchmark times a learner's reads)."""

    def __init__(self, inner: ObjectStore, rtt_s: float, sleep: Callable[[float], None] = time.sleep):
        super().__init__(inner)
        self.rtt_s, self.sleep = rtt_s, sleep
        self.requests: Counter = Counter()
        self._lock = threading.Lock()

    def _call(self, op, key, fn, *args):
        if op in READS:
            with self._lock:
                self.requests["head" if op == "exists" else op] += 1
            self.sleep(self.rtt_s)
        return fn(*args)


def _commit_versions(store: ObjectStore, desc, fragments: list[int], rng: np.random.Generator) -> None:
    """What a syncer writes for one merge per fragment: the version object, the commit, the hint."""
    log = CommitLog(store)
    for p in fragments:
        seq = log.tail() + 1
        values = published({n: rng.standard_normal(desc.spec(n).shape).astype(np.float32)
                            for n in desc.layout.fragments[p]}, desc.versions.dtype)
        version = seq + 1
        key = version_key(p, version, 0)
        digest = tensor_digest(values)
        store.put_if_absent(key, encode_version(desc, p, version, seq, 0, values, None, digest))
        log.append(CommitRecord(seq=seq, epoch=0, kind="merge", fragment=p, version=version, output_key=key,
                                output_checksum=digest))


def _serial(tracker: VersionTracker) -> int:
    newest = {r.fragment: r for r in tracker.poll() if r.kind == "merge"}
    return len([tracker.load(r) for r in newest.values()])


def _fast(tracker: VersionTracker, pool: ThreadPoolExecutor) -> int:
    newest = {r.fragment: r for r in tracker.poll_fast(map_fn=pool.map) if r.kind == "merge"}
    return len(list(pool.map(tracker.load, newest.values())))


def bench_versions(directory: str, rtt_ms: float = 20.0, commits: tuple[int, ...] = (0, 1, 4, 8),
                   repeat: int = 5, values_per_fragment: int = 250_000, threads: int = 8) -> dict:
    """Median seconds and requests per poll, each way, for each number of new commits."""
    from pipeline.descriptor import VersionsConfig
    from workers.launch import RunSettings, create_run

    fragments = max(max(commits), 1)
    rng = np.random.default_rng(0)
    base = open_store(directory)
    init = {f"t{p}": rng.standard_normal(values_per_fragment).astype(np.float32) for p in range(fragments)}
    # full (bf16) versions: the figures are the requests a poll costs, each version one object
    desc = create_run(base, init, RunSettings(schedule=Schedule(fragments=fragments, sync_every=fragments),
                                              versions=VersionsConfig("bf16")))
    slow = SlowStore(base, rtt_ms / 1000)
    rows = []
    with ThreadPoolExecutor(threads, thread_name_prefix="bench-fetch") as pool:
        ways: dict[str, Callable[[VersionTracker], int]] = {"serial": _serial, "fast": lambda t: _fast(t, pool)}
        trackers = {name: VersionTracker(slow, desc) for name in ways}
        for t in trackers.values():
            t.cursor = CommitLog(base).tail()
        for k in commits:
            secs: dict[str, list[float]] = {name: [] for name in ways}
            reqs: dict[str, Counter] = {name: Counter() for name in ways}
            for _ in range(repeat):
                _commit_versions(base, desc, list(range(k)), rng)
                for name, way in ways.items():
                    slow.requests.clear()
                    t0 = time.perf_counter()
                    loaded = way(trackers[name])
                    secs[name].append(time.perf_counter() - t0)
                    reqs[name] += slow.requests
                    if loaded != k:
                        raise RuntimeError(f"bench versions: the {name} way loaded {loaded} versions, not {k}")
            serial_s, fast_s = (statistics.median(secs[n]) for n in ways)
            rows.append({"new_commits": k, "serial_s": serial_s, "fast_s": fast_s,
                         "speedup": statistics.median(a / b for a, b in zip(secs["serial"], secs["fast"])),
                         **{f"{n}_requests": {op: c / repeat for op, c in sorted(reqs[n].items())} for n in ways}})
    return {"rtt_ms": rtt_ms, "repeat": repeat, "values_per_fragment": values_per_fragment, "threads": threads,
            "rows": rows}


def print_versions(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"finding and fetching new versions, {res['rtt_ms']:g} ms per request, "
                    f"{res['values_per_fragment']:,} values per fragment, medians of {res['repeat']}")
    for col in ("new commits", "serial s", "fast s", "speed-up", "serial requests", "fast requests"):
        t.add_column(col, justify="right")
    for r in res["rows"]:
        t.add_row(str(r["new_commits"]), f"{r['serial_s']:.3f}", f"{r['fast_s']:.3f}", f"{r['speedup']:.2f}×",
                  " ".join(f"{op} {n:g}" for op, n in r["serial_requests"].items()),
                  " ".join(f"{op} {n:g}" for op, n in r["fast_requests"].items()))
    Console().print(t)
