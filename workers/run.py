"""`ddiloco run`: the main job on an embedded default (SPEC §1-8 end to end).

Creates a run (one initial model, descriptor, version 0), starts one syncer and M learner
processes (a ``workers.cluster.LocalCluster``) over ZeroMQ on loopback with storage in a local
directory (or S3), shows live progress, evaluates the global model from storage while it trains
(never pausing anyone), and at the end
writes a summary (``--summary PATH`` JSON) and a report with plots. ``--mode dp`` runs the
lock-step data-parallel baseline with the same model, data order and token budget instead.

Secure by default (docs/security.md): it creates an identity for the syncer and
every learner in ``OUT/keys`` (``--keys DIR``; secrets 0600), lists their public keys in a signed
run, and hands each process the path of its own secret key file. ``--insecure`` runs without
CURVE or signatures, and says so in the log and the summary.
"""
from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import torch

from pipeline.regions import RegionSpec, RegionsConfig, regions_from_specs
from storage.store import ObjectStore, open_store
from . import config
from .cluster import ClusterConfig, LocalCluster, RoleExited, create_job_run, global_eval_loss
from .run_config import ALIASES, CHOICES, HELP, SKIP, RunConfig
from workers.common.placement import Placement, learner_names
from workers.job.data import Corpus, evaluate
from workers.common.events import EventLog, Tail, read_events
from workers.job.job import dp_baseline
from workers.tools.cost import parse_prices
from workers.job.lockstep import OuterSettings, diloco_baseline
from workers.tools.progress import Progress
from workers.tools.run_figures import (accounting_figures, log_figures, rounds_figures, run_summary,
                                        write_outputs)


def configure(parser):
    """Train a model with M learners and a syncer (default: a small GPT on Python's own sources)."""
    a = parser.add_argument
    a("--config", default=None, metavar="FILE.toml",
      help="the run's settings as TOML, sections as below (flags given override the file; --print-config writes one)")
    a("--print-config", action="store_true", help="print the resolved settings as TOML and exit")
    a("--out", default=None, help="output directory (default runs/<time>)")
    a("--summary", default=None, help="also write the summary JSON here")
    a("--plain", action="store_true", help="plain progress lines instead of a live table")
    a("--region", action="append", default=None, metavar="NAME=URI[,endpoint=URL][,profile=NAME]",
      help="a region of the run on its own store (once per region, home first; run.region_specs)")
    a("--create-only", action="store_true",
      help="only create the run (descriptor + version 0) and exit; start roles with ddiloco syncer/learner")
    config.add_flags(parser, RunConfig, skip=SKIP, aliases=ALIASES, helps=HELP, choices=CHOICES)
    topologies = _topology_plugins(parser)
    return lambda args: run(args, topologies)


def run_config(args) -> RunConfig:
    """The run's resolved settings: the tree's defaults, then ``--config FILE``, then the flags
    given (``SystemExit`` naming the file or flag for a refused value)."""
    regions = {"run.region_specs": ";".join(args.region)} if getattr(args, "region", None) else None
    cfg = config.from_args(args, RunConfig, SKIP, regions)
    try:
        return cfg.resolved()
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


TOPOLOGY_GROUP = "ddiloco.run_topology"


def _topology_plugins(parser) -> list:
    """Run topologies from plugins (entry-point group ``ddiloco.run_topology``, setup.cfg): each
    entry point names ``configure(parser) -> select(args, cfg, out)`` that adds its flags and returns,
    for parsed flags and the resolved config tree, None (not asked for) or a topology: ``store_uri``, ``regions``, ``cluster(cfg)
    -> LocalCluster``, ``summary() -> dict``, ``close()``. So ``ddiloco run --wan`` (infra/wan_run.py)
    brings up S3 servers and WAN links while workers/ never imports infra/."""
    from importlib import metadata
    selects = []
    for ep in metadata.entry_points(group=TOPOLOGY_GROUP):
        try:
            selects.append(ep.load()(parser))
        except Exception as exc:   # noqa: BLE001 - one broken plugin must not break `ddiloco run`
            print(f"warning: run topology {ep.name} unavailable: {exc}", file=sys.stderr)
    return selects


def metrics_flags(base: int | None, index: int) -> list[str]:
    """``--metrics-port`` for role ``index`` of ``ddiloco run --metrics-port N`` (0: the syncer,
    m + 1: learner m): port N + index, or 0 for every role when N is 0 (each takes a free port)."""
    if base is None:
        return []
    return ["--metrics-port", str(base + index if base else 0)]


LEARNER_NICE = 5   # co-located demo only: see ClusterConfig.learner_nice (workers/cluster.py)
SYNCER_READY_S = 180.0   # how long `ddiloco run` waits for its syncers to recover before it starts learners


def local_regions(cfg: RunConfig, store_uri: str, out: Path) -> RegionsConfig | None:
    """``run.regions`` N: home r0 at the run's store, r1..r(N-1) in local directories (None: one region);
    ``run.region_specs`` (``--region``): the regions as given, each on its own store."""
    if cfg.run.region_specs is not None:
        return regions_from_specs(cfg.run.region_specs.split(";"))
    if cfg.run.regions == 1:
        return None
    if "://" in store_uri:
        raise SystemExit("--regions N places regions in local directories; for S3 buckets create the run with a "
                         "regions section (docs/regions.md) and start the roles with ddiloco syncer/learner --region")
    uris = [store_uri, *(str((out / "regions" / f"r{r}").resolve()) for r in range(1, cfg.run.regions))]
    return RegionsConfig("r0", tuple(RegionSpec(f"r{r}", uri) for r, uri in enumerate(uris)))


def run(args, topologies=()) -> int:
    cfg = run_config(args)
    if args.print_config:
        print(config.to_toml(cfg, SKIP, header="ddiloco run --config FILE reads this back (workers/run_config.py)"),
              end="")
        return 0
    try:
        parse_prices(cfg.run.prices)         # refused before anything starts (the report uses it at the end)
    except ValueError as exc:
        raise SystemExit(f"--run.prices: {exc}") from None
    out = Path(args.out or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "config.toml").write_text(config.to_toml(cfg, SKIP, header="the settings of this run "
                                                    "(ddiloco run --config OUT/config.toml repeats it)"))
    torch.set_num_threads(1)
    if cfg.run.mode in ("dp", "diloco"):
        return _run_baseline(args, cfg, out)
    topology = next((t for t in (select(args, cfg, out) for select in topologies) if t is not None), None)
    try:
        return _run_decoupled(args, cfg, out, topology)
    finally:
        if topology is not None:
            topology.close()


def _run_decoupled(args, cfg: RunConfig, out: Path, topology) -> int:
    gcfg, job, steps, learners = cfg.model, cfg.job, cfg.job.steps, cfg.run.learners
    home = regions_from_specs(cfg.run.region_specs.split(";")).regions[0] if cfg.run.region_specs else None
    if home is not None and home.profile is not None:
        raise SystemExit(f"--region {home.name}: the home region's credentials come from the standard AWS "
                         "variables (every role opens it with them); give profiles to the other regions")
    store_uri = topology.store_uri if topology is not None else home.uri if home is not None else \
        cfg.run.store or str(out / "store")
    s3_endpoint = home.endpoint if home is not None and home.endpoint else cfg.run.s3_endpoint
    store = open_store(store_uri, s3_endpoint=s3_endpoint)
    keydir = None if cfg.run.insecure else Path(cfg.run.keys or out / "keys")
    names = learner_names(learners)
    regions = topology.regions if topology is not None else local_regions(cfg, store_uri, out)
    placement = Placement.round_robin(names, [r.name for r in regions.regions] if regions is not None else [])
    desc, model = create_job_run(store, cfg.settings(regions), gcfg, cfg.run.seed, keydir, names)
    if args.create_only:
        print(f"created run {desc.run_id} at {store_uri}: {desc.num_fragments} fragments, "
              f"H={desc.schedule.sync_every}, K={desc.policy.quorum}, {desc.codec.scheme}; {steps} steps per learner; "
              + ("UNSIGNED (--insecure)" if cfg.run.insecure else f"signed, keys in {keydir} (roles: --keys {keydir})"))
        return 0
    corpus = Corpus(job.data_config(gcfg.block_size))
    events = EventLog(out / "logs" / "launcher.jsonl", "launcher", "launcher")
    if cfg.run.insecure:
        events.emit("security-off", detail="--insecure: no CURVE on the bus and no signatures")
    events.emit("run-created", run_id=desc.run_id, store=store_uri, learners=learners, steps=steps,
                security="off" if cfg.run.insecure else "signed",
                fragments=desc.num_fragments, sync_every=desc.schedule.sync_every, quorum=desc.policy.quorum,
                compression=desc.codec.scheme, params=int(sum(p.numel() for p in model.parameters())))
    ccfg = ClusterConfig(store_uri, out, keydir=keydir, bus=cfg.run.bus, s3_endpoint=s3_endpoint,
                         learner_nice=LEARNER_NICE, syncers=cfg.run.syncers)
    cluster = topology.cluster(ccfg) if topology is not None else LocalCluster(ccfg)
    t_start = time.time()
    # shards (--syncers > 1) take free metrics ports (logged): base + 1 + m already belongs to learner m
    roles = cfg.roles
    spill_poll = ["--spill-poll", str(roles.spill_poll)] if roles.spill_poll is not None else []
    cluster.start_syncers([*metrics_flags(roles.metrics_port if cfg.run.syncers == 1 else roles.metrics_port and 0, 0),
                           *spill_poll])
    # Learners start once their syncers listen (recovered, bus bound): started together on a busy
    # machine, learners of a short run trained to their end before a syncer had imported torch, and
    # their work reached the model in one outer step at the drain (a CI run: eval loss 5.41 from
    # 5.56). Learners never wait for a syncer; the launcher, which starts both, orders them.
    try:
        cluster.wait_ready(cluster.syncer_names(), SYNCER_READY_S)
    except (RoleExited, TimeoutError) as exc:
        cluster.stop()
        raise SystemExit(f"ddiloco run: the syncer did not come up: {exc}") from None
    for lid in names:
        region = ["--region", placement.region(lid)] if placement.region(lid) is not None else []
        slow = ["--slow", str(roles.slow)] if roles.slow != 1.0 else []
        slow += ["--pace", str(roles.pace)] if roles.pace is not None else []
        slow += ["--poll", str(roles.poll)] if roles.poll is not None else []
        slow += ["--sync-process"] if roles.sync_process else []
        cluster.start_learner(lid, ["--shard", str(placement.shard(lid)), *region, *slow,
                                    *metrics_flags(roles.metrics_port, names.index(lid) + 1)])
    init_loss = evaluate(model, corpus)
    events.emit("eval", tokens=0, loss=init_loss, versions={})
    progress = Progress(learners, steps, desc, plain=args.plain or not sys.stdout.isatty())
    drained, interrupted = _watch(cluster, progress, events, desc, corpus, roles.eval_every)
    wall = time.time() - t_start
    final = _eval_global(store, desc, corpus)
    if final is not None:
        events.emit("eval", tokens=progress.total_tokens(), loss=final[0], versions=final[1])
    events.close()
    all_events = [e for f in sorted((out / "logs").glob("*.jsonl")) for e in read_events(f)]
    summary = run_summary(store_uri, desc, all_events, init_loss, final, wall, drained, cfg.run.learners,
                          cfg.run.insecure, interrupted)
    summary["placement"] = placement.to_dict()
    summary["settings"] = {"learners": learners, "fragments": desc.num_fragments, "sync_every": desc.schedule.sync_every,
                           "quorum": desc.policy.quorum, "compression": desc.codec.scheme}
    summary.update(rounds_figures(store, desc, all_events))
    summary.update(log_figures(store, desc))
    summary["accounting"] = accounting_figures(all_events, desc, cfg.run.prices)
    if topology is not None:
        summary.update(topology.summary())
    write_outputs(out, summary, all_events, args)
    return 0 if summary["ok"] else 130 if interrupted else 1


def _watch(cluster: LocalCluster, progress: Progress, events: EventLog, desc, corpus: Corpus,
           eval_every: float) -> tuple[bool, bool]:
    """Show progress and evaluate the global model every ``eval_every`` s until the learners
    finish, then wait (bounded) for the syncer to commit what is left; stop every role.
    (drained: ``LocalCluster.drain_status`` ok, interrupted: Ctrl-C or SIGTERM stopped it)."""
    tails = {name: Tail(cluster.log_path(name)) for name in cluster.names()}
    # Ctrl-C / SIGINT stops the run even when it was started with SIGINT ignored (a background job
    # of a non-interactive shell inherits SIG_IGN, and Python then keeps it: the run ran on to its
    # last step and left its syncer behind). SIGTERM stops it the same way.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.default_int_handler)

    def show() -> None:
        for name, tail in tails.items():
            progress.update(name, tail.read(), cluster.life(name).popen.poll())
    next_eval = time.time() + eval_every
    drained = interrupted = False
    try:
        with progress:
            while not cluster.learners_done():
                show()
                if time.time() >= next_eval:
                    ev = _eval_global(cluster.store, desc, corpus)
                    if ev is not None:
                        events.emit("eval", tokens=progress.total_tokens(), loss=ev[0], versions=ev[1])
                        progress.eval_loss = ev[0]
                    next_eval = time.time() + eval_every
                for sn in cluster.syncer_names():
                    if not cluster.alive(sn):
                        progress.note(f"{sn} exited with {cluster.life(sn).popen.returncode}; "
                                      f"see {cluster.logs}/{sn}.stderr")
                time.sleep(0.25)
            progress.note("learners finished; waiting for the syncer to commit what is left")
            status = cluster.wait_drained(60, tick=show)
            drained = status.ok
            if not drained:
                progress.note(f"not drained after the learners finished: {status}")
    except KeyboardInterrupt:
        interrupted = True
        progress.note("interrupted: stopping processes")
    finally:
        cluster.stop()
        show()
    return drained, interrupted


def _eval_global(store: ObjectStore, desc, corpus: Corpus):
    """(held-out loss, versions) of the global model as it stands in storage, or None when it
    cannot be read right now (an evaluator never stops a run; it reports and tries again later)."""
    try:
        loss, versions = global_eval_loss(store, desc, corpus)
    except Exception as exc:   # noqa: BLE001 - see the docstring
        print(f"evaluation skipped: {exc}", file=sys.stderr)
        return None
    return loss, {str(k): v for k, v in versions.items()}


def _run_baseline(args, cfg: RunConfig, out: Path) -> int:
    mode, learners, seed = cfg.run.mode, cfg.run.learners, cfg.run.seed
    events = EventLog(out / "logs" / f"{mode}.jsonl", mode, mode)
    t0 = time.time()
    if mode == "dp":
        res = dp_baseline(cfg.model, cfg.job, learners, seed, events)
    else:
        outer = OuterSettings(sync_every=cfg.schedule.h, fragments=1, latency=0, outer=cfg.outer, merge=cfg.merge,
                              learner=cfg.learner, codec=cfg.codec)     # deltas through the run's codec
        res = diloco_baseline(cfg.model, cfg.job, learners, seed, events, outer)
    events.close()
    summary = {"ok": True, "status": "ok", "mode": mode, "run_uri": None, "learners": learners,
               "settings": {"learners": learners, "sync_every": cfg.schedule.h if mode == "diloco" else None,
                            "codec": res.get("codec")},
               "tokens_trained": res["tokens"], "initial_eval_loss": res["initial_eval_loss"],
               "final_eval_loss": res["final_eval_loss"], "wall_s": round(time.time() - t0, 2),
               "bytes_per_learner_per_step": res["bytes_per_learner_per_step"]}
    write_outputs(out, summary, read_events(out / "logs" / f"{mode}.jsonl"), args)
    return 0
