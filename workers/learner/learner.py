"""A learner (SPEC §3, paper §3): one full model replica that trains on its own data and never waits.

Public API (the default job uses it too)::

    keys = KeyRing(load_identity("keys/l0.key_secret"), load_public("keys/syncer.key"))   # workers/bus/keys.py
    learner = Learner(model, optimizer, store="runs/demo", learner_id="l0", config=LearnerConfig(keys=keys))
    learner.start()                        # loads the latest global model from storage
    for x, y in batches:
        learner.step(lambda: loss_fn(model(x), y), tokens=x.numel())
    learner.close()                        # waits (bounded) until its deltas are durable

Each ``step`` (SPEC §3): answer every round the syncer opened since the last step (hand
``Δ_p = base_p − θ_p`` to the background sender, header naming the round; a new life's first
answers are spaced like the schedule's rounds, workers/learner/answers.py), apply fragment versions
that arrived (overwrite θ_p, reset p's counters, remember the version as base) - answering first
for a version whose round it still owes, so that no unsent work is overwritten - then one inner
optimizer step and bump the counters. The syncer, not the learner, decides when p is synced.
With the model on an accelerator, an answer's Δ_p is quantised there and only its packed bytes
are copied to the host, without waiting (workers/learner/device_quant.py; the same delta bytes).
Nothing in ``step`` touches the network or storage.

Security (docs/security.md): a signed run needs ``LearnerConfig.keys`` (the learner's identity and
the syncer's pinned public key); the learner then signs its deltas, talks CURVE to the syncer, and
applies only versions the syncer signed. An unsigned run refuses keys, a signed one requires them.
"""
from __future__ import annotations

import dataclasses
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from pipeline.descriptor import RunDescriptor
from pipeline.schedule import JoinStagger, join_gap
from pipeline.types import check_learner_id
from storage.learner_state import LearnerState, read_state
from storage.log import claim_incarnation
from storage.regions import learner_region_store
from storage.store import ObjectStore, open_store
from workers.bus.bus import ZMQ, BusConfig, BusCounters, Transport
from workers.common.events import EventLog
from workers.bus.keys import KeyRing, Roster
from workers.learner.bootstrap import (StateRecorder, discovery_target, find_run, from_env, optimizer_snapshot,
                                      resume_optimizer, stop_requested)
from workers.learner.env import LearnerEnv
from workers.learner.answers import ANSWERS_KEPT, LearnerAnswers
from workers.learner.figures import LearnerFigures
from workers.learner.host_bases import host_base, pin_bases, tensor_of
from workers.learner.device_quant import QMAX as _DEVICE_QMAX
from workers.learner.io import DeltaSender, VersionReceiver
from workers.learner.nonfinite import NonFiniteGuard
from workers.learner.receiver import Receiver
from workers.learner.sender import Sender, SenderConfig
from workers.learner.shards import learner_tracker, make_receiver, make_sender, split_bus
from workers.learner.observer import StepObserver, StepParts
from workers.bus.signing import seal_delta
from workers.common.traffic import TrafficMeter, counted, region_names
from workers.common.versions import VersionTracker


INCARNATION_EPOCH_NS = 1_704_067_200 * 10**9   # 2024-01-01T00:00:00Z
DEVICE_QUANTISE = ("auto", "on", "off")
DEVICE_SCHEMES = tuple(_DEVICE_QMAX)   # int4, int8


@dataclass(frozen=True)
class LearnerConfig:
    sender: SenderConfig = SenderConfig()
    poll_s: float = 0.5               # how often storage is polled for new versions
    drain_s: float = 30.0             # how long close() waits for deltas to become durable
    log_every: int = 10               # steps between progress events
    stats_window: int = 1024          # recent steps kept for step-time and gap figures (bounded memory)
    keys: KeyRing | None = field(default=None, repr=False)   # required in a signed run, refused otherwise
    step_observer: StepObserver | None = field(default=None, repr=False)   # sees each step's parts (observer.py)
    sync_process: bool = False        # sender and receiver in a child process (workers/learner/agent.py)
    agent_cpus: tuple[int, ...] | None = None   # with sync_process: the only cores the agent runs on (None: any)
    # Quantise deltas where the model lives, copying only packed bytes (workers/learner/device_quant.py):
    # "auto" when the model is not on the CPU, "on" always (tests), "off" never. Same bytes either way.
    device_quantise: str = "auto"
    # False: the sender and receiver run no threads; whoever drives the learner calls their
    # ``turn`` (the fault simulation, on simulated time: infra/faultsim, issue 25).
    threads: bool = True
    # Issue 28 (workers/learner/bootstrap.py): on a store with no run yet, propose this model as
    # version 0 and wait up to propose_wait_s for the run; state_every_s: seconds between resume
    # records (None: none kept, the learner starts at step 0 every life).
    propose: bool = False
    propose_wait_s: float = 600.0
    state_every_s: float | None = None
    # Fragments whose base stays on the model's device between answers (device quantisation): 0, the
    # default, keeps none - the device holds no second copy of the model; N <= P trades N fragments of
    # device memory for their host-to-device upload per answer (workers/learner/learner.py _device_base).
    device_base_cache: int = 0
    # Steps between snapshots of the inner optimizer's state kept for the next life (needs
    # state_every_s; None: a resumed life starts a fresh optimizer, as the paper's recovery does).
    optimizer_every: int | None = None
    discover: bool = False            # find and follow the syncer's bus through the store (workers/bus/discovery.py)

    def __post_init__(self) -> None:
        if self.optimizer_every is not None and (not isinstance(self.optimizer_every, int) or self.optimizer_every < 1
                                                 or self.state_every_s is None):
            raise ValueError(f"optimizer_every must be an int >= 1 and needs state_every_s, got {self.optimizer_every!r} "
                             f"(state_every_s {self.state_every_s})")
        if not isinstance(self.device_base_cache, int) or self.device_base_cache < 0:
            raise ValueError(f"device_base_cache must be an int >= 0 (fragments), got {self.device_base_cache!r}")
        if not self.propose_wait_s > 0 or (self.state_every_s is not None and not self.state_every_s > 0):
            raise ValueError(f"propose_wait_s must be > 0 and state_every_s None or > 0, got {self.propose_wait_s}, "
                             f"{self.state_every_s}")
        if not isinstance(self.stats_window, int) or self.stats_window < 20:
            raise ValueError(f"stats_window must be an int >= 20, got {self.stats_window!r}")
        if self.poll_s <= 0 or self.drain_s < 0 or self.log_every < 1:
            raise ValueError("poll_s must be > 0, drain_s >= 0 and log_every >= 1")
        if self.agent_cpus is not None and (not self.sync_process or not self.agent_cpus or any(
                not isinstance(c, int) or isinstance(c, bool) or c < 0 for c in self.agent_cpus)):
            raise ValueError(f"agent_cpus must be a non-empty tuple of core numbers >= 0 and needs sync_process, "
                             f"got {self.agent_cpus!r} (sync_process {self.sync_process})")
        if not isinstance(self.threads, bool) or (not self.threads and self.sync_process):
            raise ValueError(f"threads must be a bool, and True with sync_process, got {self.threads!r}")
        if self.device_quantise not in DEVICE_QUANTISE:
            raise ValueError(f"device_quantise must be one of {DEVICE_QUANTISE}, got {self.device_quantise!r}")


class Learner(LearnerAnswers, LearnerFigures):
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, store: str | ObjectStore | None = None,
                 learner_id: str | None = None, config: LearnerConfig = LearnerConfig(), bus: BusConfig | None = None,
                 events: EventLog | None = None, incarnation: int | None = None,
                 clock: Callable[[], float] = time.monotonic, region: str | None = None,
                 wall: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep,
                 transport: Transport = ZMQ, descriptor: RunDescriptor | None = None,
                 model_config: dict | None = None):
        self.model, self.optimizer = model, optimizer
        # what rebuilds the model, recorded in a run this learner's proposal creates (exports carry it):
        # e.g. {"hf_config": model.config.to_dict()} for a Hugging Face model (docs/running.md)
        self.model_config = dict(model_config or {})
        if store is None or learner_id is None:   # under `ddiloco launch`: the environment contract (env.py)
            env = LearnerEnv.from_environ()
            if env is None:
                raise ValueError("Learner needs store= and learner_id=, or the environment `ddiloco launch` sets "
                                 "(DDILOCO_STORE, DDILOCO_LEARNER_ID: docs/running.md \"The environment contract\")")
            store, learner_id, config, bus, events, region = from_env(env, store, learner_id, config, bus, events,
                                                                      region)
        self._given = descriptor     # the run's descriptor when the caller read it already (one read per process)
        self.transport = transport   # what builds its bus sockets (ZeroMQ; the fault simulation's own)
        self.region = region     # issue 14: start() moves to this region's store (None: ``store`` is it)
        self.store = open_store(store, create=False) if isinstance(store, str) else store   # never a new empty dir
        self.id = check_learner_id(learner_id)
        self.cfg = config
        # Issue 14: the bus sockets count into one BusCounters this learner reports (workers/common/traffic.py).
        self.bus = bus if bus is None or bus.counters is not None else dataclasses.replace(bus, counters=BusCounters())
        self.traffic: TrafficMeter | None = None
        self.events = events or EventLog(None, "learner", learner_id)
        # Later lives of the same learner id order after earlier ones: start() claims the next
        # incarnation from storage (create-if-absent), never from a clock.
        self.incarnation: int | None = incarnation
        self.clock, self.wall, self.sleep = clock, wall, sleep   # injected: its sender and receiver use them too
        self.params = dict(model.named_parameters())
        self.descriptor: RunDescriptor | None = None
        self.step_count = 0
        self._first_step = 0     # step_count at start (a resumed life continues its count)
        self.resumed: LearnerState | None = None   # the record this life continued from (start())
        self._state: StateRecorder | None = None
        self.seq = 0
        self.base: dict[int, dict[str, np.ndarray]] = {}
        self.base_version: dict[int, int] = {}
        self.answered: dict[int, tuple[int, int]] = {}   # fragment -> (syncer epoch, round) last answered
        self._answered_recent: dict[int, deque[tuple[int, int]]] = {}   # fragment -> its last ANSWERS_KEPT answers
        self._opened_seen: dict[int, tuple[int, int]] = {}   # fragment -> the opening answer_rounds saw last
        self._rounds_seen: dict | None = None      # the receiver's open rounds as of the last answer_rounds
        self._stagger = JoinStagger(1)             # this life's first answers, spaced (set in start())
        self._answered_steps: dict[int, int] = {}   # fragment -> c_steps its last answer held
        self._at_answer: dict[int, tuple] = {}   # keep_progress: fragment -> (θ_p, c_steps, c_tokens) at the answer
        self.c_steps: list[int] = []
        self.c_tokens: list[int] = []
        self.tokens = 0
        # Bounded: recent windows plus running aggregates, never per-step lists.
        self.step_times: deque[float] = deque(maxlen=config.stats_window)
        self.gaps: deque[float] = deque(maxlen=config.stats_window)   # between consecutive step() starts
        self._max_gap = 0.0
        self._step_total = (0, 0.0)       # (steps timed, seconds): the running mean step time
        self._last_start: float | None = None
        self._window_gap = 0.0             # longest gap since the last step event
        self.loss_ewma: float | None = None
        self.sender: DeltaSender | None = None        # this process's threads, per shard, or the sync agent
        self.receiver: VersionReceiver | None = None
        self.applied = 0
        self.health = NonFiniteGuard()
        self.observer = config.step_observer
        self._device_quantise = False   # decided in start(): the run's codec and the model's device
        self._pin_bases = False         # decided in start(): pinned host bases for a CUDA model (host_bases.py)
        self._base_dev: dict[int, tuple[dict, dict[str, torch.Tensor]]] = {}   # p -> (base[p], its device copy)
        self._fragment_params: dict[int, dict[str, torch.nn.Parameter]] = {}   # p -> its parameters, by name

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> "Learner":
        if self.region is not None and self._given is None and self.cfg.propose:   # the run may not exist yet
            self._given = find_run(self.store, self.id, self.params, self.events, True, self.cfg.propose_wait_s,
                                   sleep=self.sleep, model_config=self.model_config)
        self.store = counted(learner_region_store(self.store, self.region))   # every request it makes, counted
        d = self.descriptor = self._given if self._given is not None else find_run(
            self.store, self.id, self.params, self.events, self.cfg.propose, self.cfg.propose_wait_s,
            sleep=self.sleep, model_config=self.model_config)
        here, home = region_names(d, self.store, self.region)
        target = discovery_target(self.cfg, self.bus, d, self.store, self.events)
        counters = self.bus.counters if self.bus is not None else target.counters if target is not None else None
        self.traffic = TrafficMeter(self.events, here, home, {here: self.store}, counters, clock=self.clock)
        d.check_writable("learner")            # a newer writer's feature this build lacks: refused by name
        if d.schedule.driver != "syncer":
            raise ValueError(f"run {d.run_id} was created before syncer-driven rounds (driver {d.schedule.driver!r}): "
                             "its log still replays, but learners of this version cannot train it; create a new run")
        self._check_model(d)
        agent = self.cfg.sync_process                  # sync off the training process's GIL
        self._device_quantise = self._use_device_quantise(d, agent)   # refused before anything is claimed
        self._pin_bases = pin_bases(self.params.values())             # host bases, page-locked beside a GPU
        curve, seal = self._security(d)
        tracker = learner_tracker(self.store, d)    # the run's log, or every syncer shard's
        # its own: the receiver's belongs to its thread (sharded runs: no older-version fallback yet)
        self.health.tracker = VersionTracker(self.store, d) if d.syncers == 1 else None
        values, versions = tracker.load_all()
        if self.incarnation is None:
            self.incarnation = claim_incarnation(self.store, self.id, floor=tracker.next_incarnation(self.id))
        self._overwrite(values)
        if self.cfg.state_every_s is not None:
            self._resume()
        for p in range(d.num_fragments):
            self.base[p] = host_base(values, d.layout.fragments[p], self._pin_bases, copy=True)
            self.base_version[p] = versions[p]
            self.answered[p] = (-1, -1)
            self._answered_recent[p] = deque(maxlen=ANSWERS_KEPT)
        self._rounds_seen = None
        self._stagger = JoinStagger(join_gap(d.schedule.sync_every, d.num_fragments))
        self.c_steps = [0] * d.num_fragments
        self.c_tokens = [0] * d.num_fragments
        if agent:   # the child builds the same sender(s) and receiver(s), one per syncer shard if sharded
            from workers.learner.agent import agent_for
            split_bus(self.bus, d.syncers)           # a wrong endpoint count is refused here, not in the child
            self.sender, self.receiver = agent_for(self, d, tracker.cursor, versions, curve)
        else:   # one of each, or one per syncer shard (workers/learner/shards.py: fragment p to shard p % N)
            self.sender = make_sender(self.store, d, self.bus, lambda store, bus: Sender(
                store, d.codec, self.cfg.sender, self.events, bus, self.id.encode(), self._heartbeat, self.clock,
                curve=curve, seal=seal, sleep=self.sleep, threads=self.cfg.threads, transport=self.transport,
                target=target))
            self.receiver = make_receiver(tracker, versions, self.bus, lambda t, known, bus: Receiver(
                t, known, self.events, bus, self.cfg.poll_s, curve=curve, clock=self.clock, wall=self.wall,
                threads=self.cfg.threads, transport=self.transport, target=target))
        self.sender.start()
        self.receiver.start()
        self._first_step = self.step_count
        self.events.emit("learner-start", incarnation=self.incarnation, pid=os.getpid(),
                         **({"sync_process": True} if agent else {}), versions={str(p): v for p, v in versions.items()},
                         **({"resumed_step": self.step_count} if self.resumed is not None else {}))
        if self._state is not None:
            self._state.start()
        return self

    def _resume(self) -> None:
        """Continue this id's step count and token total from its resume record (storage/learner_state.py)."""
        self.resumed = read_state(self.store, self.id)
        if self.resumed is not None:
            self.step_count, self.tokens = self.resumed.step, self.resumed.tokens
            self.events.emit("learner-resumed", step=self.step_count, tokens=self.tokens,
                             from_incarnation=self.resumed.incarnation,
                             optimizer_step=resume_optimizer(self.store, self.id, self.optimizer, self.events)
                             if self.cfg.optimizer_every is not None else None)
        self._state = StateRecorder(
            self.store, lambda: LearnerState(self.id, self.incarnation, self.step_count, self.tokens, self.wall()),
            self.cfg.state_every_s, self.events, threads=self.cfg.threads)

    def _snapshot_optimizer(self) -> None:
        if self.cfg.optimizer_every is not None and self._state is not None:
            self._state.offer(optimizer_snapshot(self.optimizer, self.id, self.incarnation, self.step_count))

    def close(self, flush: bool = True) -> bool:
        """Stop; first wait up to ``drain_s`` for every delta to be durable. True if all were.

        ``flush``: a learner that leaves first answers once more for every fragment it trained since
        its last answer (late answers, SPEC §4), so the steps since then still reach the model
        instead of dying with the process."""
        drained = True
        if self.sender is not None:
            if flush and self.descriptor is not None and self.sender.failed is None:
                for p in range(self.descriptor.num_fragments):
                    if self.c_steps[p] > 0 and self._unsent(p):
                        self._emit_delta(p, max(self.answered[p][1], 0))
            drained = self.sender.drain(self.cfg.drain_s)
            self.sender.stop()
        if self.receiver is not None:
            self.receiver.stop()
        if self._state is not None:
            self._snapshot_optimizer()
            self._state.stop()        # the last record: the next life starts where this one ended
        # Stats first, then the store's counters: a spill still in flight (the sender's join timed
        # out) counts its bytes at the store before the sender counts it, so the final report's
        # bytes_written always covers the bytes_spilled reported here (issue 14 accounting).
        stats = self.stats()
        self._report_traffic(final=True)
        self.events.emit("learner-stop", step=self.step_count, tokens=self.tokens, drained=drained, **stats)
        if self.observer is not None:
            self.observer.close()
        return drained

    def __enter__(self) -> "Learner":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _use_device_quantise(self, d: RunDescriptor, agent: bool) -> bool:
        """Whether answers quantise on the model's device: int4/int8 runs without
        keep_progress, in threads mode; "auto" only when a parameter is not on the CPU."""
        mode = self.cfg.device_quantise
        able = d.codec.scheme in DEVICE_SCHEMES and not d.learner.keep_progress and not agent
        if mode == "on" and not able:
            raise ValueError(f"learner {self.id}: device_quantise='on' needs an int4/int8 run without keep_progress "
                             f"and without sync_process (run {d.run_id}: scheme {d.codec.scheme}, keep_progress "
                             f"{d.learner.keep_progress}, sync_process {agent})")
        on_device = any(p.device.type != "cpu" for p in self.params.values())
        return able and (mode == "on" or (mode == "auto" and on_device))

    def _security(self, d: RunDescriptor):
        """CURVE keys and the delta sealer for this run, after checking that keys and run agree."""
        sec, keys = d.security, self.cfg.keys
        if sec is None:
            if keys is not None:
                raise ValueError(f"run {d.run_id} is unsigned (created with --insecure): a learner with keys "
                                 "cannot join it (pass --insecure instead)")
            self.events.emit("security-off", detail="unsigned run (--insecure): no CURVE, no signatures")
            return None, None
        if keys is None:
            raise ValueError(f"run {d.run_id} is signed: learner {self.id} needs its key (--key or --keys)")
        if (keys.syncer.sign, keys.syncer.curve) != (sec.syncer.sign, sec.syncer.curve):
            raise ValueError(f"the pinned syncer key is not run {d.run_id}'s syncer key: wrong run, or the "
                             "descriptor was replaced")
        roster = Roster(d, sec)
        if roster.sign_key(self.id) is None:
            roster.refresh(self.store)
        if roster.sign_key(self.id) != keys.own.public.sign or keys.own.name != self.id:
            raise ValueError(f"learner {self.id} with key {keys.own.name!r} is not listed in run {d.run_id}: "
                             "add it with `ddiloco keys DIR NAME --join STORE --authority SYNCER_KEY`")
        signer, run_id = keys.own.signer(), d.run_id
        return keys.own.curve_keys(server=keys.syncer), (lambda blob: seal_delta(blob, self.id, signer, run_id))

    def _check_model(self, d: RunDescriptor) -> None:
        wide = sorted(n for n, p in self.params.items() if p.dtype == torch.float64)
        if wide:   # versions and deltas travel as fp32/bf16: a float64 model would silently lose precision
            raise ValueError(f"learner {self.id}: the model has float64 parameters ({', '.join(wide[:3])}"
                             f"{' ...' if len(wide) > 3 else ''}); runs train float32 models: call "
                             "model.float() before creating the Learner (and before create_run)")
        want = {t.name: t.shape for t in d.layout.tensors}
        have = {n: tuple(p.shape) for n, p in self.params.items()}
        if want != have:
            missing = sorted(set(want) - set(have))
            extra = sorted(set(have) - set(want))
            wrong = sorted(n for n in set(want) & set(have) if want[n] != have[n])
            raise ValueError(f"model does not match run {d.run_id}: missing {missing[:5]}, unexpected {extra[:5]}, "
                             f"wrong shape {wrong[:5]}")

    # -- the training loop -----------------------------------------------------------------------
    @torch.no_grad()
    def _overwrite(self, values: dict[str, np.ndarray]) -> None:
        alpha = self.descriptor.learner.mixing_alpha if self.descriptor else 0.0
        for name, v in values.items():
            param = self.params[name]
            if alpha > 0.0:   # Streaming DiLoCo's mixing: θ ← α θ_local + (1−α) Θ
                param.mul_(alpha).add_(tensor_of(v).to(param.device, param.dtype), alpha=1.0 - alpha)
            else:             # copy_ converts device and dtype itself (the model may be on an accelerator)
                param.copy_(tensor_of(v))

    @torch.no_grad()
    def _carry(self, p: int, values: dict[str, np.ndarray], at_answer: dict[str, np.ndarray], steps: int,
               tokens: int) -> None:
        """``keep_progress`` (an option beyond the paper, issue "Rounds"): θ_p ← Θ_new + (θ_p − θ_p at
        the answer). The steps taken since the answer are not overwritten: the counters keep them and
        the next answer (against Θ_new) carries them to the syncer."""
        for name, v in values.items():
            param = self.params[name]
            since = param - tensor_of(at_answer[name]).to(param.device, param.dtype)
            param.copy_(tensor_of(v).to(param.device, param.dtype) + since)
        self.c_steps[p] = max(0, self.c_steps[p] - steps)
        self.c_tokens[p] = max(0, self.c_tokens[p] - tokens)

    def apply_arrivals(self, arrivals: list | None = None) -> int:
        """Apply every version that arrived since the last step (``arrivals``: taken already);
        returns how many."""
        n = 0
        for a in (self.receiver.take() if arrivals is None else arrivals):
            if a.version <= self.base_version[a.fragment]:
                continue
            if a.round >= 0 and self._owes(a.fragment, (a.epoch, a.round)):
                self._answer(a.fragment, (a.epoch, a.round))   # never overwrite work not yet sent
            kept = self._at_answer.pop(a.fragment, None) if self.descriptor.learner.keep_progress else None
            if kept is None:
                self._overwrite(a.values)
                self.c_steps[a.fragment] = 0
                self.c_tokens[a.fragment] = 0
            else:
                self._carry(a.fragment, a.values, *kept)
            self._answered_steps[a.fragment] = 0
            self.base[a.fragment] = host_base(a.values, a.values, self._pin_bases, copy=False)
            self.base_version[a.fragment] = a.version
            self.applied += 1
            n += 1
            self.events.emit("version-applied", fragment=a.fragment, version=a.version, seq=a.seq,
                             found_by=a.found_by, step=self.step_count,
                             latency_s=round(self.wall() - a.committed_at, 4) if a.committed_at else None)
        return n

    def range(self, steps: int):
        """The step indices still to take, up to ``steps`` in all, from where this learner stands (a
        resumed life continues its count, issue 28). Ends early once the process is asked to stop
        (SIGTERM/SIGINT: ``ddiloco launch``'s Ctrl-C; workers/learner/bootstrap.py ``stop_requested``),
        so that the script reaches ``close()``, which drains and records where the learner stands."""
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
            raise ValueError(f"learner {self.id}: range(steps) needs an int >= 0, got {steps!r}")
        stop = stop_requested()
        while self.step_count < steps and not stop.is_set():
            yield self.step_count

    def step(self, closure: Callable[[], torch.Tensor], tokens: int) -> float:
        """One inner step. ``closure`` computes the loss (forward); ``tokens`` it consumed (> 0)."""
        mark = self.boundary(tokens)
        self.optimizer.zero_grad(set_to_none=True)
        loss = closure()
        loss.backward()
        value = float(loss.detach())
        if not self.health.check(self, loss, value):
            return value   # skipped, nothing counted; reported and repaired (workers/learner/nonfinite.py)
        self.optimizer.step()
        self.account(tokens, value, mark)
        return value

    def boundary(self, tokens: int, arrivals: list | None = None, rounds: dict | None = None) -> tuple:
        """The step boundary (SPEC §3): answer the open rounds, then apply what arrived (``arrivals``:
        already taken from the receiver; ``rounds``: the receiver's open rounds as already read - both
        so that a sharded learner gathers exactly the fragments this boundary reads, workers/learner/fsdp.py).
        Returns the mark ``account`` takes once the inner step is done: ``step`` is boundary, the
        inner step, account."""
        if not isinstance(tokens, (int, np.integer)) or isinstance(tokens, bool) or tokens <= 0:   # SPEC §4 weights
            raise ValueError(f"learner {self.id}: step(tokens=...) must be a positive int, got {tokens!r}")
        if self.sender is None:
            raise RuntimeError("call start() before step()")
        if self.sender.failed is not None:
            raise RuntimeError(f"learner {self.id}: the sender thread failed: {self.sender.failed}")
        t0 = self.clock()
        if self._last_start is not None:
            self.gaps.append(t0 - self._last_start)
            self._window_gap = max(self._window_gap, t0 - self._last_start)
            self._max_gap = max(self._max_gap, t0 - self._last_start)
        self._last_start = t0
        answered = self.answer_rounds(rounds)
        t_answer = self.clock()
        applied = self.apply_arrivals(arrivals)
        return t0, t_answer, self.clock(), answered, applied

    def account(self, tokens: int, value: float, mark: tuple) -> None:
        """Count one inner step of ``tokens`` taken after ``boundary`` returned ``mark``: the fragments'
        counters, the step count, the progress event."""
        t0, t_answer, t_apply, answered, applied = mark
        t_compute = self.clock()
        d = self.descriptor
        for p in range(d.num_fragments):
            self.c_steps[p] += 1
            self.c_tokens[p] += tokens
        self.tokens += tokens
        self.step_count += 1
        if self.step_count - self._first_step in (4, 16):   # this life's first pace reaches the syncer's clock at once
            self.sender.beat_soon()
        if self.step_count % d.schedule.sync_every == 0:
            self._report_traffic()        # one outer step: H inner steps (SPEC §2)
        if self.cfg.optimizer_every is not None and self.step_count % self.cfg.optimizer_every == 0:
            self._snapshot_optimizer()    # a copy at this boundary; its write is the recorder thread's
        self.loss_ewma = value if self.loss_ewma is None else 0.9 * self.loss_ewma + 0.1 * value
        took = self.clock() - t0
        self.step_times.append(took)
        self._step_total = (self._step_total[0] + 1, self._step_total[1] + took)
        logged = self.step_count % self.cfg.log_every == 0
        if self.observer is not None:   # the progress event below is not in ``took``: it is the next gap's
            self.observer.record(StepParts(took, t_answer - t0, t_apply - t_answer, t_compute - t_apply,
                                           answered, applied, logged))
        if logged:
            self.events.emit("step", step=self.step_count, loss=round(value, 4), tokens=self.tokens,
                             step_time_s=round(self._step_time(), 5),
                             versions={str(p): v for p, v in self.base_version.items()},
                             spilled=self.sender.stats.spilled, acked=self.sender.stats.acked,
                             bytes_sent=self.sender.stats.bytes_sent + self.sender.stats.bytes_spilled,
                             max_gap_s=round(self._window_gap, 4))   # longest step-to-step gap since the last event
            self._window_gap = 0.0
