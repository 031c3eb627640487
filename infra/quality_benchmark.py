"""`ddiloco benchmark quality`: the quality table of issue 30 ("Quality to the published bar").

    ddiloco benchmark quality --learners 2,4,8 --seeds 0,1,2 --steps 1200 --json q.json

For each M in ``--learners``, at equal tokens and the same H, it runs (each a ``ddiloco run``, so
exactly what a user gets):

- **decoupled**: ``ddiloco run --learners M`` (real processes: syncer and M learners, K and the
  grace window as configured);
- **diloco**: lock-step DiLoCo with the same H (``--mode diloco``, in-process; its deltas go through
  the run's codec as a learner's do, workers/job/lockstep.py, so both rows carry the same int4 error);
- **dp**: data parallelism over M replicas of the per-learner batch (``--mode dp``), its inner lr the
  best of ``--dp-lrs`` by mean final loss over the seeds (a fair DP is tuned at its own batch size,
  as the DiLoCo side is; without ``--dp-lrs`` the job's lr is used and the table says so);

plus one learner alone (``--mode dp --learners 1``) once. It prints, per M, mean ± sample std over
the seeds of the final held-out loss and the gaps of decoupled to DP and to lock-step in percent of
theirs (the gap of the means), writes ``OUT/quality.png`` and, with ``--json``, every number.
``--run-args`` passes more ``ddiloco run`` flags to every run (a model size, the outer optimizer...).
"""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from infra.benchmark import spread

SIDES = ("decoupled", "diloco", "dp")
MODES = {"decoupled": [], "diloco": ["--mode", "diloco"], "dp": ["--mode", "dp"]}


@dataclass(frozen=True)
class QualityPlan:
    """What ``ddiloco benchmark quality`` runs; validated before any run starts."""
    learners: tuple[int, ...] = (2, 4, 8)
    seeds: tuple[int, ...] = (0, 1, 2)
    steps: int = 300
    dp_lrs: tuple[float, ...] = ()          # empty: DP at the job's lr (not tuned)
    run_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.learners or any(not isinstance(m, int) or m < 1 for m in self.learners) or \
                len(set(self.learners)) != len(self.learners):
            raise ValueError(f"--learners must list distinct counts >= 1, e.g. 2,4,8, got {self.learners}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"--seeds needs at least one seed and no repeats, got {self.seeds}")
        if self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if any(not lr > 0 for lr in self.dp_lrs) or len(set(self.dp_lrs)) != len(self.dp_lrs):
            raise ValueError(f"--dp-lrs must be distinct learning rates > 0, got {self.dp_lrs}")
        for flag in ("--learners", "--mode", "--seed", "--steps", "--out", "--lr"):
            if any(a == flag or a.startswith(flag + "=") for a in self.run_args):
                raise ValueError(f"--run-args may not set {flag}: the benchmark sets it for each run")

    def runs(self) -> list[tuple[str, int, int, float | None]]:
        """(side, M, seed, DP lr or None) of every run, in order; the lone learner is side "alone"."""
        out = []
        for m in self.learners:
            for seed in self.seeds:
                out += [("decoupled", m, seed, None), ("diloco", m, seed, None)]
                out += [("dp", m, seed, lr) for lr in (self.dp_lrs or (None,))]
        return out + [("alone", 1, seed, None) for seed in self.seeds]


def run_args(plan: QualityPlan, side: str, m: int, seed: int, lr: float | None, out: Path) -> list[str]:
    """The ``ddiloco run`` arguments of one run of the plan."""
    mode = MODES["dp"] if side == "alone" else MODES[side]
    return ["run", "--plain", "--out", str(out), "--learners", str(m), "--steps", str(plan.steps), "--seed", str(seed),
            *mode, *(["--lr", repr(lr)] if lr is not None else []), *plan.run_args]


def ddiloco_run(args: list[str], out: Path) -> float:
    """Run ``ddiloco ARGS`` and return its summary's final eval loss (SystemExit naming the run if it failed)."""
    done = subprocess.run([sys.executable, "-m", "workers.cli", *args], capture_output=True, text=True)
    summary = out / "summary.json"
    if done.returncode != 0 or not summary.exists():
        raise SystemExit(f"benchmark quality: `ddiloco {shlex.join(args)}` failed ({done.returncode}):\n"
                         f"{done.stdout[-1500:]}\n{done.stderr[-1500:]}")
    return float(json.loads(summary.read_text())["final_eval_loss"])


def _spread(xs: list[float]) -> dict:
    return {**spread(xs), "values": list(xs)}     # infra/benchmark.py's mean ± sample std, and the values


def _gap_pct(a: dict, b: dict) -> float:
    return 100.0 * (a["mean"] - b["mean"]) / b["mean"]


@dataclass
class QualityTable:
    """Final eval losses by side and M (``dp``: at its chosen lr), the gaps in %, the lone learner."""
    plan: QualityPlan
    rows: dict[int, dict] = field(default_factory=dict)
    alone: dict | None = None

    @classmethod
    def from_losses(cls, plan: QualityPlan, losses: dict[tuple[str, int, int, float | None], float]) -> "QualityTable":
        table = cls(plan)
        for m in plan.learners:
            row: dict = {}
            for side in ("decoupled", "diloco"):
                row[side] = _spread([losses[(side, m, s, None)] for s in plan.seeds])
            by_lr = {lr: _spread([losses[("dp", m, s, lr)] for s in plan.seeds]) for lr in (plan.dp_lrs or (None,))}
            best = min(by_lr, key=lambda lr: by_lr[lr]["mean"])
            row["dp"], row["dp_lr"] = by_lr[best], best
            if plan.dp_lrs:
                row["dp_by_lr"] = {repr(lr): s for lr, s in by_lr.items()}
            row["gap_to_dp_pct"] = _gap_pct(row["decoupled"], row["dp"])
            row["gap_to_diloco_pct"] = _gap_pct(row["decoupled"], row["diloco"])
            table.rows[m] = row
        table.alone = _spread([losses[("alone", 1, s, None)] for s in plan.seeds])
        return table

    def to_dict(self) -> dict:
        return {"plan": asdict(self.plan), "rows": {str(m): r for m, r in self.rows.items()}, "alone": self.alone}

    def format(self) -> str:
        f = lambda s: f"{s['mean']:.4f} ± {s['std']:.4f}" if s["std"] is not None else f"{s['mean']:.4f}"  # noqa: E731
        lr_note = "DP lr: the best of " + ", ".join(map(repr, self.plan.dp_lrs)) if self.plan.dp_lrs else \
            "DP lr: the job's (not tuned: give --dp-lrs for a fair DP)"
        lines = [f"final held-out loss, {self.plan.steps} steps per learner, seeds {list(self.plan.seeds)}; {lr_note}; "
                 "lock-step DiLoCo through the run's codec",
                 f"{'M':>3}  {'decoupled':>17}  {'lock-step DiLoCo':>17}  {'DP':>17}  {'DP lr':>8}  "
                 f"{'vs DP':>7}  {'vs DiLoCo':>9}"]
        for m, r in self.rows.items():
            lr = repr(r["dp_lr"]) if r["dp_lr"] is not None else "job's"
            lines.append(f"{m:>3}  {f(r['decoupled']):>17}  {f(r['diloco']):>17}  {f(r['dp']):>17}  {lr:>8}  "
                         f"{r['gap_to_dp_pct']:>+6.2f}%  {r['gap_to_diloco_pct']:>+8.2f}%")
        lines.append(f"one learner alone (DP, M = 1): {f(self.alone)}")
        return "\n".join(lines)

    def plot(self, path: Path) -> Path:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        ms = list(self.rows)
        fig, ax = plt.subplots(figsize=(6, 4))
        for i, side in enumerate(SIDES):
            means = [self.rows[m][side]["mean"] for m in ms]
            stds = [self.rows[m][side]["std"] or 0.0 for m in ms]
            ax.errorbar(ms, means, yerr=stds, marker="o", capsize=3, color=f"C{i}",
                        label={"decoupled": "decoupled", "diloco": "lock-step DiLoCo", "dp": "DP"}[side])
        ax.axhline(self.alone["mean"], ls="--", color="grey", label="one learner alone")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ms, [str(m) for m in ms])
        ax.set_xlabel("learners M (equal tokens)")
        ax.set_ylabel("final held-out loss")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path


def run_quality(plan: QualityPlan, out: Path, run: Callable[[list[str], Path], float] = ddiloco_run,
                progress: Callable[[str], None] = print) -> QualityTable:
    """Every run of ``plan`` under ``out`` (one directory each), then the table and its plot."""
    out.mkdir(parents=True, exist_ok=True)
    losses = {}
    todo = plan.runs()
    t0 = time.monotonic()
    for i, (side, m, seed, lr) in enumerate(todo, 1):
        where = out / f"{side}-m{m}-seed{seed}" if lr is None else out / f"{side}-m{m}-seed{seed}-lr{lr:g}"
        losses[(side, m, seed, lr)] = run(run_args(plan, side, m, seed, lr, where), where)
        progress(f"[{i}/{len(todo)}] {side} M={m} seed {seed}{'' if lr is None else f' lr {lr:g}'}: "
                 f"{losses[(side, m, seed, lr)]:.4f}  ({time.monotonic() - t0:.0f} s)")
    table = QualityTable.from_losses(plan, losses)
    table.plot(out / "quality.png")
    return table
