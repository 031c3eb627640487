"""A local cluster: the role processes of one run (a syncer, M learners, their restarts) on this machine.

``LocalCluster`` is the one orchestrator behind ``ddiloco run`` (workers/run.py), ``ddiloco chaos``
(infra/chaos/harness.py) and the end-to-end tests (tests/runhelpers.py). It

- picks free loopback ports for the bus (``free_port``) and spawns each role as
  ``python -m workers.cli syncer|learner ...`` (or another module with the same flags, such as the
  the fault-injecting syncer wrapper), every process in its own session with one
  OMP/MKL thread and its events in ``OUT/logs/<name>.jsonl`` (a restart appends to the same file);
- knows when a role is ready from its own event log (``syncer-recovered`` / ``syncer-bus``,
  ``learner-start``), never from a sleep;
- stops (SIGTERM, a bounded wait, then SIGKILL), kills (SIGKILL), pauses and resumes
  (SIGSTOP/SIGCONT) and restarts roles (a restarted learner claims a new incarnation by itself);
- decides when the run is drained (``drain_status``): no learner runs, the syncer's inbox holds
  none of their deltas, the syncer's event log has caught up with the commit log, and the last
  durable delta of every learner is named by a commit. It is a polled condition, with no grace sleep;
- evaluates the global model as it stands in storage (``global_eval_loss``): the one place that does.

Faults are injected from outside production code: through the levers here (signals), a wrapper
module passed as ``module`` (infra/chaos/faulty_syncer.py), or a wrapper store; roles read no fault
setting from the environment.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

from pipeline.descriptor import RunDescriptor
from pipeline.errors import FormatError
from storage.errors import NotFound, StoreError
from storage.layout import SPILL_PREFIX, parse_spill_key
from storage.log import CommitLog
from storage.shards import shard_stores
from storage.store import ObjectStore, open_store
from workers.common.events import Tail, read_events
from workers.bus.keys import SYNCER, ensure_identities, key_paths
from .launch import RunSettings, create_run

SYNCER_ROLE, LEARNER_ROLE, EVALUATOR_ROLE = "syncer", "learner", "evaluator"
DURABLE_EVENTS = ("delta-acked", "delta-spilled")     # a learner's delta is durable at the syncer or in storage


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


@dataclass(frozen=True)
class ClusterConfig:
    """Where the run lives and how its role processes are started.

    ``keydir``: the run's key directory (each role gets only its own secret key file and the
    syncer's public key); None for an unsigned run (every role gets ``--insecure``).
    ``ingest``/``announce``: the syncer's bus endpoints (default: free loopback ports).
    ``learner_nice``: niceness of learner processes. The demo puts every role on one machine, where
    learners saturate the cores and a round's latency is then mostly the syncer waiting for one; a
    few nice levels down, the learners lose almost no throughput (they are the only other load) and
    the syncer, whose work is small and latency-bound, gets the CPU when it needs it. Multi-host
    deployments start roles with ``ddiloco syncer``/``ddiloco learner`` and never pass here.
    """

    store: str
    out: Path
    keydir: Path | None = None
    bus: bool = True
    ingest: str = ""
    announce: str = ""
    s3_endpoint: str | None = None
    env: Mapping[str, str] | None = None
    learner_nice: int = 0
    syncers: int = 1                   # syncer shards: own endpoints each, learners get all of them
    stop_timeout_s: float = 20.0
    kill_timeout_s: float = 10.0
    poll_s: float = 0.1

    def __post_init__(self) -> None:
        if not self.store:
            raise ValueError("ClusterConfig.store: the run's location is required")
        if not isinstance(self.syncers, int) or isinstance(self.syncers, bool) or self.syncers < 1:
            raise ValueError(f"ClusterConfig.syncers must be an int >= 1, got {self.syncers!r}")
        if self.syncers > 1 and (self.ingest or self.announce):
            raise ValueError("ClusterConfig.ingest/announce name one syncer's endpoints: a sharded cluster "
                             "picks one pair per shard")
        if self.stop_timeout_s <= 0 or self.kill_timeout_s <= 0 or self.poll_s <= 0:
            raise ValueError(f"timeouts and poll_s must be > 0, got stop {self.stop_timeout_s}, "
                             f"kill {self.kill_timeout_s}, poll {self.poll_s}")


@dataclass
class Life:
    """One process of a role, from spawn to exit. ``how``: '' while running, then 'exit N' or 'killed'."""

    name: str
    role: str
    popen: subprocess.Popen
    started: float
    argv: list[str]
    module: str
    nice: int
    tail: Tail
    ended: float | None = None
    how: str = ""
    killed: bool = False
    seen: list[dict] = field(default_factory=list)
    script: tuple[list[str], dict[str, str]] | None = None   # spawn_script's command and extra environment

    def events(self) -> list[dict]:
        """This life's events so far (its log lines written after it was spawned)."""
        self.seen.extend(self.tail.read())
        return self.seen

    def running(self) -> bool:
        return self.popen.poll() is None


class RoleExited(RuntimeError):
    """A role process exited while the cluster waited for it (the message holds its stderr's end)."""


@dataclass
class DrainStatus:
    """Why the run is (not yet) drained; ``ok`` when every condition holds."""

    running: list[str] = field(default_factory=list)          # learners still running
    inbox: list[str] = field(default_factory=list)            # their deltas still in the syncer's inbox
    unreported: int | None = None                             # log tail the syncer's events have not reached
    uncommitted: dict[str, str] = field(default_factory=dict) # learner -> last durable delta no commit names
    error: str = ""

    @property
    def ok(self) -> bool:
        return not (self.running or self.inbox or self.unreported is not None or self.uncommitted or self.error)

    def __str__(self) -> str:
        if self.ok:
            return "drained"
        parts = [f"learners running: {self.running}" if self.running else "",
                 f"inbox holds {len(self.inbox)} deltas (e.g. {self.inbox[:3]})" if self.inbox else "",
                 f"the syncer has not logged commit {self.unreported}" if self.unreported is not None else "",
                 f"last durable deltas not committed: {self.uncommitted}" if self.uncommitted else "",
                 f"store: {self.error}" if self.error else ""]
        return "; ".join(p for p in parts if p)


class LocalCluster:
    """The role processes of one run on this machine (see the module docstring)."""

    def __init__(self, cfg: ClusterConfig, clock: Callable[[], float] = time.time,
                 observer: Callable[[str, str, str], None] | None = None):
        self.cfg = cfg
        self.out = Path(cfg.out)
        self.logs = self.out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.clock = clock
        # One (ingest, announce) pair per syncer shard; learners connect to all of them, listed
        # comma-separated in shard order (workers/learner/shards.py ``split_bus``).
        self.shard_endpoints = [(cfg.ingest or loopback_endpoint(), cfg.announce or loopback_endpoint())
                                for _ in range(cfg.syncers)]
        self.ingest = ",".join(i for i, _ in self.shard_endpoints)
        self.announce = ",".join(a for _, a in self.shard_endpoints)
        self.env = dict(cfg.env if cfg.env is not None else os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.lives: dict[str, list[Life]] = {}
        self._observer = observer
        self._committed: set[str] = set()     # delta ids named by commits read so far
        self._log_next = [0] * cfg.syncers    # next commit seq of each shard's log to read into _committed
        self._store: ObjectStore | None = None

    # -- set-up ----------------------------------------------------------------------------------
    @property
    def store(self) -> ObjectStore:
        """The run's store, opened on first use (the run must exist by then)."""
        if self._store is None:
            self._store = open_store(self.cfg.store, s3_endpoint=self.cfg.s3_endpoint, create=False)
        return self._store

    def log_path(self, name: str) -> Path:
        return self.logs / f"{name}.jsonl"

    def key_args(self, name: str) -> list[str]:
        """Key flags of role ``name``: paths only (a secret never appears on a command line), and
        only its own secret plus the syncer's public key it pins."""
        if self.cfg.keydir is None:
            return ["--insecure"]
        own = ["--key", str(key_paths(self.cfg.keydir, name)[1])]
        return own if name == SYNCER else [*own, "--syncer-key", str(key_paths(self.cfg.keydir, SYNCER)[0])]

    def bus_args(self, bus: bool | None = None, ingest: str | None = None, announce: str | None = None) -> list[str]:
        if not (self.cfg.bus if bus is None else bus):
            return ["--no-bus"]
        return ["--ingest", ingest or self.ingest, "--announce", announce or self.announce]

    def _note(self, who: str, what: str, detail: str = "") -> None:
        if self._observer is not None:
            self._observer(who, what, detail)

    # -- starting --------------------------------------------------------------------------------
    def spawn(self, name: str, role: str, argv: Sequence[str], module: str = "workers.cli", nice: int = 0) -> Life:
        """Start one process: ``python -m module *argv --store URI --log OUT/logs/<name>.jsonl``.
        ``argv`` holds the role's own flags (and its subcommand for ``workers.cli``)."""
        if role not in (SYNCER_ROLE, LEARNER_ROLE, EVALUATOR_ROLE):
            raise ValueError(f"role must be {SYNCER_ROLE!r}, {LEARNER_ROLE!r} or {EVALUATOR_ROLE!r}, got {role!r}")
        if self.alive(name):
            raise RuntimeError(f"{name} is already running (pid {self.life(name).popen.pid}): stop it first")
        log = self.log_path(name)
        store = ["--store", self.cfg.store, *(["--s3-endpoint", self.cfg.s3_endpoint] if self.cfg.s3_endpoint else [])]
        cmd = [sys.executable, "-m", module, *argv, *store, "--log", str(log)]
        return self._popen(name, role, cmd, nice, self.env, subprocess.DEVNULL,
                           lambda p, tail: Life(name, role, p, self.clock(), list(argv), module, nice, tail))

    def spawn_script(self, name: str, cmd: Sequence[str], env: Mapping[str, str], nice: int = 0,
                     role: str = LEARNER_ROLE) -> Life:
        """Start a learner that is the user's own command (``ddiloco launch``): ``env`` is added to
        the cluster's environment (the contract of workers/learner/env.py, its ``DDILOCO_LOG`` =
        ``OUT/logs/<name>.jsonl``); its stdout goes to ``OUT/logs/<name>.out``. ``restart`` repeats it.
        ``role``: a learner, or the run's evaluator (workers/evaluator.py; never counted as a learner)."""
        if role not in (LEARNER_ROLE, EVALUATOR_ROLE):
            raise ValueError(f"a script's role must be {LEARNER_ROLE!r} or {EVALUATOR_ROLE!r}, got {role!r}")
        if self.alive(name):
            raise RuntimeError(f"{name} is already running (pid {self.life(name).popen.pid}): stop it first")
        with open(self.logs / f"{name}.out", "a") as out:
            return self._popen(name, role, list(cmd), nice, {**self.env, **env}, out,
                               lambda p, tail: Life(name, role, p, self.clock(), [], "", nice, tail,
                                                    script=(list(cmd), dict(env))))

    def _popen(self, name: str, role: str, cmd: list[str], nice: int, env: Mapping[str, str], stdout,
               make: Callable[[subprocess.Popen, Tail], Life]) -> Life:
        log = self.log_path(name)
        _end_torn_line(log)
        tail = Tail(log)
        tail.read()           # this life's events are those written after this point
        with open(self.logs / f"{name}.stderr", "a") as err:
            p = subprocess.Popen(cmd, env=dict(env), stdout=stdout, stderr=err, start_new_session=True,
                                 preexec_fn=(lambda: os.nice(nice)) if nice else None)
        life = make(p, tail)
        self.lives.setdefault(name, []).append(life)
        self._note(name, "start", f"pid {p.pid}")
        return life

    def start_syncer(self, name: str = "syncer", extra: Sequence[str] = (), module: str = "workers.cli",
                     endpoints: tuple[str, str] | None = None, bus: bool | None = None) -> Life:
        """A syncer on the cluster's endpoints (or ``endpoints``); ``module`` may be a wrapper that
        takes ``ddiloco syncer``'s flags (infra/chaos/faulty_syncer.py)."""
        ingest, announce = endpoints or (None, None)
        sub = ["syncer"] if module == "workers.cli" else []
        argv = [*sub, "--id", name, *self.key_args(SYNCER), *self.bus_args(bus, ingest, announce), *extra]
        return self.spawn(name, SYNCER_ROLE, argv, module)

    def syncer_names(self, name: str = SYNCER) -> list[str]:
        """The syncer role names: ``name`` alone, or ``<name>-s<i>`` for each shard of a sharded run."""
        n = self.cfg.syncers
        return [name] if n == 1 else [f"{name}-s{i}" for i in range(n)]

    def start_syncers(self, extra: Sequence[str] = (), module: str = "workers.cli", name: str = SYNCER) -> list[Life]:
        """Every syncer of the run: one, or one per shard (``--shard i/N`` on the shard's own endpoints)."""
        n = self.cfg.syncers
        if n == 1:
            return [self.start_syncer(name, extra, module)]
        return [self.start_syncer(sn, [*extra, "--shard", f"{i}/{n}"], module, endpoints=self.shard_endpoints[i])
                for i, sn in enumerate(self.syncer_names(name))]

    def start_learner(self, lid: str, extra: Sequence[str] = (), module: str = "workers.cli",
                      endpoints: tuple[str, str] | None = None, bus: bool | None = None) -> Life:
        """A learner ``lid`` connecting to the cluster's endpoints (or ``endpoints``: a relay, a dead
        address); ``module`` may be another role with the same flags (infra/chaos/faulty_syncer.py)."""
        ingest, announce = endpoints or (None, None)
        sub = ["learner"] if module == "workers.cli" else []
        argv = [*sub, "--id", lid, *self.key_args(lid), *self.bus_args(bus, ingest, announce), *extra]
        return self.spawn(lid, LEARNER_ROLE, argv, module, nice=self.cfg.learner_nice)

    def restart(self, name: str) -> Life:
        """A new life of a role that exited, with the same flags (a learner claims a new incarnation)."""
        if name not in self.lives:
            raise KeyError(f"no role named {name!r} was started (known: {sorted(self.lives)})")
        last = self.life(name)
        if last.running():
            raise RuntimeError(f"{name} is still running (pid {last.popen.pid}): stop or kill it before a restart")
        self.poll()
        if last.script is not None:
            return self.spawn_script(name, *last.script, nice=last.nice, role=last.role)
        return self.spawn(name, last.role, last.argv, last.module, last.nice)

    # -- readiness -------------------------------------------------------------------------------
    def ready(self, name: str) -> bool:
        """Whether the current life of ``name`` has said it is ready: a syncer once it recovered
        (and bound the bus, when it has one, and published where it listens, when told to
        advertise: a learner with ``--discover`` cannot reach it before), a learner once it loaded
        the global model."""
        life = self.life(name)
        seen = {e.get("event") for e in life.events()}
        if life.role == LEARNER_ROLE:
            return "learner-start" in seen
        bus = "--no-bus" in life.argv or "syncer-bus" in seen
        advertises = any(a == "--advertise" or a.startswith("--advertise=") for a in life.argv)
        told = not advertises or bool(seen & {"syncer-advertised", "syncer-advertise-failed"})
        return "syncer-recovered" in seen and bus and told

    def wait_ready(self, names: str | Sequence[str], timeout_s: float = 60.0) -> None:
        """Wait until every named role is ready; RoleExited if one exits first, TimeoutError on time."""
        names = [names] if isinstance(names, str) else list(names)

        def check() -> bool:
            for n in names:
                if not self.ready(n) and not self.life(n).running():
                    raise RoleExited(f"{n} exited ({self.life(n).popen.returncode}) before it was ready: "
                                     f"{self.stderr(n, 800)}")
            return all(self.ready(n) for n in names)
        self.wait_for(check, timeout_s, f"{', '.join(names)} to be ready")

    def wait_for(self, cond: Callable[[], bool], timeout_s: float, what: str,
                 tick: Callable[[], None] | None = None) -> None:
        """Poll ``cond`` (after ``tick``) until it holds; TimeoutError naming ``what`` otherwise."""
        deadline = time.monotonic() + timeout_s
        while True:
            if tick is not None:
                tick()
            if cond():
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
            time.sleep(self.cfg.poll_s)

    # -- observation -----------------------------------------------------------------------------
    def life(self, name: str) -> Life:
        if name not in self.lives:
            raise KeyError(f"no role named {name!r} was started (known: {sorted(self.lives)})")
        return self.lives[name][-1]

    def alive(self, name: str) -> bool:
        return name in self.lives and self.life(name).running()

    def names(self, role: str | None = None) -> list[str]:
        return sorted(n for n, ls in self.lives.items() if role is None or ls[0].role == role)

    def events(self, name: str) -> list[dict]:
        """Every event of ``name``, all lives."""
        return read_events(self.log_path(name))

    def stderr(self, name: str, chars: int = 3000) -> str:
        try:
            return (self.logs / f"{name}.stderr").read_text()[-chars:]
        except FileNotFoundError:
            return ""

    def poll(self) -> list[Life]:
        """Notice lives that exited on their own (their end time is the time of noticing)."""
        ended = []
        for lives in self.lives.values():
            for life in lives:
                rc = life.popen.poll()
                if rc is not None and life.ended is None:
                    self._ended(life, f"exit {rc}")
                    self._note(life.name, "exit", str(rc))
                    ended.append(life)
        return ended

    def learners_done(self) -> bool:
        self.poll()
        return not any(self.alive(n) for n in self.names(LEARNER_ROLE))

    def _ended(self, life: Life, how: str) -> None:
        if life.ended is None:
            life.ended, life.how = self.clock(), how

    # -- levers ----------------------------------------------------------------------------------
    def signal(self, name: str, sig: int) -> bool:
        """Send ``sig`` to the process group of ``name``'s current life; False if it already exited."""
        life = self.life(name)
        if not life.running():
            return False
        try:
            os.killpg(life.popen.pid, sig)
        except ProcessLookupError:
            return False
        return True

    def kill(self, name: str) -> None:
        """SIGKILL: no clean-up, no drain."""
        if self.signal(name, signal.SIGKILL):
            life = self.life(name)
            life.popen.wait()
            life.killed = True
            self._ended(life, "killed")
            self._note(name, "kill")

    def pause(self, name: str) -> None:
        if self.signal(name, signal.SIGSTOP):
            self._note(name, "pause")

    def resume(self, name: str) -> None:
        if self.signal(name, signal.SIGCONT):
            self._note(name, "resume")

    def terminate(self, name: str) -> None:
        """SIGTERM (after SIGCONT, so a paused process can act on it): a clean stop, a learner
        drains its deltas first."""
        if self.signal(name, signal.SIGCONT) and self.signal(name, signal.SIGTERM):
            self._note(name, "terminate")

    def stop(self, names: str | Sequence[str] | None = None, timeout_s: float | None = None) -> None:
        """Terminate the named roles (default: all), wait up to ``timeout_s`` (default the config's)
        for them together, then SIGKILL whatever is left."""
        names = self.names() if names is None else [names] if isinstance(names, str) else list(names)
        for n in names:
            self.terminate(n)
        deadline = time.monotonic() + (self.cfg.stop_timeout_s if timeout_s is None else timeout_s)
        for n in names:
            for life in self.lives[n]:
                try:
                    life.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    try:
                        os.killpg(life.popen.pid, signal.SIGKILL)
                    except ProcessLookupError:   # it exited between the wait and the kill
                        pass
                    life.popen.wait(timeout=self.cfg.kill_timeout_s)
                    life.killed = True
                    self._ended(life, "killed")
                    self._note(n, "kill", f"did not stop within {self.cfg.stop_timeout_s:g} s")
        self.poll()

    def close(self) -> None:
        self.stop()

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- drain -----------------------------------------------------------------------------------
    def drain_status(self, learners: Sequence[str] | None = None) -> DrainStatus:
        """Whether everything the learners made durable is committed and reported (module docstring).
        ``learners``: whose deltas count (default: every learner this cluster started)."""
        learners = self.names(LEARNER_ROLE) if learners is None else list(learners)
        status = DrainStatus(running=[n for n in learners if self.alive(n)])
        if status.running:
            return status
        try:
            status.inbox = self._inbox_of(set(learners))
            if not status.inbox:
                status.unreported = self._unreported_tail()
            if not status.inbox and status.unreported is None:
                status.uncommitted = self._uncommitted(learners)
        except StoreError as exc:     # the store is down for a moment (chaos): not drained yet
            status.error = str(exc)
        return status

    def wait_drained(self, timeout_s: float = 60.0, learners: Sequence[str] | None = None,
                     tick: Callable[[], None] | None = None) -> DrainStatus:
        """Poll ``drain_status`` until it holds, ``timeout_s`` passes, or no syncer is left to make
        progress; returns the last status (``ok`` tells which)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if tick is not None:
                tick()
            self.poll()
            status = self.drain_status(learners)
            if status.ok or time.monotonic() >= deadline or not any(self.alive(n) for n in self.names(SYNCER_ROLE)):
                return status
            time.sleep(self.cfg.poll_s)

    def _inbox_of(self, learners: set[str]) -> list[str]:
        """Inbox (spill) keys of these learners (a rogue's refused objects stay there as evidence)."""
        out = []
        for store in self._shards():
            for key in store.list(SPILL_PREFIX):
                try:
                    if parse_spill_key(key)[0] in learners:
                        out.append(key)
                except ValueError:
                    continue
        return out

    def _shards(self) -> list[ObjectStore]:
        """The run's store, or each syncer shard's view of it (storage/shards.py)."""
        if self.cfg.syncers == 1:
            return [self.store]
        from storage.layout import read_descriptor
        return shard_stores(self.store, read_descriptor(self.store))

    def _unreported_tail(self) -> int | None:
        """The log's tail seq when no syncer has logged it yet (the inbox is tidied in the
        background, possibly before the commit's event line is written), else None."""
        syncers = self.names(SYNCER_ROLE)
        for i, store in enumerate(self._shards()):
            names = syncers if self.cfg.syncers == 1 else [n for n in syncers if n.endswith(f"-s{i}")]
            tail = self._unreported_in(store, names)
            if tail is not None:
                return tail
        return None

    def _unreported_in(self, store: ObjectStore, names: Sequence[str]) -> int | None:
        tail = CommitLog(store).tail()
        reported = -1
        for n in names:
            for e in self.events(n):
                if e.get("event") == "commit":
                    reported = max(reported, int(e.get("seq", -1)))
                elif e.get("event") == "syncer-recovered":
                    reported = max(reported, int(e.get("fence_seq", -1)))
        if reported >= tail or tail < 0:
            return None
        return None if CommitLog(store).read(tail).kind == "init" else tail

    def _uncommitted(self, learners: Sequence[str]) -> dict[str, str]:
        """Learners whose last durable delta no commit names yet (the commit log is read once, on)."""
        for k, store in enumerate(self._shards()):
            log = CommitLog(store)
            tail = log.tail()
            for seq in range(self._log_next[k], tail + 1):
                try:
                    rec = log.read(seq)
                except (NotFound, FormatError):   # (other store errors propagate: the caller asks again)
                    # A commit a killed syncer left missing or damaged (an S3 server kept an empty
                    # object once, a clean-clone run): recovery declared it lost and went on past it.
                    continue
                self._committed.update(i.delta_id for i in rec.inputs)
                self._committed.update(d.delta_id for d in rec.dropped)
            self._log_next[k] = max(self._log_next[k], tail + 1)
        out = {}
        for lid in learners:
            last = next((e["delta"] for e in reversed(self.events(lid))
                         if e.get("event") in DURABLE_EVENTS and "delta" in e), None)
            if last is not None and last not in self._committed:
                out[lid] = last
        return out

    # -- the model -------------------------------------------------------------------------------
    def global_loss(self, descriptor: RunDescriptor, corpus=None) -> float:
        return global_eval_loss(self.store, descriptor, corpus)[0]


def _end_torn_line(log: Path) -> None:
    """A life killed mid-line leaves a torn last line: end it, so that the next life's first event
    (the one readiness waits for) starts a line of its own instead of being glued to the torn one."""
    try:
        with open(log, "rb+") as fh:
            fh.seek(0, os.SEEK_END)
            if fh.tell() == 0:
                return
            fh.seek(-1, os.SEEK_END)
            if fh.read(1) != b"\n":
                fh.write(b"\n")
    except FileNotFoundError:
        pass


def global_eval_loss(store: ObjectStore, descriptor: RunDescriptor, corpus=None) -> tuple[float, dict[int, int]]:
    """Held-out loss of the global model as it stands in storage (the latest version of every
    fragment; nobody is paused) and those versions. ``corpus``: the job's, when the caller holds it."""
    import torch   # here, not at import: the cluster itself never needs torch
    from workers.job.data import Corpus, evaluate
    from workers.job.job import job_from
    from workers.job.model import GPT
    gcfg, job = job_from(descriptor)
    from workers.learner.shards import learner_tracker
    values, versions = learner_tracker(store, descriptor).load_all()   # every shard's fragments in a sharded run
    model = GPT(gcfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(torch.from_numpy(values[n].copy()))
    return evaluate(model, corpus or Corpus(job.data_config(gcfg.block_size))), versions


def create_job_run(store: ObjectStore, settings: RunSettings, gcfg, seed: int, keydir: Path | None,
                   learners: Sequence[str], also_listed: Sequence[str] = ()):
    """Create a run of the default job (workers/job/job.py): the model drawn from ``seed``, keys for
    the syncer and every learner in ``keydir`` (None: an unsigned run) with ``learners`` and
    ``also_listed`` listed. Returns (descriptor, the initial model)."""
    from workers.job.model import EMBEDDING_TENSORS, build_model
    model = build_model(gcfg, seed)
    init = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    listed = [*learners, *also_listed]
    idents = ensure_identities(keydir, [SYNCER, *listed]) if keydir is not None else {}
    desc = create_run(store, init, settings, embedding_tensors=EMBEDDING_TENSORS, syncer=idents.get(SYNCER),
                      learners=[idents[n].public for n in listed] if idents else ())
    return desc, model
