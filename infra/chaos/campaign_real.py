"""The real-process fault campaign: random, seeded fault schedules on real runs.

``ddiloco chaos campaign --real --runs N --seed S`` draws N schedules, each 1-4 faults over the
fault kinds the harness has on a plain local run - learner kill (+ restart), learner pause,
straggler (a learner slowed for the whole run), syncer kill (+ restart after an outage), a second
syncer, bus blackhole, bad input from a listed key - and, less often because each needs servers of
its own, an S3 outage (a SeaweedFS server per run). Every schedule runs as a chaos scenario
(runner.run_scenario: real ``ddiloco syncer`` and learner processes). A quarter of the runs
need a quorum K = 2 (their learner faults then hit one learner), and a third run the learners'
sync agent in a child process (``--sync-process``), whose SIGKILL is one more fault kind and is judged by every
invariant, bookkeeping and progress (invariants.py, progress.py). The deterministic simulation
(infra/faultsim/) runs the same idea a thousand times faster; this one keeps it honest.

Schedule i of seed S is a pure function of (S, i): ``--seed S --only i`` runs exactly it again
(timing on real processes differs run to run; the schedule does not).
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Callable

import numpy as np

from pipeline.policy import PolicyConfig
from .scenarios import _ALL_BAD, _BASE, Bounds, Fault, Scenario

KINDS = ("kill-learner", "pause-learner", "slow-learner", "kill-syncer", "second-syncer", "blackhole", "rogue",
         "s3-down", "kill-agent")
_WEIGHTS = (3, 3, 1, 3, 1, 2, 1, 1, 2)       # s3-down is rarer: it starts a server per run
_ATTACKS = [a for a in dict.fromkeys(_ALL_BAD.split(",")) if a != "too-old"]   # too-old waits for 16 versions


def schedule(seed: int, index: int, learners: int = 3, steps: int = 420) -> Scenario:
    """Schedule ``index`` of campaign ``seed``: 1-4 faults, drawn from ``KINDS`` (no two of one
    kind on one target), at 1-6 s after training starts, lasting 1-4 s."""
    rng = np.random.default_rng([seed, index, 25])
    # A quarter of the runs need K = 2 of the 3 learners (then learner faults hit one learner, so K
    # stay live); a third run the sync agent in a child process, whose SIGKILL the learner survives.
    quorum = 2 if rng.random() < 0.25 else 1
    agent = bool(rng.random() < 0.35)
    spec = dataclasses.replace(_BASE, learners=learners, steps=steps, seed=seed, policy=PolicyConfig(quorum=quorum),
                               sync_process=agent)
    victim = f"l{int(rng.integers(1, learners))}"
    faults: list[Fault] = []
    slow: dict[str, float] = {}
    used: set[tuple[str, str]] = set()
    for _ in range(int(rng.integers(1, 5))):
        kind = str(rng.choice(KINDS, p=np.array(_WEIGHTS) / sum(_WEIGHTS)))
        target = (victim if quorum > 1 else f"l{int(rng.integers(1, learners))}") \
            if kind in ("kill-learner", "pause-learner", "slow-learner", "kill-agent") else ""
        if (kind, target) in used or (kind == "kill-agent" and not agent):
            continue
        used.add((kind, target))
        at = round(float(rng.uniform(1.0, 6.0)), 2)
        dur = round(float(rng.uniform(1.0, 4.0)), 2)
        if kind == "slow-learner":
            slow[target] = float(rng.choice([2.0, 4.0]))
        elif kind == "kill-learner":
            faults.append(Fault(at, kind, target, dur))
        elif kind == "pause-learner":
            faults.append(Fault(at, kind, target, dur))
        elif kind == "kill-syncer":
            faults.append(Fault(at, kind, "syncer", dur))
        elif kind == "second-syncer":
            faults.append(Fault(at, kind, "syncer2"))
        elif kind == "blackhole":
            faults.append(Fault(at, kind, "", dur))
        elif kind == "rogue":
            picks = rng.choice(len(_ATTACKS), size=int(rng.integers(2, 6)), replace=False)
            faults.append(Fault(at, kind, ",".join(_ATTACKS[k] for k in sorted(picks))))
        elif kind == "kill-agent":
            faults.append(Fault(at, kind, target))
        elif kind == "s3-down":
            spec = dataclasses.replace(spec, storage="s3")
            faults.append(Fault(at, kind, "", dur))
    if slow:
        spec = dataclasses.replace(spec, slow_by=tuple(sorted(slow.items())))
    if not faults and not slow:       # every draw collided: one learner kill is always possible
        faults.append(Fault(2.0, "kill-learner", "l1", 2.0))
    # Bad input while the syncer is down or being replaced would go unheard on the bus (a rogue's
    # socket closes after its attack): that tests the rogue, not the syncer. It comes after them.
    down = [f.at_s + f.duration_s for f in faults if f.action in ("kill-syncer", "second-syncer")]
    if down:
        faults = [dataclasses.replace(f, at_s=round(max(f.at_s, max(down) + 1.0), 2)) if f.action == "rogue" else f
                  for f in faults]
    faults.sort(key=lambda f: f.at_s)
    # A syncer restart (imports, recovery) or an S3 outage holds commits for its length plus a few
    # seconds; otherwise a few seconds at most while one learner trains.
    slow_commits = any(f.action in ("kill-syncer", "second-syncer", "s3-down") for f in faults)
    bounds = Bounds(max_commit_gap_s=(20.0 if slow_commits else 6.0) + max((f.duration_s for f in faults), default=0))
    bounds = dataclasses.replace(bounds, quorum_alive=quorum)
    parts = (["K=2"] if quorum > 1 else []) + (["sync agent"] if agent else []) + [
        f"{f.action}{' ' + f.target if f.target else ''} at {f.at_s} s" + (f" for {f.duration_s} s" if f.duration_s else "")
        for f in faults] + ([("slow " + ", ".join(f"{k} x{v}" for k, v in sorted(slow.items())))] if slow else [])
    desc = "; ".join(parts)
    return Scenario(f"campaign-{seed}-{index}", "campaign", desc, spec, tuple(faults), bounds)


def replay_command(seed: int, index: int) -> str:
    return f"ddiloco chaos campaign --real --seed {seed} --only {index}"


def run_real_campaign(runs: int, seed: int, out: str | Path, only: int | None = None,
                      say: Callable[[str], None] = print) -> dict:
    """Run ``runs`` schedules (or schedule ``only``) and return the campaign report (also written
    to ``OUT/campaign.json``): per schedule its faults, ok and failed checks, and for each failure
    the command that runs it again."""
    from .runner import run_scenario
    if runs < 1:
        raise ValueError(f"--runs must be >= 1, got {runs}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    indices = [only] if only is not None else list(range(runs))
    results, t0 = [], time.time()
    for i in indices:
        sc = schedule(seed, i)
        say(f"[{i}] {sc.description}")
        report = run_scenario(sc, out / f"s{i}", seed=seed, say=lambda s: None)
        failed = [f"{c['name']}: {c['detail']}" for c in report["checks"] if not c["ok"]]
        results.append({"index": i, "faults": [f.to_dict() for f in sc.faults], "slow": dict(sc.spec.slow_by),
                        "storage": sc.spec.storage, "ok": report["ok"], "failed": failed,
                        "wall_s": report["wall_s"], "replay": replay_command(seed, i),
                        "progress": {c["name"]: c["detail"] for c in report["checks"]
                                     if c["name"].startswith("progress")}})
        say(f"    {'ok' if report['ok'] else 'FAILED'} in {report['wall_s']:.0f} s" +
            "".join(f"\n      {f}" for f in failed) + ("" if report["ok"] else f"\n      replay: {replay_command(seed, i)}"))
    summary = {"format": "ddiloco-campaign-report", "version": 1, "engine": "real", "seed": seed,
               "schedules": len(results), "failed": [r["index"] for r in results if not r["ok"]],
               "wall_s": round(time.time() - t0, 1), "results": results}
    (out / "campaign.json").write_text(json.dumps(summary, indent=2))
    return summary
