"""Where a learner's "other" steps lose time to the control (issue 15; docs/results-overhead.md).

``python -m infra.lab.overhead`` compares the learner (with a syncer) with a plain training loop.
This tool takes the difference apart: it runs the sync-off control (infra/lab/overhead_roles.py
``control``) in *variants*, one learner feature or one neighbour at a time, interleaved (each
repeat runs every variant once, the order rotating between repeats) so that the machine's drift
affects all alike, and reports each variant's median step time over the plain control's of the
same repeat. A variant is ``+``-joined words:

* ``plain``: the control as the benchmark runs it;
* ``guard``: plus the learner's non-finite check (``float(loss)``, ``grads_finite``);
* ``spinNN`` / ``memNN`` / ``torchNN``: a neighbour process on ``--load-cpus`` busy NN% of each
  ``--period`` (pure-Python loop / a numpy copy of 32 MiB buffers, beyond L2 / a small torch
  matmul loop), the rest asleep: a stand-in for the syncer and the sync agent, which use 20-35% of
  the other core in the benchmark;
* ``learner`` / ``learner-threads`` (``--ab`` only): ``Learner.step`` (with its sync agent, or
  its sender and receiver threads) on alternate steps, the plain loop on the others, one process,
  on a run with no syncer - every learner step an "other" step (overhead_roles ``learner_ab``);
* ``syncer``: a real idle syncer of a fresh run on ``--load-cpus`` (no learner: it only waits);
* ``stack``: a real sync stack on ``--load-cpus``: a syncer and a learner with its sync agent
  (``--sync-process``), the learner paced (``--slow 2``: half its time computing) so that the
  syncer opens and merges rounds all along - the benchmark's neighbours plus some torch work.

    python -m infra.lab.overhead_ablate --variants plain,guard,spin30,mem30 --repeats 6 --steps 300

Run it under the CPU lock (``flock /tmp/heavy.lock``). Timing claims live here, never in tests.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

WARMUP = 20
LOADS = ("spin", "mem", "torch")


def parse_variant(text: str) -> dict:
    """``"guard+mem30"`` -> {"guard": True, "load": ("mem", 0.30)}; ValueError on an unknown word."""
    out: dict = {"guard": False, "load": None, "syncer": False, "stack": False}
    for word in filter(None, text.split("+")):
        if word == "plain":
            continue
        if word == "guard":
            out["guard"] = True
        elif word in ("syncer", "stack"):
            out[word] = True
        else:
            kind = next((k for k in LOADS if word.startswith(k)), None)
            duty = word[len(kind):] if kind else ""
            if kind is None or not duty.isdigit() or not 0 < int(duty) <= 100:
                raise ValueError(f"unknown variant word {word!r}: plain, guard, syncer, stack, "
                                 "or spin/mem/torch + 1..100")
            out["load"] = (kind, int(duty) / 100)
    return out


def load(kind: str, duty: float, period: float) -> None:
    """Busy ``duty`` of every ``period`` seconds with ``kind`` work, asleep the rest; until killed."""
    import numpy as np
    src, dst = np.ones(8 << 20, np.float32), np.empty(8 << 20, np.float32)   # 32 MiB each: past L2
    if kind == "torch":
        import torch
        torch.set_num_threads(1)
        a = torch.randn(128, 128)
    while True:
        t0 = time.monotonic()
        while time.monotonic() - t0 < duty * period:
            if kind == "spin":
                sum(range(2000))
            elif kind == "mem":
                np.copyto(dst, src)
            else:
                a @ a
        left = period - (time.monotonic() - t0)
        if left > 0:
            time.sleep(left)


def _start_neighbour(v: dict, args, work: Path) -> tuple[list, object]:
    """The variant's neighbour: (processes to stop, cluster or None)."""
    if v["load"] is not None:
        kind, duty = v["load"]
        cmd = [sys.executable, "-m", "infra.lab.overhead_ablate", "--load", kind, "--duty", str(duty),
               "--period", str(args.period)]
        proc = subprocess.Popen(["taskset", "-c", args.load_cpus, *cmd])
        return [proc], None
    if v["syncer"] or v["stack"]:
        from workers.cluster import ClusterConfig, LocalCluster
        from workers.common.cpus import parse_cpus, pin
        import shutil
        shutil.rmtree(work, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "workers.cli", "run", "--create-only", "--out", str(work),
                        "--learners", "1", "--steps", str(args.steps), "--seed", "0"], check=True, capture_output=True)
        cluster = LocalCluster(ClusterConfig(str(work / "store"), work, keydir=work / "keys"))
        life = cluster.start_syncers()[0]
        cluster.wait_ready(life.name, 60)
        pin(parse_cpus(args.load_cpus), life.popen.pid)
        cluster.ablate_pids = [life.popen.pid]
        if v["stack"]:
            learner = cluster.start_learner("l0", ["--steps", str(args.steps * 8), "--slow", "2", "--sync-process",
                                                   "--agent-cpus", args.load_cpus])
            cluster.wait_ready("l0", 60)
            pin(parse_cpus(args.load_cpus), learner.popen.pid)
            time.sleep(1.0)   # the agent is started and pinned by now
            agents = Path(f"/proc/{learner.popen.pid}/task/{learner.popen.pid}/children").read_text().split()
            cluster.ablate_pids += [learner.popen.pid, *map(int, agents)]
        return [], cluster
    return [], None


def run_variant(v: dict, args, out: Path) -> list[float]:
    """One control run in variant ``v``; its step times after the warm-up."""
    procs, cluster = _start_neighbour(v, args, out.with_suffix(".run"))
    try:
        time.sleep(0.5)    # the neighbour is in its steady state before the first step
        cmd = [sys.executable, "-m", "infra.lab.overhead_roles", "control", "--out", str(out), "--steps",
               str(args.steps), "--seed", "0", "--cpus", args.cpus, *(["--guard", "on"] if v["guard"] else [])]
        subprocess.run(cmd, check=True, capture_output=True)
    finally:
        _stop(procs, cluster)
    return json.loads(out.read_text())["step_times"][WARMUP:]


def _stop(procs, cluster) -> None:
    """End a neighbour: its processes, or its cluster."""
    for p in procs:
        p.kill()
        p.wait()
    if cluster is not None:
        cluster.stop()


def run_ab(word: str, args, out: Path) -> tuple[float, float]:
    """One control process with feature ``word`` on alternate steps (guard) or in alternate blocks of
    ``--block`` steps (a neighbour, stopped in the other blocks): (median ms without, with).
    ``learner`` / ``learner-threads``: ``Learner.step`` on alternate steps (overhead_roles
    ``learner_ab``; the sync agent, or the sender and receiver threads), on a run with no syncer."""
    if word in ("learner", "learner-threads"):
        return _learner_ab(word == "learner", args, out)
    v = parse_variant(word)
    procs, cluster = _start_neighbour({**v, "guard": False}, args, out.with_suffix(".run"))
    pids = [p.pid for p in procs] if procs else cluster.ablate_pids if cluster is not None else []
    try:
        time.sleep(0.5)
        cmd = [sys.executable, "-m", "infra.lab.overhead_roles", "control", "--out", str(out), "--steps",
               str(args.steps), "--seed", "0", "--cpus", args.cpus, "--block", str(args.block),
               *(["--guard", "alternate"] if v["guard"] else []),
               *(["--neighbour", ",".join(map(str, pids))] if pids else [])]
        subprocess.run(cmd, check=True, capture_output=True)
    finally:
        _stop(procs, cluster)
    return _ab_medians(out)


def _learner_ab(sync_process: bool, args, out: Path) -> tuple[float, float]:
    import shutil
    run = out.with_suffix(".run")
    shutil.rmtree(run, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "workers.cli", "run", "--create-only", "--insecure", "--out", str(run),
                    "--learners", "1", "--steps", str(args.steps), "--seed", "0"], check=True, capture_output=True)
    subprocess.run([sys.executable, "-m", "infra.lab.overhead_roles", "learner-ab", "--out", str(out), "--run",
                    str(run / "store"), "--steps", str(args.steps), "--cpus", args.cpus,
                    *(["--sync-process"] if sync_process else [])], check=True, capture_output=True)
    return _ab_medians(out)


def _ab_medians(out: Path) -> tuple[float, float]:
    res = json.loads(out.read_text())
    rows = list(zip(res["step_times"], res["b"]))[WARMUP:]
    return (float(np.median([t for t, b in rows if not b])) * 1e3, float(np.median([t for t, b in rows if b])) * 1e3)


def main_ab(a) -> int:
    """``--ab WORD``: ``--repeats`` processes, each an A/B inside itself (``run_ab``)."""
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    pairs = []
    for r in range(a.repeats):
        pairs.append(run_ab(a.ab, a, out / f"ab-{a.ab}-{r}.json"))
        print(f"repeat {r}: without {pairs[-1][0]:.3f} ms, with {pairs[-1][1]:.3f} ms, "
              f"ratio {pairs[-1][1] / pairs[-1][0]:.4f}", flush=True)
    ratios = [w / wo for wo, w in pairs]
    res = {"ab": a.ab, "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
           "without_ms": [p[0] for p in pairs], "with_ms": [p[1] for p in pairs]}
    print(f"{a.ab}: with/without median {res['ratio_median']:.4f} ({res['ratio_min']:.4f}-{res['ratio_max']:.4f}) "
          f"over {a.repeats} processes")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), **res}, indent=2))
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m infra.lab.overhead_ablate", description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="plain,guard")
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--cpus", default="0", help="cores of the control")
    p.add_argument("--load-cpus", default="1", help="cores of the neighbour")
    p.add_argument("--period", type=float, default=0.01, help="the neighbour's busy/asleep cycle, seconds")
    p.add_argument("--out", default="/tmp/overhead-ablate")
    p.add_argument("--json", default=None)
    p.add_argument("--ab", default=None, help="one variant word timed inside each process (run_ab)")
    p.add_argument("--block", type=int, default=10, help="with --ab and a neighbour: steps per on/off block")
    p.add_argument("--load", choices=LOADS, default=None, help=argparse.SUPPRESS)   # the neighbour itself
    p.add_argument("--duty", type=float, default=0.3, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.load:
        load(a.load, a.duty, a.period)
        return 0
    if a.ab:
        return main_ab(a)
    names = a.variants.split(",")
    variants = {n: parse_variant(n) for n in names}
    if "plain" not in variants or a.repeats < 1 or a.steps <= 2 * WARMUP:
        raise SystemExit("--variants must include plain; --repeats >= 1; --steps > 40")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    medians: dict[str, list[float]] = {n: [] for n in names}
    for r in range(a.repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            times = run_variant(variants[n], a, out / f"{n}-{r}.json")
            medians[n].append(float(np.median(times)))
        print(f"repeat {r}: " + ", ".join(f"{n} {medians[n][-1] * 1e3:.3f}" for n in names), flush=True)
    res = {}
    for n in names:
        ratios = [m / b for m, b in zip(medians[n], medians["plain"])]
        res[n] = {"median_ms": statistics.median(medians[n]) * 1e3, "ratio_median": statistics.median(ratios),
                  "ratio_min": min(ratios), "ratio_max": max(ratios), "per_repeat_ms": [m * 1e3 for m in medians[n]]}
        print(f"{n:<20} median {res[n]['median_ms']:.3f} ms  /plain {res[n]['ratio_median']:.4f} "
              f"({res[n]['ratio_min']:.4f}-{res[n]['ratio_max']:.4f})")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "variants": res}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
