"""`ddiloco simulate` and `ddiloco bandwidth` (entry points in setup.cfg, group ddiloco.commands)."""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Callable

from rich.console import Console
from rich.table import Table

from . import systems
from .bandwidth import FORMULA, BandwidthConfig, bandwidth
from .config import (DAY_S, DEFAULT_CHIPS, DEFAULT_LEARNERS, YEAR_S, ModelConfig, SweepConfig,
                     parse_dist)
from .eventlog import events_from_running, write_events
from .events import generate_trace
from .sweep import SweepResult, point_rng, run_sweep

Handler = Callable[[argparse.Namespace], int]
_SUFFIX = {"k": 1e3, "m": 1e6, "g": 1e9, "b": 1e9}


def count(text: str) -> int:
    """A positive whole number, also written 150k, 1.2M or 2.4e6."""
    t = text.strip().lower()
    mult = _SUFFIX.get(t[-1:], 1.0)
    try:
        value = float(t[:-1] if mult != 1.0 else t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (examples: 150000, 150k, 1.2M)") from None
    if not math.isfinite(value) or value < 1 or abs(value - round(value)) > 1e-9 * value:
        raise argparse.ArgumentTypeError(f"{text!r} must be a whole number >= 1")
    return int(round(value))


def number(text: str) -> float:
    t = text.strip().lower()
    mult = _SUFFIX.get(t[-1:], 1.0)
    try:
        return float(t[:-1] if mult != 1.0 else t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def _fail(command: str, exc: Exception) -> int:
    print(f"ddiloco {command}: error: {exc}", file=sys.stderr)
    return 2


# --------------------------------------------------------------------------------------- simulate
def configure_simulate(parser: argparse.ArgumentParser) -> Handler:
    """Goodput simulator: data parallel vs elastic DP vs Decoupled DiLoCo under chip failures (SPEC §9)."""
    d = ModelConfig()
    g = parser.add_argument_group("cluster and failures")
    g.add_argument("--chips", type=count, nargs="+", default=list(DEFAULT_CHIPS), metavar="N",
                   help="cluster sizes to sweep (default: 150k 300k 600k 1.2M 2.4M)")
    g.add_argument("--mtbi-years", type=float, default=d.mtbi_s / YEAR_S,
                   help="mean time between interruptions per chip, in years; inf = no failures (default 1)")
    g.add_argument("--chips-per-slice", type=int, default=d.chips_per_slice,
                   help="a failed chip takes its slice out (default %(default)s)")
    g.add_argument("--detection", type=parse_dist, default=d.detection, metavar="DIST",
                   help="failure detection time, kind[:mean[:cv]] in seconds: fixed|exp|lognormal "
                        "(default %(default)s)")
    g.add_argument("--reconfiguration", type=parse_dist, default=d.reconfiguration, metavar="DIST",
                   help="one global reconfiguration (shrink, grow, restart) (default %(default)s)")
    g.add_argument("--repair", type=parse_dist, default=d.repair, metavar="DIST",
                   help="slice repair time; without a mean it is calibrated so that data parallel at 150k "
                        "chips and MTBI 1 year has 72%% goodput (default %(default)s)")
    g.add_argument("--speed-cv", type=float, default=d.speed_cv,
                   help="per-step, per-chip step-time coefficient of variation (default %(default)s)")
    s = parser.add_argument_group("systems and sweep")
    s.add_argument("--learners", type=int, nargs="+", default=list(DEFAULT_LEARNERS), metavar="M",
                   help="Decoupled DiLoCo learner counts (default 2 4 8 16)")
    s.add_argument("--quorum", type=int, default=1, metavar="K", help="minimum quorum K (default 1)")
    s.add_argument("--duration-days", type=float, default=d.duration_s / DAY_S,
                   help="simulated wall time per seed (default %(default)s)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--min-seeds", type=int, default=None,
                   help="repetitions before the CI is first checked (default: 3, or --max-seeds if fewer)")
    s.add_argument("--max-seeds", type=int, default=30, help="limit on repetitions per cluster size")
    s.add_argument("--target-ci", type=float, default=1.0,
                   help="stop repeating when every 95%% CI is within ± this many points (default 1)")
    o = parser.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print a JSON list of rows instead of a table")
    o.add_argument("--out", type=Path, default=Path("."), help="directory for the plot (default .)")
    o.add_argument("--plot", type=Path, default=None, help="PNG path (default OUT/goodput.png)")
    o.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    o.add_argument("--events", type=Path, default=None, metavar="PATH",
                   help="write the learner fail/recover events of one simulated Decoupled DiLoCo run")
    o.add_argument("--events-chips", type=count, default=None, help="its cluster size (default: first --chips)")
    o.add_argument("--events-learners", type=int, default=None, help="its M (default: first --learners)")
    return _simulate


def _sweep_config(args: argparse.Namespace) -> SweepConfig:
    model = ModelConfig(mtbi_s=args.mtbi_years * YEAR_S, chips_per_slice=args.chips_per_slice,
                        detection=args.detection, reconfiguration=args.reconfiguration,
                        repair=args.repair, speed_cv=args.speed_cv, duration_s=args.duration_days * DAY_S)
    return SweepConfig(model=model, chips=tuple(args.chips), learners=tuple(args.learners),
                       quorum=args.quorum, seed=args.seed,
                       min_seeds=args.min_seeds if args.min_seeds is not None else min(3, args.max_seeds),
                       max_seeds=args.max_seeds, target_ci=args.target_ci / 100)


def _simulate(args: argparse.Namespace) -> int:
    try:
        cfg = _sweep_config(args)
        result = run_sweep(cfg)
    except ValueError as exc:
        return _fail("simulate", exc)
    model = result.model
    note = (f"MTBI {model.mtbi_s / YEAR_S:g} y/chip, {model.chips_per_slice} chips/slice, detection "
            f"{model.detection}, reconfiguration {model.reconfiguration}, repair {model.repair} s "
            f"(calibrated: {cfg.model.repair.mean is None}), speed cv {model.speed_cv:g}, "
            f"{model.duration_s / DAY_S:g} days/seed; {result.wall_s:.2f} s wall")
    if args.json:
        print(json.dumps([row.to_json() for row in result.rows], indent=1))
    else:
        _print_table(result, note)
    if not args.no_plot:
        from .plot import plot_sweep  # matplotlib only when needed
        path = plot_sweep(result.rows, args.plot or args.out / "goodput.png", subtitle=note)
        print(f"plot: {path}", file=sys.stderr if args.json else sys.stdout)
    if args.events is not None:
        try:
            path = _write_event_log(args, cfg, result)
        except ValueError as exc:
            return _fail("simulate", exc)
        print(f"events: {path}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _print_table(result: SweepResult, note: str) -> None:
    table = Table(title="Goodput under chip failures (SPEC §9)")
    for col in ("system", "chips", "M", "K", "goodput", "uptime", "±CI (95%)", "seeds"):
        table.add_column(col, justify="left" if col == "system" else "right")
    for r in result.rows:
        ci = "n/a" if r.ci is None else f"{100 * r.ci:.2f} pt"
        table.add_row(r.system, f"{r.chips:,}", str(r.learners), str(r.quorum), f"{100 * r.goodput:.1f}%",
                      f"{100 * r.uptime:.1f}%", ci, str(r.seeds))
    console = Console(width=140)
    console.print(table)
    console.print(note)


def _write_event_log(args: argparse.Namespace, cfg: SweepConfig, result: SweepResult) -> Path:
    chips = args.events_chips or cfg.chips[0]
    learners = args.events_learners or cfg.learners[0]
    if not cfg.quorum <= learners:
        raise ValueError(f"--events-learners M={learners} is below the quorum K={cfg.quorum}")
    model = result.model
    trace = generate_trace(model, chips, point_rng(cfg.seed, 0, chips))
    run = systems.decoupled(trace, learners, cfg.quorum, model.speed_cv)
    events = events_from_running(run.learner_running, model.duration_s)
    meta = {"learners": learners, "duration_s": model.duration_s, "chips": chips, "quorum": cfg.quorum,
            "seed": cfg.seed, "repetition": 0, "mtbi_s": model.mtbi_s,
            "chips_per_slice": model.chips_per_slice, "detection": str(model.detection),
            "reconfiguration": str(model.reconfiguration), "repair": str(model.repair),
            "speed_cv": model.speed_cv, "goodput": run.outcome.goodput, "uptime": run.outcome.uptime}
    write_events(args.events, events, meta)
    return args.events


# -------------------------------------------------------------------------------------- bandwidth
def configure_bandwidth(parser: argparse.ArgumentParser) -> Handler:
    """Cross-site bandwidth that data parallel needs vs Decoupled DiLoCo in bf16 and int4 (SPEC §10)."""
    d = BandwidthConfig(params=1.0)
    parser.add_argument("--params", type=number, required=True, help="model parameters B, e.g. 5e9 or 5B")
    parser.add_argument("--step-time", type=float, default=d.step_time_s, help="compute time of one step [s]")
    parser.add_argument("--utilisation", type=float, default=d.utilisation, help="target compute utilisation")
    parser.add_argument("--sites", type=int, default=d.sites, help="number of sites (default %(default)s)")
    parser.add_argument("--fragments", type=int, default=d.fragments, help="fragments P (default %(default)s)")
    parser.add_argument("--sync-every", type=int, default=None, help="H in steps (default: = P)")
    parser.add_argument("--overlap", type=int, default=d.overlap, help="tau in steps (default %(default)s)")
    parser.add_argument("--dp-bits", type=int, default=d.dp_bits, help="bits per DP gradient value (default 16)")
    parser.add_argument("--backward-fraction", type=float, default=d.backward_fraction,
                        help="share of a step spent in the backward pass (default 2/3)")
    parser.add_argument("--json", action="store_true", help="print {dp_gbps, decoupled_bf16_gbps, "
                                                            "decoupled_int4_gbps} in Gbit/s")
    return _bandwidth


def _bandwidth(args: argparse.Namespace) -> int:
    try:
        cfg = BandwidthConfig(params=args.params, step_time_s=args.step_time, utilisation=args.utilisation,
                              sites=args.sites, fragments=args.fragments, sync_every=args.sync_every,
                              overlap=args.overlap, dp_bits=args.dp_bits,
                              backward_fraction=args.backward_fraction)
    except ValueError as exc:
        return _fail("bandwidth", exc)
    out = bandwidth(cfg)
    if args.json:
        print(json.dumps(out))
        return 0
    print(FORMULA)
    print(f"\nB={cfg.params:g}, s={cfg.step_time_s:g} s, u={cfg.utilisation:g}, S={cfg.sites}, P={cfg.fragments}, "
          f"H={cfg.period}, tau={cfg.overlap}, dp_bits={cfg.dp_bits}, b={cfg.backward_fraction:.3g}")
    table = Table(title="Cross-site bandwidth per site (Gbit/s)")
    table.add_column("system")
    table.add_column("Gbit/s", justify="right")
    table.add_column("vs data parallel", justify="right")
    names = {"dp_gbps": "data parallel (bf16 gradients)", "decoupled_bf16_gbps": "Decoupled DiLoCo bf16",
             "decoupled_int4_gbps": "Decoupled DiLoCo int4"}
    for key, value in out.items():
        table.add_row(names[key], f"{value:.4g}", f"1/{out['dp_gbps'] / value:.0f}")
    Console(width=120).print(table)
    return 0
