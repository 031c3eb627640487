"""A paced learner process for the chaos experiments (heterogeneous speeds, scavenging, goodput).

``python -m infra.chaos.worker --store URI --id l0 --keys DIR --pace 0.05 --slow 1.18 --jitter 0.1``
is ``ddiloco learner`` (the same ``workers.job.job.learner_process``: Learner, model, data, keys) except
that every inner step is padded (``workers.job.job.Pace``) to last ``pace * slow * (1 + jitter * z)``
seconds, z a standard normal drawn from ``--seed`` (clipped so a step never lasts under half its
mean). Padding rather than stretching
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

from storage.regions import learner_region_store
from storage.store import open_store
from workers.bus.bus import BusConfig
from workers.commands import learner_exit
from workers.common.events import EventLog
from workers.common.placement import default_shard
from workers.job.job import Pace, learner_process
from workers.bus.keys import SYNCER, KeyRing, key_paths, load_identity, load_public
from workers.learner.learner import LearnerConfig
from workers.learner.sender import SenderConfig


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m infra.chaos.worker", description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True)
    p.add_argument("--s3-endpoint", default=None)
    p.add_argument("--id", required=True)
    p.add_argument("--keys", default=None, help="key directory (<id>.key_secret and syncer.key)")
    p.add_argument("--key", default=None, help="this learner's secret key file (instead of --keys)")
    p.add_argument("--syncer-key", default=None, help="the syncer's public key file (with --key)")
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
    p.add_argument("--region", default=None, help="the run region it is in (as ddiloco learner --region)")
    p.add_argument("--sync-process", action="store_true", help="sender and receiver in a child process "
                                                                "(as ddiloco learner --sync-process)")
    return p


def _keyring(args) -> KeyRing:
    if args.key and args.syncer_key:
        own, pinned = args.key, args.syncer_key
    elif args.keys:
        own, pinned = key_paths(args.keys, args.id)[1], key_paths(args.keys, SYNCER)[0]
    else:
        raise SystemExit("keys: give --keys DIR, or --key PATH and --syncer-key PATH")
    return KeyRing(load_identity(own), load_public(pinned))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        pace = Pace(args.pace, args.slow, args.jitter, args.seed)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    store = open_store(args.store, s3_endpoint=args.s3_endpoint, create=False)
    if args.region is not None:
        store = learner_region_store(store, args.region)
    events = EventLog(args.log, "learner", args.id)
    cfg = LearnerConfig(sender=SenderConfig(ack_timeout_s=args.ack_timeout), poll_s=args.poll, keys=_keyring(args),
                        sync_process=args.sync_process)
    shard = args.shard if args.shard is not None else default_shard(args.id)
    wait_for = args.wait_for
    stats = learner_process(store, args.id, shard, BusConfig(args.ingest, args.announce), events, steps=args.steps,
                            config=cfg, stop=stop.is_set, pace=pace, data_seed=args.data_seed,
                            join_when=(lambda: os.path.exists(wait_for)) if wait_for else None)
    if not stats.get("joined", True):     # stopped before joining: a spare machine never used
        return 0
    events.emit("learner-done", **stats)
    print(json.dumps(stats))
    return learner_exit(args.id, args.store, stats, sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
