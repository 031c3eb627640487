"""`ddiloco benchmark scale`: what sync costs per parameter as the model grows (issue 31).

    ddiloco benchmark scale --sizes 2x128,6x256,8x576,12x832 --steps 300 --json scale.json

For each size ``LxW`` (layers x width of the demo GPT: 0.47M, 4.9M, 32M and 100M parameters for
the sizes above) it runs one ``ddiloco run --learners M`` (real processes, the bus, the local
store: what a user gets) and beside it, under the same machine load, a *control*: the same
model, data and AdamW in a plain loop with no sync at all (infra/benchmark.py ``control_main``).
While they run it samples every process's resident memory and CPU time from /proc. Per size it
prints, and writes with ``--json``:

- **step ratio** on/off: the learners' median step over the control's (after ``WARMUP`` steps);
- **learner extra memory**: a learner's peak RSS minus the control's, in MB and B/param;
- **syncer memory**: its RSS at the end (steady state after the run's commits) and its peak, B/param;
- **syncer CPU** seconds per commit;
- **bytes** up per delta and down per version applied, per fragment parameter, and up + down per
  learner step against a data-parallel fp32 ring all-reduce of the same model;
- **double sends**: deltas the bus delivered that were also spilled (the spill found the syncer's
  copy already stored) and all spills;
- **latency**: publish -> applied (s, p50) and answer -> applied in steps (p50);
- **utilisation** (mean over learners) and the **start gap**: a learner's longest step gap in its
  first 2H steps over its median step (the start-up burst).

Timing claims live here, never in tests; memory is what it is on any load, step ratios are only
side by side (the control runs while the learners do).
"""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from workers.common.cpus import process_cpu
from workers.common.events import read_events

WARMUP = 10          # steps left out of the step-time figures (allocator and caches warming up)
SAMPLE_S = 0.5       # /proc sampling period
DEFAULT_SIZES = ((2, 128), (6, 256), (8, 576), (12, 832))


def parse_sizes(text: str) -> tuple[tuple[int, int], ...]:
    """``"2x128,6x256"`` -> ((2, 128), (6, 256)); ValueError naming the bad entry."""
    sizes = []
    for part in (p.strip() for p in text.split(",")):
        m = re.fullmatch(r"(\d+)x(\d+)", part)
        if not m or int(m.group(1)) < 1 or int(m.group(2)) < 4:
            raise ValueError(f"--sizes entries are LAYERSxWIDTH (e.g. 6x256, width >= 4), got {part!r}")
        sizes.append((int(m.group(1)), int(m.group(2))))
    if not sizes or len(set(sizes)) != len(sizes):
        raise ValueError(f"--sizes needs at least one size and no repeats, got {text!r}")
    return tuple(sizes)


@dataclass(frozen=True)
class ScalePlan:
    """What ``ddiloco benchmark scale`` runs; validated before any run starts."""
    sizes: tuple[tuple[int, int], ...] = DEFAULT_SIZES
    steps: int = 300
    learners: int = 2
    run_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.steps <= 2 * WARMUP:
            raise ValueError(f"--steps must be > {2 * WARMUP} (the first {WARMUP} are warm-up), got {self.steps}")
        if self.learners < 1:
            raise ValueError(f"--learners must be >= 1, got {self.learners}")
        for flag in ("--learners", "--steps", "--out", "--layers", "--width", "--mode"):
            if any(a == flag or a.startswith(flag + "=") for a in self.run_args):
                raise ValueError(f"--run-args may not set {flag}: the benchmark sets it for each size")


class Sampler:
    """A thread that samples RSS, peak RSS and CPU seconds of the processes whose command line
    names ``marker`` (the run's directory) or whose pid is added, every ``SAMPLE_S``."""

    def __init__(self, marker: str, clock: Callable[[], float] = time.monotonic):
        self.marker, self.clock = marker, clock
        self.pids: dict[int, str] = {}           # pid -> role ("syncer", "learner l0", "control")
        self.samples: dict[str, list[tuple[float, int, int, float]]] = {}   # role -> (t, rss, hwm, cpu_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="scale-sampler", daemon=True)

    def add(self, pid: int, role: str) -> None:
        self.pids[pid] = role

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self._find()
            for pid, role in list(self.pids.items()):
                got = _status(pid)
                if got is not None:
                    self.samples.setdefault(role, []).append((self.clock(), *got, process_cpu(pid)))

    def _find(self) -> None:
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) in self.pids:
                continue
            try:
                argv = Path(f"/proc/{name}/cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            if "workers.cli" not in argv or not any(self.marker in a for a in argv):
                continue
            if "syncer" in argv:
                self.pids[int(name)] = "syncer"
            elif "learner" in argv and "--id" in argv:
                self.pids[int(name)] = f"learner {argv[argv.index('--id') + 1]}"


def _status(pid: int) -> tuple[int, int] | None:
    """(VmRSS, VmHWM) in bytes, None if the process is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    if "VmRSS" not in fields:
        return None
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def start_gap(events: list[dict], window: int) -> float | None:
    """A learner's longest gap between step events in its first ``window`` steps over its median
    gap (the start-up burst: answering and applying every fragment at once)."""
    t = [e["t"] for e in events if e.get("event") == "step"]
    gaps = [b - a for a, b in zip(t, t[1:])]
    if len(gaps) <= window:
        return None
    med = statistics.median(gaps[WARMUP:] or gaps)
    return max(gaps[:window]) / med if med > 0 else None


def size_figures(summary: dict, stops: dict[str, dict], samples: dict, control: dict, params: int,
                 fragment_params: float, steps: int, gaps: list[float]) -> dict:
    """The per-size row from a finished run's summary, its learners' ``learner-stop`` events
    (``stops``, by learner), the samples and the control's step times."""
    learners = stops
    on = statistics.median(d["median_step_s"] for d in learners.values() if d.get("median_step_s"))
    off = statistics.median(control["step_times"][WARMUP:])
    peak = lambda role: max(s[2] for s in samples[role])           # noqa: E731 (VmHWM)
    lpeaks = [peak(r) for r in samples if r.startswith("learner")]
    ctl = peak("control") if "control" in samples else None
    syncer = samples.get("syncer") or [(0, 0, 0, 0.0)]
    commits = summary.get("merge_commits") or 0
    deltas = sum(d.get("deltas") or 0 for d in learners.values())
    applied = sum(d.get("versions_applied") or 0 for d in learners.values())
    up = sum(d.get("bytes_sent") or 0 for d in learners.values()) + \
        sum(d.get("bytes_spilled") or 0 for d in learners.values())
    down = sum(d.get("bytes_received") or 0 for d in learners.values())
    m = max(len(learners), 1)
    ring = 2 * (m - 1) / m if m > 1 else 1.0
    per_step = (up + down) / m / steps
    util = [u for u in (summary.get("utilisation") or {}).values() if u is not None]
    lat = [v for v in (summary.get("version_latency_steps_p50") or {}).values() if v is not None]
    extra = statistics.median(lpeaks) - ctl if lpeaks and ctl else None
    return {
        "params": params, "steps": steps, "commits": commits,
        "step_time_sync_on_s": on, "step_time_sync_off_s": off, "step_ratio_on_off": on / off,
        "learner_peak_mb": statistics.median(lpeaks) / 1e6 if lpeaks else None,
        "control_peak_mb": ctl / 1e6 if ctl else None,
        "learner_extra_mb": extra / 1e6 if extra is not None else None,
        "learner_extra_bytes_per_param": extra / params if extra is not None else None,
        "syncer_end_mb": syncer[-1][1] / 1e6, "syncer_peak_mb": syncer[-1][2] / 1e6,
        "syncer_end_bytes_per_param": syncer[-1][1] / params, "syncer_peak_bytes_per_param": syncer[-1][2] / params,
        "syncer_cpu_s_per_commit": syncer[-1][3] / commits if commits else None,
        "bytes_up_per_delta_per_fragment_param": up / deltas / fragment_params if deltas else None,
        "bytes_down_per_version_per_fragment_param": down / applied / fragment_params if applied else None,
        "bytes_per_learner_step": per_step,
        "reduction_vs_fp32_ring": 2 * ring * 4 * params / per_step if per_step else None,
        "deltas": deltas, "deltas_spilled": summary.get("deltas_spilled", 0),
        "delivered_and_spilled": sum(d.get("spill_found") or 0 for d in learners.values()),
        "publish_to_applied_p50_s": summary.get("publish_to_applied_p50_s"),
        "version_latency_steps_p50": statistics.median(lat) if lat else None,
        "utilisation_mean": statistics.fmean(util) if util else None,
        "start_gap_over_median": max(gaps) if gaps else None,
    }


def _stops(run: Path) -> dict[str, dict]:
    """Each learner's last ``learner-stop`` event (its totals), by learner id."""
    out = {}
    for f in sorted((run / "logs").glob("l*.jsonl")):
        for e in read_events(f):
            if e.get("event") == "learner-stop":
                out[e["id"]] = e
    return out


def measure(plan: ScalePlan, layers: int, width: int, out: Path) -> dict:
    """One size: the run and its control side by side, sampled; the row of ``size_figures``."""
    from storage.layout import read_descriptor
    from storage.store import open_store
    from workers.run import LEARNER_NICE
    run = out / f"{layers}x{width}"
    ctl_json = out / f"{layers}x{width}.control.json"
    for p in (run, ctl_json):
        if p.exists():
            raise SystemExit(f"benchmark scale: {p} exists; give an empty --out")
    ctl = subprocess.Popen([sys.executable, "-m", "infra.benchmark", "control", str(ctl_json), str(run),
                            str(plan.steps), _store_of(plan, run)], env=dict(os.environ, OMP_NUM_THREADS="1"),
                           preexec_fn=lambda: os.nice(LEARNER_NICE))   # the learners' priority: same footing
    args = ["run", "--plain", "--out", str(run), "--learners", str(plan.learners), "--steps", str(plan.steps),
            "--layers", str(layers), "--width", str(width), *plan.run_args]
    with Sampler(str(run)) as sampler:
        sampler.add(ctl.pid, "control")
        done = subprocess.run([sys.executable, "-m", "workers.cli", *args], capture_output=True, text=True)
        if done.returncode != 0:
            ctl.kill()               # it would wait out its deadline for a first step that never comes
        ctl_rc = ctl.wait()
    if done.returncode != 0:
        raise SystemExit(f"benchmark scale: the run in {run} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    if ctl_rc != 0:
        raise SystemExit(f"benchmark scale: the control of {run} failed ({ctl_rc})")
    summary = json.loads((run / "summary.json").read_text())
    desc = read_descriptor(open_store(summary["run_uri"], create=False))
    params = sum(t.numel for t in desc.layout.tensors)
    window = 2 * desc.schedule.sync_every
    gaps = [g for f in sorted((run / "logs").glob("l*.jsonl"))
            if (g := start_gap(read_events(f), window)) is not None]
    row = size_figures(summary, _stops(run), sampler.samples, json.loads(ctl_json.read_text()), params,
                       params / desc.num_fragments, plan.steps, gaps)
    return {"size": f"{layers}x{width}", "layers": layers, "width": width, **row}


def run_scale(plan: ScalePlan, out: Path, progress: Callable[[str], None] = print) -> list[dict]:
    """Every size of ``plan``, smallest first; the rows."""
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for layers, width in plan.sizes:
        t0 = time.monotonic()
        progress(f"benchmark scale: {layers}x{width}, {plan.learners} learners, {plan.steps} steps ...")
        rows.append(measure(plan, layers, width, out))
        progress(f"  {rows[-1]['params'] / 1e6:.2f}M params, {time.monotonic() - t0:.0f} s")
    return rows


COLUMNS = (  # (heading, key, format)
    ("params", "params", lambda v: f"{v / 1e6:.2f}M"),
    ("commits", "commits", str),
    ("step on/off", "step_ratio_on_off", "{:.3f}".format),
    ("learner +B/param", "learner_extra_bytes_per_param", "{:.1f}".format),
    ("syncer B/param", "syncer_end_bytes_per_param", "{:.1f}".format),
    ("syncer s/commit", "syncer_cpu_s_per_commit", "{:.3f}".format),
    ("up B/frag-param", "bytes_up_per_delta_per_fragment_param", "{:.3f}".format),
    ("down B/frag-param", "bytes_down_per_version_per_fragment_param", "{:.3f}".format),
    ("vs fp32 ring", "reduction_vs_fp32_ring", "{:.1f}x".format),
    ("sent+spilled", "delivered_and_spilled", str),
    ("publish->applied", "publish_to_applied_p50_s", "{:.2f} s".format),
    ("latency steps", "version_latency_steps_p50", "{:g}".format),
    ("utilisation", "utilisation_mean", "{:.0%}".format),
    ("start gap", "start_gap_over_median", "{:.2f}x".format),
)


def format_table(rows: list[dict]) -> str:
    """One line per figure, one column per size (the figures are many, the sizes few)."""
    head = ["figure"] + [r["size"] for r in rows]
    body = [[name] + [("-" if r.get(key) is None else fmt(r[key])) for r in rows] for name, key, fmt in COLUMNS]
    widths = [max(len(line[i]) for line in [head] + body) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
                     for line in [head] + body)


def _store_of(plan: ScalePlan, run: Path) -> str:
    """The store the run is created in: ``--store`` of ``--run-args``, else the run's own directory."""
    a = plan.run_args
    for i, arg in enumerate(a):
        if arg == "--store" and i + 1 < len(a):
            return a[i + 1]
        if arg.startswith("--store="):
            return arg.split("=", 1)[1]
    return str(run / "store")

