"""`ddiloco benchmark regions`: cross-region training over the emulated WAN vs the same run without
it (docs/results-regions.md "Benchmark").

For each path - the bus (ZeroMQ from region r1's learners to the home syncer through the link) and
bucket-only (``--no-bus``: r1's learners reach the syncer only through r1's bucket) - ``--pairs``
pairs of runs of the same shape, each pair started *together* (which launcher starts first
alternates) to train side by side under the same machine load: ``ddiloco run --regions 2 --wan
SPEC`` (default rtt 100 ms, 100 Mbit/s on every cross-region path) and the baseline ``--wan
BASELINE`` (default ``rtt=0ms``: the same servers and proxies, unshaped, so the pair differs in
the link alone; ``none``: no proxies). ``--pace S`` pads every learner step to S seconds (``ddiloco
run --pace``): in production each learner owns its accelerator, so what a ratio must show is
whether the WAN ever stalls a learner, not how a shared machine's cores are split between two
runs; a stall shows as a step gap above the pace (``r1_max_gap_s``) and a ratio below 1. Each
pair's figures are reported, and per key figure the median over the pairs. Per pair:

- ``r1_tokens_per_s_ratio``: tokens/s of r1's learners, WAN / no WAN (goal >= 0.97), over the
  window in which every learner of *both* runs was training (from the latest first ``step``
  report to the earliest last one; the cumulative tokens of each learner's ``step`` reports,
  interpolated at the window's ends): a run that finishes first leaves the other a quieter machine;
  ``home_tokens_per_s_ratio`` is the same for the home learners (no link on their path): the
  spread that the two runs' shares of the machine alone give;
- ``r1_version_latency_steps_p50``: inner steps from a learner's answer to applying the version
  that merged it (workers/tools/utilisation.py), r1's learners, both runs (goal <= 2);
- ``cross_region_bytes_per_r1_learner_token``: every byte through every link (both ways: deltas,
  replication of commit records and versions, inbox listings, the bus) over the tokens r1's
  learners trained, and its ratio to a data-parallel ring all-reduce of the same model (each
  replica sends and receives 2(N-1)/N of the bf16 gradient every step; goal <= 1/200 at int4);
- per run (suffix ``_wan`` / ``_none``, ``run_extras``): the answer-to-version latency in seconds
  (r1, home), r1's and home's late share (merged answers to an earlier round than their commit's),
  the replication delay to r1, commits and the longest gap between two, how often r1's learners
  waited for r1's copy of an announced commit, r1's longest and median step gap, and where r1's
  answer-to-version time goes (``latency_parts``). ``--slow F`` stretches every step by its own
  compute time instead of ``--pace`` (which follows the machine's load).
Timing figures live here, never in tests.
"""
from __future__ import annotations

import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from workers.common.events import read_events
from workers.common.placement import Placement

PATHS = (("bus", []), ("bucket-only", ["--no-bus"]))


def _start(out: Path, wan: str, extra: list[str], args) -> subprocess.Popen:
    pace = getattr(args, "pace", None)
    cmd = [sys.executable, "-m", "workers.cli", "run", "--out", str(out), "--plain", "--regions", "2", "--wan", wan,
           "--learners", str(args.learners), "--steps", str(args.steps), "--eval-every", "100000", *extra,
           *(["--sync-every", str(args.sync_every)] if getattr(args, "sync_every", None) else []),
           *(["--slow", str(args.slow)] if getattr(args, "slow", 1.0) != 1.0 else []),
           *(["--pace", str(pace)] if pace else []), *shlex.split(getattr(args, "run_args", None) or "")]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(out: Path, proc: subprocess.Popen) -> dict:
    log = proc.communicate()[0]
    if proc.returncode != 0:
        raise SystemExit(f"run in {out} failed ({proc.returncode}):\n{log[-3000:]}")
    return json.loads((out / "summary.json").read_text())


def region_learners(summary: dict, region: int = 1) -> list[str]:
    """The learners a run placed in region ``r<region>`` (its summary's ``placement``)."""
    return Placement.from_dict(summary["placement"]).in_region(f"r{region}")


def _progress(out: Path, lid: str) -> list[tuple[float, int]]:
    """(time, cumulative tokens) of one learner's ``step`` reports (every ``log_every`` steps)."""
    return [(e["t"], e["tokens"]) for e in read_events(out / "logs" / f"{lid}.jsonl")
            if e.get("event") == "step" and "tokens" in e]


def training_span(out: Path, lid: str) -> tuple[float, float] | None:
    """The first and the last ``step`` report of one learner: it trained all along in between (its
    start-up and its drain at close, when it makes no tokens, are outside)."""
    rows = _progress(out, lid)
    return (rows[0][0], rows[-1][0]) if len(rows) >= 2 else None


def tokens_per_s(out: Path, lid: str, window: tuple[float, float]) -> float | None:
    """One learner's tokens/s inside ``window`` (its cumulative tokens at its step reports,
    interpolated at the window's ends)."""
    rows = _progress(out, lid)
    a, b = window
    if len(rows) < 2 or b <= a or rows[0][0] > a or rows[-1][0] < b:
        return None
    ts, toks = zip(*rows)
    return float(np.interp(b, ts, toks) - np.interp(a, ts, toks)) / (b - a)


def common_window(outs: list[Path], learners: list[str]) -> tuple[float, float]:
    """From the latest first step report to the earliest last one, over every learner of every run."""
    spans = [training_span(o, lid) for o in outs for lid in learners]
    if any(s is None for s in spans):
        raise SystemExit(f"a learner of {outs} has fewer than two step reports: cannot compare throughput")
    return max(s[0] for s in spans), min(s[1] for s in spans)


def dp_bytes_per_learner_token(params: int, learners: int, tokens_per_step: int, width: int = 2) -> float:
    """A ring all-reduce of the full gradient every step: each replica sends and receives
    2(N-1)/N of it (``width`` bytes per value; bf16: 2)."""
    ring = 2 * (learners - 1) / learners if learners > 1 else 1.0
    return 2 * ring * width * params / tokens_per_step


def path_figures(wan: dict, none: dict, wan_out: Path, none_out: Path) -> dict:
    """The figures of one path from its two side-by-side runs (module docstring)."""
    r1 = region_learners(wan)
    window = common_window([wan_out, none_out], list(wan["per_learner"]))
    rate = {side: [tokens_per_s(o, lid, window) for lid in r1] for side, o in (("wan", wan_out), ("none", none_out))}
    home = [lid for lid in wan["per_learner"] if lid not in r1]
    rate.update({f"home-{side}": [tokens_per_s(o, lid, window) for lid in home]
                 for side, o in (("wan", wan_out), ("none", none_out))})
    mean = {side: statistics.fmean([x for x in v if x]) if any(v) else None for side, v in rate.items()}
    home_ratio = mean["home-wan"] / mean["home-none"] if mean["home-wan"] and mean["home-none"] else None
    lat = {side: [s["version_latency_steps_p50"].get(lid) for lid in r1]
           for side, s in (("wan", wan), ("none", none))}
    tokens_r1 = sum(wan["per_learner"][lid]["tokens"] or 0 for lid in r1)
    cross = wan["wan"]["cross_region_bytes"]
    return {"window_s": round(window[1] - window[0], 2), "r1_tokens_per_s_wan": mean["wan"], "r1_tokens_per_s_none": mean["none"],
            "r1_tokens_per_s_ratio": mean["wan"] / mean["none"] if mean["wan"] and mean["none"] else None,
            # the same ratio for the home learners, whose path crosses no link: what the two runs'
            # shares of the machine alone make of the comparison
            "home_tokens_per_s_ratio": home_ratio,
            "r1_version_latency_steps_p50_wan": _median(lat["wan"]),
            "r1_version_latency_steps_p50_none": _median(lat["none"]),
            "home_version_latency_steps_p50_wan": _median([v for k, v in wan["version_latency_steps_p50"].items()
                                                           if k not in r1]),
            "cross_region_bytes": cross, "links": {k: v["bytes_up"] + v["bytes_down"] for k, v in wan["wan"]["links"].items()},
            "cross_region_bytes_per_r1_learner_token": cross / tokens_r1 if tokens_r1 else None,
            "final_eval_wan": wan["final_eval_loss"], "final_eval_none": none["final_eval_loss"],
            "regions_verified": all(r.get("ok") for r in wan["wan"]["regions_verified"].values()),
            "ok": wan["ok"] and none["ok"],
            **{f"{k}_{side}": v for side, (s, o) in (("wan", (wan, wan_out)), ("none", (none, none_out)))
               for k, v in run_extras(o, s, r1).items()}}


def answers(out: Path, lids: list[str]) -> dict[str, dict]:
    """Per learner, from the run's event logs (its commit log is gone with its S3 servers): for
    every version it applied that merged one of its own deltas, the inner steps and the seconds
    from that answer (its ``delta`` event) to applying the version; and of its merged deltas, the
    share that answered an earlier round than the commit that merged them closed ("late": they
    missed their round and waited H steps for the next one, SPEC §4)."""
    commits = {e["seq"]: e for e in read_events(out / "logs" / "syncer.jsonl") if e.get("event") == "commit"}
    out_: dict[str, dict] = {}
    for lid in lids:
        ev = read_events(out / "logs" / f"{lid}.jsonl")
        made = {e["delta"]: e for e in ev if e.get("event") == "delta"}
        steps, secs = [], []
        for e in ev:
            c = commits.get(e.get("seq")) if e.get("event") == "version-applied" else None
            mine = [made[i] for i in (c or {}).get("inputs", ()) if i in made]
            if mine:
                last = max(mine, key=lambda d: d["step"])
                steps.append(e["step"] - (last["step"] + 1))
                secs.append(e["t"] - last["t"])
        merged = [(made[i].get("round", -1), c.get("round", -1)) for c in commits.values()
                  for i in c.get("inputs", ()) if i in made]
        timed = [(a, r) for a, r in merged if a >= 0 and r >= 0]
        out_[lid] = {"latency_steps": steps, "latency_s": secs,
                     "late_share": sum(a < r for a, r in timed) / len(timed) if timed else None}
    return out_


def latency_parts(out: Path, lids: list[str], region: str = "r1") -> dict:
    """Where the answer-to-version time of ``lids`` (learners in ``region``) goes, medians over
    every (answer, applied version that merged it) pair, in seconds:
    ``to_close`` answer -> the round closed (the answer crossing up, the other answers, the grace
    window; ``grace`` is the window alone), ``commit`` the merge and its writes at home, ``replicate``
    commit -> its record copied into ``region`` (``replicated`` events), ``to_apply`` copied -> applied
    (the announcement or a poll, the read in the region, the wait for the learner's next step)."""
    syncer = read_events(out / "logs" / "syncer.jsonl")
    commits = {e["seq"]: e for e in syncer if e.get("event") == "commit"}
    copied = {e["seq"]: e["t"] for e in syncer if e.get("event") == "replicated" and e.get("region") == region}
    parts: dict[str, list[float]] = {k: [] for k in ("to_close", "grace", "commit", "replicate", "to_apply", "total")}
    for lid in lids:
        ev = read_events(out / "logs" / f"{lid}.jsonl")
        made = {e["delta"]: e for e in ev if e.get("event") == "delta"}
        for e in ev:
            c = commits.get(e.get("seq")) if e.get("event") == "version-applied" else None
            mine = [made[i] for i in (c or {}).get("inputs", ()) if i in made]
            if not mine or e["seq"] not in copied:
                continue
            answer = max(mine, key=lambda d: d["step"])["t"]
            closed = c["t"] - (c.get("sync_s") or 0.0)
            for k, v in (("to_close", closed - answer), ("grace", c.get("grace_s") or 0.0),
                         ("commit", c.get("sync_s") or 0.0), ("replicate", copied[e["seq"]] - c["t"]),
                         ("to_apply", e["t"] - copied[e["seq"]]), ("total", e["t"] - answer)):
                parts[k].append(v)
    return {k: (round(_median(v), 4) if v else None) for k, v in parts.items()}


def run_extras(out: Path, summary: dict, r1: list[str]) -> dict:
    """What a run says beyond its summary: r1's and home's answer-to-version latency in seconds and
    late share, the replication delay to r1, and how often r1's learners waited for r1's copy of
    an announced commit (receiver: versions_awaited, copy_misses)."""
    home = [lid for lid in summary["per_learner"] if lid not in r1]
    a = answers(out, list(summary["per_learner"]))
    stop = [e for e in read_events(out / "logs" / "syncer.jsonl") if e.get("event") == "syncer-stop"]
    rep = (stop[-1].get("regions") or {}).get("r1", {}) if stop else {}
    lstop = {lid: next((e for e in reversed(read_events(out / "logs" / f"{lid}.jsonl"))
                        if e.get("event") == "learner-stop"), {}) for lid in r1}
    commits = [e["t"] for e in read_events(out / "logs" / "syncer.jsonl") if e.get("event") == "commit"]
    gaps = [b - x for x, b in zip(commits, commits[1:])]

    def pooled(lids, key):
        return _median([x for lid in lids for x in a[lid][key]])

    def share(lids):
        xs = [a[lid]["late_share"] for lid in lids if a[lid]["late_share"] is not None]
        return statistics.fmean(xs) if xs else None
    return {"r1_latency_parts_s": latency_parts(out, r1),
            "r1_latency_s_p50": pooled(r1, "latency_s"), "home_latency_s_p50": pooled(home, "latency_s"),
            "r1_latency_steps_pooled_p50": pooled(r1, "latency_steps"),
            "r1_late_share": share(r1), "home_late_share": share(home),
            "median_step_s": _median([summary["per_learner"][lid].get("median_step_s") for lid in r1]),
            "commits": len(commits), "max_commit_gap_s": max(gaps) if gaps else None,
            "replication_delay_s_mean": rep.get("delay_s_mean"), "replication_delay_s_max": rep.get("delay_s_max"),
            "replication_home_reads": rep.get("home_reads"),
            "r1_versions_awaited": sum(e.get("versions_awaited", 0) for e in lstop.values()),
            "r1_copy_misses": sum(e.get("copy_misses", 0) for e in lstop.values()),
            # a stall of r1's learners shows here: the longest step-to-step gap against the median one
            "r1_max_gap_s": max((e.get("max_gap_s") or 0.0 for e in lstop.values()), default=None),
            "r1_median_gap_s": _median([e.get("median_gap_s") for e in lstop.values()]),
            "r1_p99_step_s": _median([e.get("p99_step_s") for e in lstop.values()])}


def _median(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


KEY_FIGURES = ("r1_tokens_per_s_ratio", "home_tokens_per_s_ratio", "r1_over_home", "r1_version_latency_steps_p50_wan",
               "r1_version_latency_steps_p50_none", "r1_latency_s_p50_wan", "r1_latency_s_p50_none",
               "r1_max_gap_s_wan", "r1_max_gap_s_none", "r1_median_gap_s_wan", "r1_median_gap_s_none",
               "ratio_to_dp_bf16")


def _pair(out: Path, name: str, extra: list[str], i: int, args, dp: float) -> dict:
    """One side-by-side pair of one path: the WAN run and the baseline run start together; the
    one started first alternates with ``i`` (a launcher started first gets the machine first)."""
    dirs = {side: out / f"{name}-{i}-{side}" for side in ("wan", "none")}
    specs = {"wan": args.wan, "none": getattr(args, "baseline", "none")}
    order = ("wan", "none") if i % 2 == 0 else ("none", "wan")
    procs = {side: _start(dirs[side], specs[side], extra, args) for side in order}
    runs = {side: _finish(dirs[side], procs[side]) for side in order}
    f = path_figures(runs["wan"], runs["none"], dirs["wan"], dirs["none"])
    per_token = f["cross_region_bytes_per_r1_learner_token"]
    f["ratio_to_dp_bf16"] = per_token / dp if per_token is not None else None
    r1, home = f["r1_tokens_per_s_ratio"], f["home_tokens_per_s_ratio"]
    # r1's ratio over the home learners' one: the link's share, with the two runs' machine shares divided out
    f["r1_over_home"] = r1 / home if r1 and home else None
    f["started_first"] = order[0]
    return f


def run_benchmark(args) -> int:
    """``--pairs`` side-by-side pairs per path (module docstring), each pair's figures and, per
    key figure, the median over the pairs."""
    from workers.job.model import GPTConfig, build_model
    from workers.launch import Schedule
    from workers.run_config import RunConfig
    out = Path(args.out) / "regions"
    out.mkdir(parents=True, exist_ok=True)
    pairs = getattr(args, "pairs", 1)
    names = [n.strip() for n in getattr(args, "paths", "bus,bucket-only").split(",") if n.strip()]
    known = dict(PATHS)
    if pairs < 1 or not names or any(n not in known for n in names):
        raise SystemExit(f"--pairs must be >= 1 and --paths a subset of {sorted(known)}, got {pairs}, {names}")
    gcfg = GPTConfig()
    params = sum(p.numel() for p in build_model(gcfg, 0).parameters())
    dp = dp_bytes_per_learner_token(params, args.learners, RunConfig().job.batch_size * gcfg.block_size)
    figures: dict = {"wan": args.wan, "baseline": getattr(args, "baseline", "none"), "learners": args.learners,
                     "steps": args.steps, "params": params, "slow": getattr(args, "slow", 1.0),
                     "pace": getattr(args, "pace", None), "pairs": pairs,
                     "run_args": getattr(args, "run_args", None),
                     "sync_every": args.sync_every or Schedule(fragments=4).h,
                     "dp_bf16_bytes_per_learner_token": dp}
    t0 = time.time()
    for name in names:
        runs = [_pair(out, name, known[name], i, args, dp) for i in range(pairs)]
        figures[name] = {"pairs": runs, "median": {k: _median([r.get(k) for r in runs]) for k in KEY_FIGURES}}
    figures["wall_s"] = round(time.time() - t0, 1)
    for name in names:
        print(f"{name}:")
        for k in KEY_FIGURES:
            vals = ", ".join(_fmt(r.get(k)) for r in figures[name]["pairs"])
            print(f"  {k:<36} median {_fmt(figures[name]['median'][k]):>8}   pairs: {vals}")
    print(f"dp_bf16_bytes_per_learner_token          {dp:.4g}  (params {params}, {args.learners} learners)")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0


def _fmt(x) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)
