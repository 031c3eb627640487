"""Helpers for end-to-end tests: a tiny default-job run driven as real processes.

``TinyRun`` is a thin test front of ``workers.cluster.LocalCluster`` (the orchestrator behind
``ddiloco run`` and ``ddiloco chaos``): the cluster spawns, signals and stops the processes and
decides when the run is drained; this adds the tiny model and the names the tests use.
Secure by default like ``ddiloco run``: ``create`` makes keys for the syncer and every learner in
``DIR/keys`` and a signed run; ``TinyRun(..., secure=False)`` makes an unsigned one (--insecure)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.descriptor import LearnerRules
from pipeline.outer import OuterConfig
from storage.store import open_store
from workers.cluster import ClusterConfig, LocalCluster, create_job_run, free_port, global_eval_loss
from workers.job.data import Corpus, evaluate
from workers.common.events import EventLog
from workers.job.job import JobSettings
from workers.launch import RunSettings, Schedule
from workers.job.model import GPTConfig

__all__ = ["TINY", "TinyRun", "Recorder", "free_port"]

TINY = GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=32)


def finished_demo_run(out: Path, steps: int) -> Path:
    """A finished 2-learner `ddiloco run` of a tiny model in ``out`` (a module fixture's directory)."""
    cmd = [sys.executable, "-m", "workers.cli", "run", "--learners", "2", "--steps", str(steps), "--fragments", "3",
           "--sync-every", "6", "--layers", "1", "--width", "32", "--batch-size", "4", "--plain",
           "--eval-every", "1000", "--out", str(out)]
    done = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=200)
    assert done.returncode == 0 and (out / "summary.json").exists(), done.stdout[-3000:] + done.stderr[-3000:]
    return out


@dataclass
class TinyRun:
    uri: str
    dir: Path
    env: dict
    steps: int = 150
    learners: int = 2
    ingest: str = ""
    announce: str = ""
    secure: bool = True
    cluster: LocalCluster = field(init=False)

    def __post_init__(self) -> None:
        self.dir = Path(self.dir)
        self.cluster = LocalCluster(ClusterConfig(self.uri, self.dir, keydir=self.keydir if self.secure else None,
                                                  ingest=self.ingest, announce=self.announce, env=self.env))
        self.ingest, self.announce = self.cluster.ingest, self.cluster.announce

    @property
    def keydir(self) -> Path:
        return self.dir / "keys"

    @property
    def procs(self) -> dict[str, subprocess.Popen]:
        """The current process of every role started so far."""
        return {name: lives[-1].popen for name, lives in self.cluster.lives.items()}

    def key_args(self, name: str) -> list[str]:
        return self.cluster.key_args(name)

    @property
    def store(self):
        return open_store(self.uri)

    def create(self, **settings) -> None:
        job = JobSettings(steps=self.steps, batch_size=4, lr=3e-3, max_bytes=300_000, shards=self.learners)
        # momentum 0.9 (the flat settings' default before issue 27): at this tiny run's H = 6 the global
        # model then gains > 1 nat within the tests' budget; at the new runs' 0.5 a CI run fell short (5.31 vs 4.54)
        kw = dict(schedule=Schedule(fragments=3, sync_every=6), outer=OuterConfig(momentum=0.9), model=TINY.to_dict(),
                  job=job.to_dict())
        kw.update(settings)
        names = [f"l{m}" for m in range(self.learners)]
        self.descriptor, model = create_job_run(self.store, RunSettings(**kw), TINY, 0,
                                                self.keydir if self.secure else None, names)
        self.corpus = Corpus(job.data_config(TINY.block_size))
        self.init_loss = evaluate(model, self.corpus)

    def _spawn(self, name: str, args: list[str], bus: bool = True, ingest: str | None = None) -> subprocess.Popen:
        """``ddiloco <args>`` as role ``args[0]`` with the run's store, bus and log (keys are the caller's)."""
        argv = [*args, *self.cluster.bus_args(bus, ingest)]
        return self.cluster.spawn(name, args[0], argv).popen

    def syncer(self, name: str = "syncer", bus: bool = True, ingest: str | None = None) -> subprocess.Popen:
        return self.cluster.start_syncer(name, bus=bus, endpoints=(ingest, None) if ingest else None).popen

    def learner(self, lid: str, steps: int | None = None, extra: list[str] = (), bus: bool = True,
                ingest: str | None = None) -> subprocess.Popen:
        more = [*(["--steps", str(steps)] if steps else []), *extra]
        return self.cluster.start_learner(lid, more, bus=bus, endpoints=(ingest, None) if ingest else None).popen

    def wait(self, name: str, timeout: float = 120) -> int:
        return self.procs[name].wait(timeout=timeout)

    def events(self, name: str) -> list[dict]:
        return self.cluster.events(name)

    def wait_inbox_empty(self, timeout: float = 60) -> bool:
        """Drained: every durable delta of the learners committed and logged (``LocalCluster.drain_status``)."""
        self.drain_status = self.cluster.wait_drained(timeout)
        return self.drain_status.ok

    def stop_all(self) -> None:
        self.cluster.stop()

    def kill_all(self) -> None:
        for name in self.cluster.names():
            self.cluster.signal(name, signal.SIGKILL)

    def global_loss(self) -> float:
        return global_eval_loss(self.store, self.descriptor, self.corpus)[0]

    def stderr(self, name: str) -> str:
        return self.cluster.stderr(name)




class ManualClock:
    """An injected clock the test moves by hand (``clock.t += dt``)."""

    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def wait_for(cond, timeout: float = 20.0, what: str = "condition", poll_s: float = 0.2) -> None:
    """Poll ``cond`` every ``poll_s`` until it holds; AssertionError naming ``what`` after
    ``timeout`` seconds (a deadline, not a wait: it returns as soon as the condition holds)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(poll_s)
    raise AssertionError(f"timed out waiting for {what}")


def last_step(run: "TinyRun", lid: str) -> int:
    """The newest step learner ``lid`` of ``run`` reported (0 before any)."""
    return max([e["step"] for e in run.events(lid) if e.get("event") == "step"], default=0)



class FakeReceiver:
    """Stands in for a learner's receiver thread (a ``VersionReceiver``, workers/learner/io.py): the
    test says which rounds are open and what arrives."""

    def __init__(self):
        self.rounds: dict[int, tuple[int, int]] = {}
        self.arrivals: list = []
        self.errors = self.refused = self.bytes_received = self.awaited = self.copy_misses = 0
        self.copy_wait_s = 0.0
        self.failed = None

    def start(self):
        pass

    def opened(self):
        return dict(self.rounds)

    def take(self):
        out, self.arrivals = self.arrivals, []
        return out

    def stop(self):
        pass


def rounds_learner(tmp_path, keep_progress=False, fragments=1, sync_every=4):
    """A started learner (one fragment, H = 4 unless told) whose receiver is a ``FakeReceiver``: (learner,
    model, step, events), ``step()`` one inner step; its events go to ``tmp_path/l0.jsonl``."""
    import torch
    from workers.launch import create_run
    from workers.learner.learner import Learner

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    store = open_store(str(tmp_path / "store"))
    init = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    create_run(store, init, RunSettings(schedule=Schedule(fragments=fragments, sync_every=sync_every),
                                        learner=LearnerRules(keep_progress=keep_progress)), embedding_tensors=())
    events = EventLog(tmp_path / "l0.jsonl", "learner", "l0")
    learner = Learner(model, torch.optim.SGD(model.parameters(), lr=0.1), store, "l0", events=events).start()
    learner.receiver.stop()
    learner.receiver = FakeReceiver()
    x, y = torch.ones(3, 4), torch.zeros(3, 2)
    step = lambda: learner.step(lambda: ((model(x) - y) ** 2).mean(), tokens=3)   # noqa: E731
    return learner, model, step, events


class Recorder(EventLog):
    """An event log kept in memory, for tests that read what a component reported."""

    def __init__(self):
        super().__init__(None, "learner", "l0")
        self.seen: list[dict] = []

    def emit(self, event, **fields):
        self.seen.append({"event": event, **fields})

    def named(self, event):
        return [e for e in list(self.seen) if e["event"] == event]


def syncer_thread(store, *, bus=None, keys=None, until=lambda s: False, timeout: float = 20.0, **cfg):
    """An in-process syncer (recovered, its bus open) running on a thread until ``until(syncer)`` or
    ``timeout`` seconds; returns ``(syncer, thread)``. ``cfg``: SyncerConfig fields (spill poll 0.1 s)."""
    import threading
    import time

    from workers.syncer.syncer import Syncer, SyncerConfig
    syncer = Syncer(store, SyncerConfig(**{"spill_poll_s": 0.1, **cfg}), bus=bus, keys=keys)
    syncer.recover()
    syncer.open_bus()
    deadline = time.time() + timeout
    t = threading.Thread(target=syncer.run, args=(lambda: until(syncer) or time.time() > deadline,))
    t.start()
    return syncer, t
