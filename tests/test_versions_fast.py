"""Issue 15: a learner finds new versions with one GET per poll when nothing is new (the next
commit's key: NotFound), reads what is new in parallel with the log's head hint saying how far to
read, and never misses or delays a commit when the advisory hint lags, is lost, is missing or is
wrong (``VersionTracker.poll_fast``, workers/learner/receiver.py)."""
from __future__ import annotations

import itertools
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from pipeline.errors import FormatError
from pipeline.types import CommitRecord
from storage.layout import HEAD_HINT_KEY, LOG_PREFIX, commit_key, pack_head_hint
from storage.log import CommitLog
from storage.store import open_store
from storage.wrapper import StoreWrapper
from workers.common.versions import FETCH_WINDOW, VersionTracker
from workers.launch import RunSettings, Schedule, create_run


class Counting(StoreWrapper):
    """A store that counts reads by method (and GETs of the hint apart)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.calls: Counter = Counter()
        self.lock = threading.Lock()

    def _call(self, op, key, fn, *args):
        if op == "get":
            op = "get hint" if key == HEAD_HINT_KEY else "get log" if key.startswith(LOG_PREFIX) else "get"
        if op in ("get", "get hint", "get log", "head", "exists", "list"):
            with self.lock:
                self.calls[op] += 1
        return fn(*args)

    def take(self) -> Counter:
        with self.lock:
            out, self.calls = self.calls, Counter()
        return out


@pytest.fixture
def run(tmp_path):
    store = open_store(str(tmp_path / "run"))
    rng = np.random.default_rng(0)
    desc = create_run(store, {"a": rng.standard_normal(8).astype(np.float32),
                              "b": rng.standard_normal(4).astype(np.float32)},
                      RunSettings(schedule=Schedule(fragments=2, sync_every=4)))
    counting = Counting(store)
    tracker = VersionTracker(counting, desc)
    tracker.latest()
    counting.take()
    return store, counting, tracker


def append(store, n: int, hint: bool = True) -> list[int]:
    """``n`` drop commits (what a syncer appends for a round it merged nothing from); the head hint
    rewritten after each unless ``hint`` is False."""
    log = CommitLog(store)
    seqs = []
    for _ in range(n):
        seq = log.tail() + 1
        log.append(CommitRecord(seq=seq, epoch=0, kind="drop", fragment=seq % 2, version=0), hint=hint)
        seqs.append(seq)
    return seqs


def test_an_idle_poll_is_one_get(run):
    store, counting, tracker = run
    append(store, 1)
    tracker.poll_fast()
    counting.take()
    for _ in range(10):
        assert tracker.poll_fast() == []
    assert counting.take() == Counter({"get log": 10}), "one GET (NotFound) per poll: no LIST, HEAD or hint"


def test_new_commits_are_read_in_parallel_in_order(run):
    store, counting, tracker = run
    start = tracker.cursor
    seqs = append(store, 5)
    threads = set()
    # The first two reads wait for each other: they can only both pass if they are in flight at once
    # (a serial reader breaks the barrier), however fast the store is.
    together = threading.Barrier(2, timeout=10)
    started = itertools.count()

    def job(fn, j):
        threads.add(threading.current_thread().name)
        if next(started) < 2:
            together.wait()
        return fn(j)

    with ThreadPoolExecutor(4) as pool:
        def spy(fn, jobs):
            return pool.map(lambda j: job(fn, j), jobs)
        got = tracker.poll_fast(map_fn=spy)
    assert [r.seq for r in got] == seqs == list(range(start + 1, start + 6))
    assert tracker.cursor == seqs[-1]
    calls = counting.take()
    assert calls == Counter({"get hint": 1, "get log": 6}), "five commits, one past them and the hint, nothing else"
    assert len(threads) > 1


def test_one_new_commit_costs_one_get_more_than_an_idle_poll_plus_the_hint(run):
    store, counting, tracker = run
    seqs = append(store, 1)
    assert [r.seq for r in tracker.poll_fast()] == seqs
    assert counting.take() == Counter({"get log": 2, "get hint": 1})


def test_a_lagging_or_lost_hint_never_delays_a_commit(run):
    store, _, tracker = run
    seqs = append(store, 2)
    seqs += append(store, 3, hint=False)              # the hint says seqs[1]: three commits later
    assert [r.seq for r in tracker.poll_fast()] == seqs
    more = append(store, 1, hint=False)                # its hint write was lost
    assert [r.seq for r in tracker.poll_fast()] == more


def test_an_announced_seq_is_read_at_once(run):
    store, counting, tracker = run
    seqs = append(store, 3, hint=False)                # announced on the bus before the hint write
    assert [r.seq for r in tracker.poll_fast(at_least=seqs[-1])] == seqs
    assert counting.take() == Counter({"get log": 4}), "one parallel batch: the three and one past"


def test_a_hint_past_the_log_is_not_followed_twice(run):
    store, counting, tracker = run
    seqs = append(store, 2)
    store.put(HEAD_HINT_KEY, pack_head_hint(tracker.cursor + 10_000, 0))   # wrong (damaged, or a liar)
    assert [r.seq for r in tracker.poll_fast()] == seqs
    assert counting.take()["get log"] <= FETCH_WINDOW + 2, "one window, not 10,000 reads"
    more = append(store, 2, hint=False)
    assert [r.seq for r in tracker.poll_fast()] == more
    assert counting.take()["get log"] == 3, "the same wrong hint is not followed again"


def test_a_long_backlog_is_read_in_windows(run):
    store, counting, tracker = run
    seqs = append(store, FETCH_WINDOW + 7)
    assert [r.seq for r in tracker.poll_fast()] == seqs
    assert [r.seq for r in tracker.poll_fast()] == []


def test_without_a_hint_it_walks_the_log(run):
    store, counting, tracker = run
    store.delete(HEAD_HINT_KEY)
    seqs = append(store, 3, hint=False)
    assert [r.seq for r in tracker.poll_fast()] == seqs
    assert counting.take()["get log"] == 4


def test_a_damaged_commit_stops_the_poll_there(run):
    store, _, tracker = run
    first = append(store, 1)
    (bad,) = append(store, 1)
    after = append(store, 1)
    data = store.get(commit_key(bad))
    store.delete(commit_key(bad))
    store.put(commit_key(bad), data[:-3] + b"xyz")
    assert [r.seq for r in tracker.poll_fast()] == first
    with pytest.raises(FormatError):
        tracker.poll_fast()
    assert tracker.cursor == first[0] and after
