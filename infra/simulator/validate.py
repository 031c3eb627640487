"""Simulated vs real: the simulator's Decoupled DiLoCo goodput and uptime for one failure event
log, against what real learners driven by the same log measured (docs/simulator.md).

    ddiloco simulate ... --events sim.events --events-stop-at-end   # predict, and write the log
    ddiloco chaos event-log --events sim.events --time-scale S --steps N --slow F --out OUT
    python -m infra.simulator.validate --events sim.events --chaos OUT --time-scale S

The real side is measured over the log's window [t0, t0 + S·duration], t0 = the run's first merge
commit (schedule time 0 of ``ddiloco chaos``), with the chaos experiments' definitions
(``infra.chaos.experiments.goodput_measures``):

- goodput: learner-time from each process life's ``learner-start`` to its last delta that was
  merged, over M x window (a killed life's unmerged work and its start-up count as lost);
- uptime (commit bins): fraction of one-second bins with a merge commit;
- uptime (learners): fraction of the window in which at least K learners were in such a
  productive stretch (the simulator's definition, ``systems.decoupled``, applied to the run).

Both sides also split learner-time into training, waiting (killed, until the log's ``recover``),
restarting (the simulated reconfiguration; a real process's start-up) and work lost at a kill,
which shows where a difference comes from.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

from . import intervals as iv
from .dists import parse_dist
from .eventlog import EventLog, read_event_log

SHARES = ("training", "waiting", "restarting", "lost")


def _lives(events: list[dict], merged: set[str]) -> dict[int, tuple[float, float | None]]:
    """Per process life (by pid): (learner-start, production time of its last merged delta or None)."""
    lives: dict[int, list] = {}
    current = None
    for e in events:
        if e.get("event") == "learner-start":
            current = lives.setdefault(e.get("pid", len(lives)), [e["t"], None])
        elif e.get("event") == "delta" and current is not None and e.get("delta") in merged:
            current[1] = e["t"]
    return {pid: (a, b) for pid, (a, b) in lives.items()}


def time_shares(spawns: list[dict], lives: dict[int, tuple[float, float | None]], t0: float,
                t_end: float) -> tuple[dict[str, float], list[float]]:
    """One learner's seconds in [t0, t_end] by what it was doing: ``training`` (a life's
    learner-start to its last merged delta), ``lost`` (the rest of a started life: work that died
    with it), ``restarting`` (spawn to learner-start), ``waiting`` (no process: killed, waiting for
    the log's recover); and each restarted life's start-up. ``spawns``: the report's lives in order."""
    def clip(a: float, b: float) -> float:
        return max(0.0, min(b, t_end) - max(a, t0))

    out = dict.fromkeys(SHARES, 0.0)
    startups, prev_end = [], t0
    for i, life in enumerate(spawns):
        end = life["ended"] if life["ended"] is not None else t_end
        out["waiting"] += clip(prev_end, life["started"])
        start, last = lives.get(life["pid"], (None, None))
        out["restarting"] += clip(life["started"], start if start is not None else end)
        if start is not None:
            if i:
                startups.append(start - life["started"])
            out["training"] += clip(start, last) if last is not None else 0.0
            out["lost"] += clip(last if last is not None else start, end)
        prev_end = end
    out["waiting"] += clip(prev_end, t_end)
    return out, startups


def learner_uptime(productive: list[list[tuple[float, float]]], t0: float, t_end: float, quorum: int) -> float:
    """Fraction of [t0, t_end] in which at least ``quorum`` learners were productive."""
    horizon = t_end - t0
    starts, ends = [], []
    for spans in productive:
        s, e = iv.union(np.array([a - t0 for a, _ in spans]), np.array([b - t0 for _, b in spans]), horizon)
        starts.append(s)
        ends.append(e)
    s, e = np.concatenate(starts), np.concatenate(ends)
    count = iv.step(np.r_[s, e], np.r_[np.ones(s.size), -np.ones(e.size)], 0.0, horizon)
    return iv.length(iv.where(count, count[1] >= quorum, horizon)) / horizon


def measure(out: Path, window_s: float, quorum: int) -> dict:
    """Goodput, uptimes, learner-time shares and start-ups of the chaos run in ``out``."""
    from infra.chaos.experiments import goodput_measures
    from storage.layout import read_descriptor
    from storage.log import CommitLog
    from storage.store import open_store
    from workers.common.events import read_events

    report = json.loads((out / "report.json").read_text())
    t0 = next(m["t"] for m in report["timeline"] if m["what"] == "training")
    t_end = t0 + window_s
    store = open_store(report["store"])
    log = CommitLog(store)
    records = list(log.read_range(0, log.tail() + 1))
    names = sorted(n for n, lives in report["lives"].items() if lives[0]["role"] == "learner")
    events = {n: read_events(out / "logs" / f"{n}.jsonl") for n in names}
    m = goodput_measures(events, records, read_descriptor(store), t0, t_end)
    merged = {i.delta_id for r in records if r.kind == "merge" for i in r.inputs}
    productive, startups, shares, kills = [], [], dict.fromkeys(SHARES, 0.0), 0
    for n in names:
        lives = _lives(events[n], merged)
        productive.append([(a, b) for a, b in lives.values() if b is not None])
        mine, ups = time_shares(report["lives"][n], lives, t0, t_end)
        shares = {k: shares[k] + mine[k] for k in SHARES}
        startups += ups
        kills += sum(1 for life in report["lives"][n] if life["how"] == "killed" and life["ended"] < t_end)
    total = len(names) * window_s
    return {"goodput": m["goodput"], "uptime_commits": m["uptime"],
            "uptime_learners": round(learner_uptime(productive, t0, t_end, quorum), 4),
            "shares": {k: round(v / total, 4) for k, v in shares.items()}, "kills": kills,
            "mean_startup_s": round(statistics.fmean(startups), 2) if startups else None,
            "window_s": window_s, "commits": len(records)}


def simulated(log: EventLog, time_scale: float) -> dict:
    """The log's own prediction and learner-time shares: waiting = fail -> recover (what the log
    schedules), restarting = the reconfiguration after it (the rest), training = goodput (with
    speed cv 0 goodput is the share of learner-time spent training)."""
    rc = parse_dist(str(log.meta.get("reconfiguration", "fixed:0"))).mean or 0.0
    horizon = log.duration_s
    events = [e for e in log.events if e.time_s < horizon]   # not the closing fails of stop-at-end
    waiting, open_fail = 0.0, {}
    for e in events:
        if e.event == "fail":
            open_fail[e.learner] = e.time_s
        elif e.learner in open_fail:
            waiting += e.time_s - open_fail.pop(e.learner)
    waiting = (waiting + sum(horizon - t for t in open_fail.values())) / (log.learners * horizon)
    training = float(log.meta.get("goodput", float("nan")))
    return {"goodput": training, "uptime": log.meta.get("uptime"),
            "shares": {"training": round(training, 4), "waiting": round(waiting, 4),
                       "restarting": round(1 - training - waiting, 4), "lost": 0.0},
            "kills": sum(e.event == "fail" for e in events), "mean_startup_s": round(rc * time_scale, 2),
            "window_s": horizon * time_scale}


def compare(events_path: Path, chaos_out: Path, time_scale: float) -> dict:
    if not time_scale > 0:
        raise ValueError(f"time scale must be > 0, got {time_scale}")
    log = read_event_log(events_path)
    sim = simulated(log, time_scale)
    real = measure(chaos_out, sim["window_s"], int(log.meta.get("quorum", 1)))
    return {"simulated": sim, "real": real, "learners": log.learners, "time_scale": time_scale}


def _print(res: dict) -> None:
    sim, real = res["simulated"], res["real"]
    print(f"{res['learners']} learners, window {sim['window_s']:.1f} s (time scale {res['time_scale']:g})")
    print(f"{'':<34}{'simulated':>11}{'real':>11}")
    rows = [("goodput (share training)", sim["goodput"], real["goodput"]),
            ("  share waiting (fail->recover)", sim["shares"]["waiting"], real["shares"]["waiting"]),
            ("  share restarting", sim["shares"]["restarting"], real["shares"]["restarting"]),
            ("  share lost at kills", 0.0, real["shares"]["lost"]),
            ("uptime (>= K learners training)", sim["uptime"], real["uptime_learners"]),
            ("uptime (1-s bins with a commit)", None, real["uptime_commits"]),
            ("failures (kills)", sim["kills"], real["kills"]),
            ("mean restart start-up [s]", sim["mean_startup_s"], real["mean_startup_s"])]
    for name, a, b in rows:
        print(f"{name:<34}{'-' if a is None else f'{a:.3g}':>11}{'-' if b is None else f'{b:.3g}':>11}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m infra.simulator.validate", description=__doc__.splitlines()[0])
    p.add_argument("--events", type=Path, required=True, help="the simulator's event log (kind sim-events)")
    p.add_argument("--chaos", type=Path, required=True, help="OUT of `ddiloco chaos event-log --events ...`")
    p.add_argument("--time-scale", type=float, required=True, help="the --time-scale the chaos run used")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        res = compare(args.events, args.chaos, args.time_scale)
    except (ValueError, OSError, KeyError, StopIteration) as exc:
        print(f"validate: error: {exc!r}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        _print(res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
