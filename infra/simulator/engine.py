"""The discrete-event engine: jobs over one failure trace, sharing a finite spare pool (SPEC §9).

A *job* owns a block of slices (``slots``): the whole cluster for data parallel, N/M of it for a
Decoupled DiLoCo learner. It consumes the trace's potential interruptions of its own slices, and
only while it computes on them (``events.py``). Two kinds (docs/simulator.md, "State machines"):

- ``RestartJob`` (non-elastic data parallel). An interruption at t stops the whole job and loses
  the progress since its last checkpoint (one every ``checkpoint_s`` seconds of progress). The
  broken slice goes to repair; a spare from the pool takes its place, and the job trains again
  at max(t + detection, spare at hand) + restart. Chips of a stopped job are not interrupted, so
  failures during the outage cost nothing extra.
- ``ElasticJob`` (elastic data parallel, and each Decoupled DiLoCo learner). An interruption stalls
  the job for detection + one reconfiguration (the shrink), after which it trains without the
  slice. A spare is taken from the pool at once; ``recovery`` after it is at hand it is ready, and
  joining costs another reconfiguration (the grow) during which the job stalls. Replacements that
  become ready while the job is stalled join in one grow right after that stall. A job with no
  slice left waits for its first replacement; its grow is then a restart.

The spare pool: every interruption takes a spare for its slot and sends the broken slice to repair;
it is back in the pool detection + repair after the interruption. When the pool is empty a request
waits (first come, first served) for the next repaired slice: only then does repair time matter.

Two drivers with one set of state machines: ``ample`` runs each job on its own, serving every
request at once, then checks that the pool never ran dry (an exact check, ``pool_ran_dry``); only if
it did, ``shared`` replays every job in one global event loop with the finite pool.
"""
from __future__ import annotations

import heapq
import itertools
import math
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .events import FailureTrace

INF = math.inf


class Stream:
    """A job's share of a trace as Python lists (scalar indexing in the loop is ~10x numpy's)."""

    __slots__ = ("t", "slot", "detect", "restart", "reconf_down", "reconf_up", "recovery", "repair", "n")

    def __init__(self, trace: FailureTrace):
        for name, arr in trace.arrays().items():
            setattr(self, name, arr.tolist())
        self.n = len(self.t)

    def back_at(self, k: int) -> float:
        """When event ``k``'s broken slice is healthy again (back in the pool)."""
        return self.t[k] + self.detect[k] + self.repair[k]


@dataclass
class JobRecord:
    """What a job did: its running segments and stalls (for the outcome and the event log)."""

    slots: int
    segments: list[tuple[float, float, int]] = field(default_factory=list)  # (start, end, slices in service)
    stalls: list[tuple[float, float, float]] = field(default_factory=list)  # (stop, recovery begins, trains)
    failures: int = 0
    progress_s: float = 0.0   # RestartJob: progress kept at the horizon (seconds at full size)
    lost_s: float = 0.0       # RestartJob: progress lost to restarts from checkpoints


class Job:
    """Shared bookkeeping. ``next_time`` is the job's next event, ``advance`` processes it."""

    def __init__(self, stream: Stream, slots: int, pool: "AmplePool | SharedPool"):
        self.s = stream
        self.pool = pool
        self.rec = JobRecord(slots)
        self.running = True
        self.seg_start = 0.0
        self.stall_start = 0.0
        self.recover_begin = INF
        self.stall_end = INF
        self.i = 0           # index of the next potential interruption
        self.nf = INF        # time of the next interruption while running
        self.index = 0       # position in the shared driver

    def _resume(self, t: float) -> None:
        self.rec.stalls.append((self.stall_start, self.recover_begin, t))
        self.running = True
        self.seg_start = t
        self.i = bisect_left(self.s.t, t, self.i)   # interruptions while stopped never happened
        self._next_fail()

    def _next_fail(self) -> None:
        self.nf = self.s.t[self.i] if self.i < self.s.n else INF

    def close(self, horizon: float) -> JobRecord:
        if self.running:
            self.rec.segments.append((self.seg_start, horizon, self.in_service()))
        else:
            rb = self.recover_begin if self.recover_begin < horizon else INF
            self.rec.stalls.append((self.stall_start, rb, INF))
        return self.rec

    def in_service(self) -> int:
        return self.rec.slots


class RestartJob(Job):
    """Non-elastic data parallel: any interruption stops everything until a restart."""

    def __init__(self, stream: Stream, slots: int, pool, checkpoint_s: float):
        super().__init__(stream, slots, pool)
        self.checkpoint_s = checkpoint_s
        self._next_fail()

    def next_time(self) -> float:
        return self.nf if self.running else self.stall_end

    def advance(self) -> None:
        if self.running:
            self._fail(self.nf)
        else:
            self._resume(self.stall_end)

    def _fail(self, t: float) -> None:
        k, rec = self.i, self.rec
        self.i += 1
        rec.segments.append((self.seg_start, t, rec.slots))
        progress = rec.progress_s + (t - self.seg_start)
        if self.checkpoint_s > 0:   # back to the last checkpoint
            kept = math.floor(progress / self.checkpoint_s) * self.checkpoint_s
            rec.lost_s += progress - kept
            progress = kept
        rec.progress_s = progress
        rec.failures += 1
        self.running, self.stall_start = False, t
        self.recover_begin = self.stall_end = INF
        self.pool.take(self, k, t)

    def grant(self, k: int, t: float) -> None:
        """A spare is at hand at ``t`` for interruption ``k``: the restart begins."""
        s = self.s
        self.recover_begin = max(s.t[k] + s.detect[k], t)
        self.stall_end = self.recover_begin + s.restart[k]

    def close(self, horizon: float) -> JobRecord:
        if self.running:
            self.rec.progress_s += horizon - self.seg_start
        return super().close(horizon)


class ElasticJob(Job):
    """Elastic data parallel / one Decoupled DiLoCo learner: shrink, train smaller, grow back."""

    def __init__(self, stream: Stream, slots: int, pool):
        super().__init__(stream, slots, pool)
        self.n_in = slots
        self.out: list[int] = []             # slots without a slice
        self.is_out = [False] * slots
        self.ready: list[tuple[float, int]] = []   # (ready time, event) heap of replacements
        self.pending: list[int] = []         # replacements ready while stalled
        self.joining: list[int] = []         # replacements joining in the current grow
        self._next_fail()

    def in_service(self) -> int:
        return self.n_in

    def _next_fail(self) -> None:
        i, s, is_out = self.i, self.s, self.is_out
        while i < s.n and is_out[s.slot[i]]:   # that slot has no slice: nothing to interrupt
            i += 1
        self.i = i
        self.nf = s.t[i] if i < s.n else INF

    def next_time(self) -> float:
        t = self.nf if self.running else self.stall_end
        if self.ready and self.ready[0][0] < t:
            return self.ready[0][0]
        return t

    def advance(self) -> None:
        t = self.nf if self.running else self.stall_end
        if self.ready and self.ready[0][0] <= t:
            self._ready(*heapq.heappop(self.ready))
        elif self.running:
            self._fail(t)
        else:
            self._stall_over(t)

    def _fail(self, t: float) -> None:
        k, s = self.i, self.s
        self.i += 1
        self.rec.segments.append((self.seg_start, t, self.n_in))
        self.rec.failures += 1
        slot = s.slot[k]
        self.n_in -= 1
        self.is_out[slot] = True
        self.out.append(slot)
        self.running, self.stall_start = False, t
        if self.n_in > 0:   # shrink after detection
            self.recover_begin = t + s.detect[k]
            self.stall_end = self.recover_begin + s.reconf_down[k]
        else:               # nothing left to train on: wait for a replacement
            self.recover_begin = self.stall_end = INF
        self.pool.take(self, k, t)

    def grant(self, k: int, t: float) -> None:
        """A spare is at hand at ``t`` for interruption ``k``: it is ready ``recovery`` later."""
        s = self.s
        heapq.heappush(self.ready, (max(s.t[k] + s.detect[k], t) + s.recovery[k], k))

    def _ready(self, t: float, k: int) -> None:
        if self.running:
            self.rec.segments.append((self.seg_start, t, self.n_in))
            self.running, self.stall_start = False, t
            self._grow(t, [k])
        elif self.stall_end == INF:   # waiting with no slice: this replacement restarts it
            self._grow(t, [k])
        else:
            self.pending.append(k)

    def _grow(self, t: float, ks: list[int]) -> None:
        self.joining = ks
        self.recover_begin = t
        self.stall_end = t + self.s.reconf_up[ks[0]]

    def _stall_over(self, t: float) -> None:
        for _ in self.joining:
            self.is_out[self.out.pop()] = False
        self.n_in += len(self.joining)
        self.joining = []
        if self.pending:
            ks, self.pending = self.pending, []
            self._grow(t, ks)
        else:
            self._resume(t)


class AmplePool:
    """Serves every request at once and records it, for ``pool_ran_dry`` to check afterwards."""

    def __init__(self) -> None:
        self.taken: list[float] = []
        self.back: list[float] = []

    def take(self, job: Job, k: int, t: float) -> None:
        self.taken.append(t)
        self.back.append(job.s.back_at(k))
        job.grant(k, t)


def pool_ran_dry(size: int, taken: list[float], back: list[float]) -> bool:
    """Would a pool of ``size`` spares have been empty at some request? (A slice back at the same
    instant as a request serves it.)"""
    if len(taken) <= size:
        return False
    times = np.r_[np.asarray(back, dtype=np.float64), np.asarray(taken, dtype=np.float64)]
    delta = np.r_[np.ones(len(back)), -np.ones(len(taken))]
    order = np.lexsort((-delta, times))      # by time; returns before requests
    level = size + np.cumsum(delta[order])
    return bool(np.any(level < 0))


class SharedPool:
    """A finite pool in the shared driver: requests wait in arrival order for repaired slices."""

    def __init__(self, size: int, schedule_back):
        self.free = size
        self.queue: deque[tuple[Job, int]] = deque()
        self.taken = 0
        self.waited = 0
        self._schedule_back = schedule_back

    def take(self, job: Job, k: int, t: float) -> None:
        self.taken += 1
        self._schedule_back(job.s.back_at(k))
        if self.free > 0:
            self.free -= 1
            job.grant(k, t)
        else:
            self.waited += 1
            self.queue.append((job, k))

    def give(self, t: float) -> Job | None:
        """A repaired slice is back at ``t``: the first waiting request gets it."""
        if self.queue:
            job, k = self.queue.popleft()
            job.grant(k, t)
            return job
        self.free += 1
        return None


@dataclass(frozen=True)
class EngineResult:
    jobs: tuple[JobRecord, ...]
    replacements: int   # spares taken
    waited: int         # of those, how many waited for a repaired slice (0 unless the pool ran dry)


def _make(stream: Stream, slots: int, elastic: bool, pool, checkpoint_s: float) -> Job:
    return ElasticJob(stream, slots, pool) if elastic else RestartJob(stream, slots, pool, checkpoint_s)


def run_jobs(trace: FailureTrace, blocks: list[tuple[int, int]], elastic: bool, pool_size: int,
             checkpoint_s: float = 0.0) -> EngineResult:
    """Simulate one job per slice block [lo, hi) of ``trace`` (all elastic, or all restart-on-failure)."""
    streams = [Stream(trace.subset(lo, hi)) if (lo, hi) != (0, trace.slices) else Stream(trace)
               for lo, hi in blocks]
    horizon = trace.duration
    ample = AmplePool()
    records = []
    for stream, (lo, hi) in zip(streams, blocks):
        job = _make(stream, hi - lo, elastic, ample, checkpoint_s)
        while job.next_time() < horizon:
            job.advance()
        records.append(job.close(horizon))
    if not pool_ran_dry(pool_size, ample.taken, ample.back):
        return EngineResult(tuple(records), len(ample.taken), 0)
    return _run_shared(streams, blocks, elastic, pool_size, checkpoint_s, horizon)


def _run_shared(streams: list[Stream], blocks: list[tuple[int, int]], elastic: bool, pool_size: int,
                checkpoint_s: float, horizon: float) -> EngineResult:
    """Every job in one event loop, in global time order, with the finite pool."""
    heap: list[tuple[float, int, int]] = []
    seq = itertools.count()
    pool = SharedPool(pool_size, lambda t: heapq.heappush(heap, (t, next(seq), -1)))
    jobs = [_make(s, hi - lo, elastic, pool, checkpoint_s) for s, (lo, hi) in zip(streams, blocks)]
    for j, job in enumerate(jobs):
        job.index = j
        heapq.heappush(heap, (job.next_time(), next(seq), j))
    while heap and heap[0][0] < horizon:
        t, _, j = heapq.heappop(heap)
        if j < 0:
            job = pool.give(t)
            if job is not None:
                heapq.heappush(heap, (job.next_time(), next(seq), job.index))
            continue
        job = jobs[j]
        if t != job.next_time():   # stale entry: the job's next event moved
            continue
        job.advance()
        heapq.heappush(heap, (job.next_time(), next(seq), j))
    return EngineResult(tuple(job.close(horizon) for job in jobs), pool.taken, pool.waited)
