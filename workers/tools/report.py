"""End-of-run report: plots (PNG) from the processes' JSONL event logs.

Panels: loss vs tokens per learner with the global model's held-out eval loss; fragment versions
over time; bytes sent per learner step.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path


def plot_run(events: list[dict], path: str | Path, title: str = "decoupled-diloco run") -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = defaultdict(list)
    evals = []
    commits = []
    for e in events:
        if e.get("event") == "step" and e.get("role") in ("learner", "dp"):
            steps[e["id"]].append(e)
        elif e.get("event") == "eval":
            evals.append(e)
        elif e.get("event") == "commit" and e.get("kind") == "merge":
            commits.append(e)
    t0 = min((e["t"] for e in events if "t" in e), default=0.0)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    ax = axes[0]
    for lid, rows in sorted(steps.items()):
        ax.plot([r["tokens"] for r in rows], [r["loss"] for r in rows], lw=0.8, alpha=0.7, label=f"{lid} train")
    if evals:
        ax.plot([e["tokens"] for e in evals], [e["loss"] for e in evals], "k-o", ms=3, lw=1.6, label="global eval")
    ax.set_xlabel("tokens (per learner for train, total for eval)")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title("loss vs tokens")
    ax.legend(fontsize=7)
    ax = axes[1]
    by_frag = defaultdict(list)
    for c in commits:
        by_frag[c["fragment"]].append((c["t"] - t0, c["version"]))
    for p, rows in sorted(by_frag.items()):
        ax.step([r[0] for r in rows], [r[1] for r in rows], where="post", label=f"fragment {p}")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("version")
    ax.set_title("fragment versions over time")
    if by_frag:
        ax.legend(fontsize=7)
    ax = axes[2]
    for lid, rows in sorted(steps.items()):
        pts = [(b["step"], (b.get("bytes_sent", 0) - a.get("bytes_sent", 0)) / max(b["step"] - a["step"], 1))
               for a, b in zip(rows, rows[1:]) if "bytes_sent" in b]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] / 1024 for p in pts], lw=0.8, label=lid)
    ax.set_xlabel("learner step")
    ax.set_ylabel("KiB sent per step")
    ax.set_title("bytes per step")
    if steps:
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
