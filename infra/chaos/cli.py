"""`ddiloco chaos`: run a fault-injection scenario on a local job and check its invariants.

``ddiloco chaos --list`` prints the scenarios (name, then a short description, one per line).
``ddiloco chaos SCENARIO [--seed S] [--out DIR]`` runs one: exit status 0 only if every invariant
held; the report is ``OUT/report.json`` and ``OUT/timeline.png``. ``--events PATH`` drives learner
failures from a failure event log (the simulator's ``--events`` output; ``--time-scale`` maps its
seconds onto the local run). ``ddiloco chaos experiment NAME`` runs one of the experiments
(heterogeneous speeds, compute scavenging, goodput under failures; docs/chaos.md).
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path


def configure(parser):
    """Fault injection on a local run (kill, stall, partition, bad input...) with invariant checks."""
    from .experiments import EXPERIMENTS
    parser.add_argument("scenario", nargs="?", help="a scenario from --list, or 'experiment'")
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
