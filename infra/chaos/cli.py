"""`ddiloco chaos`: run a fault-injection scenario on a local job and check its invariants.

``ddiloco chaos --list`` prints the scenarios (name, then a short description, one per line).
``ddiloco chaos SCENARIO [--seed S] [--out DIR]`` runs one: exit status 0 only if every invariant
held; the report is ``OUT/report.json`` and ``OUT/timeline.png``. ``--events PATH`` drives learner
failures from a failure event log (the simulator's ``--events`` output; ``--time-scale`` maps its
seconds onto the local run). ``ddiloco chaos experiment NAME`` runs one of the experiments
(heterogeneous speeds, compute scavenging, goodput under failures; docs/chaos.md).
``ddiloco chaos campaign [--runs N] [--seed S] [--sim|--real]`` runs a seeded random fault campaign:
``--sim`` (the default) the deterministic simulation (infra/faultsim, docs/faultsim.md;
``--jobs``, ``--schedule``), ``--real`` real processes (infra/chaos/campaign_real.py; ``--only I``).
Exit status 0 only if every schedule kept every invariant; each failure prints the command that
replays it.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path


def configure(parser):
    """Fault injection on a local run (kill, stall, partition, bad input...) with invariant checks."""
    from .experiments import EXPERIMENTS
    parser.add_argument("scenario", nargs="?", help="a scenario from --list, 'experiment' or 'campaign'")
    parser.add_argument("name", nargs="?", help=f"with 'experiment': one of {', '.join(EXPERIMENTS)}")
    parser.add_argument("--list", action="store_true", help="print the scenarios and experiments")
    parser.add_argument("--seed", type=int, default=0, help="model init, data order and drawn schedules")
    parser.add_argument("--out", default=None, help="output directory (default runs/chaos/<name>-<time>)")
    parser.add_argument("--events", default=None, help="a failure event log (kind sim-events) to replay")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="multiply the event log's times by this (e.g. 1/600: ten minutes a second)")
    parser.add_argument("--quick", action="store_true", help="experiments: the smallest setting (a smoke run)")
    parser.add_argument("--steps", type=int, default=None, help="scenarios: every learner's step count (overrides)")
    parser.add_argument("--slow", type=float, default=None, help="scenarios: every learner's --slow factor (overrides)")
    engine = parser.add_mutually_exclusive_group()
    engine.add_argument("--sim", dest="engine", action="store_const", const="sim",
                        help="campaign: the deterministic simulation (the default; infra/faultsim)")
    engine.add_argument("--real", dest="engine", action="store_const", const="real",
                        help="campaign: real processes (infra/chaos/campaign_real.py)")
    parser.add_argument("--runs", type=int, default=None,
                        help="campaign: schedules to run (default: sim 100, or 1 with --schedule; real 20)")
    parser.add_argument("--jobs", type=int, default=1, help="campaign --sim: processes the runs spread over")
    parser.add_argument("--schedule", default=None,
                        help="campaign --sim: run this one schedule (e.g. 'kill-syncer@60+12') on --seed's world")
    parser.add_argument("--rules", default=None,
                        help="campaign --sim: world overrides, e.g. 'quorum=2' or 'marks=1' (a failure's replay line has them)")
    parser.add_argument("--only", type=int, default=None, help="campaign --real: run only schedule I of --seed")
    return _handle


def _handle(args) -> int:
    from .experiments import EXPERIMENTS, run_experiment
    from .runner import run_scenario
    from .scenarios import SCENARIOS, get
    if args.list:
        for sc in SCENARIOS.values():
            print(f"{sc.name:<26} {sc.kind}: {sc.description}")
        for name, (_, doc) in EXPERIMENTS.items():
            print(f"{'experiment ' + name:<26} {doc}")
        return 0
    if not args.scenario:
        raise SystemExit("name a scenario (ddiloco chaos --list shows them) or 'experiment NAME'")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if args.scenario == "campaign":
        return _campaign(args, stamp)
    if args.scenario == "experiment":
        if args.name not in EXPERIMENTS:
            raise SystemExit(f"name an experiment: one of {', '.join(EXPERIMENTS)}")
        out = Path(args.out or f"runs/chaos/experiment-{args.name}-{stamp}")
        result = run_experiment(args.name, out, seed=args.seed, quick=args.quick)
        print(json.dumps(result.get("summary", result), indent=2))
        print(f"report: {out / 'experiment.json'}")
        return 0
    if args.name:
        raise SystemExit(f"unexpected argument {args.name!r} after scenario {args.scenario!r}")
    try:
        sc = get(args.scenario)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    over = {k: v for k, v in (("steps", args.steps), ("slow", args.slow)) if v is not None}
    if over:   # e.g. event-log with a long simulated log: learners that train through all of it
        try:
            sc = dataclasses.replace(sc, spec=dataclasses.replace(sc.spec, **over))
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
    if args.events and args.time_scale <= 0:
        raise SystemExit(f"--time-scale must be > 0, got {args.time_scale}")
    out = Path(args.out or f"runs/chaos/{sc.name}-{stamp}")
    report = run_scenario(sc, out, seed=args.seed, events_path=args.events, time_scale=args.time_scale)
    print(f"\nchaos {sc.name}: {'all invariants hold' if report['ok'] else 'INVARIANT VIOLATED'}")
    for c in report["checks"]:
        print(f"  [{'ok' if c['ok'] else 'FAIL'}] {c['name']:<26} {c['detail']}")
    print(f"report: {out / 'report.json'}  timeline: {report.get('timeline_png')}")
    return 0 if report["ok"] else 1


def _campaign(args, stamp: str) -> int:
    """``ddiloco chaos campaign``: 0 if every schedule kept every invariant, 1 otherwise."""
    if args.name:
        raise SystemExit(f"unexpected argument {args.name!r} after 'campaign'")
    engine = args.engine or "sim"
    if engine == "sim":
        if args.only is not None:
            raise SystemExit("--only picks a schedule of the real campaign (--real); a simulated run is --seed S --runs 1")
        from infra.faultsim.campaign import parse_rules, run_campaign
        try:
            runs = args.runs if args.runs is not None else (1 if args.schedule is not None else 100)
            report = run_campaign(runs, args.seed, jobs=args.jobs,
                                  schedule=args.schedule, out=args.out, rules=parse_rules(args.rules))
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
        return 0 if not report["failed"] else 1
    if args.schedule is not None or args.jobs != 1 or args.rules is not None:
        raise SystemExit("--schedule, --jobs and --rules are options of the simulated campaign (--sim)")
    try:
        from .campaign_real import run_real_campaign
    except ImportError as exc:
        raise SystemExit(f"the real-process campaign is not available: infra/chaos/campaign_real.py "
                         f"({exc})") from None
    out = Path(args.out or f"runs/chaos/campaign-{stamp}")
    try:
        report = run_real_campaign(args.runs if args.runs is not None else 20, args.seed, out, only=args.only)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    print(f"report: {out / 'campaign.json'}")
    return 0 if not report["failed"] else 1
