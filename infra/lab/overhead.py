"""`python -m infra.lab.overhead`: a learner's step time with sync on / sync off.

Lab (issue 15's question: what does sync cost a learner's step?); written up in
docs/results-overhead.md, the figure in docs/results.md.

Goal: sync on / off <= 1.03x (median) and p99 <= 1.1x the median, measured with no more busy
processes than cores. Each repeat runs, **one after the other, never together**:

* *off*: the sync-off control alone (infra/lab/overhead_roles.py ``control``): the default job's model,
  data and optimizer in a plain loop, one process, one torch thread;
* *on*: one learner (the same ``learner_process`` as ``ddiloco learner``, with its step trace) and
  one syncer, on a fresh signed run with the same seed, shape and step count (``ddiloco run
  --create-only``); this process only polls for the learner's exit (no evaluations).

The order alternates between repeats (off, on; on, off; ...) so that a drift of the machine
affects both sides alike. ``--cpus-learner``/``--cpus-syncer`` pin the processes (the control
gets the learner's cores). The first ``--warmup`` steps of every run are left out of every figure
(allocator and caches warming up: the same on both sides); nothing else is left out: the step
classes (answer, version applied, garbage collection, other) are reported beside the totals, so a
tail can be traced to what the step held. Timing claims live here, never in tests.

Separate processes differ by +-4% on a 2-vCPU VM even when they run the same loop, so a 5-repeat
median is good to about +-2%; infra/lab/overhead_ablate.py times one learner feature or neighbour at a
time inside one process instead (docs/results-overhead.md, "The other steps, taken apart").

``--interleave`` instead takes both sides from one learner process, a plain step before each
learner step (infra/lab/overhead_interleave.py): free of that spread, but blind to what spills from a
learner step into the next (charged to both sides), so the docs give both figures.
"""
from __future__ import annotations

import json
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from workers.common.events import read_events

WARMUP = 20
STALL_S = 600.0     # the sync-on learner is given up after this long without a new event


def tails(times: list[float]) -> dict:
    """Median, p95, p99 (seconds) and p95, p99 over the median; n."""
    if not times:
        return {"n": 0, "median_s": None, "p95_s": None, "p99_s": None, "p95_over_median": None,
                "p99_over_median": None}
    med = float(np.median(times))
    p95, p99 = float(np.percentile(times, 95)), float(np.percentile(times, 99))
    return {"n": len(times), "median_s": med, "p95_s": p95, "p99_s": p99,
            "p95_over_median": p95 / med if med else None, "p99_over_median": p99 / med if med else None}


def step_classes(trace: dict, warmup: int) -> dict[str, list[float]]:
    """The learner's steps after ``warmup`` by what they held: ``answer`` (handed a delta to the
    sender), ``applied`` (a version, and no answer), ``gc`` (a collection ran, neither of those),
    ``other``; and ``all``."""
    rows = list(zip(trace["took_s"], trace["answered"], trace["applied"], trace["gcs"]))[warmup:]
    out: dict[str, list[float]] = {"all": [], "answer": [], "applied": [], "gc": [], "other": []}
    for took, answered, applied, gcs in rows:
        out["all"].append(took)
        kind = "answer" if answered else "applied" if applied else "gc" if gcs else "other"
        out[kind].append(took)
    return out


def parts_medians(trace: dict, warmup: int) -> dict:
    """Median seconds of each part of a step (answer, apply, compute) over the steps that had it."""
    res = {}
    for part, flag in (("answer_s", "answered"), ("apply_s", "applied")):
        xs = [t for t, n in list(zip(trace[part], trace[flag]))[warmup:] if n]
        res[f"{part[:-2]}_median_s"] = float(np.median(xs)) if xs else None
    res["compute_median_s"] = float(np.median(trace["compute_s"][warmup:])) if trace["compute_s"][warmup:] else None
    return res


def compare(on: dict, off: dict, warmup: int = WARMUP) -> dict:
    """One repeat's figures from the learner's trace (``on``: the step-trace event's columns) and
    the control's step times (``off``: {"step_times", "gcs"}), both after the warm-up."""
    classes = step_classes(on, warmup)
    off_times = off["step_times"][warmup:]
    off_gc = [t for t, g in zip(off_times, off["gcs"][warmup:]) if g]
    res = {"on": tails(classes["all"]), "off": tails(off_times),
           "on_by_class": {k: tails(v) for k, v in classes.items() if k != "all"},
           "off_gc": tails(off_gc), "parts": parts_medians(on, warmup)}
    res["ratio_median"] = (res["on"]["median_s"] / res["off"]["median_s"]
                           if res["on"]["median_s"] and res["off"]["median_s"] else None)
    res["ratio_mean"] = (statistics.fmean(classes["all"]) / statistics.fmean(off_times)
                         if classes["all"] and off_times else None)
    return res


def cpu_ticks() -> dict[str, list[int]]:
    """Per-core /proc/stat counters (user nice system idle iowait irq softirq steal ...), Linux."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return {}
    return {ln.split()[0]: [int(x) for x in ln.split()[1:]] for ln in lines if ln.startswith("cpu") and ln[3:4].isdigit()}


def steal_share(before: dict, after: dict) -> dict[str, float]:
    """Per core: the share of its time the hypervisor gave to others (``steal``) between two readings."""
    out = {}
    for cpu, b in before.items():
        a = after.get(cpu)
        if a is None or len(a) < 8:
            continue
        total = sum(a[:8]) - sum(b[:8])
        out[cpu] = round((a[7] - b[7]) / total, 4) if total > 0 else 0.0
    return out


def _control(out: Path, steps: int, seed: int, cpus: str | None, model_from: Path | None = None) -> dict:
    cmd = [sys.executable, "-m", "infra.lab.overhead_roles", "control", "--out", str(out), "--steps", str(steps),
           "--seed", str(seed), *(["--cpus", cpus] if cpus else []),
           *(["--model-from", str(model_from)] if model_from else [])]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"control failed ({res.returncode}): {res.stderr[-2000:]}")
    return json.loads(out.read_text())


def _create(out: Path, steps: int, seed: int, run_args: list[str]) -> None:
    """A fresh signed run of one learner in ``out`` (``ddiloco run --create-only`` and ``run_args``)."""
    shutil.rmtree(out, ignore_errors=True)
    res = subprocess.run([sys.executable, "-m", "workers.cli", "run", "--create-only", "--out", str(out),
                          "--learners", "1", "--steps", str(steps), "--seed", str(seed), *run_args],
                         capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"creating the run in {out} failed: {res.stderr[-2000:]}")


def _sync_on(out: Path, steps: int, seed: int, cpus_learner: str | None, cpus_syncer: str | None,
             sync_process: bool, interleave: bool = False, run_args: list[str] = ()) -> dict:
    """One learner and one syncer on a fresh signed run; the learner's step-trace and thread-cpu."""
    from workers.common.cpus import process_cpu
    from workers.common.cpus import parse_cpus, pin
    from workers.cluster import ClusterConfig, LocalCluster
    _create(out, steps, seed, list(run_args))     # a fresh run every repeat
    cluster = LocalCluster(ClusterConfig(str(out / "store"), out, keydir=out / "keys"))
    try:
        life = cluster.start_syncers()[0]
        cluster.wait_ready(life.name, 60)
        pin(parse_cpus(cpus_syncer), life.popen.pid)
        syncer_cpu = process_cpu(life.popen.pid)
        cluster.start_learner("l0", ["--steps", str(steps), *(["--cpus", cpus_learner] if cpus_learner else []),
                                       *(["--sync-process"] if sync_process else []),
                                       *(["--agent-cpus", cpus_syncer] if sync_process and cpus_syncer else []),
                                       *(["--interleave"] if interleave else [])],
                              module="infra.lab.overhead_roles")
        # A deadline on progress, not on the whole run: at 100M parameters a step takes seconds
        # here, so any fixed per-step allowance either times out a large model or waits for ever
        # on a hung small one. The learner's event log grows with its steps and answers.
        log, seen = out / "logs" / "l0.jsonl", (-1, 0.0)
        while not cluster.learners_done():
            size = log.stat().st_size if log.exists() else 0
            if size != seen[0]:
                seen = (size, time.monotonic())
            elif time.monotonic() - seen[1] > STALL_S:
                raise SystemExit(f"the learner in {out} made no progress for {STALL_S:.0f} s: {cluster.stderr('l0')}")
            time.sleep(0.5)
        syncer_cpu = process_cpu(life.popen.pid) - syncer_cpu   # the learner's life, start-up included
        cluster.wait_drained(30)
    finally:
        cluster.stop()
    events = read_events(out / "logs" / "l0.jsonl")
    trace = next((e for e in events if e.get("event") == "step-trace"), None)
    if trace is None:
        raise SystemExit(f"no step-trace from the learner in {out}: {cluster.stderr('l0')}")
    cpu = next((e for e in events if e.get("event") == "thread-cpu"), {})
    if interleave:
        from infra.lab.overhead_interleave import split
        ab = next((e for e in events if e.get("event") == "ab-steps"), None)
        if ab is None:
            raise SystemExit(f"no ab-steps from the interleaved learner in {out}: {cluster.stderr('l0')}")
        trace, plain = split(ab, trace)
        return {"trace": trace, "plain": plain, "thread_cpu": {"syncer process": round(syncer_cpu, 3)},
                "deltas": None}
    return {"trace": trace, "thread_cpu": {**cpu.get("cpu_s", {}), "syncer process": round(syncer_cpu, 3)},
            "deltas": next((e.get("deltas") for e in events if e.get("event") == "learner-stop"), None)}


def _repeat(args, r: int, out: Path, runs: Path, seed: int, run_args: list[str]) -> dict:
    """One repeat: the control and the sync-on learner, one after the other (order alternating)."""
    sides = {}
    for side in (("off", "on") if r % 2 == 0 else ("on", "off")):
        before = cpu_ticks()
        if side == "off":
            sides["off"] = _control(out / f"control-{r}.json", args.steps, seed, args.cpus_learner,
                                    out / "model" / "store" if run_args else None)
        else:
            sides["on"] = _sync_on(runs / f"on-{r}", args.steps, seed, args.cpus_learner, args.cpus_syncer,
                                   args.sync_process, run_args=run_args)
        sides[side]["steal"] = steal_share(before, cpu_ticks())
    return sides


def _interleaved_repeat(args, r: int, runs: Path, seed: int, run_args: list[str]) -> dict:
    """One repeat of ``--interleave`` (infra/lab/overhead_interleave.py): both sides from one process."""
    before = cpu_ticks()
    on = _sync_on(runs / f"on-{r}", args.steps, seed, args.cpus_learner, args.cpus_syncer, args.sync_process,
                  interleave=True, run_args=run_args)
    on["steal"] = steal_share(before, cpu_ticks())
    return {"on": on, "off": {**on.pop("plain"), "steal": on["steal"]}}


def run_overhead(args) -> int:
    """The benchmark (module docstring): ``args.repeats`` alternating pairs; prints and returns figures."""
    warmup = getattr(args, "warmup", WARMUP)
    if not isinstance(warmup, int) or warmup < 1:
        raise SystemExit(f"--warmup must be an int >= 1, got {warmup!r}")
    if args.steps <= warmup * 2:
        raise SystemExit(f"--steps must be > {warmup * 2} (twice --warmup {warmup}: the first {warmup} are "
                         f"warm-up); at 100M parameters, e.g. --steps 30 --warmup 5")
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    out = Path(args.out) / "overhead"
    out.mkdir(parents=True, exist_ok=True)
    runs = Path(args.store_root) / "overhead" if getattr(args, "store_root", None) else out
    runs.mkdir(parents=True, exist_ok=True)
    seed = int(args.seeds.split(",")[0])
    repeats = []
    interleave = getattr(args, "interleave", False)
    run_args = shlex.split(args.run_args or "")
    if run_args and not interleave:      # the control trains the same model: it reads this run's
        _create(out / "model", args.steps, seed, run_args)
    for r in range(args.repeats):
        if interleave:
            sides = _interleaved_repeat(args, r, runs, seed, run_args)
        else:
            sides = _repeat(args, r, out, runs, seed, run_args)
        fig = compare(sides["on"]["trace"], sides["off"], warmup)
        answers = sum(1 for n in sides["on"]["trace"]["answered"] if n) or 1
        fig["thread_cpu_s"] = sides["on"]["thread_cpu"]
        fig["background_cpu_ms_per_answer"] = 1e3 * sum(   # the learner's other threads (or its agent)
            v for k, v in sides["on"]["thread_cpu"].items() if k not in ("MainThread", "syncer process")) / answers
        fig["syncer_cpu_share"] = sides["on"]["thread_cpu"]["syncer process"] / (   # over the learner's life
            sum(sides["on"]["trace"]["took_s"]) + (sum(sides["off"]["step_times"]) if interleave else 0) or 1.0)
        fig["order"] = "interleaved" if interleave else "off,on" if r % 2 == 0 else "on,off"
        fig["steal_on"], fig["steal_off"] = sides["on"]["steal"], sides["off"]["steal"]   # hypervisor's share
        repeats.append(fig)
        print(_line(r, fig), flush=True)
    summary = summarise(repeats)
    summary.update({"steps": args.steps, "repeats": args.repeats, "warmup": warmup, "seed": seed,
                    "cpus_learner": args.cpus_learner, "cpus_syncer": args.cpus_syncer,
                    "sync_process": args.sync_process, "store_root": getattr(args, "store_root", None),
                    "interleave": interleave, "run_args": args.run_args})
    for k, v in summary.items():
        if k != "per_repeat":
            print(f"{k:<40} {v:.4g}" if isinstance(v, float) else f"{k:<40} {v}")
    summary["per_repeat"] = repeats
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


def summarise(repeats: list[dict]) -> dict:
    """Medians over the repeats of each repeat's ratio and tails (both sides)."""
    def med(get) -> float | None:
        xs = [x for x in (get(f) for f in repeats) if x is not None]
        return float(statistics.median(xs)) if xs else None
    res = {"ratio_median_on_off": med(lambda f: f["ratio_median"]),
           "ratio_median_min": min((f["ratio_median"] for f in repeats if f["ratio_median"]), default=None),
           "ratio_median_max": max((f["ratio_median"] for f in repeats if f["ratio_median"]), default=None),
           "ratio_mean_on_off": med(lambda f: f["ratio_mean"])}
    for side in ("on", "off"):
        for q in ("median_s", "p95_over_median", "p99_over_median"):
            res[f"{side}_{q}"] = med(lambda f: f[side][q])
    for kind in ("answer", "applied", "gc", "other"):
        res[f"on_{kind}_median_s"] = med(lambda f: f["on_by_class"][kind]["median_s"])
        res[f"on_{kind}_share"] = med(lambda f: f["on_by_class"][kind]["n"] / max(f["on"]["n"], 1))
    res["background_cpu_ms_per_answer"] = med(lambda f: f["background_cpu_ms_per_answer"])
    res["syncer_cpu_share"] = med(lambda f: f.get("syncer_cpu_share"))
    return res


def _line(r: int, f: dict) -> str:
    on, off, c = f["on"], f["off"], f["on_by_class"]
    return (f"repeat {r} ({f['order']}): on/off median {f['ratio_median']:.4f} ({on['median_s'] * 1e3:.2f} / "
            f"{off['median_s'] * 1e3:.2f} ms), p99/median on {on['p99_over_median']:.3f} off "
            f"{off['p99_over_median']:.3f}; answer steps {c['answer']['n']} median "
            f"{(c['answer']['median_s'] or 0) * 1e3:.2f} ms, other {(c['other']['median_s'] or 0) * 1e3:.2f} ms; "
            f"background CPU {f['background_cpu_ms_per_answer']:.2f} ms per answer")


def main(argv: list[str] | None = None) -> int:
    """``python -m infra.lab.overhead``: the options ``python -m infra.lab.overhead`` had."""
    import argparse
    p = argparse.ArgumentParser(prog="python -m infra.lab.overhead", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--out", default="runs/benchmark")
    p.add_argument("--json", default=None, help="write the figures here too")
    p.add_argument("--seeds", default="0", help="the first seed is the runs' seed")
    p.add_argument("--run-args", default=None, metavar="FLAGS",
                   help="more ddiloco run flags for the sync-on runs, e.g. a model's shape '--layers 4 --width 256' "
                        "(the control trains the same model)")
    p.add_argument("--repeats", type=int, default=4, help="alternating on/off pairs")
    p.add_argument("--warmup", type=int, default=WARMUP,
                   help=f"steps left out at the start of every run (default {WARMUP}; --steps must exceed twice it)")
    p.add_argument("--cpus-learner", default=None, help="cores of the learner and of the control (e.g. 0)")
    p.add_argument("--cpus-syncer", default=None, help="cores of the syncer (e.g. 1)")
    p.add_argument("--sync-process", action="store_true",
                   help="the learner's sender and receiver in a child process (LearnerConfig.sync_process)")
    p.add_argument("--interleave", action="store_true",
                   help="sync on / off as an A/B inside one learner process, a plain step before each learner "
                        "step (infra/lab/overhead_interleave.py)")
    p.add_argument("--store-root", default=None, metavar="DIR",
                   help="where the sync-on runs and their stores live (default: under --out); a directory on "
                        "tmpfs (e.g. /dev/shm/x) takes the store's fsyncs off this machine's disk")
    return run_overhead(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
