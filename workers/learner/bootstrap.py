"""How a learner that brings its own model finds its run, and where a restarted one resumes (issue 28).

- ``from_env``: what ``Learner(model, optimizer)`` takes from the environment contract
  (workers/learner/env.py) when no store or id is given.
- ``find_run``: the run's descriptor - and, with ``propose``, when no run exists yet, the learner's
  own weights proposed as version 0 (storage/proposal.py, create-if-absent: one proposal lands),
  then a bounded wait until whoever creates the run (``ddiloco launch``) has written it. Every
  learner then loads version 0 from the run, the proposer too (SPEC §7 "One initial model").
- ``StateRecorder``: the learner's resume record (storage/learner_state.py), written from its own
  thread every few seconds and once at close - never from ``step``.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable

import numpy as np
import torch

from pipeline.descriptor import RunDescriptor
from storage.errors import NotFound, StoreError
from storage.layout import read_descriptor
from storage.learner_state import LearnerState, OptimizerState, read_optimizer, write_optimizer, write_state
from storage.proposal import propose, run_complete, syncer_started, wait_for_run
from storage.store import ObjectStore, open_store
from workers.bus.bus import BusConfig, BusCounters
from workers.bus.keys import KeyRing, load_identity, load_public
from workers.common.events import EventLog
from workers.common.stop_flag import StopFlag
from workers.learner.env import LearnerEnv

POLL_S = 0.2


def from_env(env: LearnerEnv, store, learner_id: str | None, config, bus: BusConfig | None, events: EventLog | None,
             region: str | None):
    """(store, learner id, config, bus, events, region) of a learner from the contract, each filled
    only where the caller gave nothing."""
    store = store if store is not None else open_store(env.store, s3_endpoint=env.s3_endpoint, create=False)
    learner_id = learner_id or env.learner_id
    keys = config.keys
    if keys is None and env.key:
        try:
            keys = KeyRing(load_identity(env.key), load_public(env.syncer_key))
        except (OSError, ValueError) as exc:
            raise ValueError(f"DDILOCO_KEY / DDILOCO_SYNCER_KEY: {exc}") from None
    config = dataclasses.replace(config, keys=keys, propose=config.propose or env.propose,
                                 discover=config.discover or env.discover,
                                 optimizer_every=config.optimizer_every or env.optimizer_every,
                                 propose_wait_s=env.propose_wait_s if env.propose else config.propose_wait_s,
                                 state_every_s=config.state_every_s if config.state_every_s is not None
                                 else (env.state_every_s or None))
    if bus is None and env.ingest:
        bus = BusConfig(env.ingest, env.announce, counters=BusCounters())
    return (store, learner_id, config, bus, events or EventLog(env.log, "learner", learner_id), region or env.region)


SYNCER_WAIT_S = 60.0   # how long a proposer waits for the new run's syncer to start, at most


def find_run(store: ObjectStore, learner: str, params: dict[str, torch.nn.Parameter], events: EventLog,
             propose_model: bool, timeout_s: float, clock: Callable[[], float] = time.monotonic,
             sleep: Callable[[float], None] = time.sleep, model_config: dict | None = None) -> RunDescriptor:
    """The run at ``store`` once it is complete (descriptor and every fragment's version 0); see the
    module docstring. ``NotFound`` at once without ``propose_model``, after ``timeout_s`` with it.
    ``model_config``: what rebuilds the model (the descriptor's ``model`` map if this proposal lands).

    A learner that found no run (a new launch) also waits, up to ``SYNCER_WAIT_S``, until the
    run's syncer has claimed its epoch, as ``ddiloco run`` starts learners once their syncer is up:
    learners of a short run otherwise trained to their end before the syncer opened a round, and
    their work reached the model in one outer step. Once a run exists, no learner waits for anyone."""
    try:
        return read_descriptor(store) if not propose_model else _wait_complete(store, read_descriptor(store))
    except NotFound:
        if not propose_model:
            raise
    tensors = {n: p.detach().cpu().numpy().astype(np.float32, copy=True) for n, p in params.items()}
    won = propose(store, learner, tensors, model_config)
    events.emit("initial-model-proposed", accepted=won, params=int(sum(a.size for a in tensors.values())))
    desc = wait_for_run(store, timeout_s, clock, sleep)
    deadline = clock() + SYNCER_WAIT_S
    while not syncer_started(store, desc) and clock() < deadline:
        sleep(POLL_S)
    return desc


def _wait_complete(store: ObjectStore, desc: RunDescriptor) -> RunDescriptor:
    """``desc`` once its run's creation finished (another launcher may be writing it right now)."""
    return desc if run_complete(store, desc) else wait_for_run(store, 60.0)


def optimizer_snapshot(optimizer: torch.optim.Optimizer, learner: str, incarnation: int, step: int) -> OptimizerState:
    """A copy of ``optimizer``'s state as plain data (taken on the training thread at a step
    boundary, so that no step changes it while it is written; the write itself is the recorder's)."""
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for i, state in sd["state"].items():
        for name, v in state.items():
            if torch.is_tensor(v):
                v = v.detach().to("cpu", copy=True)
                tensors[(int(i), name)] = (v.float() if v.dtype == torch.bfloat16 else v).numpy()
            else:
                scalars[(int(i), name)] = v
    groups = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in sd["param_groups"]]
    return OptimizerState(learner, incarnation, step, groups, tensors, scalars)


def load_optimizer(optimizer: torch.optim.Optimizer, state: OptimizerState) -> None:
    """Put a kept state back (``load_state_dict`` casts it to the parameters' device and dtype);
    ValueError when it is not this optimizer's (other parameter groups or sizes)."""
    current = optimizer.state_dict()["param_groups"]
    if len(current) != len(state.groups) or any(len(a["params"]) != len(b.get("params", ())) for a, b in
                                                zip(current, state.groups)):
        raise ValueError(f"the kept optimizer state has {[len(g.get('params', ())) for g in state.groups]} parameters "
                         f"per group, this optimizer {[len(g['params']) for g in current]}")
    groups = [{k: tuple(v) if isinstance(cur.get(k), tuple) else v for k, v in g.items()}
              for g, cur in zip(state.groups, current)]
    sd: dict = {"state": {}, "param_groups": groups}
    for (i, name), a in state.tensors.items():
        sd["state"].setdefault(i, {})[name] = torch.from_numpy(a)
    for (i, name), v in state.scalars.items():
        sd["state"].setdefault(i, {})[name] = v
    try:
        optimizer.load_state_dict(sd)
    except (RuntimeError, KeyError, TypeError) as exc:
        raise ValueError(f"the kept optimizer state does not fit this optimizer: {exc}") from None


def resume_optimizer(store: ObjectStore, learner: str, optimizer: torch.optim.Optimizer, events: EventLog) -> int | None:
    """Load the learner id's kept inner optimizer state: the step it was taken at, or None (none
    kept, or it does not fit this optimizer: reported, and the optimizer starts fresh)."""
    kept = read_optimizer(store, learner)
    if kept is None:
        return None
    try:
        load_optimizer(optimizer, kept)
    except ValueError as exc:
        events.emit("learner-optimizer-refused", error=str(exc)[:300])
        return None
    return kept.step


def discovery_target(config, bus, descriptor: RunDescriptor, store: ObjectStore, events: EventLog):
    """With ``LearnerConfig.discover``: the BusTarget that finds (and follows) the syncer through the
    store (workers/bus/discovery.py), read once now; None without it. ValueError for what it cannot do."""
    if not config.discover:
        return None
    if bus is not None:
        raise ValueError("discover and bus endpoints exclude each other: the endpoints are found in the store")
    if descriptor.syncers > 1 or config.sync_process or not config.threads:
        raise ValueError("discovering the syncer needs an unsharded run, no sync_process and the learner's threads "
                         f"(run {descriptor.run_id}: {descriptor.syncers} syncers)")
    from workers.bus.discovery import BusTarget
    target = BusTarget(store, descriptor, events)
    target.refresh(force=True)
    return target


class StateRecorder:
    """Writes ``read()``'s LearnerState every ``every_s`` seconds when it changed, on its own thread,
    and the newest optimizer snapshot ``offer``ed; ``stop`` writes the last of both. A failed write is
    reported once per failure run and retried later: the records are advisory, training never waits."""

    def __init__(self, store: ObjectStore, read: Callable[[], LearnerState], every_s: float, events: EventLog,
                 threads: bool = True):
        self.store, self.read, self.every_s, self.events = store, read, every_s, events
        self._stop = threading.Event()
        self._last: tuple[int, int] | None = None
        self._failing = False
        self._optimizer: OptimizerState | None = None   # offered, not written yet
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="learner-state", daemon=True) if threads else None

    def start(self) -> None:
        if self._thread is not None:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.write()

    def offer(self, snapshot: OptimizerState) -> None:
        """The newest optimizer snapshot, written at the recorder's next turn (an older one unwritten
        is replaced: only the newest matters)."""
        with self._lock:
            self._optimizer = snapshot

    def write(self) -> bool:
        with self._lock:
            snapshot, self._optimizer = self._optimizer, None
        if snapshot is not None:
            try:
                write_optimizer(self.store, snapshot)
            except StoreError as exc:
                self.events.emit("learner-state-failed", what="optimizer", error=str(exc)[:300])
                with self._lock:
                    self._optimizer = self._optimizer or snapshot   # try again at the next turn
        state = self.read()
        if self._last == (state.incarnation, state.step):
            return True
        try:
            write_state(self.store, state)
        except StoreError as exc:
            if not self._failing:
                self.events.emit("learner-state-failed", error=str(exc)[:300])
            self._failing = True
            return False
        self._failing = False
        self._last = (state.incarnation, state.step)
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.write()


_STOP: StopFlag | None = None
STOP_REPORT_S = 20.0     # still running this long after the signal: every thread's stack to stderr


def stop_requested() -> StopFlag:
    """A flag set once this process gets SIGTERM or SIGINT (``ddiloco launch`` sends SIGTERM on
    Ctrl-C, SLURM and Kubernetes before a kill), so that a training loop ends at a step boundary and
    reaches ``Learner.close`` (drain, resume record). A ``StopFlag`` (``set``/``is_set``/``wait``):
    waiting on it is safe, where a ``threading.Event`` set by a signal handler can deadlock
    (workers/common/stop_flag.py). The signal also arms a watchdog: a process still alive
    ``STOP_REPORT_S`` later (under SLURM's and Kubernetes' default 30 s before the SIGKILL) writes
    its threads' stacks to stderr. Handlers are installed once, from the main thread only;
    elsewhere the flag is never set and the signals keep their own handlers."""
    global _STOP
    if _STOP is None:
        _STOP = StopFlag()
        if threading.current_thread() is threading.main_thread():
            import faulthandler
            import signal

            def stop(*_) -> None:
                if not _STOP.is_set():
                    faulthandler.dump_traceback_later(STOP_REPORT_S, exit=False)
                _STOP.set()
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, stop)
    return _STOP
