"""``ddiloco slurm summary OUT`` and ``ddiloco slurm status OUT``: what a SLURM run did, from its logs and store.

The summary is ``ddiloco launch``'s (workers/tools/launch_summary.py: the run's figures, restarts
per learner, where each life resumed), written to ``OUT/summary.json`` and ``OUT/report.png`` by
the run's stop job; ``mode`` is ``slurm`` and ``jobs`` holds the job ids. A learner's restarts are
its lives in its event log (``learner-start`` events) less one; the syncer's lives are its
``syncer-recovered`` events.
"""
from __future__ import annotations

import subprocess
from pathlib import Path
from types import SimpleNamespace

from storage.layout import read_descriptor
from storage.store import open_store
from workers import config
from workers.common.events import read_events
from workers.launch_config import SKIP, LaunchConfig
from workers.tools.launch_summary import launch_summary
from workers.tools.run_figures import write_outputs

from .drain import not_drained
from .submit import read_jobs, run_store


def settings(out: Path) -> LaunchConfig:
    path = out / "launch.toml"
    try:
        values = config.read_toml(path, LaunchConfig, SKIP)
        return config.build(LaunchConfig, values, {k: str(path) for k in values})
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None


def _events(out: Path) -> list[dict]:
    return [e for f in sorted((out / "logs").glob("*.jsonl")) for e in read_events(f)]


def lives(events: list[dict]) -> dict[str, int]:
    """How many times each role started: its learner-start (a syncer: syncer-recovered) events."""
    counts: dict[str, int] = {}
    for e in events:
        if e.get("event") in ("learner-start", "syncer-recovered"):
            counts[e.get("id", "?")] = counts.get(e.get("id", "?"), 0) + 1
    return counts


def summarize(out: Path, args=None) -> dict:
    """Write OUT/summary.json and OUT/report.png; returns the summary."""
    out = Path(out).resolve()
    jobs, cfg = read_jobs(out), settings(out)
    lc = cfg.launch
    store_uri, s3_endpoint = run_store(out, lc)
    store = open_store(store_uri, s3_endpoint=s3_endpoint, create=False)
    desc = read_descriptor(store)
    events = _events(out)
    stop = next((e for e in reversed(events) if e.get("event") == "syncer-stop"), {})
    stamps = [e["t"] for e in events if isinstance(e.get("t"), (int, float))]
    wall = max(0.0, max(stamps) - jobs["submitted"]) if stamps else 0.0     # submission to the last event
    restarts = {lid: n - 1 for lid, n in lives(events).items() if lid in jobs["learners"]}
    # drained: judged from the store and the logs (infra/slurm/drain.py), as the stop job waited for it;
    # the syncer's own stop event is reported beside it
    why = not_drained(store, out / "logs", sorted(jobs["learners"]))
    summary = launch_summary(store, store_uri, desc, events, wall, not why, False, lc, restarts)
    summary["not_drained"] = why or None
    summary["syncer_stopped_cleanly"] = bool(stop) and not stop.get("fenced")
    summary["mode"] = "slurm"
    summary["jobs"] = {"syncer": jobs["syncer"], "stop": jobs["stop"], **jobs["learners"],
                       **({"evaluator": jobs["evaluator"]} if jobs.get("evaluator") else {})}
    summary["syncer_lives"] = lives(events).get("syncer", 0)
    write_outputs(out, summary, events, args or SimpleNamespace(summary=None))
    return summary


def status(out: Path, environ: dict[str, str]) -> str:
    """One line per job: its SLURM state and, for a learner, the last step its log shows."""
    out = Path(out).resolve()
    jobs = read_jobs(out)
    roles = {"syncer": jobs["syncer"], **jobs["learners"],
             **({"evaluator": jobs["evaluator"]} if jobs.get("evaluator") else {}), "stop": jobs["stop"]}
    done = subprocess.run(["squeue", "-h", "-j", ",".join(roles.values()), "-o", "%i %T %r"], capture_output=True,
                          text=True, env=environ, timeout=60)
    states = {line.split()[0]: " ".join(line.split()[1:]) for line in done.stdout.splitlines() if line.strip()}
    steps: dict[str, int] = {}
    for e in _events(out):
        if e.get("event") == "step":
            steps[e.get("id", "?")] = max(steps.get(e.get("id", "?"), 0), int(e.get("step", 0)))
    counts = lives(_events(out))
    lines = []
    for role, jid in roles.items():
        state = states.get(jid, "ended (not in the queue)")
        more = f", step {steps[role]}" if role in steps else ""
        more += f", {counts[role]} lives" if counts.get(role, 0) > 1 else ""
        lines.append(f"{role:<8} job {jid:<8} {state}{more}")
    return "\n".join(lines)
