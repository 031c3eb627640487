"""The simulated fault campaign (docs/faultsim.md): ``ddiloco chaos campaign --sim``.

Run ``i`` of a campaign with seed ``S`` is the run of seed ``S + i``: its world and fault schedule
are drawn from that seed alone (world.py), so a failing run replays with
``ddiloco chaos campaign --sim --seed S+i --runs 1`` - the identical event sequence, whatever ran
before it or beside it (``--jobs``: runs spread over processes; each run is still one process's
pure function of its seed). ``--schedule TEXT`` runs one schedule of your own on seed ``S``'s world;
``--rules quorum=2,marks=1`` overrides the drawn K or the run's rules (``guard_version``; world.py).

Each run's record: seed, K, schedule (its ``--schedule`` text), ok, the failed checks, the trace
hash (sha256 of every event record: two runs of one seed must agree, tests/test_faultsim.py) and the
CPU seconds it took. The report (``OUT/campaign.json`` with ``--out``) has them all and the rate.
"""
from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path
from typing import Callable, Sequence

from .checks import check_run, failures
from .faults import Fault, parse_schedule, schedule_text
from .runner import simulate
from .world import draw, draw_world

MAX_RUNS = 1_000_000


RULES = ("quorum", "marks", "guard_version", "bus")     # world fields ``--rules`` may override


def parse_rules(text: str | None) -> dict | None:
    """``--rules`` text (``quorum=2,marks=1``) as world overrides; ValueError names a bad piece."""
    if text is None:
        return None
    out = {}
    for piece in text.split(","):
        name, sep, value = piece.strip().partition("=")
        if not sep or name not in RULES or not value.isdigit():
            raise ValueError(f"--rules piece {piece!r}: use NAME=INT with NAME one of {', '.join(RULES)}")
        out[name] = bool(int(value)) if name == "bus" else int(value)
    return out


def rules_text(rules: dict | None) -> str:
    return ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in sorted((rules or {}).items()))


def replay_command(seed: int, schedule: str | None = None, rules: dict | None = None) -> str:
    """The one command that replays a run."""
    extra = f" --rules {rules_text(rules)}" if rules else ""
    if schedule is not None:
        return f"ddiloco chaos campaign --sim --seed {seed} --schedule '{schedule}'{extra}"
    return f"ddiloco chaos campaign --sim --seed {seed} --runs 1{extra}"


def run_one(seed: int, schedule: str | None = None, rules: dict | None = None) -> dict:
    """Simulate and judge one run (seed ``seed``, or its world under ``schedule``); ``rules``:
    world fields to override (e.g. ``{"marks": 1}``: the rules of a run written before issue 25)."""
    t0 = time.process_time()
    if schedule is None:
        cfg, faults = draw(seed, **(rules or {}))
    else:
        cfg, faults = draw_world(seed, **(rules or {})), parse_schedule(schedule)
    res = simulate(cfg, faults)
    failed = failures(check_run(res))
    return {"seed": seed, "quorum": cfg.quorum, "schedule": schedule_text(faults), "ok": not failed,
            "failed": failed, "trace_hash": res.trace_hash(), "events": len(res.trace),
            "cpu_s": round(time.process_time() - t0, 3),
            "replay": replay_command(seed, schedule, rules)}


def _one(args: tuple[int, str | None, dict | None]) -> dict:
    return run_one(*args)


def run_campaign(runs: int, seed: int, *, jobs: int = 1, schedule: str | None = None,
                 out: str | Path | None = None, say: Callable[[str], None] = print,
                 rules: dict | None = None) -> dict:
    """Run ``runs`` simulated schedules from ``seed`` (module docstring) on ``jobs`` processes;
    print each failure with its replay command; return (and with ``out`` write) the report.
    ``rules``: world overrides for every run (``run_one``; tests reproduce older rules with it)."""
    _check_args(runs, seed, jobs, schedule)
    todo = [(seed + i, schedule, rules) for i in range(runs)]
    t0 = time.time()
    results: list[dict] = []
    for r in _map(todo, jobs):
        results.append(r)
        if not r["ok"]:
            say(f"FAILED seed {r['seed']} (K={r['quorum']}) {r['schedule']}")
            for f in r["failed"]:
                say(f"    {f}")
            say(f"    replay: {r['replay']}")
    wall = time.time() - t0
    failed = [r["seed"] for r in results if not r["ok"]]
    report = {"format": "ddiloco-campaign-report", "version": 1, "engine": "sim", "seed": seed, "schedules": runs,
              "jobs": jobs, "failed": failed, "wall_s": round(wall, 2),
              "schedules_per_minute": round(60 * runs / wall, 1) if wall > 0 else None,
              "cpu_s": round(sum(r["cpu_s"] for r in results), 2), "results": results}
    say(f"{runs} simulated schedules, {len(failed)} failed, {wall:.1f} s on {jobs} process(es) "
        f"({report['schedules_per_minute']} schedules/min)")
    if out is not None:
        path = Path(out)
        path.mkdir(parents=True, exist_ok=True)
        (path / "campaign.json").write_text(json.dumps(report, indent=2))
    return report


def _check_args(runs: int, seed: int, jobs: int, schedule: str | None) -> None:
    for name, v, lo in (("runs", runs, 1), ("seed", seed, 0), ("jobs", jobs, 1)):
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise ValueError(f"--{name} must be an int >= {lo}, got {v!r}")
    if runs > MAX_RUNS:
        raise ValueError(f"--runs must be <= {MAX_RUNS}, got {runs}")
    if schedule is not None:
        parse_schedule(schedule)       # refused before anything runs
        if runs != 1:
            raise ValueError(f"--schedule runs one schedule: use --runs 1, not {runs}")


def _map(todo: Sequence[tuple[int, str | None, dict | None]], jobs: int):
    """Results in seed order; on ``jobs`` fresh processes (spawned: nothing inherited) when > 1."""
    if jobs == 1 or len(todo) == 1:
        yield from map(_one, todo)
        return
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        yield from pool.imap(_one, todo)


def schedule_of(seed: int) -> tuple[Fault, ...]:
    """The faults run ``seed`` applies (for docs and tests)."""
    return draw(seed)[1]
