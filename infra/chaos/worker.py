"""A paced learner process for the chaos experiments (heterogeneous speeds, scavenging, goodput).

``python -m infra.chaos.worker --store URI --id l0 --keys DIR --pace 0.05 --slow 1.18 --jitter 0.1``
is ``ddiloco learner`` (same Learner, model, data and keys: ``workers.job``) except that every
inner step is padded to last ``pace * slow * (1 + jitter * z)`` seconds, z a standard normal drawn
from ``--seed`` (clipped so a step never lasts under half its mean). Padding rather than stretching
makes a learner's speed a controlled quantity even on a busy machine, which is what the paper's
heterogeneous-speed setting needs (half the learners ~18% slower plus 10% step-time variance).
SIGTERM stops it cleanly (its deltas drain first).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

import numpy as np
import torch

from storage.layout import read_descriptor
from storage.store import open_store
from workers.bus import BusConfig
from workers.data import Corpus
from workers.events import EventLog
from workers.job import job_from, make_optimizer, set_lr
from workers.keys import SYNCER, KeyRing, key_paths, load_identity, load_public
from workers.learner import Learner, LearnerConfig
from workers.model import GPT
from workers.sender import SenderConfig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m infra.chaos.worker", description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True)
    p.add_argument("--id", required=True)
    p.add_argument("--keys", required=True, help="key directory (<id>.key_secret and syncer.key)")
    p.add_argument("--ingest", required=True)
    p.add_argument("--announce", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--shard", type=int, default=None)
    p.add_argument("--pace", type=float, required=True, help="mean step time in seconds at --slow 1")
    p.add_argument("--slow", type=float, default=1.0)
    p.add_argument("--jitter", type=float, default=0.0, help="std of the per-step time factor")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ack-timeout", type=float, default=1.0)
    p.add_argument("--poll", type=float, default=0.5)
    p.add_argument("--wait-for", default=None, help="after importing, wait for this file before joining")
    p.add_argument("--data-seed", type=int, default=None, help="batch order seed (default: the run's)")
    args = p.parse_args(argv)
    if not args.pace > 0 or args.slow < 1.0 or not 0.0 <= args.jitter < 0.5:
        raise SystemExit(f"need --pace > 0, --slow >= 1 and 0 <= --jitter < 0.5 (got {args.pace}, {args.slow}, "
                         f"{args.jitter})")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    torch.set_num_threads(1)
    store = open_store(args.store)
    desc = read_descriptor(store)
    gcfg, job = job_from(desc)
    keys = KeyRing(load_identity(key_paths(args.keys, args.id)[1]), load_public(key_paths(args.keys, SYNCER)[0]))
    events = EventLog(args.log, "learner", args.id)
    cfg = LearnerConfig(sender=SenderConfig(ack_timeout_s=args.ack_timeout), poll_s=args.poll, keys=keys)
    model = GPT(gcfg)
    learner = Learner(model, make_optimizer(model, job), store, args.id, cfg,
                      bus=BusConfig(args.ingest, args.announce), events=events)
    shard = args.shard if args.shard is not None else int("".join(c for c in args.id if c.isdigit()) or 0)
    seed = desc.seed if args.data_seed is None else args.data_seed
    batches = Corpus(job.data_config(gcfg.block_size)).batches(shard % job.shards, job.shards, seed)
    rng = np.random.default_rng([args.seed, shard])
    while args.wait_for and not os.path.exists(args.wait_for):   # a spare machine, booted, not yet joined
        if stop.wait(0.05):
            return 0
    learner.start()
    n = args.steps if args.steps is not None else job.steps
    for i in range(n):
        if stop.is_set():
            break
        x, y = next(batches)
        set_lr(learner.optimizer, job, i)
        t0 = time.monotonic()
        learner.step(lambda: model(x, y)[1], tokens=x.numel())
        factor = args.slow * max(0.5, 1.0 + args.jitter * float(rng.standard_normal()))
        time.sleep(max(0.0, args.pace * factor - (time.monotonic() - t0)))
    drained = learner.close()
    stats = {"steps": learner.step_count, "tokens": learner.tokens, "drained": drained, **learner.stats()}
    events.emit("learner-done", **stats)
    print(json.dumps(stats))
    return 0 if drained else 4


if __name__ == "__main__":
    sys.exit(main())
