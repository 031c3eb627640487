"""Simulated time for the fault simulation (docs/faultsim.md): one event queue, simulated
processes and threads, and an executor that runs work inline.

Everything runs on the caller's one thread. A *process* (:class:`Proc`) is what a fault kills or
pauses; a *thread* (:class:`Thread`) is one of its loops (a learner's training loop, sender and
receiver; the syncer's loop). Each thread's next turn is an event ``(time, order, thread, fn)``;
``order`` is a counter, so two events at one time run in the order they were scheduled and the
whole run is a pure function of what was scheduled - no wall clock, no real threads.

A thread that sleeps (``Sim.block``: an injected ``sleep``, e.g. a retry's backoff) does not stop
the world: the queue runs on, without that thread, until its wake-up time, then the call returns.
Sleeps nest on the Python stack, so a thread woken while a deeper sleeper still sleeps resumes
when that one does (late, never early - like a loaded machine); only failure paths sleep, each
briefly, so the delay stays bounded. Time a thread merely *spends* (``Sim.charge``: a slow store's
requests) is a debt instead: its turn finishes at once and its next turn waits until the debt is
paid - without nesting, so a busy store cannot starve a thread that waits on it. A process killed
while one of its threads sleeps raises :class:`Killed` in it when the sleep ends: the thread's
stack unwinds and nothing after the sleep happens, as with SIGKILL. A paused process (SIGSTOP)
keeps its events until it is resumed.
"""
from __future__ import annotations

import heapq
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

WALL_EPOCH = 1_750_000_000.0   # the simulated wall clock at simulated time 0 (any fixed value)


class Killed(BaseException):
    """Raised in a waiting thread whose process was killed meanwhile. A BaseException, so that no
    ``except Exception`` (or ``except StoreError``) in the code under test can swallow it."""


@dataclass(eq=False)
class Proc:
    """A simulated process: its threads run, pause and die together."""

    name: str
    alive: bool = True
    paused: bool = False


@dataclass(eq=False)
class Thread:
    """One loop of a process. ``stash``: its events held while it waits or its process is paused."""

    proc: Proc
    name: str
    blocked: bool = False
    stash: list = field(default_factory=list)
    debt: float = 0.0            # time spent in the current turn (``Sim.charge``), paid after it
    seen: float = 0.0            # the latest time its clock showed in the current turn (monotone)
    busy_until: float = 0.0      # its next turn waits until then

    @property
    def label(self) -> str:
        return f"{self.proc.name}/{self.name}"


class Sim:
    """The event queue and the simulated clock (seconds from 0; ``wall`` adds a fixed epoch)."""

    def __init__(self, max_events: int = 5_000_000):
        if not isinstance(max_events, int) or max_events < 1:
            raise ValueError(f"max_events must be an int >= 1, got {max_events!r}")
        self.now = 0.0
        self.current: Thread | None = None
        self.events_run = 0
        self.max_events = max_events      # a runaway loop (a thread rescheduling itself at once) ends loudly
        self._q: list[tuple[float, int, Thread, Callable[[], None]]] = []
        self._n = 0

    # -- the clocks handed to the components ---------------------------------------------------------
    def clock(self) -> float:
        """The current thread's time: the turn's start plus what it has spent in the turn so far
        (``charge``), so that two requests made one after another are seen apart - a restarted
        syncer's inbox backlog arrives spread over its listing's reads, as on real processes (a
        clock that stood still within a turn hid the pace-from-one-listing defect, issue 25).
        Never earlier than the thread saw before (an ``InlineExecutor.map`` job starts afresh)."""
        thread = self.current
        if thread is None:
            return self.now
        thread.seen = max(self.now + thread.debt, thread.seen)
        return thread.seen

    def wall(self) -> float:
        return WALL_EPOCH + self.clock()

    # -- scheduling ------------------------------------------------------------------------------
    def at(self, t: float, thread: Thread, fn: Callable[[], None]) -> None:
        """Run ``fn`` as ``thread`` at simulated time ``t`` (not before now)."""
        self._n += 1
        heapq.heappush(self._q, (max(t, self.now), self._n, thread, fn))

    def after(self, dt: float, thread: Thread, fn: Callable[[], None]) -> None:
        self.at(self.now + max(0.0, dt), thread, fn)

    def run_until(self, t_end: float) -> None:
        """Run every event due by ``t_end``, then set the clock to ``t_end``."""
        while self._q and self._q[0][0] <= t_end:
            t, _, thread, fn = heapq.heappop(self._q)
            self.now = max(self.now, t)
            self._dispatch(thread, fn)
        self.now = max(self.now, t_end)

    def idle(self) -> bool:
        return not self._q

    def _dispatch(self, thread: Thread, fn: Callable[[], None]) -> None:
        if not thread.proc.alive:
            return                                     # died: its turns die with it
        if thread.blocked or thread.proc.paused:
            thread.stash.append(fn)                    # runs once it wakes / is resumed
            return
        if thread.busy_until > self.now:
            self.at(thread.busy_until, thread, fn)     # still paying for its last turn
            return
        self.events_run += 1
        if self.events_run > self.max_events:
            raise RuntimeError(f"simulation ran more than {self.max_events} events (at t={self.now:.3f}, "
                               f"thread {thread.label}): a loop that never waits?")
        outer, self.current = self.current, thread
        thread.seen = self.now
        try:
            fn()
        except Killed:
            pass                                       # its process died during a wait: the turn just ends
        finally:
            self.current = outer
            spent = max(thread.debt, thread.seen - self.now)
            if spent > 0:
                thread.busy_until = self.now + spent
            thread.debt, thread.seen = 0.0, 0.0

    def release(self, thread: Thread) -> None:
        """Put a thread's stashed events back in the queue (it woke, or its process was resumed)."""
        held, thread.stash = thread.stash, []
        for fn in held:
            self.at(self.now, thread, fn)

    # -- waiting inside a thread ---------------------------------------------------------------------
    def block(self, seconds: float) -> None:
        """The current thread waits ``seconds`` of simulated time while every other thread runs;
        raises :class:`Killed` if its process died meanwhile (the injected ``sleep``)."""
        thread = self.current
        if thread is None:
            raise RuntimeError("Sim.block called outside a simulated thread")
        seconds = max(0.0, float(seconds)) + max(thread.debt, thread.seen - self.now)   # what it spent first
        thread.debt = 0.0
        thread.blocked = True
        try:
            self.run_until(self.now + seconds)
            while thread.proc.paused and thread.proc.alive and self._q:
                self.run_until(self._q[0][0])          # SIGSTOPped: it wakes only once resumed
        finally:
            thread.blocked = False
            self.current = thread
            thread.seen = self.now
        self.release(thread)
        if not thread.proc.alive:
            raise Killed(thread.label)

    def charge(self, seconds: float) -> None:
        """The current thread spends ``seconds`` (a slow request): paid after its turn (module doc)."""
        if self.current is not None:
            self.current.debt += max(0.0, float(seconds))

    # -- faults on processes -------------------------------------------------------------------------
    def kill(self, proc: Proc, threads: Iterable[Thread] = ()) -> None:
        proc.alive = False
        for t in threads:
            t.stash.clear()

    def pause(self, proc: Proc) -> None:
        proc.paused = True

    def resume(self, proc: Proc, threads: Iterable[Thread]) -> None:
        proc.paused = False
        for t in threads:
            if not t.blocked:
                self.release(t)


class InlineExecutor(Executor):
    """The syncer's ``io`` pool in the simulation: each job runs at once on the calling thread, in a
    fixed order. Time is charged as a pool spends it: a ``map`` (jobs in parallel, the caller
    waiting) costs the caller its slowest job, a ``submit`` (background work the caller does not
    wait for) costs the caller nothing. A job's exception is kept in its future, as a pool would;
    :class:`Killed` is not (the process died: the caller's stack unwinds too)."""

    def __init__(self, sim: Sim):
        self.sim = sim

    def _debt(self) -> float:
        return self.sim.current.debt if self.sim.current is not None else 0.0

    def _set_debt(self, value: float) -> None:
        if self.sim.current is not None:
            self.sim.current.debt = value

    def submit(self, fn, /, *args, **kwargs) -> Future:
        fut: Future = Future()
        before = self._debt()
        try:
            fut.set_result(fn(*args, **kwargs))
        except Exception as exc:   # noqa: BLE001 - what a pool's worker does with a job's error
            fut.set_exception(exc)
        finally:
            self._set_debt(before)
        return fut

    def map(self, fn, *iterables, timeout=None, chunksize=1) -> Iterator:
        before, slowest, out = self._debt(), 0.0, []
        try:
            for args in zip(*iterables):
                self._set_debt(0.0)
                out.append(fn(*args))
                slowest = max(slowest, self._debt())
        finally:
            self._set_debt(before + max(slowest, self._debt()))
        return iter(out)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        pass
