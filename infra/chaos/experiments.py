"""The chaos experiments (issue "Chaos engineering"; the paper's §5 heterogeneity, scavenging and
goodput studies), scaled to one small machine: ``ddiloco chaos experiment NAME``.

Every learner is a paced ``ddiloco learner --pace`` (each step padded to a set duration), so speeds
are controlled quantities even when the machine is shared; decoupled numbers are measured on real
processes. The data-parallel baselines cannot be measured on one 2-core machine (their speed-up
needs real parallel hardware), so their wall time and uptime are *modelled* from the same schedule
with the restart time measured in the same experiment, while their quality is *measured* by
training the identical model in-process with the same data, tokens and replica counts.

- ``hetero``: 4 learners, half 18% slower, 10% step-time noise; K = M vs K = 1 (no grace window) vs
  K = 1 + grace window: per learner its busy fraction (time in steps: nobody waits), its
  utilisation (share of its deltas that were merged rather than superseded or dropped), its share
  of the merge weight, how long its deltas waited for their round, their staleness; final loss.
- ``scavenging``: a fixed token budget with 4 base learners; +25/+50/+100/+300% temporary learners
  (booted in advance, listed with a membership record when they join at 20% of the budget,
  bootstrapping from storage, SIGTERMed at 70%): wall time and final loss relative to no extra
  capacity; the same for data parallelism, which pauses to resize (twice per extra capacity).
- ``goodput``: learner-kill rate sweep (Poisson, fixed repair time): the fraction of learner-time
  that produced merged progress and the uptime (fraction of one-second bins with a merge commit),
  decoupled (measured) vs data parallel (any failure stops everyone until repair + restart, plus
  the work since its last checkpoint; modelled on the same failure schedule).
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Callable

import numpy as np

from pipeline.descriptor import LearnerRules
from pipeline.policy import PolicyConfig
from workers.launch import Schedule
from workers.common.events import Tail
from workers.tools.utilisation import latency_steps, p50, useful_steps
from .harness import ChaosRun, RunSpec
from .scenarios import draw_failures

TOKENS_PER_STEP = 4 * 32        # the tiny model's batch x block


class TokenMeter:
    """Tokens trained so far by every learner life (from their ``step`` events, read incrementally)."""

    def __init__(self, run: ChaosRun):
        self.run = run
        self.tails: dict[str, Tail] = {}
        self.done: dict[str, int] = {}        # tokens of finished lives
        self.current: dict[str, int] = {}

    def total(self) -> int:
        for name in self.run.learner_names():
            tail = self.tails.setdefault(name, Tail(self.run.out / "logs" / f"{name}.jsonl"))
            for e in tail.read():
                if e.get("event") == "learner-start":
                    self.done[name] = self.done.get(name, 0) + self.current.pop(name, 0)
                elif e.get("event") in ("step", "learner-stop"):
                    self.current[name] = int(e.get("tokens", 0))
        return sum(self.done.values()) + sum(self.current.values())


def _wait(run: ChaosRun, cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    run.wait_for(cond, timeout_s, what, tick=run.poll)


def _finish(run: ChaosRun, names: list[str]) -> None:
    for n in names:
        if run.alive(n):
            run.terminate(n)
    _wait(run, lambda: all(not run.alive(n) for n in names), 90, "learners to drain")


def _starts(run: ChaosRun, name: str) -> list[float]:
    return [e["t"] for e in run.events(name) if e.get("event") == "learner-start"]


def _merged_by_learner(records) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for r in records:
        if r.kind != "merge":
            continue
        at = r.info.get("committed_at")
        for i in r.inputs:
            d = out.setdefault(i.learner, {"deltas": 0, "weight": 0.0, "staleness": [], "commit_t": []})
            d["deltas"] += 1
            d["weight"] += i.weight
            d["staleness"].append(i.staleness)
            d["commit_t"].append((i.delta_id, at))
    return out


def _learner_rows(run: ChaosRun, records) -> dict[str, dict]:
    """Per learner: steps/s; busy = the share of its training time spent in steps (it never waits);
    utilisation = the share of its steps whose progress entered the global model (``useful_steps``);
    its mean normalised weight in the merges it joined and its share of all merge weight; how long
    its deltas waited for their round; staleness."""
    merged = _merged_by_learner(records)
    merges = sum(r.kind == "merge" for r in records)
    useful = useful_steps(records, run.descriptor.num_fragments)
    rows = {}
    for name in run.learner_names():
        ev = run.events(name)
        stops = [e for e in ev if e.get("event") == "learner-stop"]
        produced = {e["delta"]: e["t"] for e in ev if e.get("event") == "delta"}
        m = merged.get(name, {"deltas": 0, "weight": 0.0, "staleness": [], "commit_t": []})
        waits = [at - produced[d] for d, at in m["commit_t"] if d in produced and at]
        starts = _starts(run, name)
        steps_t = [e["t"] for e in ev if e.get("event") == "step"]
        n_steps = sum(int(e.get("step", 0)) for e in stops)
        span = (steps_t[-1] - starts[0]) if steps_t and starts else 0.0
        busy = sum(e.get("step", 0) * e.get("median_gap_s", 0.0) for e in stops) / span if span else None
        rows[name] = {
            "steps": n_steps, "steps_per_s": round(n_steps / span, 2) if span else None,
            "busy_frac": round(min(1.0, busy), 3) if busy is not None else None,
            "deltas_produced": len(produced), "deltas_merged": m["deltas"],
            "utilisation": round(useful.get(name, 0.0) / n_steps, 4) if n_steps else None,
            "latency_steps_p50": p50(latency_steps(records, {name: ev})[name]),
            "weight_share": round(m["weight"] / merges, 4) if merges else None,
            "mean_weight": round(m["weight"] / m["deltas"], 4) if m["deltas"] else None,
            "mean_round_wait_s": round(statistics.fmean(waits), 3) if waits else None,
            "mean_staleness": round(statistics.fmean(m["staleness"]), 3) if m["staleness"] else None,
        }
    return rows


# -- 1. heterogeneous speeds --------------------------------------------------------------------------

def hetero(out: Path, seed: int = 0, quick: bool = False) -> dict:
    steps, pace = (120, 0.05) if quick else (300, 0.05)
    g = PolicyConfig.gamma     # the default grace window (docs/results.md "Rounds, defaults and quality")
    configs = {"K=M": (4, g, False), "K=1": (1, 0.0, False), "K=1+grace": (1, g, False),
               "K=1+grace+keep": (1, g, True)}
    slow = {"l2": 1.18, "l3": 1.18}
    result = {}
    for label, (k, gamma, keep) in configs.items():
        # The demo job's round shape (P=4, H=16: workers/run.py) so utilisation reads as it would there.
        spec = RunSpec(learners=4, steps=steps, seed=seed, slow=1.0, schedule=Schedule(fragments=4, sync_every=16),
                       policy=PolicyConfig(quorum=k, gamma=gamma), learner=LearnerRules(keep_progress=keep))
        with ChaosRun(spec, out / label.replace("=", "").replace("+", "-")) as run:
            run.create()
            run.start_syncer()
            for lid in spec.learner_ids():
                run.start_learner(lid, slow=slow.get(lid, 1.0), pace_s=pace, jitter=0.1, seed=seed)
            _wait(run, run.learners_done, 600, "learners")
            run.drain(60)
            records = run.commits()
            rows = _learner_rows(run, records)
            loss = run.global_loss()
        merges = [r for r in records if r.kind == "merge"]
        result[label] = {"quorum": k, "grace_gamma": gamma, "keep_progress": keep, "final_eval_loss": round(loss, 4),
                         "merge_commits": len(merges),
                         "mean_quorum": round(statistics.fmean(r.quorum for r in merges), 3) if merges else None,
                         "mean_grace_s": round(statistics.fmean(r.grace_wait_s for r in merges), 4) if merges else None,
                         "per_learner": rows}
    summary = {label: {"final_eval_loss": r["final_eval_loss"],
                       "utilisation_fast": _mean([r["per_learner"][l]["utilisation"] for l in ("l0", "l1")]),
                       "utilisation_slow": _mean([r["per_learner"][l]["utilisation"] for l in ("l2", "l3")]),
                       "utilisation_min": min((r["per_learner"][l]["utilisation"] or 0.0) for l in r["per_learner"]),
                       "latency_steps_p50": _mean([r["per_learner"][l]["latency_steps_p50"] for l in r["per_learner"]]),
                       "busy_fast": _mean([r["per_learner"][l]["busy_frac"] for l in ("l0", "l1")]),
                       "busy_slow": _mean([r["per_learner"][l]["busy_frac"] for l in ("l2", "l3")]),
                       "weight_share_slow": _mean([r["per_learner"][l]["weight_share"] for l in ("l2", "l3")]),
                       "round_wait_fast_s": _mean([r["per_learner"][l]["mean_round_wait_s"] for l in ("l0", "l1")]),
                       "round_wait_slow_s": _mean([r["per_learner"][l]["mean_round_wait_s"] for l in ("l2", "l3")]),
                       "mean_quorum": r["mean_quorum"], "merge_commits": r["merge_commits"]}
               for label, r in result.items()}
    return {"experiment": "hetero", "steps": steps, "pace_s": pace, "slow": slow, "jitter": 0.1,
            "configs": result, "summary": summary}


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(statistics.fmean(xs), 4) if xs else None


# -- 2. compute scavenging ----------------------------------------------------------------------------

def _dp_train(spec: RunSpec, phases: list[tuple[int, int]], seed: int) -> float:
    """Lock-step data parallelism in one process: ``phases`` of (replicas, tokens); every step each
    replica takes a batch from its shard (the same streams as the learners), gradients averaged,
    one AdamW step. Returns the final held-out loss (the quality a DP job would reach)."""
    import torch
    from workers.job.data import Corpus, evaluate
    from workers.job.job import JobSettings, make_optimizer
    from workers.job.model import build_model
    from .harness import MODELS
    torch.set_num_threads(1)
    gcfg, batch, max_bytes = MODELS[spec.model]
    job = JobSettings(steps=1, batch_size=batch, max_bytes=max_bytes, shards=spec.shards or spec.learners)
    corpus = Corpus(job.data_config(gcfg.block_size))
    model = build_model(gcfg, seed)
    opt = make_optimizer(model, job)
    streams = [corpus.batches(r % job.shards, job.shards, seed if r < job.shards else seed + 1 + r) for r in range(16)]
    for replicas, tokens in phases:
        done = 0
        while done < tokens:
            opt.zero_grad(set_to_none=True)
            for s in streams[:replicas]:
                x, y = next(s)
                (model(x, y)[1] / replicas).backward()
                done += x.numel()
            opt.step()
    return evaluate(model, corpus)


def scavenging(out: Path, seed: int = 0, quick: bool = False) -> dict:
    extras = (0, 1, 2) if quick else (0, 1, 2, 4, 12)
    pace = 0.12
    base = 4
    budget = base * (80 if quick else 250) * TOKENS_PER_STEP
    join_at, leave_at = 0.2, 0.7
    result = {}
    restart_times = []
    for extra in extras:
        spec = RunSpec(learners=base, steps=10**6, seed=seed, slow=1.0, shards=base)
        temps = [f"x{i}" for i in range(extra)]
        with ChaosRun(spec, out / f"extra{extra}") as run:
            run.create()
            go = run.out / "join.go"
            run.start_syncer()
            for lid in spec.learner_ids():
                run.start_learner(lid, pace_s=pace, seed=seed)
            for i, lid in enumerate(temps):     # spare machines: booted now, join later
                run.make_key(lid)
                run.start_learner(lid, pace_s=pace, seed=seed, shard=i % base, wait_for=go, data_seed=seed + 1 + i)
            meter = TokenMeter(run)
            _wait(run, lambda: all(_starts(run, l) for l in spec.learner_ids()), 120, "base learners")
            t_start = max(_starts(run, l)[0] for l in spec.learner_ids())
            restart_times += [_starts(run, l)[0] - run.lives[l][0].started for l in spec.learner_ids()]
            if temps:
                _wait(run, lambda: meter.total() >= join_at * budget, 600, "the join point")
                for lid in temps:
                    run.add_learner(lid)
                go.write_text("go")
                run.mark("run", "join", f"{extra} temporary learners")
                _wait(run, lambda: meter.total() >= leave_at * budget, 600, "the leave point")
                for lid in temps:
                    run.terminate(lid)
                run.mark("run", "leave")
            _wait(run, lambda: meter.total() >= budget, 900, "the token budget")
            t_end = time.time()
            _finish(run, run.learner_names())
            run.drain(60)
            records = run.commits()
            loss = run.global_loss()
            joined = [_starts(run, l)[0] - go.stat().st_mtime for l in temps if _starts(run, l)]
            temp_merges = sum(_merged_by_learner(records).get(l, {}).get("deltas", 0) for l in temps)
        result[extra] = {"extra_learners": extra, "extra_pct": 100 * extra // base, "wall_s": round(t_end - t_start, 2),
                         "tokens": meter.total(), "final_eval_loss": round(loss, 4),
                         "temp_join_latency_s": round(statistics.fmean(joined), 2) if joined else None,
                         "temp_deltas_merged": temp_merges}
    restart_s = statistics.median(restart_times)
    # Data parallel on the same budget: tokens/s = replicas x (tokens per step) / pace; pays a restart
    # of the whole job (measured: spawn to training) at each resize.
    for extra in extras:
        r = result[extra]
        phases = [(base, int(join_at * budget)), (base + extra, int((leave_at - join_at) * budget)),
                  (base, budget - int(join_at * budget) - int((leave_at - join_at) * budget))] if extra else [(base, budget)]
        wall = sum(tok / ((reps * TOKENS_PER_STEP) / pace) for reps, tok in phases) + (2 * restart_s if extra else 0.0)
        r["dp_wall_s_model"] = round(wall, 2)
        r["dp_final_eval_loss"] = round(_dp_train(RunSpec(learners=base, shards=base), phases, seed), 4)
    ref = result[0]
    summary = {f"+{r['extra_pct']}%": {
        "wall_rel": round(r["wall_s"] / ref["wall_s"], 3), "loss_delta": round(r["final_eval_loss"] - ref["final_eval_loss"], 4),
        "dp_wall_rel": round(r["dp_wall_s_model"] / ref["dp_wall_s_model"], 3),
        "dp_loss_delta": round(r["dp_final_eval_loss"] - ref["dp_final_eval_loss"], 4)} for r in result.values()}
    return {"experiment": "scavenging", "budget_tokens": budget, "pace_s": pace, "base_learners": base,
            "join_at": join_at, "leave_at": leave_at, "restart_s_measured": round(restart_s, 2),
            "configs": {str(k): v for k, v in result.items()}, "summary": summary}


# -- 3. goodput under failures ------------------------------------------------------------------------

def _union_length(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, -1e18
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def goodput_measures(events: dict[str, list[dict]], records, descriptor, t0: float, t_end: float) -> dict:
    """Measured over [t0, t_end]. ``goodput``: learner-time that produced merged progress over
    allocated learner-time (M x window): a life's time counts from its ``learner-start`` to the
    production of its last delta that was merged (work after that died with the process).
    ``uptime``: fraction of one-second bins with a merge commit. ``merged_step_share``: steps whose
    work entered the model over steps taken (``useful_steps``: the overwrite of local progress by
    newer versions, not failures, is most of the gap to 1)."""
    merged = {i.delta_id for r in records if r.kind == "merge" for i in r.inputs}
    productive = 0.0
    stepped = 0
    produced_in: set[str] = set()
    for lid, ev in events.items():
        life_start = None
        last = None
        for e in ev + [{"event": "learner-start", "t": float("inf")}]:
            if e.get("event") == "learner-start":
                if life_start is not None and last is not None:
                    productive += max(0.0, min(last, t_end) - max(life_start, t0))
                life_start, last = e["t"], None
            elif e.get("event") == "delta":
                if t0 <= e["t"] <= t_end:
                    stepped += 1
                    produced_in.add(e["delta"])
                if e["delta"] in merged:
                    last = e["t"]
    stepped = stepped * descriptor.schedule.sync_every / descriptor.num_fragments
    useful = sum(useful_steps(records, descriptor.num_fragments, produced_in).values())
    commit_t = np.array(sorted(r.info["committed_at"] for r in records if r.kind == "merge"
                               and t0 <= r.info.get("committed_at", 0) <= t_end))
    bins = np.arange(t0, t_end, 1.0)
    uptime = float(np.mean([np.any((commit_t >= b) & (commit_t < b + 1.0)) for b in bins])) if len(bins) else 0.0
    return {"goodput": round(productive / (len(events) * (t_end - t0)), 4), "uptime": round(uptime, 4),
            "merged_step_share": round(useful / stepped, 4) if stepped else None,
            "steps_per_learner_s": round(stepped / (len(events) * (t_end - t0)), 2)}


def goodput(out: Path, seed: int = 0, quick: bool = False) -> dict:
    rates = (0.0, 6.0) if quick else (0.0, 1.0, 3.0, 6.0)
    learners, pace, duration, repair = 4, 0.06, (15.0 if quick else 25.0), 2.0
    checkpoint_s = 5.0
    result = {}
    restart_times = []
    for rate in rates:
        spec = RunSpec(learners=learners, steps=10**6, seed=seed, slow=1.0)
        events = [e for e in draw_failures(learners + 1, duration, rate, repair, seed)]
        events = [type(e)(e.time_s, e.learner - 1, e.event) for e in events]   # every learner may fail
        with ChaosRun(spec, out / f"rate{rate:g}") as run:
            run.create()
            run.start_syncer()
            for lid in spec.learner_ids():
                run.start_learner(lid, pace_s=pace, seed=seed)
            _wait(run, lambda: all(_starts(run, l) for l in spec.learner_ids()), 120, "learners")
            t0 = max(_starts(run, l)[0] for l in spec.learner_ids())
            queue = sorted(events, key=lambda e: e.time_s)
            while time.time() < t0 + duration:
                run.poll()
                while queue and time.time() >= t0 + queue[0].time_s:
                    e = queue.pop(0)
                    lid = f"l{e.learner}"
                    if e.event == "fail":
                        run.kill(lid)
                    else:
                        run.start_learner(lid, pace_s=pace, seed=seed, data_seed=seed + int(e.time_s * 1000))
                time.sleep(0.02)
            t_end = time.time()
            _finish(run, run.learner_names())
            run.drain(60)
            records = run.commits()
            for lid in spec.learner_ids():
                lives, starts = run.lives[lid], _starts(run, lid)
                restart_times += [s - l.started for l, s in zip(lives[1:], starts[1:])]
        m = goodput_measures({l: run.events(l) for l in spec.learner_ids()}, records, run.descriptor, t0, t_end)
        result[rate] = {"kills_per_learner_min": rate, "failures": sum(e.event == "fail" for e in events),
                        "t0": t0, "wall_s": round(t_end - t0, 2), **m,
                        "events": [(e.time_s, e.learner, e.event) for e in events]}
    restart_s = statistics.median(restart_times) if restart_times else 4.0
    for rate in rates:
        r = result[rate]
        fails = [(t, m) for t, m, ev in r["events"] if ev == "fail"]
        backs = {m: sorted(t for t, mm, ev in r["events"] if ev == "recover" and mm == m) for _, m in fails}
        down = []
        for t, m in fails:
            back = next((b for b in backs[m] if b >= t), duration)
            down.append((t, min(duration, back + restart_s)))
        lost = len(fails) * checkpoint_s / 2       # on average half a checkpoint interval of work redone
        dp_down = _union_length(down)
        r["dp_uptime_model"] = round(1 - dp_down / duration, 4)
        r["dp_goodput_model"] = round(max(0.0, duration - dp_down - lost) / duration, 4)
    summary = {f"{rate:g}/min": {"decoupled_goodput": r["goodput"], "decoupled_uptime": r["uptime"],
                                 "merged_step_share": r["merged_step_share"],
                                 "dp_goodput_model": r["dp_goodput_model"], "dp_uptime_model": r["dp_uptime_model"],
                                 "failures": r["failures"]} for rate, r in result.items()}
    return {"experiment": "goodput", "learners": learners, "pace_s": pace, "duration_s": duration,
            "repair_s": repair, "restart_s_measured": round(restart_s, 2), "dp_checkpoint_s": checkpoint_s,
            "configs": {f"{k:g}": v for k, v in result.items()}, "summary": summary}


EXPERIMENTS: dict[str, tuple[Callable[..., dict], str]] = {
    "hetero": (hetero, "heterogeneous speeds: K=M vs K=1 vs K=1+grace (utilisation, final loss)"),
    "scavenging": (scavenging, "compute scavenging: +25..300% temporary learners vs data parallel"),
    "goodput": (goodput, "goodput and uptime under a learner-kill rate sweep vs data parallel"),
}


def run_experiment(name: str, out: str | Path, seed: int = 0, quick: bool = False) -> dict:
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; choose from {', '.join(EXPERIMENTS)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    result = EXPERIMENTS[name][0](out, seed=seed, quick=quick)
    result["wall_s"] = round(time.time() - t0, 1)
    (out / "experiment.json").write_text(json.dumps(result, indent=2, default=str))
    return result
