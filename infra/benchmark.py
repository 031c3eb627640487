"""`ddiloco benchmark [run|codec|merge|throughput|regions]`: the figures a user runs on this machine.

``run`` (the default) runs the default job and reports, each measured side by side in the same run
where it is a ratio:
1. learner step time with sync on vs off: a *control* process trains the identical model with a
   plain AdamW loop (no Learner) alongside the run's learners, under the same machine load;
2. time from a delta's publication to the version that merged it being applied by another learner
   (p50/p99), over the local directory store and over the local S3 server;
3. bytes each learner moves per step in *both* directions - deltas up plus versions down - vs a
   data-parallel ring all-reduce (each replica sends and receives 2(N-1)/N of the gradient), per
   direction and in total (issue 11 item 16: counting uploads only overstated the saving ~17x);
4. final held-out eval loss of ``--mode decoupled`` vs ``--mode dp`` at equal tokens, lock-step
   ``--mode diloco`` with the same H, and one learner alone (``--mode dp --learners 1``), as mean ±
   sample standard deviation over ``--seeds`` (reruns of one side spread by ~0.1: one run per
   side cannot tell them apart);
5. rounds: utilisation - the share of each learner's inner steps whose work
   entered a committed version - the version latency in steps (answer -> applied) and the mean
   number of learners merged per round.
``codec``, ``merge`` and ``throughput`` (both) time the codec and the syncer's merge beside this
machine's memcpy (workers/tools/bench.py); ``regions`` compares paced runs over an emulated WAN with
and without the links (infra/wan_benchmark.py). Timing claims live here, never in tests.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from storage.log import CommitLog
from storage.store import open_store
from workers.common.events import read_events
from workers.tools.bench import add_arguments as add_bench_arguments, run_bench


KINDS = ("run", "codec", "merge", "throughput", "regions", "quality", "scale")


def configure(parser: argparse.ArgumentParser):
    """Figures on this machine: end-to-end runs, codec/merge throughput, regions over an emulated WAN."""
    parser.add_argument("what", nargs="?", default="run", choices=KINDS,
                        help="run (default): sync overhead, version latency, bytes both ways, utilisation and final "
                             "loss vs DP / DiLoCo / one learner over --seeds; codec, merge, throughput (both): "
                             "throughput beside memcpy (workers/tools/bench.py); regions: 2 regions over the "
                             "emulated WAN vs none, bus and bucket-only (infra/wan_benchmark.py); quality: "
                             "decoupled vs lock-step DiLoCo vs DP per M at equal tokens (infra/quality_benchmark.py); "
                             "scale: memory, CPU, bytes and latency per parameter at several model sizes "
                             "(infra/scale_benchmark.py)")
    parser.add_argument("--quality", action="store_true", help="the same as `ddiloco benchmark quality`")
    parser.add_argument("--scale", action="store_true", help="the same as `ddiloco benchmark scale`")
    parser.add_argument("--sizes", default=None, metavar="LxW,...",
                        help="scale: model sizes as layers x width (default 2x128,6x256,8x576,12x832: "
                             "0.47M, 4.9M, 32M, 100M parameters)")
    parser.add_argument("--learners", default=None,
                        help="learners (default 4; scale: 2); quality: the counts M to compare, comma-separated "
                             "(default 2,4,8)")
    parser.add_argument("--dp-lrs", default=None, metavar="LR,LR,...",
                        help="quality: DP's inner lr, the best of these by mean over the seeds (default: the job's)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default="runs/benchmark")
    parser.add_argument("--no-s3", action="store_true", help="skip the run over the local S3 server")
    parser.add_argument("--json", default=None, help="write the figures here too")
    parser.add_argument("--seeds", default="0,1,2",
                        help="comma-separated seeds for the quality comparison (mean ± spread over them)")
    parser.add_argument("--wan", default="rtt=100ms,bw=100mbit", help="regions: the link spec between regions")
    parser.add_argument("--sync-every", type=int, default=None, help="regions: H of both runs (default: ddiloco run's)")
    parser.add_argument("--slow", type=float, default=1.0,
                        help="regions: stretch every learner step by this factor (ddiloco run --slow)")
    parser.add_argument("--pace", type=float, default=None, metavar="SECONDS",
                        help="regions: pad every learner step to this many seconds (ddiloco run --pace)")
    parser.add_argument("--pairs", type=int, default=3,
                        help="regions: side-by-side WAN/baseline pairs per path (start order alternates)")
    parser.add_argument("--baseline", default="rtt=0ms",
                        help="regions: the other run's links ('rtt=0ms': the same proxies, unshaped; "
                             "'none': no proxies)")
    parser.add_argument("--paths", default="bus,bucket-only", help="regions: which paths to measure")
    parser.add_argument("--run-args", default=None, metavar="FLAGS",
                        help="regions, quality, scale: more ddiloco run flags for every run, e.g. '--poll 0.2' or "
                             "'--layers 2 --width 128'")
    add_bench_arguments(parser)
    return lambda args: _handle(parser, args)


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--seeds must be comma-separated integers, got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds needs at least one seed and no repeats, got {text!r}")
    return seeds


def bandwidth_figures(summary: dict, steps: int, params: int, learners: int) -> dict:
    """Bytes per learner per step, up (deltas) and down (versions), against a data-parallel ring
    all-reduce of the full gradient in bf16 and fp32 (each replica sends 2(N-1)/N of it and
    receives as much). Ratios > 1: decoupled moves fewer bytes."""
    up = statistics.mean(v / steps for v in summary["bytes_sent_per_learner"].values())
    down = statistics.mean(v / steps for v in summary.get("bytes_received_per_learner", {}).values() or [0])
    ring = 2 * (learners - 1) / learners if learners > 1 else 1.0
    dp = {f"dp_bytes_per_step_each_way_{name}": ring * width * params for name, width in (("fp32", 4), ("bf16", 2))}
    total = up + down
    return {"bytes_per_learner_step_up": up, "bytes_per_learner_step_down": down,
            "bytes_per_learner_step": total, **dp,
            "bandwidth_reduction_vs_bf16_dp": 2 * dp["dp_bytes_per_step_each_way_bf16"] / total if total else None,
            "bandwidth_reduction_vs_bf16_dp_up": dp["dp_bytes_per_step_each_way_bf16"] / up if up else None,
            "bandwidth_reduction_vs_bf16_dp_down": dp["dp_bytes_per_step_each_way_bf16"] / down if down else None}


def spread(values: list[float]) -> dict:
    """Mean, sample standard deviation (None for one value), min, max and n."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0}
    return {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else None,
            "min": min(xs), "max": max(xs), "n": len(xs)}


def quality_figures(decoupled: list[float], dp: list[float], diloco: list[float] | None = None,
                    alone: list[float] | None = None) -> dict:
    """Final eval loss of each side over seeds, and the gaps, each as mean ± spread: decoupled vs
    data parallel (``dp``), lock-step DiLoCo with the same H (``diloco``) and one learner alone."""
    d, b = spread(decoupled), spread(dp)
    gap = spread([x - y for x, y in zip(decoupled, dp)])
    more = {}
    if diloco:
        more["diloco_final_eval"] = spread(diloco)
        more["gap_decoupled_minus_diloco"] = spread([x - y for x, y in zip(decoupled, diloco)])
    if alone:
        more["one_learner_final_eval"] = spread(alone)
        more["gap_decoupled_minus_one_learner"] = spread([x - y for x, y in zip(decoupled, alone)])
    return {"decoupled_final_eval": d, "dp_final_eval": b, "gap_decoupled_minus_dp": gap, **more,
            "quality_note": ("one seed per side: no spread, the gap is not established" if min(d["n"], b["n"]) < 2
                             else f"mean ± sample std over {min(d['n'], b['n'])} seeds")}


def _fmt(x) -> str:
    if isinstance(x, dict) and "mean" in x:
        if x["mean"] is None:
            return "-"
        return f"{x['mean']:.4g} ± {x['std']:.2g} (n={x['n']})" if x["std"] is not None else f"{x['mean']:.4g} (n=1)"
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def _ddiloco(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workers.cli", *args], env=env, capture_output=True, text=True)


def _control(out: Path, run_dir: Path, steps: int) -> subprocess.Popen:
    from workers.run import LEARNER_NICE
    # Same priority as the run's learners: the ratio compares sync on vs off, not scheduling classes.
    return subprocess.Popen([sys.executable, "-m", "infra.benchmark", "control", str(out), str(run_dir), str(steps)],
                            env=dict(os.environ, OMP_NUM_THREADS="1"), preexec_fn=lambda: os.nice(LEARNER_NICE))


def control_main(out: str, run_dir: str, steps: int, model_from: str | None = None) -> None:
    """The sync-off control: the default job's model, data and optimizer (``model_from``: those of
    the run created in that store), no Learner at all, trained while the run in ``run_dir`` trains
    (same machine load); step times and its parameter count written to ``out``."""
    import torch
    from workers.job.data import Corpus
    from workers.job.job import JobSettings, make_optimizer
    from workers.job.model import build_model
    from workers.run_config import RunConfig
    torch.set_num_threads(1)
    # Train while the run's learners train (they take seconds to start): wait for their first step.
    # (It once derived the run's directory from ``out`` wrongly, waited out its deadline and trained
    # alone after the run: the "sync on/off" ratio of ~2.5-3 compared a loaded learner to an idle core.)
    first = Path(run_dir) / "logs" / "l0.jsonl"
    deadline = time.monotonic() + 600
    while not (first.exists() and '"event":"step"' in first.read_text()):
        if time.monotonic() > deadline:
            raise SystemExit(f"control: no step of {first} within 600 s; the run did not start")
        time.sleep(0.2)
    if model_from is None:
        demo = RunConfig()                                   # what `ddiloco run` trains
        gcfg, job = demo.model, JobSettings(steps=steps, batch_size=demo.job.batch_size)
    else:
        from storage.layout import read_descriptor
        from workers.job.job import job_from
        gcfg, job = job_from(read_descriptor(open_store(model_from, create=False)))
    corpus = Corpus(job.data_config(gcfg.block_size))
    model = build_model(gcfg, 0)
    opt = make_optimizer(model, job)
    batches = corpus.batches(0, job.shards, 0)
    times = []
    for _ in range(steps):
        x, y = next(batches)
        t0 = time.monotonic()
        opt.zero_grad(set_to_none=True)
        model(x, y)[1].backward()
        opt.step()
        times.append(time.monotonic() - t0)
    Path(out).write_text(json.dumps({"step_times": times, "params": sum(p.numel() for p in model.parameters())}))


def _run(out: Path, learners: int, steps: int, extra: list[str], env=None, control: bool = False) -> dict:
    ctl = _control(out.with_suffix(".control.json"), out, steps) if control else None
    res = _ddiloco(["run", "--out", str(out), "--plain", "--learners", str(learners), "--steps", str(steps), *extra],
                   env=env)
    if res.returncode != 0:
        raise SystemExit(f"run in {out} failed ({res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    if ctl is not None:
        ctl.wait()
        summary["control_step_times"] = json.loads(out.with_suffix(".control.json").read_text())["step_times"]
    return summary


def _step_clock(events: list[dict]) -> tuple[list[int], list[float]]:
    rows = [(e["step"], e["t"]) for e in events if e.get("event") == "step"]
    return [r[0] for r in rows], [r[1] for r in rows]


def version_latencies(out: Path, store_uri: str) -> list[float]:
    """For every merged delta: from its publication (learner wall time at its step, interpolated
    from that learner's step log) to the first time *another* learner applied that version or a newer one."""
    logs = {f.stem: read_events(f) for f in (out / "logs").glob("l*.jsonl")}
    clocks = {lid: _step_clock(ev) for lid, ev in logs.items()}
    applied = {lid: sorted((e["fragment"], e["version"], e["t"]) for e in ev if e.get("event") == "version-applied")
               for lid, ev in logs.items()}
    store = open_store(store_uri)
    lat = []
    for rec in CommitLog(store).read_range(0):
        if rec.kind != "merge":
            continue
        for inp in rec.inputs:
            steps, ts = clocks.get(inp.learner, ([], []))
            if len(steps) < 2:
                continue
            t_pub = float(np.interp(inp.learner_step, steps, ts))
            for lid, rows in applied.items():
                if lid == inp.learner:
                    continue
                times = [t for (p, v, t) in rows if p == rec.fragment and v >= rec.version]
                if times:
                    lat.append(min(times) - t_pub)
    return [x for x in lat if x >= 0]


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def step_tails(out: Path, control_times: list[float]) -> dict:
    """p95/p99 step times with sync on (the median over learners of each learner's own tail, from
    its ``learner-stop`` event) and off (the control's), and the on p99 over the on median (issue
    15: p99 <= 1.1x median)."""
    stops = [e for f in sorted((out / "logs").glob("l*.jsonl")) for e in read_events(f)
             if e.get("event") == "learner-stop" and e.get("p99_step_s")]
    res: dict = {}
    for q in (95, 99):
        on = [e[f"p{q}_step_s"] for e in stops]
        res[f"step_time_sync_on_p{q}_s"] = statistics.median(on) if on else None
        res[f"step_time_sync_off_p{q}_s"] = _pct(control_times, q)
    on99 = [e["p99_step_s"] / e["median_step_s"] for e in stops if e.get("median_step_s")]
    res["step_time_sync_on_p99_over_median"] = statistics.median(on99) if on99 else None
    off = statistics.median(control_times) if control_times else None
    res["step_time_sync_off_p99_over_median"] = _pct(control_times, 99) / off if off else None
    return res


def _handle(parser: argparse.ArgumentParser, args) -> int:
    if args.quality or args.what == "quality":
        return _quality(args)
    if args.scale or args.what == "scale":
        return _scale(args)
    try:
        args.learners = 4 if args.learners is None else int(args.learners)
    except ValueError:
        raise SystemExit(f"--learners must be one count for `benchmark {args.what}`, got {args.learners!r} "
                         "(a list is for `benchmark quality`)") from None
    if args.what == "regions":
        from .wan_benchmark import run_benchmark
        return run_benchmark(args)
    if args.what in ("codec", "merge", "throughput"):
        return run_bench(parser, args, args.what)
    seeds = parse_seeds(args.seeds)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    figures: dict = {"learners": args.learners, "steps": args.steps, "seeds": seeds}
    t0 = time.time()
    local = _run(out / "decoupled-local", args.learners, args.steps, ["--seed", str(seeds[0])], control=True)
    learner_steps = [d["median_step_s"] for d in local["per_learner"].values() if d.get("median_step_s")]
    control = statistics.median(local["control_step_times"])
    figures["step_time_sync_on_s"] = statistics.median(learner_steps)
    figures["step_time_sync_off_s"] = control
    figures["step_time_ratio_on_off"] = figures["step_time_sync_on_s"] / control
    figures.update(step_tails(out / "decoupled-local", local["control_step_times"]))
    lat = version_latencies(out / "decoupled-local", local["run_uri"])
    figures["latency_local_p50_s"], figures["latency_local_p99_s"] = _pct(lat, 50), _pct(lat, 99)
    from workers.job.model import GPTConfig, build_model
    params = sum(p.numel() for p in build_model(GPTConfig(), 0).parameters())
    figures.update(bandwidth_figures(local, args.steps, params, args.learners))
    # Rounds: share of each learner's steps whose work entered a version, and how
    # many steps pass between a learner's answer and the version that merged it.
    util = [u for u in (local.get("utilisation") or {}).values() if u is not None]
    lat = [v for v in (local.get("version_latency_steps_p50") or {}).values() if v is not None]
    figures["utilisation_min"] = min(util) if util else None
    figures["utilisation_mean"] = statistics.fmean(util) if util else None
    figures["version_latency_steps_p50"] = statistics.median(lat) if lat else None
    figures["mean_round_size"] = local.get("mean_round_size")
    figures["decoupled_tokens"] = local["tokens_trained"]
    if not args.no_s3:
        from infra.s3server import S3Server
        server = S3Server(out / "s3data").start()
        try:
            env = dict(os.environ, **server.env())
            uri = server.uri(f"bench-{int(time.time())}")
            s3 = _run(out / "decoupled-s3", args.learners, args.steps, ["--store", uri], env=env)
            os.environ.update(server.env())
            lat = version_latencies(out / "decoupled-s3", uri)
            figures["latency_s3_p50_s"], figures["latency_s3_p99_s"] = _pct(lat, 50), _pct(lat, 99)
            figures["decoupled_s3_final_eval"] = s3["final_eval_loss"]
        finally:
            server.stop()
    decoupled, dp_losses, diloco, alone = [local["final_eval_loss"]], [], [], []
    for seed in seeds:
        if seed != seeds[0]:
            decoupled.append(_run(out / f"decoupled-seed{seed}", args.learners, args.steps,
                                  ["--seed", str(seed)])["final_eval_loss"])
        dp = _run(out / f"dp-seed{seed}", args.learners, args.steps, ["--mode", "dp", "--seed", str(seed)])
        dp_losses.append(dp["final_eval_loss"])
        figures["dp_tokens"] = dp["tokens_trained"]
        diloco.append(_run(out / f"diloco-seed{seed}", args.learners, args.steps,
                           ["--mode", "diloco", "--seed", str(seed)])["final_eval_loss"])
        alone.append(_run(out / f"alone-seed{seed}", 1, args.steps, ["--mode", "dp", "--seed", str(seed)])["final_eval_loss"])
    figures.update(quality_figures(decoupled, dp_losses, diloco, alone))
    figures["wall_s"] = round(time.time() - t0, 1)
    for k, v in figures.items():
        print(f"{k:<36} {_fmt(v)}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0


def _quality(args) -> int:
    import shlex
    from .quality_benchmark import QualityPlan, run_quality
    try:
        text = args.learners or "2,4,8"
        try:
            counts = tuple(int(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise ValueError(f"--learners must be comma-separated counts, e.g. 2,4,8, got {text!r}") from None
        plan = QualityPlan(learners=counts,
                           seeds=tuple(parse_seeds(args.seeds)), steps=args.steps,
                           dp_lrs=tuple(float(x) for x in (args.dp_lrs or "").split(",") if x.strip()),
                           run_args=tuple(shlex.split(args.run_args or "")))
    except ValueError as exc:
        raise SystemExit(f"benchmark quality: {exc}") from None
    out = Path(args.out)
    print(f"benchmark quality: {len(plan.runs())} runs under {out}", flush=True)
    table = run_quality(plan, out, progress=lambda line: print(line, flush=True))
    print(table.format())
    print(f"plot: {out / 'quality.png'}")
    if args.json:
        Path(args.json).write_text(json.dumps(table.to_dict(), indent=2))
    return 0


def _scale(args) -> int:
    import shlex
    from .scale_benchmark import DEFAULT_SIZES, ScalePlan, format_table, parse_sizes, run_scale
    try:
        plan = ScalePlan(sizes=parse_sizes(args.sizes) if args.sizes else DEFAULT_SIZES, steps=args.steps,
                         learners=2 if args.learners is None else _one_count(args.learners),
                         run_args=tuple(shlex.split(args.run_args or "")))
    except ValueError as exc:
        raise SystemExit(f"benchmark scale: {exc}") from None
    rows = run_scale(plan, Path(args.out) / "scale", progress=lambda line: print(line, flush=True))
    print(format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"learners": plan.learners, "steps": plan.steps, "sizes": rows},
                                              indent=2))
    return 0


def _one_count(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--learners must be one count here, got {text!r}") from None


if __name__ == "__main__":
    if len(sys.argv) in (5, 6) and sys.argv[1] == "control":
        control_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), *sys.argv[5:])
    else:
        raise SystemExit("usage: python -m infra.benchmark control OUT RUN_DIR STEPS [MODEL_STORE] (internal)")
