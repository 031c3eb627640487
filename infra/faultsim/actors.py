"""The real syncer and the real learners as simulated processes (docs/faultsim.md).

No logic of theirs is copied here: a :class:`SimSyncer` owns a ``workers.syncer.Syncer`` built
with the simulation's clocks, an inline ``io`` executor and the in-memory store, recovers it
(``Syncer.recover``: restart state from the log) and calls ``Syncer.turn`` on simulated time; a
:class:`SimLearner` owns a ``workers.learner.Learner`` with ``threads=False`` and drives its
training loop (``Learner.step``), its sender (``Sender.turn``) and its receiver
(``Receiver.turn``) as three simulated threads of one process. With a bus (simbus.py) each
endpoint's messages wake the thread that reads it: the syncer's loop, a learner's sender (acks) and
receiver (announcements), as a socket's poll would.

What stays the simulation's: when each turn runs, and what a supervisor does - a process that
cannot start (the store refuses writes: down or full) tries again a second later, as a restart
loop would (waiting here also keeps the log's retry loops, which sleep for real, out of a run;
store faults are kept ``STORE_GAP_S`` apart so no start straddles two). A component that raises
an exception it should have handled is recorded as a crash (an invariant fails) and restarted.
"""
from __future__ import annotations

import math
import traceback
from typing import Protocol

import torch

from storage.errors import Fenced, StoreError
from workers.bus.bus import ZMQ, BusConfig
from workers.common.events import EventLog
from workers.learner.learner import Learner, LearnerConfig
from workers.learner.sender import SenderConfig
from workers.syncer.syncer import Syncer, SyncerConfig

from .clock import InlineExecutor, Proc, Sim, Thread
from .memstore import MemoryStore
from .simbus import SimNet
from .model import TOKENS_PER_STEP, Batches, build_model
from .world import SimConfig, stable_seed

MIN_TURN_S = 0.01       # a loop turn is never free: the next one is at least this much later
RETRY_START_S = 1.0     # a supervisor's pause before starting a process again
SENDER_MAX_PENDING = 8  # deltas a simulated learner's sender holds at most (``_boot``)


class Context(Protocol):
    """What the actors need from the run that holds them (runner.py ``SimRun``)."""

    sim: Sim
    store: MemoryStore
    cfg: SimConfig
    train_end: float
    net: SimNet | None            # the bus (None: a run without one)
    bus_cfg: BusConfig | None

    def events(self, role: str, name: str) -> EventLog: ...

    def mark(self, who: str, what: str, detail: str = "") -> None: ...

    def crashed(self, who: str, exc: BaseException) -> None: ...

    def new_life(self, role: str, name: str) -> int: ...

    def life_ended(self, name: str, how: str, killed: bool) -> None: ...

    def later(self, dt: float, fn) -> None: ...


class Turns:
    """One thread's next turn: ``at(t)`` schedules ``fn`` at ``t`` unless a turn is due sooner; a
    turn brought forward leaves its old event behind, which is ignored when it fires (else every
    wake-up would start one more chain of turns)."""

    def __init__(self, sim: Sim, thread: Thread, fn):
        self.sim, self.thread, self.fn = sim, thread, fn
        self.due, self._ticket = math.inf, 0

    def at(self, t: float) -> None:
        if t >= self.due:
            return
        self.due, self._ticket = t, self._ticket + 1
        ticket = self._ticket
        self.sim.at(t, self.thread, lambda: self._fire(ticket))

    def _fire(self, ticket: int) -> None:
        if ticket == self._ticket:
            self.due = math.inf
            self.fn()

    def reset(self) -> None:
        """Forget what is scheduled (a new life's thread)."""
        self.due, self._ticket = math.inf, self._ticket + 1


def _sleep_injected(log, sim: Sim) -> None:
    """The commit log's retries sleep for real by default: make one of them wait on simulated time."""
    log._sleep = sim.block


class SimSyncer:
    """One syncer process (``name``): started, recovered, turned, killed, paused or fenced."""

    def __init__(self, ctx: Context, name: str):
        self.ctx, self.name = ctx, name
        self.proc = Proc(name)
        self.thread = Thread(self.proc, "loop")
        self.syncer: Syncer | None = None
        self.exited = ""                   # why the process ended ("" while it runs)
        self.turns = Turns(ctx.sim, self.thread, self._turn)   # a bus message arriving brings it forward
        if ctx.net is not None:
            ctx.net.on_message(self.proc, "syncer", self._schedule)

    @property
    def running(self) -> bool:
        return self.proc.alive and self.syncer is not None and not self.syncer.fenced

    def start(self) -> None:
        self.ctx.sim.after(0.0, self.thread, self._boot)

    def _boot(self) -> None:
        ctx = self.ctx
        if ctx.store.refuses_writes(ctx.sim.now):
            ctx.sim.after(RETRY_START_S, self.thread, self._boot)
            return
        try:
            # The clock's pace before any learner's is measured: the learners' nominal step (spill-only
            # learners report theirs only after 8 steps; the default 0.1 s ran the clock away at start).
            cfg = SyncerConfig(syncer_id=self.name, initial_step_s=ctx.cfg.step_s)
            syncer = Syncer(ctx.store, cfg, bus=ctx.bus_cfg, events=ctx.events("syncer", self.name), clock=ctx.sim.clock,
                            wall=ctx.sim.wall, sleep=ctx.sim.block, io=InlineExecutor(ctx.sim),
                            transport=ctx.net.transport if ctx.net is not None else ZMQ)
            syncer.recover()
            syncer.open_bus()             # as ``Syncer.run`` does after recovering (none without a bus config)
        except Fenced:
            self._exit("exit 3")
            return
        except StoreError:
            ctx.sim.after(RETRY_START_S, self.thread, self._boot)
            return
        except Exception as exc:          # noqa: BLE001 - a bug: recorded, and the supervisor tries again
            ctx.crashed(self.name, exc)
            ctx.sim.after(RETRY_START_S, self.thread, self._boot)
            return
        _sleep_injected(syncer.committer.log, ctx.sim)
        self.syncer = syncer
        ctx.new_life("syncer", self.name)
        self.turns.reset()
        self._schedule(ctx.sim.now)

    def _schedule(self, t: float) -> None:
        """A turn at ``t`` unless one is due sooner (a bus message arriving wakes the loop)."""
        if self.syncer is not None:
            self.turns.at(t)

    def _turn(self) -> None:
        if self.syncer is None:
            return
        try:
            # ``Syncer.run``'s loop: the bus (what arrived), then a turn (the inbox, the rounds)
            if self.syncer.bus is not None:
                self.syncer.ingest.poll_bus(0)
            wait = self.syncer.turn()
        except Exception as exc:          # noqa: BLE001 - the real loop would have died: a bug, restarted
            self.ctx.crashed(self.name, exc)
            self.syncer = None
            self.ctx.sim.after(RETRY_START_S, self.thread, self._boot)
            return
        if self.syncer.fenced:
            self._exit("exit 3")
            return
        self._schedule(self.ctx.sim.now + max(wait, MIN_TURN_S))

    def _exit(self, how: str) -> None:
        self.exited = how
        self.proc.alive = False
        self.ctx.life_ended(self.name, how, killed=False)

    def kill(self) -> None:
        self.ctx.sim.kill(self.proc, [self.thread])
        self.exited = "killed"
        self.ctx.life_ended(self.name, "killed", killed=True)

    def pause(self) -> None:
        self.ctx.sim.pause(self.proc)

    def resume(self) -> None:
        self.ctx.sim.resume(self.proc, [self.thread])


class SimLearner:
    """One learner id: its lives one after another (each a process with three threads)."""

    def __init__(self, ctx: Context, name: str, speed: float):
        self.ctx, self.name, self.speed = ctx, name, speed
        self.slow = 1.0                    # a slow-learner fault's factor while it lasts
        self.skew = 0.0                    # a clock-skew fault's seconds: its wall clock reads that far ahead
        self.lives = 0
        self.learner: Learner | None = None
        self.proc: Proc | None = None
        self.done = False                  # the last life closed (trained to the end)

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        self.proc = Proc(self.name)
        p = self.proc
        self.boot, self.train = Thread(p, "boot"), Thread(p, "train")
        self.send, self.recv = Thread(p, "sender"), Thread(p, "receiver")
        self.learner = None
        self.sends, self.receives = Turns(self.ctx.sim, self.send, self._send), Turns(self.ctx.sim, self.recv, self._receive)
        if self.ctx.net is not None:     # acks wake the sender, announcements the receiver
            self.ctx.net.on_message(p, "sender", self._kick)
            self.ctx.net.on_message(p, "receiver", self._kick_receiver)
        self.ctx.sim.after(0.0, self.boot, self._boot)

    @property
    def threads(self) -> list[Thread]:
        return [self.boot, self.train, self.send, self.recv]

    def _boot(self) -> None:
        ctx = self.ctx
        if ctx.store.refuses_writes(ctx.sim.now):
            ctx.sim.after(RETRY_START_S, self.boot, self._boot)
            return
        self.lives += 1
        self.rng = _Rng(stable_seed("steps", ctx.cfg.seed, self.name, self.lives))
        self.batches = Batches(ctx.cfg.seed, self.name, self.lives)
        model = build_model(stable_seed("init", ctx.cfg.seed, self.name, self.lives))   # overwritten by version 0
        opt = torch.optim.AdamW(model.parameters(), lr=ctx.cfg.inner_lr)
        # At most 8 deltas held (a real learner: 16): a store outage of the simulation's length (<= 20 s,
        # ~10 answers) then reaches the bound, as a real one of minutes does.
        cfg = LearnerConfig(sender=SenderConfig(bus_enabled=ctx.bus_cfg is not None, max_pending=SENDER_MAX_PENDING,
                                                ack_timeout_s=ctx.cfg.ack_timeout_s),
                            threads=False,
                            log_every=ctx.cfg.sync_every)
        learner = Learner(model, opt, ctx.store, self.name, cfg, bus=ctx.bus_cfg, events=ctx.events("learner", self.name),
                          clock=ctx.sim.clock, wall=lambda: ctx.sim.wall() + self.skew, sleep=ctx.sim.block,
                          transport=ctx.net.transport if ctx.net is not None else ZMQ)
        try:
            learner.start()
        except StoreError:
            ctx.sim.after(RETRY_START_S, self.boot, self._boot)
            return
        for tracker in (learner.receiver.tracker, learner.health.tracker):
            if tracker is not None:
                _sleep_injected(tracker.log, ctx.sim)
        self.learner, self.model, self.opt = learner, model, opt
        ctx.new_life("learner", self.name)
        self._kick_receiver(ctx.sim.now)
        self._kick(ctx.sim.now)          # its hello and first heartbeat
        ctx.sim.after(0.0, self.train, self._step)

    def _step(self) -> None:
        ctx, learner = self.ctx, self.learner
        if ctx.sim.now >= ctx.train_end:
            self.ctx.sim.after(0.0, self.boot, self._close)
            return
        x, y = self.batches.next()
        try:
            learner.step(lambda: torch.nn.functional.mse_loss(self.model(x), y), tokens=TOKENS_PER_STEP)
        except Exception as exc:          # noqa: BLE001 - a training loop that raised: a bug
            ctx.crashed(self.name, exc)
            self.kill()
            ctx.later(RETRY_START_S, self.start)
            return
        if learner.sender.undelivered():
            self._kick(ctx.sim.now)
        step = ctx.cfg.step_s * self.speed * self.slow * (1.0 + ctx.cfg.jitter * (2 * self.rng.next() - 1))
        ctx.sim.after(step, self.train, self._step)

    def _close(self) -> None:
        drained = self.learner.close(flush=True)      # flush, then drain on simulated time
        self.done = True
        self.proc.alive = False
        self.ctx.life_ended(self.name, "exit 0" if drained else "exit 0 (not drained)", killed=False)

    def _kick(self, t: float) -> None:
        """A sender turn at ``t`` (the real sender thread is woken by ``submit``, or an ack)."""
        self.sends.at(t)

    def _send(self) -> None:
        if self.learner is None:
            return
        due = self.learner.sender.turn()
        if due is not None:
            self._kick(self.ctx.sim.now + max(due, MIN_TURN_S))

    def _kick_receiver(self, t: float) -> None:
        """A receiver turn at ``t`` (a poll falling due, or an announcement arriving)."""
        self.receives.at(t)

    def _receive(self) -> None:
        if self.learner is None:
            return
        wait = self.learner.receiver.turn()
        self._kick_receiver(self.ctx.sim.now + max(wait, MIN_TURN_S))

    # -- faults -------------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive

    def kill(self) -> None:
        if not self.alive:
            return
        self.ctx.sim.kill(self.proc, self.threads)
        self.learner = None
        self.ctx.life_ended(self.name, "killed", killed=True)

    def pause(self) -> None:
        if self.alive:
            self.ctx.sim.pause(self.proc)

    def resume(self) -> None:
        if self.proc is not None:
            self.ctx.sim.resume(self.proc, self.threads)


class _Rng:
    """A tiny seeded generator for step-time jitter (numpy's would do; this one is cheaper per call)."""

    def __init__(self, seed: int):
        self.state = seed or 1

    def next(self) -> float:
        self.state = (self.state * 6364136223846793005 + 1442695040888963407) & ((1 << 64) - 1)
        return (self.state >> 11) / float(1 << 53)


def describe(exc: BaseException) -> str:
    """One line naming an exception and where it was raised (a crash's record)."""
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" at {tb[-1].filename.rsplit('/', 2)[-1]}:{tb[-1].lineno}" if tb else ""
    return f"{type(exc).__name__}: {exc}{where}"
