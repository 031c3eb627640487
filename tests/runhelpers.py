"""Helpers for end-to-end tests: a tiny default-job run driven as real processes.

Secure by default like ``ddiloco run``: ``create`` makes keys for the syncer and every learner in
``DIR/keys`` and a signed run; ``TinyRun(..., secure=False)`` makes an unsigned one (--insecure)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from storage.store import open_store
from workers.data import Corpus, evaluate
from workers.events import EventLog, read_events
from workers.job import JobSettings
from workers.keys import SYNCER, ensure_identities, key_paths
from workers.launch import RunSettings, create_run
from workers.model import EMBEDDING_TENSORS, GPT, GPTConfig, build_model
from workers.versions import VersionTracker

TINY = GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=32)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class TinyRun:
    uri: str
    dir: Path
    env: dict
    steps: int = 150
    learners: int = 2
    procs: dict = field(default_factory=dict)
    ingest: str = ""
    announce: str = ""
    secure: bool = True

    def __post_init__(self) -> None:
        self.ingest = f"tcp://127.0.0.1:{free_port()}"
        self.announce = f"tcp://127.0.0.1:{free_port()}"
        (self.dir / "logs").mkdir(parents=True, exist_ok=True)

    @property
    def keydir(self) -> Path:
        return self.dir / "keys"

    def key_args(self, name: str) -> list[str]:
        if not self.secure:
            return ["--insecure"]
        if name == SYNCER:
            return ["--key", str(key_paths(self.keydir, SYNCER)[1])]
        return ["--keys", str(self.keydir)]

    @property
    def store(self):
        return open_store(self.uri)

    def create(self, **settings) -> None:
        job = JobSettings(steps=self.steps, batch_size=4, lr=3e-3, max_bytes=300_000, shards=self.learners)
        model = build_model(TINY, 0)
        init = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
        kw = dict(fragments=3, sync_every=6, model=TINY.to_dict(), job=job.to_dict())
        kw.update(settings)
        names = [f"l{m}" for m in range(self.learners)]
        self.idents = ensure_identities(self.keydir, [SYNCER, *names]) if self.secure else {}
        self.descriptor = create_run(self.store, init, RunSettings(**kw), embedding_tensors=EMBEDDING_TENSORS,
                                     syncer=self.idents.get(SYNCER),
                                     learners=[self.idents[n].public for n in names] if self.secure else ())
        self.corpus = Corpus(job.data_config(TINY.block_size))
        self.init_loss = evaluate(model, self.corpus)

    def _spawn(self, name: str, args: list[str], bus: bool = True, ingest: str | None = None) -> subprocess.Popen:
        busargs = ["--ingest", ingest or self.ingest, "--announce", self.announce] if bus else ["--no-bus"]
        cmd = [sys.executable, "-m", "workers.cli", *args, "--store", self.uri, *busargs,
               "--log", str(self.dir / "logs" / f"{name}.jsonl")]
        err = open(self.dir / "logs" / f"{name}.stderr", "a")
        p = subprocess.Popen(cmd, env=self.env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        self.procs[name] = p
        return p

    def syncer(self, name: str = "syncer", **kw) -> subprocess.Popen:
        return self._spawn(name, ["syncer", "--id", name, *self.key_args(SYNCER)], **kw)

    def learner(self, lid: str, steps: int | None = None, extra: list[str] = (), **kw) -> subprocess.Popen:
        args = ["learner", "--id", lid, *(["--steps", str(steps)] if steps else []), *self.key_args(lid), *extra]
        return self._spawn(lid, args, **kw)

    def wait(self, name: str, timeout: float = 120) -> int:
        return self.procs[name].wait(timeout=timeout)

    def events(self, name: str) -> list[dict]:
        return read_events(self.dir / "logs" / f"{name}.jsonl")

    def wait_inbox_empty(self, timeout: float = 60) -> bool:
        from storage.layout import SPILL_PREFIX
        deadline = time.time() + timeout
        while time.time() < deadline:
            if not self.store.list(SPILL_PREFIX):
                return True
            time.sleep(0.3)
        return False

    def stop_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()

    def kill_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)

    def global_loss(self) -> float:
        values, _ = VersionTracker(self.store, self.descriptor).load_all()
        model = GPT(TINY)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(torch.from_numpy(values[n].copy()))
        return evaluate(model, self.corpus)

    def stderr(self, name: str) -> str:
        return (self.dir / "logs" / f"{name}.stderr").read_text()[-3000:]


class Recorder(EventLog):
    """An event log kept in memory, for tests that read what a component reported."""

    def __init__(self):
        super().__init__(None, "learner", "l0")
        self.seen: list[dict] = []

    def emit(self, event, **fields):
        self.seen.append({"event": event, **fields})

    def named(self, event):
        return [e for e in list(self.seen) if e["event"] == event]
