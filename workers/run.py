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

import json
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch

from pipeline.regions import RegionSpec, RegionsConfig
from storage.shards import run_records
from storage.store import ObjectStore, open_store
from . import config
from .cluster import ClusterConfig, LocalCluster, RoleExited, create_job_run, global_eval_loss
from .run_config import ALIASES, CHOICES, HELP, SKIP, RunConfig
from workers.common.placement import Placement, learner_names
from workers.job.data import Corpus, evaluate
from workers.common.events import EventLog, Tail, read_events
from workers.job.job import dp_baseline
from workers.tools.accounting import traffic_report
from workers.tools.cost import parse_prices
from workers.tools.logview import stored_base, token_figures
from workers.job.lockstep import OuterSettings, diloco_baseline
from workers.tools.progress import Progress
from workers.tools.report import plot_run
from workers.tools.summary import summary_lines
from workers.tools.utilisation import latency_steps, p50, utilisation


def configure(parser):
    """Train a model with M learners and a syncer (default: a small GPT on Python's own sources)."""
    a = parser.add_argument
    a("--config", default=None, metavar="FILE.toml",
      help="the run's settings as TOML, sections as below (flags given override the file; --print-config writes one)")
    a("--print-config", action="store_true", help="print the resolved settings as TOML and exit")
    a("--out", default=None, help="output directory (default runs/<time>)")
    a("--summary", default=None, help="also write the summary JSON here")
    a("--plain", action="store_true", help="plain progress lines instead of a live table")
    a("--create-only", action="store_true",
      help="only create the run (descriptor + version 0) and exit; start roles with ddiloco syncer/learner")
    config.add_flags(parser, RunConfig, skip=SKIP, aliases=ALIASES, helps=HELP, choices=CHOICES)
    topologies = _topology_plugins(parser)
    return lambda args: run(args, topologies)


def run_config(args) -> RunConfig:
    """The run's resolved settings: the tree's defaults, then ``--config FILE``, then the flags
    given (``SystemExit`` naming the file or flag for a refused value)."""
    try:
        values = config.read_toml(args.config, RunConfig, SKIP) if args.config else {}
        sources = {k: args.config for k in values}
        flags = config.given(args)
        values.update(flags)
        sources.update({k: f"--{k}" for k in flags})
        return config.build(RunConfig, values, sources).resolved()
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
    """``run.regions`` N: home r0 at the run's store, r1..r(N-1) in local directories (None: one region)."""
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
    store_uri = topology.store_uri if topology is not None else cfg.run.store or str(out / "store")
    store = open_store(store_uri, s3_endpoint=cfg.run.s3_endpoint)
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
    ccfg = ClusterConfig(store_uri, out, keydir=keydir, bus=cfg.run.bus, s3_endpoint=cfg.run.s3_endpoint,
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
    summary = _summary(store_uri, desc, all_events, init_loss, final, wall, drained, cfg, interrupted)
    summary["placement"] = placement.to_dict()
    summary["settings"] = {"learners": learners, "fragments": desc.num_fragments, "sync_every": desc.schedule.sync_every,
                           "quorum": desc.policy.quorum, "compression": desc.codec.scheme}
    summary.update(_rounds_figures(store, desc, all_events))
    summary.update(_log_figures(store, desc))
    summary["accounting"] = _accounting(all_events, desc, cfg.run.prices)
    if topology is not None:
        summary.update(topology.summary())
    _write_outputs(out, summary, all_events, args)
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


def _summary(store_uri, desc, events, init_loss, final, wall, drained, cfg: RunConfig, interrupted: bool) -> dict:
    commits = [e for e in events if e.get("event") == "commit"]
    done = {e["id"]: e for e in events if e.get("event") == "learner-stop"}
    versions = {}
    for c in commits:
        if c.get("kind") == "merge":
            versions[str(c["fragment"])] = c["version"]
    merged = sum(len(c.get("inputs", [])) for c in commits)
    dropped = sum(len(c.get("dropped", [])) for c in commits)
    learners = {lid: {k: d.get(k) for k in ("step", "tokens", "deltas", "acked", "spilled", "superseded",
                                            "evicted", "bytes_sent", "bytes_spilled", "bytes_received",
                                            "versions_applied", "median_step_s", "max_gap_s", "drained",
                                            "spill_errors", "last_error", "nonfinite_steps", "receiver_failed")}
                for lid, d in sorted(done.items())}
    latencies = [e["latency_s"] for e in events if e.get("event") == "version-applied" and e.get("latency_s") is not None]
    final_loss = final[0] if final else None
    stop = next((e for e in reversed(events) if e.get("event") == "syncer-stop"), {})
    problems = [p for p, bad in (("interrupted (Ctrl-C or SIGTERM)", interrupted),
                                 ("the global model could not be evaluated", final is None),
                                 ("the syncer did not commit everything before stopping", not drained),
                                 (f"{cfg.run.learners - len(done)} of {cfg.run.learners} learner(s) did not finish",
                                  len(done) != cfg.run.learners)) if bad]
    return {
        "ok": not problems, "status": "interrupted" if interrupted else "ok" if not problems else "failed",
        "problems": problems,
        "mode": "decoupled", "run_uri": store_uri, "run_id": desc.run_id, "learners": cfg.run.learners,
        # where `ddiloco replay OUT` reads the run: a local store by its absolute path (the
        # summary may be read from another directory); a --wan run's topology replaces it with its copy
        "replay_uri": store_uri if "://" in store_uri else str(Path(store_uri).resolve()),
        "commits": len(commits), "merge_commits": sum(c.get("kind") == "merge" for c in commits),
        "versions_per_fragment": versions, "tokens_trained": sum((d.get("tokens") or 0) for d in done.values()),
        "initial_eval_loss": init_loss, "final_eval_loss": final_loss,
        "deltas_merged": merged, "deltas_dropped": dropped,
        "deltas_spilled": sum((d.get("spilled") or 0) for d in done.values()),
        "bytes_sent_per_learner": {lid: (d.get("bytes_sent") or 0) + (d.get("bytes_spilled") or 0)
                                   for lid, d in learners.items()},     # deltas up
        "bytes_received_per_learner": {lid: d.get("bytes_received") or 0 for lid, d in learners.items()},  # versions down
        # issue 11 item 16: named for what they measure (the commit record's time to a learner
        # applying it), next to the figure a user means by "latency" (a delta's publication to the
        # first version that merged it being applied by another learner)
        "commit_to_applied_p50_s": _pct(latencies, 50), "commit_to_applied_p99_s": _pct(latencies, 99),
        **_publish_to_applied(events),
        "drained": drained, "wall_s": round(wall, 2), "per_learner": learners,
        "security": "off" if cfg.run.insecure else "signed",
        "rejections": stop.get("rejections", {}), "drops_by_reason": stop.get("drops", {}),
    }


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def _publish_to_applied(events: list[dict]) -> dict:
    """Seconds from each merged delta's publication (its learner's ``delta`` event) to the first
    application of a version that merged it by another learner (by its own learner in a
    one-learner run): what the τ-step overlap has to hide (SPEC §2-3)."""
    published = {e["delta"]: e["t"] for e in events if e.get("event") == "delta" and "delta" in e}
    applied: dict[int, list[tuple[str, int, float]]] = {}
    for e in events:
        if e.get("event") == "version-applied":
            applied.setdefault(e.get("fragment"), []).append((e.get("id"), e.get("version", -1), e["t"]))
    alone = len({lid for rows in applied.values() for lid, _, _ in rows}) <= 1
    lat = []
    for c in events:
        if c.get("event") != "commit" or c.get("kind") != "merge":
            continue
        for did in c.get("inputs", []):
            if did not in published:
                continue
            producer = did.rsplit("/", 2)[0]
            times = [t for lid, v, t in applied.get(c.get("fragment"), ()) if v >= c.get("version", 0)
                     and (alone or lid != producer)]
            if times:
                lat.append(min(times) - published[did])
    return {"publish_to_applied_p50_s": _pct(lat, 50), "publish_to_applied_p99_s": _pct(lat, 99)}


def _log_figures(store: ObjectStore, desc) -> dict:
    """Tokens that entered the model (each counted once) and drops split into harmless ones and lost
    work, from the commit log - the numbers ``ddiloco log`` prints (workers/tools/logview.py)."""
    try:
        return token_figures(run_records(store, desc), desc.num_fragments, stored_base(store, desc))
    except Exception as exc:   # figures never fail a run
        return {"tokens_merged": None, "figures_error": str(exc)}


def _accounting(events: list[dict], desc, prices: str | None) -> dict | None:
    """Requests and bytes per region, link, learner and outer step, the monthly cost estimate and
    the data-parallel comparison (workers/tools/accounting.py); figures never fail a run."""
    try:
        return traffic_report(events, params=sum(t.numel for t in desc.layout.tensors),
                              sync_every=desc.schedule.sync_every, prices=parse_prices(prices))
    except Exception as exc:   # noqa: BLE001 - see the docstring
        return {"error": f"{exc.__class__.__name__}: {exc}"}


def _rounds_figures(store: ObjectStore, desc, events: list[dict]) -> dict:
    """Utilisation (share of each learner's steps whose work entered a version) and version latency
    in steps (answer -> applied), from the commit log and the event logs (workers/tools/utilisation.py)."""
    try:
        records = run_records(store, desc)    # every shard's log in a sharded run
    except Exception as exc:   # figures never fail a run
        return {"utilisation": None, "figures_error": str(exc)}
    by_learner: dict[str, list[dict]] = {}
    for e in events:
        if e.get("role") == "learner":
            by_learner.setdefault(e["id"], []).append(e)
    steps = {m: max((e.get("step", 0) for e in ev if e.get("event") == "learner-stop"), default=0)
             for m, ev in by_learner.items()}
    lat = latency_steps(records, by_learner)
    merges = [r for r in records if r.kind == "merge" and r.round >= 0]
    inputs = [i for r in merges for i in r.inputs]
    late = sum(1 for r in merges for i in r.inputs if i.round < r.round)
    return {"utilisation": utilisation(records, desc.num_fragments, steps),
            "late_answer_share": round(late / len(inputs), 4) if inputs else None,
            "version_latency_steps_p50": {m: p50(v) for m, v in sorted(lat.items())},
            "mean_round_size": round(sum(len(r.inputs) for r in merges) / len(merges), 3) if merges else None}


def _write_outputs(out: Path, summary: dict, events: list[dict], args) -> None:
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    if args.summary:
        Path(args.summary).parent.mkdir(parents=True, exist_ok=True)
        Path(args.summary).write_text(json.dumps(summary, indent=2))
    try:
        plot = plot_run(events, out / "report.png", summary)
        summary_plot = str(plot)
    except Exception as exc:  # a plotting failure must not hide the run's result
        summary_plot = f"(plot failed: {exc})"
    print("\n".join(summary_lines(summary, out, summary_plot)))


def _run_baseline(args, cfg: RunConfig, out: Path) -> int:
    mode, learners, seed = cfg.run.mode, cfg.run.learners, cfg.run.seed
    events = EventLog(out / "logs" / f"{mode}.jsonl", mode, mode)
    t0 = time.time()
    if mode == "dp":
        res = dp_baseline(cfg.model, cfg.job, learners, seed, events)
    else:
        outer = OuterSettings(sync_every=cfg.schedule.h, fragments=1, latency=0, outer=cfg.outer, merge=cfg.merge,
                              learner=cfg.learner)
        res = diloco_baseline(cfg.model, cfg.job, learners, seed, events, outer)
    events.close()
    summary = {"ok": True, "status": "ok", "mode": mode, "run_uri": None, "learners": learners,
               "settings": {"learners": learners, "sync_every": cfg.schedule.h if mode == "diloco" else None},
               "tokens_trained": res["tokens"], "initial_eval_loss": res["initial_eval_loss"],
               "final_eval_loss": res["final_eval_loss"], "wall_s": round(time.time() - t0, 2),
               "bytes_per_learner_per_step": res["bytes_per_learner_per_step"]}
    _write_outputs(out, summary, read_events(out / "logs" / f"{mode}.jsonl"), args)
    return 0
