"""`ddiloco syncer` and `ddiloco learner`: one role per process, for running across machines.

Both take the run's location (``--store``: a directory or s3://bucket/prefix) and the bus
endpoints. The syncer binds them (``tcp://0.0.0.0:5555`` to accept other hosts); learners connect
to the address the syncer can be reached at. SIGTERM/SIGINT stop either cleanly.

Keys (docs/security.md): a signed run's roles need their secret key file —
``--key PATH`` (and for learners ``--syncer-key PATH``, the syncer's public ``.key`` file they
pin), or ``--keys DIR`` holding ``<id>.key_secret`` and ``syncer.key``. Secrets are only ever
read from files, never from the command line. A role follows the run's own mode (fixed when it
was created): a signed run needs keys; an unsigned one (``ddiloco run --insecure``, or a run made
with ``create_run`` and no syncer key, as in the README's "Train your own model") is joined without
them - with a warning on stderr and a ``security-off`` event - and refuses keys.

Errors a user reads (issue 11 items 11, 15): a mistyped local ``--store`` is refused, never
created; a store that does not answer, a missing run, bad keys are one ``error: ... — fix`` line
(workers/cli.py ``explain``); a learner that could not make every delta durable says how many it
lost and why, and exits 4.

Metrics: ``--metrics-port N`` (0: any free port) serves Prometheus metrics of either role
at ``http://127.0.0.1:N/metrics`` (``--metrics-host`` to bind elsewhere); workers/common/metrics.py.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys

from pathlib import Path
from typing import Callable

from pipeline.descriptor import RunDescriptor
from pipeline.types import CommitRecord
from storage.layout import read_descriptor
from storage.proposal import wait_for_run
from storage.regions import learner_region_store
from storage.store import open_store
from workers.bus.bus import BusConfig, BusCounters
from workers.common.cpus import parse_cpus
from workers.common.events import EventLog
from workers.bus.keys import SYNCER, KeyRing, key_paths, load_identity, load_public
from workers.common.metrics import add_metrics_args, start_metrics
from workers.common.placement import default_shard
from workers.common.progress_line import MODES, ProgressLine, wanted
from workers.common.stop_flag import StopFlag
from workers.common.traffic import SINGLE_REGION, SyncerTraffic, TrafficMeter, counted
from workers.syncer.syncer import Syncer, SyncerConfig


# A role still alive this long after SIGTERM/SIGINT writes every thread's stack to stderr: a
# syncer once hung in its shutdown (issue 29's SLURM test, 1 run in ~12) and left no trace of where.
# Under SLURM's and Kubernetes' default 30 s between SIGTERM and SIGKILL (at 60 s it never fired).
STOP_REPORT_S = 20.0


def _stop_flag(report_s: float = STOP_REPORT_S) -> StopFlag:
    """The clean-stop flag SIGTERM/SIGINT set (a ``StopFlag``: a handler setting a
    ``threading.Event`` can deadlock, workers/common/stop_flag.py). The signal also arms a watchdog
    (``faulthandler``, a C thread that needs no lock or GIL holder's help): still running
    ``report_s`` later, the process dumps all its threads' stacks to stderr and goes on (SIGKILL
    remains the stop)."""
    flag = StopFlag()

    def stop(*_) -> None:
        if not flag.is_set():
            faulthandler.dump_traceback_later(report_s, exit=False)
        flag.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    return flag


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", required=True, help="the run's location: a directory or s3://bucket/prefix")
    parser.add_argument("--s3-endpoint", default=None, help="S3 endpoint URL (default: AWS_ENDPOINT_URL or AWS)")
    parser.add_argument("--ingest", default="tcp://127.0.0.1:5555",
                        help="syncer ingest endpoint (a learner of a sharded run: every shard's, comma-separated "
                             "in shard order)")
    parser.add_argument("--announce", default="tcp://127.0.0.1:5556",
                        help="syncer announce endpoint (a learner of a sharded run: every shard's, comma-separated)")
    parser.add_argument("--no-bus", action="store_true", help="storage only (no ZeroMQ): slower, same result")
    parser.add_argument("--log", default=None, help="JSONL event log path (default: stdout)")
    parser.add_argument("--keys", metavar="DIR", default=None,
                        help="key directory: this role's <id>.key_secret and the syncer's syncer.key")
    parser.add_argument("--key", metavar="PATH", default=None, help="this role's secret key file (.key_secret)")
    parser.add_argument("--insecure", action="store_true",
                        help="join an unsigned run: no CURVE, no signatures (logged as such)")
    parser.add_argument("--progress", choices=MODES, default="auto",
                        help="a short progress line every 5 s (auto: with --log, on a terminal)")
    add_metrics_args(parser)


def _keyring(args, desc: RunDescriptor, role: str, ident: str) -> KeyRing | None:
    """The role's keys from --key/--keys, checked against the run's mode (SystemExit with the fix)."""
    signed = desc.security is not None
    given = args.key or args.keys or getattr(args, "syncer_key", None)
    if args.insecure and given:
        raise SystemExit("--insecure and key options exclude each other")
    if signed and args.insecure:
        raise SystemExit(f"run {desc.run_id} is signed: --insecure cannot join it (give --keys DIR or --key PATH)")
    if not signed:
        if given:
            raise SystemExit(f"run {desc.run_id} is unsigned (created without keys): it cannot be joined with "
                             "keys (the keys would protect nothing) - drop --key/--keys/--syncer-key")
        if not args.insecure:
            print(f"warning: run {desc.run_id} is unsigned (created without keys): no CURVE, no signatures - "
                  "anyone who reaches the bus or the bucket can change the model", file=sys.stderr)
        return None
    if not given:
        raise SystemExit(f"run {desc.run_id} is signed: {role} {ident} needs its key (--keys DIR or --key PATH)")
    name = SYNCER if role == "syncer" else ident
    secret = Path(args.key) if args.key else key_paths(args.keys, name)[1]
    try:
        own = load_identity(secret)
        if role == "syncer":
            return KeyRing(own, own.public)
        pinned = getattr(args, "syncer_key", None) or (key_paths(args.keys, SYNCER)[0] if args.keys else None)
        if pinned is None:
            raise SystemExit("a learner needs the syncer's public key: --syncer-key PATH or --keys DIR")
        return KeyRing(own, load_public(pinned))
    except (OSError, ValueError) as exc:
        raise SystemExit(f"keys: {exc}") from None


def _bus(args) -> BusConfig | None:
    if getattr(args, "discover", False):   # found in the store (workers/bus/discovery.py), not given
        return None
    return None if args.no_bus else BusConfig(args.ingest, args.announce, counters=BusCounters())


def _events(args, role: str, ident: str) -> EventLog:
    events = EventLog(args.log, role, ident, echo=None if args.log else sys.stdout)
    if wanted(args.progress, args.log):    # JSONL to the file, a human line to the terminal
        events.subscribe(ProgressLine(role, ident))
    return events


CommitHook = Callable[[CommitRecord], None]


def configure_syncer(parser: argparse.ArgumentParser,
                     before_commit: Callable[[argparse.Namespace, EventLog], CommitHook] | None = None):
    """Run the syncer of a run (claims a new epoch, recovers from the log, merges and commits)."""
    # before_commit (never set by `ddiloco syncer`): given the parsed flags and the syncer's event
    # log, the hook for Syncer(before_commit=...). infra/chaos/faulty_syncer.py injects its crash
    # here, so the fault-injected syncer is built by this very handler.
    _common(parser)
    parser.add_argument("--id", default="syncer", help="syncer name recorded in commits")
    parser.add_argument("--checkpoint-every", type=int, default=25, help="commits between checkpoints")
    parser.add_argument("--keep-checkpoints", type=int, default=2, metavar="N",
                        help="retention after each checkpoint keeps the newest N checkpoints and what replay "
                             "from the oldest of them needs (docs/storage.md)")
    parser.add_argument("--keep-commits", type=int, default=1000, metavar="N",
                        help="retention never deletes what the newest N commits name (a shorter run keeps its "
                             "whole history)")
    parser.add_argument("--retain-bytes", default="auto", metavar="SIZE",
                        help="... unless what replay from the oldest kept checkpoint reads outgrows SIZE (e.g. "
                             "500MB, 2GiB; 'none': no byte limit; default 'auto': 8 fp32 model sizes plus the 2 "
                             "newest checkpoints, docs/storage.md \"Retention\")")
    parser.add_argument("--retain-age", default=None, metavar="DURATION",
                        help="... and let go what only commits older than DURATION name (e.g. 7d, 12h; default: no "
                             "age limit)")
    parser.add_argument("--keep-all", action="store_true",
                        help="no retention: keep every delta, version and checkpoint (full replay from the start)")
    parser.add_argument("--threads", type=int, default=1, metavar="N",
                        help="threads for a round's decode, guard, fold and version encode (same bits at any N; "
                             "docs/scale.md)")
    parser.add_argument("--keep-freed-memory", action=argparse.BooleanOptionalAction, default=True,
                        help="keep freed memory in the process (glibc mallopt; on by default): rounds reuse mapped "
                             "pages instead of the kernel zeroing fresh ones, which at 100M-parameter fragments "
                             "cost more than the arithmetic and at the demo's size made the syncer fault ~7,600 "
                             "pages a second, slowing a learner on the next core; the process keeps its peak "
                             "memory (--no-keep-freed-memory gives it back; docs/scale.md)")
    parser.add_argument("--spill-poll", type=float, default=0.5, metavar="SECONDS",
                        help="seconds between listings of every region's inbox for spilled deltas (a LIST each)")
    parser.add_argument("--shard", metavar="I/N", type=_shard_spec, default=None,
                        help="be syncer shard I of a run of N shards (ddiloco run --syncers N): own the fragments "
                             "p with p %% N == I, with its own epochs and log (docs/scale.md \"Sharded syncer\")")
    parser.add_argument("--create", metavar="LAUNCH.toml", default=None,
                        help="if the run does not exist, create it from the first learner's proposed model with these "
                             "settings (a `ddiloco launch --print-config` file), listing every learner whose NAME.key "
                             "lies beside the syncer's key (Kubernetes, SLURM: workers/syncer/create.py)")
    parser.add_argument("--advertise", metavar="HOST", default=None,
                        help="publish the bus endpoints in the run store for learners started with --discover; HOST "
                             "replaces a wildcard bind's address ('' : this host's name; workers/bus/discovery.py)")
    parser.add_argument("--wait-for-run", type=float, default=None, metavar="SECONDS",
                        help="wait up to SECONDS for the run to be created (ddiloco launch starts the syncer while "
                             "its learners propose the initial model; storage/proposal.py)")
    parser.add_argument("--failover-from-region", metavar="NAME", default=None,
                        help="take over as the run's home in the region whose copy --store is, from the lost home "
                             "region NAME: adopts what reachable regions hold beyond this copy and claims an epoch "
                             "above every region's (docs/regions.md \"Failover\"); without it a syncer refuses any "
                             "store but the home region's")

    def handler(args) -> int:
        from workers.common.memory import keep_freed_memory
        from workers.syncer.gc import RetentionConfig, parse_keep_bytes
        if args.threads < 1:
            raise SystemExit(f"--threads must be >= 1, got {args.threads}")
        from storage.retention import parse_duration
        try:
            keep_bytes = parse_keep_bytes(args.retain_bytes, "--retain-bytes")
            keep_age = None if args.retain_age is None else parse_duration(args.retain_age)
        except ValueError as exc:
            raise SystemExit(f"{exc}" if "--retain-bytes" in str(exc) else f"--retain-age: {exc}") from None
        if args.keep_freed_memory:
            keep_freed_memory()   # a round's arrays reuse mapped pages (docs/scale.md: kernel zeroing, neighbours)
        retention = RetentionConfig(enabled=not args.keep_all, keep_checkpoints=args.keep_checkpoints,
                                    keep_commits=args.keep_commits, keep_bytes=keep_bytes, keep_age_s=keep_age)
        store = open_store(args.store, s3_endpoint=args.s3_endpoint, create=False)
        if args.wait_for_run is not None and not args.wait_for_run > 0:
            raise SystemExit(f"--wait-for-run must be > 0 seconds, got {args.wait_for_run}")
        events = _events(args, "syncer", args.id)
        # read once per process, handed to what needs it
        if args.create:
            desc = _create_run(args, store, events)
        else:
            desc = wait_for_run(store, args.wait_for_run) if args.wait_for_run else read_descriptor(store)
        keys = _keyring(args, desc, "syncer", args.id)
        shard = _check_shard(args.shard, desc)
        flag = _stop_flag()
        store, metrics = start_metrics(args, events, "syncer", args.id, store, run_id=desc.run_id)
        store = counted(store)     # issue 14: its requests are reported in accounting events
        bus = _bus(args)
        syncer = Syncer(store, SyncerConfig(syncer_id=args.id, checkpoint_every=args.checkpoint_every,
                                            retention=retention, threads=args.threads, shard=shard,
                                            spill_poll_s=args.spill_poll, advertise=args.advertise),
                        bus=bus, events=events, keys=keys,
                        before_commit=before_commit(args, events) if before_commit is not None else None)
        _meter_syncer(syncer, store, bus, events)
        if metrics is not None:
            metrics.watch_syncer(syncer)
        try:
            if args.failover_from_region is not None:
                syncer.recover(failover_from=args.failover_from_region)   # issue 25: the explicit failover
            return syncer.run(flag.is_set)
        finally:
            if metrics is not None:
                metrics.close()
    return handler


def _create_run(args, store, events: EventLog) -> RunDescriptor:
    """``--create``: the run, created from a learner's proposal if it does not exist (signed unless
    ``--insecure``; waits ``--wait-for-run`` seconds, default an hour)."""
    from workers.syncer.create import create_when_proposed
    if args.insecure and (args.key or args.keys):
        raise SystemExit("--insecure and key options exclude each other")
    if not args.insecure and not (args.key or args.keys):
        raise SystemExit("--create makes a signed run: give --keys DIR or --key PATH (or --insecure)")
    secret = None if args.insecure else Path(args.key) if args.key else key_paths(args.keys, SYNCER)[1]
    try:
        ident = load_identity(secret) if secret is not None else None
    except (OSError, ValueError) as exc:
        raise SystemExit(f"keys: {exc}") from None
    return create_when_proposed(store, args.create, ident, secret.parent if secret is not None else None,
                                args.wait_for_run or 3600.0, events=events)


def _shard_spec(text: str) -> tuple[int, int]:
    """``I/N`` -> (I, N), 0 <= I < N."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard takes I/N (e.g. 0/2), got {text!r}") from None
    if not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"--shard {text}: I must be in 0..N-1")
    return i, n


def _check_shard(spec: tuple[int, int] | None, desc) -> int | None:
    """The shard index, once ``--shard I/N`` matches the run's own shard count (SystemExit if not)."""
    n = desc.syncers
    if spec is None:
        if n > 1:
            raise SystemExit(f"run {desc.run_id} has {n} syncer shards: start each with --shard I/{n}")
        return None
    if spec[1] != n:
        raise SystemExit(f"--shard {spec[0]}/{spec[1]}: run {desc.run_id} has "
                         + (f"{n} syncer shards" if n > 1 else "one syncer (not sharded): drop --shard"))
    return spec[0]


def _meter_syncer(syncer: Syncer, store, bus: BusConfig | None, events: EventLog) -> None:
    """The syncer's ``accounting`` events (workers/common/traffic.py): its home store and, through
    the replicator's counted stores, every other region's (ingest and replication)."""
    desc = syncer.descriptor
    home = desc.regions.home if desc.regions is not None else SINGLE_REGION
    if syncer.replicator is not None and syncer.replicator.home_name is not None:
        home = syncer.replicator.home_name     # the region it commits in (a failover's new home, issue 25)
    stores = {home: store, **({r.name: r.store for r in syncer.replicator.regions} if syncer.replicator else {})}
    meter = TrafficMeter(events, home, home, stores, bus.counters if bus is not None else None)
    events.subscribe(SyncerTraffic(meter, desc.num_fragments,
                                   lambda: {"life": syncer.epoch, "commits": syncer.stats.commits}))


def configure_learner(parser: argparse.ArgumentParser):
    """Run one learner of the default job (joins a running run at any time)."""
    _common(parser)
    parser.add_argument("--id", required=True, help="learner id (letters, digits, _ . -)")
    parser.add_argument("--shard", type=int, default=None, help="data shard (default: the number in --id)")
    parser.add_argument("--steps", type=int, default=None, help="inner steps (default: the run's)")
    parser.add_argument("--slow", type=float, default=1.0, help="stretch every step by this factor (>= 1)")
    parser.add_argument("--pace", type=float, default=None, metavar="SECONDS",
                        help="instead: pad every step to this many seconds, times --slow (a learner that owns its "
                             "accelerator: its speed does not follow a shared machine's load; benchmarks, chaos)")
    parser.add_argument("--jitter", type=float, default=0.0,
                        help="with --pace: the std of each step's time factor, a normal draw clipped at 0.5 (< 0.5)")
    parser.add_argument("--jitter-seed", type=int, default=0, help="with --pace: the seed of those draws")
    parser.add_argument("--wait-for", metavar="FILE", default=None,
                        help="load the model, then wait for this file to exist before joining (a spare machine)")
    parser.add_argument("--data-seed", type=int, default=None, help="the batch order's seed (default: the run's)")
    parser.add_argument("--state-every", type=float, default=None, metavar="SECONDS",
                        help="keep a resume record every this many seconds: a new life of this id (a restart, a "
                             "requeued job) continues its step count and batch order instead of starting at step 0")
    parser.add_argument("--ack-timeout", type=float, default=2.0,
                        help="least seconds before an unacked delta spills (the wait follows the acks seen)")
    parser.add_argument("--max-ack-wait", type=float, default=30.0,
                        help="most seconds an unacked delta waits before it spills, however slow the syncer's acks")
    parser.add_argument("--discover", action="store_true",
                        help="find the syncer's bus in the run store (a syncer started with --advertise) and follow it "
                             "when it moves, instead of --ingest/--announce")
    parser.add_argument("--poll", type=float, default=0.5, help="seconds between storage polls for versions")
    parser.add_argument("--syncer-key", metavar="PATH", default=None,
                        help="the syncer's public key file (syncer.key) to pin (default: DIR/syncer.key with --keys)")
    parser.add_argument("--region", metavar="NAME", default=None,
                        help="the run region this learner is in: it reads versions and spills only in that "
                             "region's store, as the descriptor names it (docs/regions.md)")
    parser.add_argument("--torchrun", action="store_true",
                        help="this process is one rank of a torchrun learner (automatic when torchrun set "
                             "WORLD_SIZE > 1): rank 0 talks to the syncer and storage (README \"A learner under "
                             "torchrun\")")
    parser.add_argument("--log-path", dest="log", default=None,
                        help="same as --log (plain torchrun's parser takes --log for its own --log-dir)")
    parser.add_argument("--sync-process", action="store_true",
                        help="run the sender and receiver in a child process, off the training process's GIL "
                             "(issue 15; docs/scale.md)")
    parser.add_argument("--agent-cpus", metavar="CPUS", default=None,
                        help="with --sync-process: the cores the child may run on, e.g. 3 or 2-3 (Linux); keep it "
                             "off the training thread's core (docs/scale.md)")
    parser.add_argument("--group-digests", action="store_true",
                        help="torchrun learner: every rank logs a digest of its weights after each applied "
                             "version (for tests; costs a copy of the model)")

    def handler(args) -> int:
        group = _torchrun_group(args)
        if group is not None and group.rank != 0:
            return _group_rank(args, group)
        # torch is imported only by the learner role, so a syncer (re)starts in a fraction of the time.
        from workers.job.job import learner_process
        from workers.learner.learner import LearnerConfig
        from workers.learner.sender import SenderConfig
        if args.slow < 1.0:
            raise SystemExit(f"--slow must be >= 1, got {args.slow}")
        if args.state_every is not None and (group is not None or not args.state_every > 0):
            raise SystemExit(f"--state-every must be > 0 seconds on a learner of one process, got {args.state_every}"
                             + (" under torchrun" if group is not None else ""))
        from workers.job.job import Pace
        if args.pace is None and (args.jitter or args.jitter_seed):
            raise SystemExit("--jitter and --jitter-seed need --pace")
        try:
            pace = Pace(args.pace, args.slow, args.jitter, args.jitter_seed) if args.pace is not None else None
        except ValueError as exc:
            raise SystemExit(f"--pace: {exc}") from None
        try:
            agent_cpus = parse_cpus(args.agent_cpus)
        except ValueError as exc:
            raise SystemExit(f"--agent-cpus: {exc}") from None
        if agent_cpus is not None and not args.sync_process:
            raise SystemExit("--agent-cpus needs --sync-process")
        if agent_cpus is not None and max(agent_cpus) >= (os.cpu_count() or 1):
            raise SystemExit(f"--agent-cpus {args.agent_cpus}: this machine has cores 0-{(os.cpu_count() or 1) - 1}")
        shard = _shard(args)
        store = open_store(args.store, s3_endpoint=args.s3_endpoint, create=False)
        if args.region is not None:   # --store may be any copy of the run; from here on only the region's
            store = learner_region_store(store, args.region)
        desc = read_descriptor(store)          # read once per process, handed to what needs it
        keys = _keyring(args, desc, "learner", args.id)
        flag = _stop_flag()
        events = _events(args, "learner", args.id)
        store, metrics = start_metrics(args, events, "learner", args.id, store, run_id=desc.run_id)
        if args.discover and args.no_bus:
            raise SystemExit("--discover finds the bus; --no-bus has none: give one of them")
        sender = SenderConfig(ack_timeout_s=args.ack_timeout, max_ack_wait_s=args.max_ack_wait)
        cfg = LearnerConfig(sender=sender, poll_s=args.poll, keys=keys, state_every_s=args.state_every,
                            sync_process=args.sync_process, agent_cpus=agent_cpus, discover=args.discover)
        try:
            wait_for = args.wait_for
            stats = learner_process(store, args.id, shard, _bus(args), events, steps=args.steps,
                                    slow=args.slow if pace is None else 1.0, config=cfg, stop=flag.is_set,
                                    group=group, pace=pace, data_seed=args.data_seed, descriptor=desc,
                                    join_when=(lambda: os.path.exists(wait_for)) if wait_for else None)
        finally:
            if metrics is not None:
                metrics.close()
        if not stats.get("joined", True):     # stopped before joining: a spare machine never used
            return 0
        events.emit("learner-done", **stats)
        if args.log:
            print(json.dumps(stats))
        return learner_exit(args.id, args.store, stats, sys.stderr)
    return handler


def _shard(args) -> int:
    """--shard, or the number in --id (workers/common/placement.py)."""
    return args.shard if args.shard is not None else default_shard(args.id)


def _torchrun_group(args):
    """This rank's DataParallelGroup under torchrun (--torchrun, or WORLD_SIZE > 1 set by torchrun);
    None for a learner of one process (workers/learner/group.py)."""
    from workers.learner.group import DataParallelGroup, GroupConfig, torchrun_env
    if not args.torchrun and torchrun_env() is None:
        return None
    try:
        return DataParallelGroup(GroupConfig(digests=args.group_digests))
    except ValueError as exc:   # --torchrun outside a torchrun job: say how to start one
        raise SystemExit(f"--torchrun: {exc}") from None


def _group_rank(args, group) -> int:
    """A torchrun learner's rank > 0: the same job loop, with no store, bus, keys or metrics (rank 0
    talks to the syncer and storage); its events go to <log>.rank<r>.jsonl, as role "rank" (tools that
    list learners by their events' role see only rank 0, the learner)."""
    from workers.job.job import learner_process
    from workers.learner.group import RANK_ROLE, rank_log_path
    flag = _stop_flag()
    path = rank_log_path(args.log, group.rank)
    events = EventLog(path, RANK_ROLE, f"{args.id}.rank{group.rank}", echo=None if path else sys.stdout)
    stats = learner_process(None, args.id, _shard(args), None, events, steps=args.steps, stop=flag.is_set,
                            group=group)
    events.emit("learner-done", **stats)
    return 0


EXIT_UNDELIVERED = 4


def learner_exit(ident: str, store: str, stats: dict, err) -> int:
    """0 when every delta became durable; otherwise one line saying how many were lost and why
    (e.g. a full disk), and exit status 4 (issue 11 item 11: never a silent exit)."""
    if stats.get("drained", True):
        return 0
    lost = stats.get("undelivered", 0)
    cause = stats.get("last_error") or "the syncer did not acknowledge them and spilling did not finish in time"
    fix = ("free space or fix the store, then restart the learner (its next deltas carry its progress)"
           if stats.get("spill_errors") else "check that the syncer and the store are reachable")
    print(f"error: learner {ident}: {lost} delta(s) were never made durable in {store} "
          f"({stats.get('spill_errors', 0)} failed spills; last: {cause}) — {fix}", file=err)
    return EXIT_UNDELIVERED
