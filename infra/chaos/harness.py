"""A local run driven as real processes, with the levers chaos needs.

``ChaosRun`` creates a run (the tiny or the default model, keys for the syncer and every learner,
a signed run), starts the syncer and learners as ``ddiloco syncer`` / ``ddiloco learner`` processes
(paced with ``--pace`` in the experiments), and can kill (SIGKILL), pause
(SIGSTOP/SIGCONT), restart and terminate them, stop and restart the S3 server (SeaweedFS, when the
run lives on S3), and blackhole the ZeroMQ path: learners reach the syncer only through two TCP
relays (``proxy.py``). Every lever is written to ``timeline`` with its wall-clock time, so the
invariants and the report can tell a fault from a bug.

Every process logs JSONL events to ``OUT/logs/<name>.jsonl`` (a restarted process appends to the
same file; ``learner-start`` / ``syncer-recovered`` separate its lives).
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pipeline.descriptor import LearnerRules, RunDescriptor, VersionsConfig
from pipeline.policy import PolicyConfig
from pipeline.types import CommitRecord
from storage.errors import StoreError
from storage.log import CommitLog
from storage.store import ObjectStore, open_store
from workers.cluster import (LEARNER_ROLE, SYNCER_ROLE, ClusterConfig, DrainStatus, Life, LocalCluster,
                             create_job_run, free_port)
from workers.common.placement import Placement, learner_names
from workers.job.job import JobSettings
from workers.bus.keys import SYNCER, ensure_identities, key_paths
from workers.launch import RunSettings, Schedule
from workers.job.model import GPTConfig
from .faulty_syncer import crash_count
from .proxy import Relay

ROGUE = "rogue"        # a listed learner key that no real learner uses (rogue.py sends with it)
MODELS = {
    "tiny": (GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=32), 4, 300_000),
    "small": (GPTConfig(n_layer=2, n_head=2, n_embd=48, block_size=32), 8, 1_000_000),
}


@dataclass(frozen=True)
class RunSpec:
    """What run a scenario or experiment drives. ``slow`` stretches a learner's steps (``--slow``);
    per-learner factors in ``slow_by`` override ``slow`` (a straggler). The run's own rules are the
    launcher's sections with their defaults (workers/launch.py RunSettings), but for the schedule:
    P = 3, H = 6, so that a run of a few hundred tiny steps makes many merges of every fragment."""

    learners: int = 2
    steps: int = 400
    slow: float = 2.0                  # every learner (keeps a 2-core machine from saturating)
    slow_by: tuple[tuple[str, float], ...] = ()
    schedule: Schedule = Schedule(fragments=3, sync_every=6)
    policy: PolicyConfig = PolicyConfig()
    versions: VersionsConfig = VersionsConfig()
    learner: LearnerRules = LearnerRules()
    storage: str = "local"             # "local" | "s3" (a SeaweedFS server owned by the run) | "wan" (below)
    regions: int = 2                   # storage "wan": a SeaweedFS server per region, learner m in r(m mod N),
    wan: str = "rtt=100ms,bw=100mbit"  # and this link on every cross-region path (infra/wan_topology.py)
    pace_s: float | None = None        # every learner paced to this step time (ddiloco learner --pace; slow applies)
    sync_process: bool = False         # learners run their sync agent in a child process (--sync-process)
    model: str = "tiny"
    seed: int = 0
    ack_timeout_s: float = 1.0
    poll_s: float = 0.5
    checkpoint_every: int = 10
    retain_bytes: str = "auto"         # the syncer's --retain-bytes (its default; "none": the commit rule only)
    shards: int | None = None          # data shards of the job (default: learners)

    def __post_init__(self) -> None:
        if self.learners < 1 or self.steps < 1:
            raise ValueError(f"learners ({self.learners}) and steps ({self.steps}) must be >= 1")
        if self.storage not in ("local", "s3", "wan"):
            raise ValueError(f"storage must be 'local', 's3' or 'wan', got {self.storage!r}")
        if self.storage == "wan" and self.regions < 2:
            raise ValueError(f"storage 'wan' needs regions >= 2, got {self.regions}")
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {sorted(MODELS)}, got {self.model!r}")
        for lid, f in ((None, self.slow), *self.slow_by):
            if not f >= 1.0:
                raise ValueError(f"slow factor{' of ' + lid if lid else ''} must be >= 1, got {f}")

    def learner_ids(self) -> list[str]:
        return learner_names(self.learners)

    def slow_of(self, lid: str) -> float:
        return dict(self.slow_by).get(lid, self.slow)

    def placement(self) -> Placement:
        """Where the run's learners live: round robin over the regions with storage "wan"."""
        regions = [f"r{r}" for r in range(self.regions)] if self.storage == "wan" else []
        return Placement.round_robin(self.learner_ids(), regions)

    def region_of(self, lid: str) -> str | None:
        """Learner ``lid``'s region with storage "wan", else None."""
        return self.placement().region(lid)


@dataclass
class Mark:
    t: float
    who: str
    what: str
    detail: str = ""

    def to_dict(self) -> dict:
        return {"t": round(self.t, 4), "who": self.who, "what": self.what, "detail": self.detail}


class ChaosRun:
    """A chaos run: its run, S3 server and relays, and its processes (a ``workers.cluster.LocalCluster``
    whose every lever is written to ``timeline``)."""

    def __init__(self, spec: RunSpec, out: str | Path, env: dict | None = None,
                 clock: Callable[[], float] = time.time):
        self.spec = spec
        self.out = Path(out).resolve()
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        self.clock = clock
        self.timeline: list[Mark] = []
        self.s3 = None
        self.uri = ""
        self.descriptor: RunDescriptor | None = None
        self.syncer_ports: tuple[int, int] = (0, 0)     # picked in create(), after the storage servers
        self.relays: tuple[Relay, Relay] | None = None
        self.keydir = self.out / "keys"
        self._saved_env: dict[str, str | None] = {}
        self._env = env
        self.cluster: LocalCluster | None = None
        self.last_drain: DrainStatus | None = None
        self.topology = None              # storage "wan": infra.wan_topology.WanTopology

    # -- set-up ----------------------------------------------------------------------------------
    @property
    def store(self) -> ObjectStore:
        return open_store(self.uri)

    @property
    def lives(self) -> dict[str, list[Life]]:
        return self.cluster.lives if self.cluster is not None else {}

    @property
    def env(self) -> dict:
        return self.cluster.env

    def mark(self, who: str, what: str, detail: str = "") -> None:
        self.timeline.append(Mark(self.clock(), who, what, detail))

    def create(self) -> RunDescriptor:
        """Storage (a directory, or a fresh S3 server), keys, the run, the relays, the cluster."""
        spec = self.spec
        env = dict(self._env if self._env is not None else os.environ)
        if spec.storage == "s3":
            from infra.s3server import S3Server
            self.s3 = S3Server(self.out / "s3").start()
            env.update(self.s3.env())
            self._saved_env = {k: os.environ.get(k) for k in self.s3.env()}
            os.environ.update(self.s3.env())   # this process opens the same store (restored by close())
            self.uri = self.s3.uri(f"chaos-{time.time_ns()}")
        elif spec.storage == "wan":
            self.uri = self._start_topology()
        else:
            self.uri = str(self.out / "store")
        gcfg, batch, max_bytes = MODELS[spec.model]
        job = JobSettings(steps=spec.steps, batch_size=batch, max_bytes=max_bytes, shards=spec.shards or spec.learners)
        settings = RunSettings(schedule=spec.schedule, policy=spec.policy, versions=spec.versions, learner=spec.learner,
                               seed=spec.seed, model=gcfg.to_dict(), job=job.to_dict(),
                               regions=self.topology.regions if self.topology else None)
        self.descriptor, _ = create_job_run(self.store, settings, gcfg, spec.seed, self.keydir, spec.learner_ids(),
                                            also_listed=[ROGUE])
        # The syncer's ports are picked now, after the S3 servers and WAN links bound theirs: a port
        # picked free earlier is not reserved, and the WAN topology's SeaweedFS servers (about ten
        # ports each, picked the same way) once held one by the time the syncer bound it ("Address
        # already in use", then 120 s waiting for a first merge: a clean-clone CI run).
        self.syncer_ports = (free_port(), free_port())
        self.relays = (Relay(self.syncer_ports[0], name="ingest").start(),
                       Relay(self.syncer_ports[1], name="announce").start())
        ing, ann = (f"tcp://127.0.0.1:{port}" for port in self.syncer_ports)
        ccfg = ClusterConfig(self.uri, self.out, keydir=self.keydir, ingest=ing, announce=ann, env=env,
                             stop_timeout_s=25.0)
        if self.topology is not None:
            from infra.wan_topology import RegionCluster
            self.cluster = RegionCluster(ccfg, self.topology, clock=self.clock, observer=self.mark)
        else:
            self.cluster = LocalCluster(ccfg, clock=self.clock, observer=self.mark)
        self.mark("run", "created", f"{self.descriptor.run_id} at {self.uri}")
        return self.descriptor

    def _start_topology(self) -> str:
        """Storage "wan": the regions' servers and links; this process becomes a home-side one
        (restored by close()). Returns the home store's URI."""
        from infra.wan_topology import AWS_VARS, WanConfig, WanTopology
        spec = self.spec
        self.topology = WanTopology(self.out, WanConfig.parse(spec.regions, spec.wan, seed=spec.seed,
                                                              prefix=f"chaos-{time.time_ns()}")).start()
        self._saved_env = {k: os.environ.get(k) for k in (*AWS_VARS, *self.topology.env("r0", {}))}
        self.topology.use_home_env()
        return self.topology.store_uri

    def _started(self) -> LocalCluster:
        if self.cluster is None:
            raise RuntimeError("ChaosRun.create() first: there is no run to start processes for")
        return self.cluster

    # -- processes -------------------------------------------------------------------------------
    def start_syncer(self, name: str = "syncer", fault: str | None = None,
                     ports: tuple[int, int] | None = None) -> Life:
        """Start a syncer on ``ports`` (default the run's): ``ddiloco syncer``, or with ``fault``
        (``crash-before-commit[:N]``, this life only) the same syncer built by
        ``python -m infra.chaos.faulty_syncer --crash-before-commit N`` (docs/chaos.md)."""
        cluster = self._started()
        endpoints = tuple(f"tcp://127.0.0.1:{port}" for port in ports) if ports else None
        extra = ["--checkpoint-every", str(self.spec.checkpoint_every), "--retain-bytes", self.spec.retain_bytes]
        if fault:
            return cluster.start_syncer(name, ["--crash-before-commit", str(crash_count(fault)), *extra],
                                        module="infra.chaos.faulty_syncer", endpoints=endpoints)
        return cluster.start_syncer(name, extra, endpoints=endpoints)

    def start_learner(self, lid: str, steps: int | None = None, slow: float | None = None, shard: int | None = None,
                      pace_s: float | None = None, jitter: float = 0.0, seed: int = 0,
                      wait_for: Path | None = None, data_seed: int | None = None) -> Life:
        """A ``ddiloco learner`` process, connected through the relays. With ``pace_s`` each step
        lasts ``pace_s * slow``, times a random factor of std ``jitter`` (``--pace``); ``wait_for``:
        it loads, then waits for that file before joining; ``data_seed``: its own batch order."""
        cluster = self._started()
        relays = (self.relays[0].endpoint, self.relays[1].endpoint)
        region = self.spec.region_of(lid)
        if region is not None and region != "r0":    # across the WAN link, not the local relays
            relays = self.topology.learner_bus(region) or relays
        pace_s = self.spec.pace_s if pace_s is None else pace_s
        extra = ["--region", region] if region is not None else []
        extra += ["--ack-timeout", str(self.spec.ack_timeout_s), "--poll", str(self.spec.poll_s),
                 "--slow", str(slow if slow is not None else self.spec.slow_of(lid))]
        if steps is not None:
            extra += ["--steps", str(steps)]
        if self.spec.sync_process:
            extra += ["--sync-process"]
        if shard is not None:
            extra += ["--shard", str(shard)]
        if pace_s is None:
            return cluster.start_learner(lid, extra, endpoints=relays)
        extra += ["--pace", str(pace_s), "--jitter", str(jitter), "--jitter-seed", str(seed)]
        extra += (["--wait-for", str(wait_for)] if wait_for else []) + \
            (["--data-seed", str(data_seed)] if data_seed is not None else [])
        return cluster.start_learner(lid, extra, endpoints=relays)

    def make_key(self, lid: str) -> None:
        """A key pair for a learner that will join later (``add_learner`` lists it)."""
        ensure_identities(self.keydir, [lid])

    def add_learner(self, lid: str) -> None:
        """List a new learner in the running (signed) run: a key pair and a membership record
        signed with the syncer's key, as ``ddiloco keys DIR ID --join STORE --authority ...`` does."""
        from workers.bus.keys import add_member, load_identity
        ident = ensure_identities(self.keydir, [lid])[lid]
        add_member(self.store, self.descriptor, load_identity(key_paths(self.keydir, SYNCER)[1]), ident.public)
        self.mark(lid, "listed")

    def global_loss(self) -> float:
        """Held-out loss of the global model as it stands in storage (never pauses anyone)."""
        return self._started().global_loss(self.descriptor)

    def life(self, name: str) -> Life:
        return self._started().life(name)

    def alive(self, name: str) -> bool:
        return self.cluster is not None and self.cluster.alive(name)

    def kill(self, name: str) -> None:
        """SIGKILL (the process group): no clean-up, no drain."""
        self._started().kill(name)

    def kill_agent(self, lid: str) -> bool:
        """SIGKILL the sync agent (``workers.learner.agent_main``, a child of learner ``lid`` run with
        ``--sync-process``) and nothing else: the learner must replace it and train on (issue 25
        item 6). False when the learner has no live agent."""
        if not self.alive(lid):
            return False
        victims = [pid for pid in _descendants(self.life(lid).popen.pid) if b"workers.learner.agent_main" in _cmdline(pid)]
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if victims:
            self.mark(lid, "kill-agent", f"pids {victims}")
        return bool(victims)

    def pause(self, name: str) -> None:
        self._started().pause(name)

    def resume(self, name: str) -> None:
        self._started().resume(name)

    def terminate(self, name: str) -> None:
        """SIGTERM: a clean stop (a learner drains its deltas first)."""
        self._started().terminate(name)

    def poll(self) -> None:
        """Notice processes that exited on their own (their end time is the time of noticing)."""
        if self.cluster is not None:
            self.cluster.poll()

    # -- storage and network faults -------------------------------------------------------------
    def s3_down(self) -> None:
        if self.s3 is None:
            raise ValueError("s3_down needs a run on S3 (RunSpec.storage='s3')")
        self.s3.kill()
        self.mark("s3", "down")

    def s3_up(self) -> None:
        self.s3.start()
        self.mark("s3", "up")

    def blackhole(self) -> None:
        for r in self.relays:
            r.blackhole()
        self.mark("bus", "blackhole")

    def restore(self) -> None:
        for r in self.relays:
            r.restore()
        self.mark("bus", "restore")

    def partition_region(self, region: str, mode: str = "reset") -> None:
        """Cut every link between home and ``region`` (storage "wan"): S3 both ways and the bus;
        ``reset`` (connections fail at once) or ``hold`` (a blackhole: every byte and new
        connection stalls until the heal, as on a real partition; infra/wan.py)."""
        self.topology.partition(region, mode)
        self.mark(region, "partition", mode)

    def heal_region(self, region: str) -> None:
        self.topology.heal(region)
        self.mark(region, "heal")

    def retarget(self, ports: tuple[int, int]) -> None:
        """Point the relays at another syncer's ports (a syncer that takes over elsewhere)."""
        for r, port in zip(self.relays, ports):
            r.retarget(port)
        self.mark("bus", "retarget", f"ports {ports}")

    # -- observation -----------------------------------------------------------------------------
    def events(self, name: str) -> list[dict]:
        return self._started().events(name)

    def stderr(self, name: str) -> str:
        """The tail of a process's stderr (every life of it, appended)."""
        return self.cluster.stderr(name) if self.cluster is not None else ""

    def learner_names(self) -> list[str]:
        return self.cluster.names(LEARNER_ROLE) if self.cluster is not None else []

    def syncer_names(self) -> list[str]:
        return self.cluster.names(SYNCER_ROLE) if self.cluster is not None else []

    def commits(self) -> list[CommitRecord]:
        log = CommitLog(self.store)
        return list(log.read_range(0, log.tail() + 1))

    def tail(self) -> int:
        try:
            return CommitLog(self.store).tail()
        except StoreError:
            return -1

    def merges(self) -> int:
        """Merge commits so far (cheap enough for a tiny run's log)."""
        try:
            return sum(r.kind == "merge" for r in self.commits())
        except StoreError:
            return -1

    def wait_for(self, cond: Callable[[], bool], timeout_s: float, what: str, tick: Callable[[], None] = None) -> None:
        self._started().wait_for(cond, timeout_s, what, tick)

    def learners_done(self) -> bool:
        return self.cluster is None or self.cluster.learners_done()

    def settled(self, timeout_s: float) -> bool:
        """Like ``drain`` but marks nothing: whether the syncer committed every durable delta within
        ``timeout_s`` (a mid-run look, not the run's verdict)."""
        return self._started().wait_drained(timeout_s).ok

    def drain(self, timeout_s: float = 60.0) -> bool:
        """After the learners exit: True once the syncer has committed (and logged) every durable
        delta of the real learners (``LocalCluster.drain_status``; a rogue's refused objects stay)."""
        status = self.last_drain = self._started().wait_drained(timeout_s)
        if not status.ok:
            self.mark("run", "not-drained", str(status))
        return status.ok

    def stop_all(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()

    def close(self) -> None:
        """Stop every process, the relays and the S3 server (the run's files stay in OUT)."""
        try:
            self.stop_all()
        finally:
            if self.relays is not None:
                for r in self.relays:
                    r.stop()
            if self.topology is not None:
                self.topology.close()
            if self.s3 is not None:
                self.s3.stop()
            if self.s3 is not None or self.topology is not None:
                for k, v in self._saved_env.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v

    def __enter__(self) -> "ChaosRun":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                ppid = int(fh.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out
