"""An evaluator that follows the log: the held-out loss of every new global model, for any run (issue 28).

SPEC §7 "Evaluation": the global model is what storage holds - the newest version of every fragment
- so an evaluator is one more reader of the run, like a learner that never trains: it never pauses
a learner or the syncer. It polls the log, and when commits were added since its last evaluation
it loads the global model into ``model``, calls ``evaluate(model) -> loss`` and logs an ``eval``
event (``loss``, ``tokens`` merged so far, the fragments' ``versions``, the log position ``seq``)
- the event ``ddiloco launch``'s summary, ``report.png`` and ``ddiloco dashboard`` read.

    evaluator = Evaluator(model)                 # under `ddiloco launch --eval`: the run from DDILOCO_*
    evaluator.follow(lambda m: held_out_loss(m)) # until SIGTERM; one last evaluation before it returns

``ddiloco evaluate --store URI`` runs one for the project's own demo job (workers/job), so a run
started by hand with ``ddiloco syncer``/``ddiloco learner`` shows its global model's quality too.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Callable

import numpy as np
import torch

from pipeline.descriptor import RunDescriptor
from storage.errors import StoreError
from storage.layout import read_descriptor
from storage.log import CommitLog
from storage.proposal import wait_for_run
from storage.shards import shard_stores
from storage.store import ObjectStore, open_store
from workers.common.events import EventLog
from workers.learner.bootstrap import stop_requested
from workers.learner.env import LearnerEnv
from workers.learner.shards import learner_tracker

ROLE = "evaluator"


class Evaluator:
    """Follows one run's log and evaluates each new global model (module docstring)."""

    def __init__(self, model: torch.nn.Module, store: str | ObjectStore | None = None, events: EventLog | None = None,
                 poll_s: float = 2.0, wait_s: float = 600.0, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        if not poll_s > 0:
            raise ValueError(f"Evaluator poll_s must be > 0 seconds, got {poll_s}")
        if store is None:
            env = LearnerEnv.from_environ()
            if env is None:
                raise ValueError("Evaluator needs store=, or the environment `ddiloco launch --eval` sets "
                                 "(DDILOCO_STORE: docs/running.md \"The environment contract\")")
            store = open_store(env.store, s3_endpoint=env.s3_endpoint, create=False)
            events = events or EventLog(env.log, ROLE, env.learner_id)
            wait_s = env.propose_wait_s + 60.0
        self.model = model
        self.store = open_store(store, create=False) if isinstance(store, str) else store
        self.events = events or EventLog(None, ROLE, ROLE)
        self.poll_s, self.wait_s, self.clock, self.sleep = poll_s, wait_s, clock, sleep
        self.params = dict(model.named_parameters())
        self.descriptor: RunDescriptor | None = None
        self.evaluations = 0
        self._seen: list[int] = []       # each shard's log position already folded into ``tokens``
        self.tokens = 0

    def follow(self, evaluate: Callable[[torch.nn.Module], float], stop: Callable[[], bool] | None = None) -> int:
        """Evaluate every new global model until ``stop()`` (default: SIGTERM/SIGINT), then once more
        if commits came since; returns how many evaluations it logged."""
        stop = stop or stop_requested().is_set
        d = self.descriptor = wait_for_run(self.store, self.wait_s, self.clock, self.sleep)
        tracker = learner_tracker(self.store, d)
        logs = [CommitLog(s) for s in shard_stores(self.store, d)]
        self._seen = [-1] * len(logs)
        while True:
            last = stop()
            try:
                if self._advance(logs):
                    self.once(tracker, evaluate)
            except StoreError as exc:   # the store is away for a moment: report, try again later
                self.events.emit("eval-skipped", error=str(exc)[:300])
            if last:
                return self.evaluations
            self.sleep(self.poll_s)

    def _advance(self, logs: list[CommitLog]) -> bool:
        """Read the commits added since the last look (their merged tokens); True when there were any."""
        moved = False
        for i, log in enumerate(logs):
            tail = log.tail()
            if tail > self._seen[i]:
                for rec in log.read_range(self._seen[i] + 1, tail + 1):
                    if rec.kind == "merge":
                        self.tokens += sum(inp.c_tokens for inp in rec.inputs)
                self._seen[i] = tail
                moved = True
        return moved

    @torch.no_grad()
    def once(self, tracker, evaluate: Callable[[torch.nn.Module], float]) -> float:
        values, versions = tracker.load_all()
        missing = sorted(set(self.params) - set(values))
        if missing:
            raise ValueError(f"the evaluator's model does not match run {self.descriptor.run_id}: {missing[:5]} "
                             "are not in it")
        for n, p in self.params.items():
            p.copy_(torch.from_numpy(np.array(values[n], copy=True)))
        was_training = self.model.training
        self.model.eval()
        try:
            loss = float(evaluate(self.model))
        finally:
            self.model.train(was_training)
        self.evaluations += 1
        self.events.emit("eval", loss=loss, tokens=self.tokens, seq=max(self._seen),
                         versions={str(p): v for p, v in sorted(versions.items())})
        return loss


def configure(parser: argparse.ArgumentParser):
    """Follow a run of the demo job and log the held-out loss of each new global model."""
    parser.add_argument("--store", required=True, help="the run's location: a directory or s3://bucket/prefix")
    parser.add_argument("--s3-endpoint", default=None, help="S3 endpoint URL (default: AWS_ENDPOINT_URL or AWS)")
    parser.add_argument("--log", default=None, help="JSONL event log (default: stdout); put it beside the run's "
                                                    "other logs for ddiloco dashboard --events DIR")
    parser.add_argument("--every", type=float, default=10.0, metavar="SECONDS", help="seconds between looks at the log")

    def handler(args) -> int:
        if not args.every > 0:
            raise SystemExit(f"--every must be > 0 seconds, got {args.every}")
        from workers.job.data import Corpus, evaluate
        from workers.job.job import job_from
        from workers.job.model import GPT
        store = open_store(args.store, s3_endpoint=args.s3_endpoint, create=False)
        desc = read_descriptor(store)
        if desc.job is None:
            raise SystemExit(f"run {desc.run_id} is not a run of the demo job (its model is the user's own): evaluate "
                             "it from the training script with workers.evaluator.Evaluator (ddiloco launch --eval)")
        gcfg, job = job_from(desc)
        corpus = Corpus(job.data_config(gcfg.block_size))
        torch.set_num_threads(1)
        events = EventLog(args.log, ROLE, ROLE, echo=None if args.log else sys.stdout)
        n = Evaluator(GPT(gcfg), store, events, poll_s=args.every).follow(lambda m: evaluate(m, corpus))
        events.close()
        return 0 if n else 1
    return handler
