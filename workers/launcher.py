"""`ddiloco launch`: the user's own training script as M decoupled learners, with the syncer(s) (issue 28).

    ddiloco launch --learners 2 --out runs/mine -- python train.py --lr 3e-4

Every learner runs the command with the environment contract (workers/learner/env.py) added, so the
script itself needs no ddiloco arguments: ``Learner(model, optimizer)`` finds the run, its id, the
bus and its keys there. With ``--nproc-per-learner N`` the command runs under ``torchrun
--standalone --nproc-per-node N`` (rank 0 is the learner, workers/learner/group.py).

1. Keys for the syncer and every learner (``OUT/keys``, unless ``--insecure``), the run's store
   (``--store``, or ``OUT/store``).
2. A new run: the learners start first and the first of them proposes its model as version 0
   (storage/proposal.py); the launcher - which holds the syncer's key and the run's settings -
   creates the run from that proposal and starts the syncer(s); every learner loads version 0.
   An existing run (the same command again) is continued: syncer(s) first, then the learners,
   each resuming its step count and data position from its record (storage/learner_state.py).
3. Live progress (as ``ddiloco run``'s). A learner that dies (an exit status other than 0) is
   restarted alone, up to ``--max-restarts`` times; nobody else stops. Ctrl-C (or SIGTERM) stops
   the learners (each drains and records where it stands), then the syncers.
4. When every learner has finished: the drain, ``OUT/summary.json``, ``OUT/report.png`` and the
   summary lines; ``ddiloco replay OUT`` verifies the run.
"""
from __future__ import annotations

import argparse
import shlex
import signal
import sys
import time
from pathlib import Path

from storage.errors import NotFound, StoreError
from storage.layout import read_descriptor
from storage.store import open_store
from workers.bus.keys import SYNCER, ensure_identities, key_paths
from workers.common.events import EventLog, Tail, read_events
from pipeline.regions import regions_from_specs
from workers.common.placement import Placement, learner_names
from workers.learner.env import LearnerEnv
from workers.tools.launch_summary import launch_summary
from workers.tools.progress import Progress
from workers.tools.run_figures import write_outputs
from . import config
from .cluster import EVALUATOR_ROLE, ClusterConfig, LocalCluster, RoleExited
from .launch import create_from_proposal
from .launch_config import ALIASES, CHOICES, HELP, SKIP, LaunchConfig

LEARNER_NICE = 5          # as `ddiloco run`'s co-located learners (workers/cluster.py ClusterConfig.learner_nice)
SYNCER_READY_S = 180.0
DRAIN_S = 60.0
EVAL_STOP_S = 120.0      # the evaluator's last evaluation of the final model
PYTHONS = ("python", "python3")


def configure(parser: argparse.ArgumentParser):
    """Run your own training script as M decoupled learners with a syncer: ddiloco launch ... -- CMD."""
    a = parser.add_argument
    a("--config", default=None, metavar="FILE.toml", help="settings as TOML, sections as below (flags override)")
    a("--print-config", action="store_true", help="print the resolved settings as TOML and exit")
    a("--out", default=None, help="output directory (default runs/<time>)")
    a("--summary", default=None, help="also write the summary JSON here")
    a("--plain", action="store_true", help="plain progress lines instead of a live table")
    a("--region", action="append", default=None, metavar="NAME=URI[,endpoint=URL][,profile=NAME]",
      help="a region of the run on its own store (once per region, home first; launch.region_specs)")
    config.add_flags(parser, LaunchConfig, skip=SKIP, aliases=ALIASES, helps=HELP, choices=CHOICES)
    a("command", nargs=argparse.REMAINDER, metavar="-- CMD ARGS", help="the training command every learner runs")
    return launch


def launch_config(args) -> LaunchConfig:
    regions = {"launch.region_specs": ";".join(args.region)} if getattr(args, "region", None) else None
    return config.from_args(args, LaunchConfig, SKIP, regions)


def learner_command(command: list[str], nproc: int) -> list[str]:
    """The command a learner process runs: ``python``/``python3`` become this interpreter (the
    script runs in the launcher's environment), and N > 1 ranks wrap it in torchrun."""
    cmd = list(command[1:] if command and command[0] == "--" else command)
    if not cmd:
        raise SystemExit("ddiloco launch: give the training command after --, e.g. "
                         "`ddiloco launch --learners 2 -- python train.py`")
    is_python = Path(cmd[0]).name in PYTHONS or cmd[0] == sys.executable
    if nproc == 1:
        return [sys.executable, *cmd[1:]] if is_python else cmd
    # torchrun with every listener of the group on 127.0.0.1 (its own rendezvous store binds every
    # interface): workers/learner/localrun.py; a group across hosts is started with torchrun itself
    run = [sys.executable, "-m", "workers.learner.localrun", "--nproc-per-node", str(nproc)]
    if not is_python:
        raise SystemExit(f"ddiloco launch --nproc-per-learner {nproc}: the command must be `python SCRIPT.py ...` or "
                         f"`python -m MODULE ...` (torchrun starts its ranks), got {cmd[0]!r}")
    return [*run, *cmd[1:]]


def launch(args) -> int:
    cfg = launch_config(args)
    if args.print_config:
        print(config.to_toml(cfg, SKIP, header="ddiloco launch --config FILE reads this back (workers/launch_config.py)"),
              end="")
        return 0
    lc = cfg.launch
    cmd = learner_command(args.command, lc.nproc_per_learner)
    eval_cmd = (learner_command(shlex.split(lc.eval_command), 1) if lc.eval_command
                else learner_command(args.command, 1) if lc.eval else None)   # one process: it only reads
    out = Path(args.out or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "config.toml").write_text(config.to_toml(cfg, SKIP, header="the settings of this launch"))
    regions = regions_from_specs(lc.region_specs.split(";")) if lc.region_specs else None
    home = regions.region(regions.home) if regions is not None else None
    store_uri = home.uri if home is not None else lc.store or str((out / "store").resolve())
    s3_endpoint = home.endpoint if home is not None and home.endpoint else lc.s3_endpoint
    store = open_store(store_uri, s3_endpoint=s3_endpoint)
    names = learner_names(lc.learners)
    placement = Placement.round_robin(names, [r.name for r in regions.regions] if regions is not None else [])
    keydir = None if lc.insecure else Path(lc.keys or out / "keys").resolve()
    idents = ensure_identities(keydir, [SYNCER, *names]) if keydir is not None else {}
    events = EventLog(out / "logs" / "launcher.jsonl", "launcher", "launcher")
    cluster = LocalCluster(ClusterConfig(store_uri, out, keydir=keydir, bus=lc.bus, s3_endpoint=s3_endpoint,
                                         learner_nice=LEARNER_NICE, syncers=lc.syncers))
    for sig in (signal.SIGINT, signal.SIGTERM):   # Ctrl-C or SIGTERM: stop everything cleanly (finally below)
        signal.signal(sig, signal.default_int_handler)
    t_start = time.time()
    try:
        desc = _existing(store)
        if desc is not None:
            if (desc.security is None) != lc.insecure:   # a run keeps the mode it was created with
                raise SystemExit(f"ddiloco launch: run {desc.run_id} at {store_uri} is "
                                 + ("unsigned: continue it with --insecure" if desc.security is None else
                                    "signed: continue it without --insecure, with its --keys directory"))
            events.emit("run-continued", run_id=desc.run_id, store=store_uri)
            _start_syncers(cluster)
            _start_learners(cluster, names, cmd, lc, keydir, placement)
            _start_evaluator(cluster, eval_cmd, lc)
        else:   # the syncer imports while the learners build their models; it waits for the run
            _start_learners(cluster, names, cmd, lc, keydir, placement)
            _start_evaluator(cluster, eval_cmd, lc)
            cluster.start_syncers(["--wait-for-run", str(lc.propose_wait + SYNCER_READY_S)])
            desc = _create(cluster, store, cfg, idents, names, events, regions)
            _wait_syncers(cluster)
        events.emit("launch", run_id=desc.run_id, store=store_uri, learners=lc.learners, command=cmd,
                    nproc_per_learner=lc.nproc_per_learner, security="off" if lc.insecure else "signed")
        progress = Progress(lc.learners, lc.steps or 0, desc, plain=args.plain or not sys.stdout.isatty())
        drained, interrupted, restarts = _watch(cluster, progress, lc.max_restarts)
    except KeyboardInterrupt:
        cluster.stop()
        events.close()
        print("interrupted before the run started: every process stopped", file=sys.stderr)
        return 130
    except BaseException:
        cluster.stop()
        raise
    events.emit("launch-end", drained=drained, interrupted=interrupted, restarts=restarts)
    events.close()
    all_events = [e for f in sorted((out / "logs").glob("*.jsonl")) for e in read_events(f)]
    summary = launch_summary(store, store_uri, desc, all_events, time.time() - t_start, drained, interrupted,
                             lc, restarts)
    write_outputs(out, summary, all_events, args)
    return 0 if summary["ok"] else 130 if interrupted else 1


def _existing(store):
    try:
        return read_descriptor(store)
    except NotFound:
        return None


def _start_syncers(cluster: LocalCluster) -> None:
    cluster.start_syncers()
    _wait_syncers(cluster)


def _wait_syncers(cluster: LocalCluster) -> None:
    try:
        cluster.wait_ready(cluster.syncer_names(), SYNCER_READY_S)
    except (RoleExited, TimeoutError) as exc:
        raise SystemExit(f"ddiloco launch: the syncer did not come up: {exc}") from None


def _start_learners(cluster: LocalCluster, names: list[str], cmd: list[str], lc, keydir: Path | None,
                    placement: Placement) -> None:
    for lid in names:
        key, syncer_key = (str(key_paths(keydir, lid)[1]), str(key_paths(keydir, SYNCER)[0])) if keydir else (None, None)
        env = LearnerEnv(store=cluster.cfg.store, learner_id=lid, s3_endpoint=cluster.cfg.s3_endpoint,
                         region=placement.region(lid),
                         ingest=cluster.ingest if lc.bus else "", announce=cluster.announce if lc.bus else "",
                         key=key, syncer_key=syncer_key, log=str(cluster.log_path(lid).resolve()), propose=True,
                         propose_wait_s=lc.propose_wait, state_every_s=lc.state_every, steps=lc.steps,
                         optimizer_every=lc.save_optimizer_every)
        cluster.spawn_script(lid, cmd, env.to_environ(), nice=LEARNER_NICE)


def _start_evaluator(cluster: LocalCluster, cmd: list[str] | None, lc) -> None:
    """The run's evaluator (workers/evaluator.py): the user's command with DDILOCO_ROLE=evaluator."""
    if cmd is None:
        return
    env = LearnerEnv(store=cluster.cfg.store, learner_id=EVALUATOR_ROLE, s3_endpoint=cluster.cfg.s3_endpoint,
                     log=str(cluster.log_path(EVALUATOR_ROLE).resolve()), propose_wait_s=lc.propose_wait,
                     steps=lc.steps, role=EVALUATOR_ROLE)
    cluster.spawn_script(EVALUATOR_ROLE, cmd, env.to_environ(), nice=LEARNER_NICE, role=EVALUATOR_ROLE)


def _create(cluster: LocalCluster, store, cfg: LaunchConfig, idents: dict, names: list[str], events: EventLog,
            regions=None):
    """Wait for a learner's proposal, then create the run from it (the launcher signs version 0)."""
    deadline = time.monotonic() + cfg.launch.propose_wait
    while True:
        try:
            desc, proposer = create_from_proposal(
                store, cfg.settings(regions), syncer=idents.get(SYNCER),
                learners=[idents[n].public for n in names] if idents else ())
            events.emit("run-created", run_id=desc.run_id, initial_model_from=proposer,
                        fragments=desc.num_fragments, sync_every=desc.schedule.sync_every, quorum=desc.policy.quorum,
                        compression=desc.codec.scheme, params=int(sum(t.numel for t in desc.layout.tensors)))
            print(f"run {desc.run_id}: created from {proposer}'s model ({sum(t.numel for t in desc.layout.tensors):,} "
                  f"parameters), P={desc.num_fragments} H={desc.schedule.sync_every} K={desc.policy.quorum}",
                  flush=True)
            return desc
        except NotFound:
            pass
        except StoreError as exc:
            if not exc.retryable:
                raise
        cluster.poll()
        if not any(cluster.alive(n) for n in names):
            tails = "\n".join(f"--- {n}: {cluster.stderr(n, 1500)}" for n in names)
            raise SystemExit(f"ddiloco launch: every learner exited before one proposed its model (does the "
                             f"script create a Learner?):\n{tails}")
        if time.monotonic() >= deadline:
            raise SystemExit(f"ddiloco launch: no learner proposed its model within {cfg.launch.propose_wait:g} s")
        time.sleep(0.1)


def _watch(cluster: LocalCluster, progress: Progress, max_restarts: int) -> tuple[bool, bool, dict[str, int]]:
    """Progress until every learner finished (restarting the ones that die), then the drain.
    Returns (drained, interrupted, restarts per learner)."""
    tails = {name: Tail(cluster.log_path(name)) for name in cluster.names()}
    restarts: dict[str, int] = {}
    learners = cluster.names("learner")

    def show() -> None:
        for name, tail in tails.items():
            if name == EVALUATOR_ROLE:   # its held-out loss goes in the title, it is no learner row
                evals = [e["loss"] for e in tail.read() if e.get("event") == "eval" and e.get("loss") is not None]
                progress.eval_loss = evals[-1] if evals else progress.eval_loss
                continue
            progress.update(name, tail.read(), cluster.life(name).popen.poll())
    drained = interrupted = False
    try:
        with progress:
            while True:
                for life in cluster.poll():
                    name, rc = life.name, life.popen.returncode
                    if life.role != "learner" or rc == 0:
                        continue
                    if restarts.get(name, 0) < max_restarts:
                        restarts[name] = restarts.get(name, 0) + 1
                        progress.note(f"{name} exited with {rc}: restart {restarts[name]} of {max_restarts} "
                                      f"(see {cluster.logs}/{name}.stderr)")
                        cluster.restart(name)
                    else:
                        progress.note(f"{name} exited with {rc}; no restarts left (see {cluster.logs}/{name}.stderr)")
                if not any(cluster.alive(n) for n in learners):
                    break
                for sn in cluster.syncer_names():
                    if not cluster.alive(sn):
                        progress.note(f"{sn} exited with {cluster.life(sn).popen.returncode}; "
                                      f"see {cluster.logs}/{sn}.stderr")
                show()
                time.sleep(0.25)
            progress.note("learners finished; waiting for the syncer to commit what is left")
            status = cluster.wait_drained(DRAIN_S, tick=show)
            drained = status.ok
            if not drained:
                progress.note(f"not drained after the learners finished: {status}")
            if EVALUATOR_ROLE in cluster.lives:   # SIGTERM: it evaluates the final model once more, then exits
                cluster.stop([EVALUATOR_ROLE], timeout_s=EVAL_STOP_S)
    except KeyboardInterrupt:
        interrupted = True
        progress.note("interrupted: stopping the learners (each drains and records where it stands), then the syncer")
        cluster.stop(learners)
    finally:
        cluster.stop()
        show()
    return drained, interrupted, restarts
