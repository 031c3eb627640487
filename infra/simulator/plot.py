"""PNG of goodput (and uptime) against cluster size for every system (matplotlib, Agg backend)."""
from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")  # headless: never needs a display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, PercentFormatter  # noqa: E402

from .sweep import Row  # noqa: E402


def label(row: Row) -> str:
    if row.system == "dp":
        return "data parallel"
    if row.system == "elastic_dp":
        return "elastic data parallel"
    return f"Decoupled DiLoCo M={row.learners}, K={row.quorum}"


def _chips(x: float, _pos: int) -> str:
    return f"{x / 1e6:g}M" if x >= 1e6 else f"{x / 1e3:g}k" if x >= 1e3 else f"{x:g}"


def plot_sweep(rows: Sequence[Row], path: str | os.PathLike, subtitle: str = "") -> Path:
    """Write the figure to ``path`` and return it."""
    series: dict[str, list[Row]] = {}
    for row in rows:
        series.setdefault(label(row), []).append(row)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), constrained_layout=True)
    for ax, metric in zip(axes, ("goodput", "uptime")):
        for name, pts in series.items():
            pts = sorted(pts, key=lambda r: r.chips)
            err = [getattr(r, f"{metric}_ci") or 0.0 for r in pts]
            style = "--" if pts[0].system != "decoupled" else "-"
            ax.errorbar([r.chips for r in pts], [getattr(r, metric) for r in pts], yerr=err,
                        marker="o", linestyle=style, capsize=3, label=name)
        ax.set_xscale("log")
        xs = sorted({r.chips for r in rows})
        ax.set_xticks(xs)
        ax.xaxis.set_major_formatter(FuncFormatter(_chips))
        ax.xaxis.set_minor_formatter(FuncFormatter(lambda *_: ""))
        ax.set_ylim(0, 1.02)
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        ax.set_xlabel("chips")
        ax.set_ylabel(metric)
        ax.grid(True, which="major", alpha=0.3)
        ax.set_title(f"{metric} vs cluster size")
    axes[0].legend(fontsize=8, loc="lower left")
    if subtitle:
        lines = [w for line in subtitle.splitlines() for w in textwrap.wrap(line, 150)]
        fig.suptitle("\n".join(lines), fontsize=8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
