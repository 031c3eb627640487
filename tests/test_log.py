"""The run layout, the commit log and syncer fencing, on the local directory and real S3.

Timelines: an older epoch is fenced; a stale syncer's commit that lands before the new fence
stays history; two or three syncers started at once under many seeded interleavings leave
exactly one committing; ambiguous (timed-out) writes resolve by reading back.
"""
from __future__ import annotations

import random
import threading

import pytest

from conftest import FlakyStore, make_commit
from pipeline.errors import FormatError
from pipeline.fragment import FragmentLayout
from pipeline.schedule import ScheduleConfig
from pipeline.descriptor import RunDescriptor
from pipeline.types import TensorSpec
from storage import layout
from storage.errors import AlreadyExists, Conflict, Fenced, NotFound, Unavailable
from storage.layout import commit_key, epoch_key, read_descriptor, write_descriptor
from storage.log import CommitLog, RetryPolicy, claim_epoch, current_epoch
from storage.store import open_store

NO_WAIT = {"sleep": lambda s: None}


# -- layout --------------------------------------------------------------------------------------

def test_keys_are_zero_padded_and_sort_numerically():
    seqs = [0, 1, 9, 10, 99, 100, 12345, 10 ** 19]
    assert sorted(commit_key(s) for s in reversed(seqs)) == [commit_key(s) for s in seqs]
    assert sorted(layout.version_key(3, v) for v in (10, 2, 100)) == [layout.version_key(3, v) for v in (2, 10, 100)]
    assert commit_key(7) == "log/00000000000000000007"
    assert layout.delta_key("alice", 3, 17) == "deltas/alice/i0000000003/s000000000017"
    assert layout.spill_key("bob.1", 0, 5).startswith(layout.SPILL_PREFIX)
    assert layout.version_key(2, 9) == "versions/f00002/v000000000009"
    assert layout.version_key(2, 9, 3) == "versions/f00002/v000000000009-e0000000003"
    assert layout.version_key(3, 2, 9) < layout.version_key(3, 2, 10) < layout.version_key(3, 3, 1)


def test_key_parsers_round_trip_and_reject_foreign_keys():
    assert layout.parse_commit_key(commit_key(42)) == 42
    assert layout.parse_epoch_key(epoch_key(3)) == 3
    assert layout.parse_checkpoint_key(layout.checkpoint_key(8)) == 8
    assert layout.parse_version_key(layout.version_key(4, 11)) == (4, 11)
    assert layout.parse_version_key(layout.version_key(4, 11, 2)) == (4, 11)
    assert layout.parse_delta_key(layout.delta_key("a-b.c", 2, 9)) == ("a-b.c", 2, 9)
    assert layout.parse_spill_key(layout.spill_key("x", 1, 0)) == ("x", 1, 0)
    for parse, key in [(layout.parse_commit_key, "log/42"), (layout.parse_commit_key, "log/0000000000000000000x"),
                       (layout.parse_spill_key, layout.delta_key("x", 1, 0)), (layout.parse_version_key, "versions/f1/v1")]:
        with pytest.raises(FormatError, match="not a"):
            parse(key)


@pytest.mark.parametrize("call", [lambda: commit_key(-1), lambda: commit_key(10 ** 20), lambda: commit_key(True),
                                  lambda: layout.version_key(100000, 0), lambda: layout.delta_key("../x", 0, 0),
                                  lambda: layout.delta_key("a", -1, 0), lambda: layout.probe_key("a/b")])
def test_key_builders_reject_bad_values(call):
    with pytest.raises(ValueError):
        call()


def _descriptor(run_id: str = "run-a") -> RunDescriptor:
    return RunDescriptor(run_id=run_id, layout=FragmentLayout((TensorSpec("w", (2, 2)),), (("w",),)),
                         schedule=ScheduleConfig(1, (0,)))


def test_descriptor_create_once(store):
    with pytest.raises(NotFound, match="no run at"):
        read_descriptor(store)
    write_descriptor(store, _descriptor())
    write_descriptor(store, _descriptor())  # identical: a no-op (relaunch, or our own timed-out write)
    assert read_descriptor(store) == _descriptor()
    with pytest.raises(AlreadyExists, match="'run-a'.*'run-b'"):
        write_descriptor(store, _descriptor("run-b"))
    store.put(layout.DESCRIPTOR_KEY, b"garbage")
    with pytest.raises(FormatError, match=layout.DESCRIPTOR_KEY):
        read_descriptor(store)


# -- the log -------------------------------------------------------------------------------------

def test_empty_log(store):
    log = CommitLog(store)
    assert log.tail() == -1
    assert list(log.read_range(0)) == []
    with pytest.raises(NotFound, match=commit_key(0)):
        log.read(0)


def test_append_read_and_ranges(store):
    log = CommitLog(store)
    records = [make_commit(i, kind="init" if i == 0 else "merge") for i in range(6)]
    for r in records:
        log.append(r)
    assert log.tail() == 5 and CommitLog(store).tail() == 5
    assert log.read(3) == records[3]
    assert list(log.read_range(0)) == records
    assert list(log.read_range(2, 4)) == records[2:4]
    assert list(log.read_range(6)) == []
    with pytest.raises(NotFound, match="commit 6 does not exist"):
        list(log.read_range(4, 8))
    with pytest.raises(ValueError, match="gap"):
        log.append(make_commit(8))
    with pytest.raises(ValueError):
        list(log.read_range(3, 2))


def test_gap_and_damaged_commits_are_named(store):
    log = CommitLog(store)
    for i in range(3):
        log.append(make_commit(i))
    store.put_if_absent(commit_key(5), make_commit(5).to_bytes())  # a hole at 3 and 4
    with pytest.raises(FormatError, match=f"{commit_key(3)} is missing"):
        list(log.read_range(0))
    store.put_if_absent(commit_key(3), b"not a commit")
    with pytest.raises(FormatError, match=commit_key(3)):
        log.read(3)
    store.put_if_absent(commit_key(4), make_commit(9).to_bytes())  # a record at the wrong key
    with pytest.raises(FormatError, match="seq 9"):
        log.read(4)


def test_tail_is_cheap_with_a_fresh_hint(store):
    writer = CommitLog(store)
    for i in range(12):
        writer.append(make_commit(i))
    counted = FlakyStore(store)
    assert CommitLog(counted).tail() == 11
    assert counted.calls["list"] == 0 and sum(counted.calls.values()) <= 3  # hint, head(hint), head(next)


@pytest.mark.parametrize("hint", ["missing", "stale", "garbage", "ahead"])
def test_tail_survives_a_bad_hint(store, hint):
    writer = CommitLog(store)
    for i in range(12):
        writer.append(make_commit(i))
    if hint == "missing":
        store.delete(layout.HEAD_HINT_KEY)
    elif hint == "stale":
        store.put(layout.HEAD_HINT_KEY, layout.pack_head_hint(2, 1))
    elif hint == "garbage":
        store.put(layout.HEAD_HINT_KEY, b"\x00garbage")
    else:
        store.put(layout.HEAD_HINT_KEY, layout.pack_head_hint(40, 1))
    for probe_limit in (0, 3, 20):  # 0 and 3 force the LIST fallback
        assert CommitLog(store, probe_limit=probe_limit).tail() == 11


def test_ambiguous_timed_out_append_is_resolved_by_reading_back(store):
    flaky = FlakyStore(store)
    log = CommitLog(flaky, **NO_WAIT)
    log.append(make_commit(0))
    flaky.fail("put_if_absent", prefix="log/", after=True)  # lands, then "times out"
    log.append(make_commit(1))  # the retry is refused, reads back its own bytes: success
    assert CommitLog(store).read(1) == make_commit(1)
    # Every attempt "times out" after landing: Unavailable, yet the commit exists; appending
    # the same record again settles the outcome.
    flaky.fail("put_if_absent", prefix="log/", after=True, times=4)
    with pytest.raises(Unavailable):
        log.append(make_commit(2))
    log.append(make_commit(2))
    assert CommitLog(store).tail() == 2
    # A different record at a seq that our timed-out write took is not ours: fenced.
    with pytest.raises(Fenced, match="commit 2 already holds"):
        CommitLog(store).append(make_commit(2, note="other"))


def test_retryable_errors_are_retried_then_surface(store):
    flaky = FlakyStore(store)
    waits = []
    log = CommitLog(flaky, retry=RetryPolicy(attempts=3, backoff_s=0.1, max_backoff_s=0.15), sleep=waits.append)
    flaky.fail("put_if_absent", times=1, error=Conflict)
    flaky.fail("put_if_absent", times=1)
    log.append(make_commit(0))
    assert waits == [0.1, 0.15] and CommitLog(store).tail() == 0
    flaky.fail("put_if_absent", times=3)
    with pytest.raises(Unavailable):
        log.append(make_commit(1))
    assert not store.exists(commit_key(1))
    with pytest.raises(ValueError, match="attempts"):
        RetryPolicy(attempts=0)


# -- fencing -------------------------------------------------------------------------------------

def test_older_epoch_is_fenced(store):
    a = claim_epoch(store, "syncer-a", **NO_WAIT)
    assert (a.epoch, a.fence_seq) == (1, 0)
    a.log.append(make_commit(1, epoch=1))
    a.log.append(make_commit(2, epoch=1))
    b = claim_epoch(store, "syncer-b", **NO_WAIT)
    assert (b.epoch, b.fence_seq) == (2, 3) and current_epoch(store) == 2
    with pytest.raises(Fenced, match="epoch 2"):
        a.log.append(make_commit(3, epoch=1))
    with pytest.raises(Fenced):  # it stays fenced: no more writes at any seq
        a.log.append(make_commit(4, epoch=1))
    b.log.append(make_commit(4, epoch=2))
    with pytest.raises(ValueError, match="epoch 2"):
        b.log.append(make_commit(5, epoch=1))
    b.log.check_fenced()
    a2 = CommitLog(store, epoch=1)
    with pytest.raises(Fenced):
        a2.check_fenced()
    fence = CommitLog(store).read(3)
    assert fence.kind == "fence" and fence.info["syncer"] == "syncer-b"
    assert [r.epoch for r in CommitLog(store).read_range(0)] == [1, 1, 1, 2, 2]


def test_stale_commit_before_the_fence_stays_history(store):
    a = claim_epoch(store, "a", **NO_WAIT)
    a.log.append(make_commit(1, epoch=1))
    flaky = FlakyStore(store)
    # Just before b places its fence at seq 2, a commits seq 2 itself.
    flaky.before("put_if_absent", "log/", lambda key: a.log.append(make_commit(2, epoch=1)))
    b = claim_epoch(flaky, "b", **NO_WAIT)
    assert (b.epoch, b.fence_seq) == (2, 3)  # fenced after a's commit, which is history
    with pytest.raises(Fenced):
        a.log.append(make_commit(3, epoch=1))
    assert [r.kind for r in CommitLog(store).read_range(0)] == ["fence", "merge", "merge", "fence"]


def test_a_newer_fence_wins_over_an_older_claim(store):
    a_store = FlakyStore(store)
    # a claims epoch 1, but before it places its fence, b claims epoch 2 and fences.
    holder = {}
    a_store.before("put_if_absent", "log/", lambda key: holder.setdefault("b", claim_epoch(store, "b", **NO_WAIT)))
    with pytest.raises(Fenced, match="lost the start race|superseded"):
        claim_epoch(a_store, "a", **NO_WAIT)
    assert holder["b"].epoch == 2
    holder["b"].log.append(make_commit(holder["b"].fence_seq + 1, epoch=2))


def test_ambiguous_epoch_claim_is_recognised(store):
    flaky = FlakyStore(store)
    flaky.fail("put_if_absent", prefix="epochs/", after=True)
    claim = claim_epoch(flaky, "a", **NO_WAIT)
    assert claim.epoch == 1 and store.list("epochs/") == [epoch_key(1)]


def _run_syncer(store, name: str, commits: int, outcome: dict) -> None:
    try:
        claim = claim_epoch(store, name, **NO_WAIT)
        outcome[name] = ("claimed", claim)
        seq = claim.fence_seq
        for _ in range(commits):
            seq += 1
            claim.log.append(make_commit(seq, epoch=claim.epoch, syncer=name))
    except Fenced:
        outcome[name] = ("fenced", outcome.get(name, (None, None))[1])


def _check_one_survivor(store, outcome: dict) -> None:
    survivors = []
    for name, (state, claim) in outcome.items():
        if state == "claimed":
            try:
                CommitLog(store, epoch=claim.epoch).check_fenced()  # one that finished early learns it now
                survivors.append(claim)
            except Fenced:
                pass
    assert len(survivors) == 1, outcome
    winner = survivors[0]
    assert winner.epoch == current_epoch(store)
    records = list(CommitLog(store).read_range(0))  # contiguous, no gaps
    epochs = [r.epoch for r in records]
    assert epochs == sorted(epochs), epochs
    assert all(r.epoch == winner.epoch for r in records[winner.fence_seq:])
    assert records[winner.fence_seq].kind == "fence"


@pytest.mark.parametrize("n", [2, 3])
def test_simultaneous_start_threads(store, n):
    for round_ in range(2):
        run = open_store(store.uri.rstrip("/") + f"/sim{n}-{round_}")
        outcome: dict = {}
        barrier = threading.Barrier(n)

        def go(i: int) -> None:
            barrier.wait()
            _run_syncer(run, f"s{i}", 4, outcome)

        threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        _check_one_survivor(run, outcome)


class _Scheduler:
    """Lets exactly one thread's store call run at a time, the order drawn from a seeded RNG
    once every live thread waits at a call: one deterministic interleaving per seed."""

    def __init__(self, seed: int, threads: int) -> None:
        self.rng = random.Random(seed)
        self.cv = threading.Condition()
        self.live, self.waiting, self.turn = threads, set(), None

    def enter(self, name: str) -> None:
        with self.cv:
            self.waiting.add(name)
            self.cv.notify_all()
            while self.turn != name:
                if self.turn is None and len(self.waiting) == self.live:
                    self.turn = self.rng.choice(sorted(self.waiting))
                    self.cv.notify_all()
                    continue
                if not self.cv.wait(timeout=10):
                    raise RuntimeError("scheduler stalled")
            self.waiting.discard(name)

    def leave(self) -> None:
        with self.cv:
            self.turn = None
            self.cv.notify_all()

    def exit(self) -> None:
        with self.cv:
            self.live -= 1
            self.cv.notify_all()


class _ScheduledStore(FlakyStore):
    def __init__(self, inner, scheduler: _Scheduler, name: str) -> None:
        super().__init__(inner)
        self.scheduler, self.name = scheduler, name

    def _call(self, op, key, *args):
        self.scheduler.enter(self.name)
        try:
            return super()._call(op, key, *args)
        finally:
            self.scheduler.leave()


@pytest.mark.parametrize("n", [2, 3])
def test_simultaneous_start_every_interleaving_keeps_one_syncer(tmp_path, n):
    """Many seeded interleavings of n syncers starting at once on one run (local store)."""
    for seed in range(25):
        store = open_store(str(tmp_path / f"run-{n}-{seed}"))
        scheduler = _Scheduler(seed, n)
        outcome: dict = {}

        def go(i: int) -> None:
            try:
                _run_syncer(_ScheduledStore(store, scheduler, f"s{i}"), f"s{i}", 3, outcome)
            finally:
                scheduler.exit()

        threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        _check_one_survivor(store, outcome)
