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
from .bandwidth import BUDGETS, FORMULA, BandwidthConfig, bandwidth, budget_steps
from .calibrate import calibration_note
from .config import DAY_S, DEFAULT_CHIPS, DEFAULT_LEARNERS, YEAR_S, ModelConfig, SweepConfig
from .dists import parse_dist
from .eventlog import events_from_stalls, write_events
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
    dist = "DIST"
    g = parser.add_argument_group("cluster and failures (durations: kind[:mean[:...]] in seconds, "
                                  "fixed|exp|lognormal:MEAN:CV|expweibull:MEAN:SHAPE:POWER)")
    g.add_argument("--chips", type=count, nargs="+", default=list(DEFAULT_CHIPS), metavar="N",
                   help="cluster sizes to sweep (default: 150k 300k 600k 1.2M 2.4M)")
    g.add_argument("--mtbi-years", type=float, default=d.mtbi_s / YEAR_S,
                   help="mean time between interruptions of a computing chip, in years; inf = none (default 1)")
    g.add_argument("--chips-per-slice", type=int, default=d.chips_per_slice,
                   help="a failed chip takes its slice out (default %(default)s)")
    g.add_argument("--detection", type=parse_dist, default=d.detection, metavar=dist,
                   help="failure -> noticed (default %(default)s)")
    g.add_argument("--restart", type=parse_dist, default=d.restart, metavar=dist,
                   help="non-elastic DP: noticed -> training again; without a mean it is calibrated so that "
                        "data parallel at 150k chips, MTBI 1 year has 72%% goodput (default %(default)s)")
    g.add_argument("--checkpoint-s", type=float, default=d.checkpoint_s,
                   help="non-elastic DP: seconds of progress between checkpoints; a failure loses the progress "
                        "since the last one (default %(default)s)")
    g.add_argument("--reconfiguration", type=parse_dist, default=d.reconfiguration, metavar=dist,
                   help="elastic DP and learners: one shrink or grow (default %(default)s)")
    g.add_argument("--recovery", type=parse_dist, default=d.recovery, metavar=dist,
                   help="recovery delay: a spare taken from the pool -> ready to join (default %(default)s)")
    g.add_argument("--repair", type=parse_dist, default=d.repair, metavar=dist,
                   help="broken slice noticed -> healthy again in the spare pool (default %(default)s)")
    g.add_argument("--spare-fraction", type=float, default=d.spare_fraction,
                   help="spare pool as a fraction of the cluster's slices (default %(default)s)")
    g.add_argument("--spares", type=int, default=None, help="spare pool in slices (overrides --spare-fraction)")
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
    o.add_argument("--events-stop-at-end", action="store_true",
                   help="end the log with a fail of every learner still up, so a replay stops with the window")
    return _simulate


def _sweep_config(args: argparse.Namespace) -> SweepConfig:
    model = ModelConfig(mtbi_s=args.mtbi_years * YEAR_S, chips_per_slice=args.chips_per_slice,
                        detection=args.detection, restart=args.restart, checkpoint_s=args.checkpoint_s,
                        reconfiguration=args.reconfiguration, recovery=args.recovery, repair=args.repair,
                        spare_fraction=args.spare_fraction, spares=args.spares, speed_cv=args.speed_cv,
                        duration_s=args.duration_days * DAY_S)
    return SweepConfig(model=model, chips=tuple(args.chips), learners=tuple(args.learners),
                       quorum=args.quorum, seed=args.seed,
                       min_seeds=args.min_seeds if args.min_seeds is not None else min(3, args.max_seeds),
                       max_seeds=args.max_seeds, target_ci=args.target_ci / 100)


def describe(model: ModelConfig) -> str:
    """The model's parameters in one line (table note, plot subtitle, event-log meta)."""
    spares = f"{model.spares} spares" if model.spares is not None else f"spares {model.spare_fraction:g} of slices"
    return (f"MTBI {model.mtbi_s / YEAR_S:g} y/chip, {model.chips_per_slice} chips/slice, detection "
            f"{model.detection}, restart {model.restart}, checkpoint every {model.checkpoint_s:g} s, "
            f"reconfiguration {model.reconfiguration}, recovery {model.recovery}, repair {model.repair}, "
            f"{spares}, speed cv {model.speed_cv:g}, {model.duration_s / DAY_S:g} days/seed")


def _simulate(args: argparse.Namespace) -> int:
    try:
        cfg = _sweep_config(args)
        result = run_sweep(cfg)
    except ValueError as exc:
        return _fail("simulate", exc)
    model = result.model
    calibrated = calibration_note(cfg.model, model)
    note = f"{describe(model)}; {result.wall_s:.2f} s wall"
    dry = [f"{r.system}{'' if r.system != 'decoupled' else f' M={r.learners}'} at {r.chips:,}: "
           f"{100 * r.pool_waits:.1f}%" for r in result.rows if r.pool_waits > 0]
    pool = ("spare pool ran dry; replacements that waited for a repair: " + ", ".join(dry)) if dry else \
        "spare pool never ran dry (repair times did not matter)"
    if args.json:
        print(json.dumps([row.to_json() for row in result.rows], indent=1))
        print(calibrated, file=sys.stderr)
    else:
        _print_table(result, [note, calibrated, pool])
    if not args.no_plot:
        from .plot import plot_sweep  # matplotlib only when needed
        path = plot_sweep(result.rows, args.plot or args.out / "goodput.png", subtitle=f"{note}\n{calibrated}")
        print(f"plot: {path}", file=sys.stderr if args.json else sys.stdout)
    if args.events is not None:
        try:
            path = _write_event_log(args, cfg, result)
        except ValueError as exc:
            return _fail("simulate", exc)
        print(f"events: {path}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _print_table(result: SweepResult, notes: list[str]) -> None:
    table = Table(title="Goodput under chip failures (SPEC §9)")
    for col in ("system", "chips", "M", "K", "goodput", "uptime", "±CI (95%)", "seeds"):
        table.add_column(col, justify="left" if col == "system" else "right")
    for r in result.rows:
        ci = "n/a" if r.ci is None else f"{100 * r.ci:.2f} pt"
        table.add_row(r.system, f"{r.chips:,}", str(r.learners), str(r.quorum), f"{100 * r.goodput:.1f}%",
                      f"{100 * r.uptime:.1f}%", ci, str(r.seeds))
    console = Console(width=140)
    console.print(table)
    for line in notes:
        console.print(line)


def _write_event_log(args: argparse.Namespace, cfg: SweepConfig, result: SweepResult) -> Path:
    chips = args.events_chips or cfg.chips[0]
    learners = args.events_learners or cfg.learners[0]
    if not cfg.quorum <= learners:
        raise ValueError(f"--events-learners M={learners} is below the quorum K={cfg.quorum}")
    model = result.model
    trace = generate_trace(model, chips, point_rng(cfg.seed, 0, chips))
    run = systems.decoupled(trace, model, learners, cfg.quorum)
    events = events_from_stalls([rec.stalls for rec in run.learners], model.duration_s, args.events_stop_at_end)
    meta = {"learners": learners, "duration_s": model.duration_s, "chips": chips, "quorum": cfg.quorum,
            "seed": cfg.seed, "repetition": 0, "mtbi_s": model.mtbi_s,
            "chips_per_slice": model.chips_per_slice, "detection": str(model.detection),
            "restart": str(model.restart), "checkpoint_s": model.checkpoint_s,
            "reconfiguration": str(model.reconfiguration), "recovery": str(model.recovery),
            "repair": str(model.repair), "spares": model.pool_slices(trace.slices),
            "speed_cv": model.speed_cv, "recover_means": "recovery begins (trains one reconfiguration later)",
            "stop_at_end": args.events_stop_at_end,
            "goodput": run.outcome.goodput, "uptime": run.outcome.uptime}
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
    parser.add_argument("--budget", choices=BUDGETS, default=d.budget,
                        help="steps a fragment's exchange may use, for --json: 'step' = min(tau, H/P), the link "
                             "keeps up with the stream of fragments; 'tau' = tau steps each (default %(default)s)")
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
                              backward_fraction=args.backward_fraction, budget=args.budget)
    except ValueError as exc:
        return _fail("bandwidth", exc)
    out = bandwidth(cfg)
    if args.json:
        print(json.dumps(out))
        return 0
    print(FORMULA)
    print(f"\nB={cfg.params:g}, s={cfg.step_time_s:g} s, u={cfg.utilisation:g}, S={cfg.sites}, P={cfg.fragments}, "
          f"H={cfg.period}, tau={cfg.overlap}, dp_bits={cfg.dp_bits}, b={cfg.backward_fraction:.3g}")
    readings = {b: bandwidth(cfg, b) for b in BUDGETS}
    table = Table(title="Cross-site bandwidth per site (Gbit/s) under both readings of a fragment's budget")
    table.add_column("system")
    for b in BUDGETS:
        label = f"sustained: {budget_steps(cfg, b):g} step(s)" if b == "step" else f"per tau: {budget_steps(cfg, b):g} steps"
        table.add_column(label + (" [--json]" if b == cfg.budget else ""), justify="right")
    names = {"dp_gbps": "data parallel (bf16 gradients)", "decoupled_bf16_gbps": "Decoupled DiLoCo bf16",
             "decoupled_int4_gbps": "Decoupled DiLoCo int4"}
    for key in out:
        cells = [f"{readings[b][key]:.4g}" + ("" if key == "dp_gbps" else f" (1/{readings[b]['dp_gbps'] / readings[b][key]:.0f})")
                 for b in BUDGETS]
        table.add_row(names[key], *cells)
    Console(width=120).print(table)
    if budget_steps(cfg, "step") != budget_steps(cfg, "tau"):
        print(f"The readings differ: with tau={cfg.overlap} > H/P={cfg.period / cfg.fragments:g}, "
              f"{math.ceil(cfg.overlap * cfg.fragments / cfg.period)} exchanges are in flight at once; 'per tau' "
              f"gives each the whole link (docs/simulator.md).")
    return 0
