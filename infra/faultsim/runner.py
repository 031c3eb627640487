"""One simulated run (docs/faultsim.md): the world, its fault schedule, the real syncer and
learners on simulated time, and what they left behind.

:func:`simulate` creates the run in a fresh :class:`~infra.faultsim.memstore.MemoryStore`, starts a
syncer and the learners, applies the faults at their times (a ``chaos`` process of its own),
lets the learners train until ``train_s``, and the syncer commit what is left (at most
``drain_s``). It returns a :class:`SimResult`: the commit log's store, every event record each
component emitted (in emission order: the trace), the harness's marks (the fault timeline in the
words infra/chaos/progress.py reads), each process's lives, and crashes. A pure function of
``(cfg, faults)``: no threads, no wall clock, no sockets.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from pipeline.descriptor import RunDescriptor
from storage.layout import SPILL_PREFIX
from workers.bus.bus import BusConfig
from workers.common.events import EventLog

from .actors import SimLearner, SimSyncer, describe
from .badinput import plant_bad_input
from .clock import Proc, Sim, Thread
from .faults import STORE_KINDS, Fault, check_schedule
from .memstore import MemoryStore, StoreFault
from .model import create_sim_run
from .simbus import SimNet
from .world import SimConfig

SYNCER = "syncer"
BUS = "bus"             # the marks' name for the bus (a blackhole and its restore)
BUS_CFG = BusConfig("inproc://faultsim-ingest", "inproc://faultsim-announce")   # names only: SimNet carries it
STORE = "s3"            # the marks' name for the store (infra/chaos/progress.py reads its down/up)
ROGUE = "rogue"         # who plants bad input
_HEX_TOKEN = re.compile(r"\b[0-9a-f]{32}\b")     # uuid4 nonces (the log's claims): not part of a trace


@dataclass
class SimResult:
    cfg: SimConfig
    faults: tuple[Fault, ...]
    store: MemoryStore
    descriptor: RunDescriptor
    trace: list[dict]                        # every event record, in the order they were emitted
    marks: list[dict]
    lives: dict[str, list[dict]]
    crashes: list[str] = field(default_factory=list)
    injections: list[dict] = field(default_factory=list)
    drained: bool = False
    end_s: float = 0.0
    events_run: int = 0

    def events_of(self, role: str) -> dict[str, list[dict]]:
        out: dict[str, list[dict]] = {}
        for rec in self.trace:
            if rec["role"] == role:
                out.setdefault(rec["id"], []).append(rec)
        return out

    def trace_hash(self) -> str:
        """sha256 of the trace (uuid nonces masked): equal for two runs of one seed, bit for bit."""
        h = hashlib.sha256()
        for rec in self.trace:
            h.update(_HEX_TOKEN.sub("<nonce>", json.dumps(rec, sort_keys=True, default=str)).encode())
            h.update(b"\n")
        return h.hexdigest()


class SimRun:
    """The run's processes and records (the ``Context`` the actors use, actors.py)."""

    def __init__(self, cfg: SimConfig, faults: Sequence[Fault]):
        check_schedule(faults, cfg.learners, (0.0, cfg.train_s), bus=cfg.bus)
        self.cfg, self.faults = cfg, tuple(faults)
        self.sim = Sim()
        self.net = SimNet(self.sim) if cfg.bus else None
        self.bus_cfg = BUS_CFG if cfg.bus else None
        # The param is a slow store's latency or a lagging listing's delay (0 for the other kinds).
        store_faults = [StoreFault(STORE_KINDS[f.kind], f.at, f.duration, f.param)
                        for f in self.faults if f.kind in STORE_KINDS]
        self.store = MemoryStore(self.sim, store_faults)
        self.descriptor = create_sim_run(self.store, cfg)
        self.train_end = cfg.train_s
        self.trace: list[dict] = []
        self.marks: list[dict] = []
        self.lives: dict[str, list[dict]] = {}
        self.crashes: list[str] = []
        self.injections: list[dict] = []
        self._logs: dict[str, EventLog] = {}
        self._pids = 0
        self.chaos = Thread(Proc("chaos"), "faults")
        self.syncers: list[SimSyncer] = []
        self.learners = {name: SimLearner(self, name, speed) for name, speed in zip(cfg.learners, cfg.speeds)}

    # -- the actors' context --------------------------------------------------------------------------
    def events(self, role: str, name: str) -> EventLog:
        log = self._logs.get(name)
        if log is None:
            log = self._logs[name] = EventLog(None, role, name, clock=self.sim.wall)
            log.subscribe(self._record)
        return log

    def _record(self, rec: dict) -> None:
        if rec.get("event") in ("learner-start", "syncer-recovered"):
            rec = {**rec, "pid": self._pids}          # one process id per life (the real pid is one for all)
        self.trace.append(rec)

    def new_life(self, role: str, name: str) -> None:
        self.lives.setdefault(name, []).append({"pid": self._pids, "role": role, "killed": False, "how": "",
                                                "started": self.sim.wall()})
        self._pids += 1

    def life_ended(self, name: str, how: str, killed: bool) -> None:
        lives = self.lives.get(name)
        if lives and not lives[-1]["how"]:
            lives[-1].update(how=how, killed=killed, ended=self.sim.wall())

    def mark(self, who: str, what: str, detail: str = "") -> None:
        self.marks.append({"t": round(self.sim.wall(), 4), "who": who, "what": what, "detail": detail})

    def crashed(self, who: str, exc: BaseException) -> None:
        self.crashes.append(f"t={self.sim.now:.2f} {who}: {describe(exc)}")

    def later(self, dt: float, fn: Callable[[], None]) -> None:
        self.sim.after(dt, self.chaos, fn)

    # -- running -------------------------------------------------------------------------------------
    def run(self) -> SimResult:
        torch.set_num_threads(1)
        self._start_syncer(SYNCER)
        for learner in self.learners.values():
            self._start_learner(learner)
        for f in self.faults:
            self.sim.at(f.at, self.chaos, lambda f=f: self._apply(f))
        self.sim.run_until(self.train_end)
        drained = self._drain()
        return SimResult(self.cfg, self.faults, self.store, self.descriptor, self.trace, self.marks, self.lives,
                         self.crashes, self.injections, drained, self.sim.now, self.sim.events_run)

    def _start_syncer(self, name: str) -> SimSyncer:
        """Spawn a syncer process (marked ``start`` as the real harness marks a spawn)."""
        s = SimSyncer(self, name)
        self.syncers.append(s)
        self.mark(name, "start")
        s.start()
        return s

    def _start_learner(self, lr: SimLearner) -> None:
        if not lr.alive:
            self.mark(lr.name, "start")
            lr.start()

    def syncer(self) -> SimSyncer | None:
        """The newest syncer process still alive (the one a syncer fault hits)."""
        return next((s for s in reversed(self.syncers) if s.proc.alive), None)

    def _drain(self) -> bool:
        """After training: run until every learner life ended and the syncer holds nothing and the
        inbox only what it refused, or ``drain_s`` passed. True if it drained."""
        deadline = self.train_end + self.cfg.drain_s
        while self.sim.now < deadline:
            self.sim.run_until(self.sim.now + 1.0)
            if self._settled():
                return True
        return self._settled()

    def _settled(self) -> bool:
        if any(lr.alive for lr in self.learners.values()):
            return False
        live = [s for s in self.syncers if s.running]
        if len(live) != 1:
            return False
        ing = live[0].syncer.ingest
        return not any(ing.pending) and all(k in ing.bad for k in self.store.keys(SPILL_PREFIX))

    # -- faults (marked in the real harness's words: infra/chaos/harness.py, workers/cluster.py) ------
    def _apply(self, f: Fault) -> None:
        if f.kind in ("kill-syncer", "pause-syncer", "second-syncer"):
            self._syncer_fault(f)
        elif f.kind in ("kill-learner", "pause-learner", "slow-learner", "clock-skew"):
            self._learner_fault(f)
        elif f.kind in STORE_KINDS:
            what = "slow" if f.kind in ("store-slow", "list-lag") else "down"
            self.mark(STORE, what, f.text())
            # A lagging listing's fault lasts until the last object written in it shows.
            lasts = f.duration + (f.param if f.kind == "list-lag" else 0.0)
            self.later(lasts, lambda: self.mark(STORE, "restore" if what == "slow" else "up", f.kind))
        elif f.kind == "bus-blackhole":
            self.net.blackholes.append((f.at, f.end))
            self.mark(BUS, "blackhole", f.text())
            self.later(f.duration, lambda: self.mark(BUS, "restore", f.kind))
        elif f.kind == "bad-input":
            key, what = plant_bad_input(self.store, f, self.trace)
            self.injections.append({"t": self.sim.wall(), "key": key, "what": what})
            self.mark(ROGUE, "rogue", f"{key}: {what}")
            self.mark(ROGUE, "restore", "planted")

    def _syncer_fault(self, f: Fault) -> None:
        s = self.syncer()
        if f.kind == "second-syncer":
            self._start_syncer(f"{SYNCER}{len(self.syncers) + 1}")
        elif s is None:
            return                                     # no syncer alive to hit
        elif f.kind == "kill-syncer":
            self.mark(s.name, "kill")
            s.kill()
            self.later(f.duration, lambda: self._start_syncer(s.name))
        else:
            self.mark(s.name, "pause")
            s.pause()
            self.later(f.duration, lambda: (self.mark(s.name, "resume"), s.resume()))

    def _learner_fault(self, f: Fault) -> None:
        lr = self.learners[f.target]
        if f.kind == "kill-learner":
            if not lr.alive:
                return
            self.mark(lr.name, "kill")
            lr.kill()
            if f.duration:
                self.later(f.duration, lambda: self._start_learner(lr))
        elif f.kind == "pause-learner":
            if not lr.alive:
                return
            self.mark(lr.name, "pause")
            lr.pause()
            self.later(f.duration, lambda: (self.mark(lr.name, "resume"), lr.resume()))
        elif f.kind == "clock-skew":
            # Its host's wall clock steps ahead, then back (an NTP step): the learner computes rounds
            # from the syncer's clock record with it whenever no round was announced lately.
            self.mark(lr.name, "skew", f"+{f.param:g} s")
            lr.skew = f.param
            self.later(f.duration, lambda: (self.mark(lr.name, "restore"), setattr(lr, "skew", 0.0)))
        else:
            self.mark(lr.name, "slow", f"x{f.param:g}")
            lr.slow = f.param
            self.later(f.duration, lambda: (self.mark(lr.name, "restore"), setattr(lr, "slow", 1.0)))


def simulate(cfg: SimConfig, faults: Sequence[Fault]) -> SimResult:
    """Run ``cfg`` under ``faults`` (module docstring)."""
    return SimRun(cfg, faults).run()
