"""End-of-run report: one PNG from the processes' JSONL event logs and the run's summary.

Panels, each on one x axis: (1) the global model's held-out loss over the tokens trained by every
learner together (the evaluations ``ddiloco run`` logs), with reference losses when the summary
knows them (``references``: e.g. data parallel and one learner alone at the same tokens); (2) per
learner, utilisation (the share of its steps whose work entered a version) and version latency in
steps, coloured by region when the run has regions; (3) each fragment's version over wall time.
The title says what ran (mode, M, P, H, K, compression) and the final loss.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

REGION_COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")


def report_title(summary: dict[str, Any]) -> str:
    """``decoupled run ab12: M=4 P=4 H=16 K=1 int4 - final held-out loss 2.174``."""
    s = summary.get("settings") or {}
    parts = [f"{summary.get('mode', 'decoupled')} run {summary.get('run_id', '')}".strip()]
    knobs = " ".join(f"{k}={s[v]}" for k, v in (("M", "learners"), ("P", "fragments"), ("H", "sync_every"),
                                               ("K", "quorum")) if s.get(v) is not None)
    if s.get("compression"):
        knobs += f" {s['compression']}"
    if not knobs and summary.get("learners"):
        knobs = f"M={summary['learners']}"
    title = parts[0] + (f": {knobs.strip()}" if knobs.strip() else "")
    loss = summary.get("final_eval_loss")
    return title + (f" - final held-out loss {loss:.3f}" if loss is not None else "")


def plot_run(events: list[dict], path: str | Path, summary: dict[str, Any] | None = None) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = summary or {}
    evals = [e for e in events if e.get("event") == "eval"]
    commits = [e for e in events if e.get("event") == "commit" and e.get("kind") == "merge"]
    t0 = min((e["t"] for e in events if "t" in e), default=0.0)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))

    ax = axes[0]
    if evals:
        ax.plot([e["tokens"] for e in evals], [e["loss"] for e in evals], "k-o", ms=3, lw=1.6, label="global model")
    for i, (name, loss) in enumerate(sorted((summary.get("references") or {}).items())):
        ax.axhline(loss, ls="--", lw=1, color=f"C{i + 1}", label=f"{name} ({loss:.3f})")
    ax.set_xlabel("tokens trained, all learners")
    ax.set_ylabel("held-out loss (nats/byte)")
    ax.set_title("global model")
    if evals or summary.get("references"):
        ax.legend(fontsize=7)

    ax = axes[1]
    util = summary.get("utilisation") or {}
    lat = summary.get("version_latency_steps_p50") or {}
    placement = summary.get("placement") or {}
    regions = sorted({(v or {}).get("region") for v in placement.values()} - {None})
    names = sorted(set(util) | set(lat))
    colour = {lid: REGION_COLOURS[regions.index(placement[lid]["region"]) % len(REGION_COLOURS)]
              if regions and (placement.get(lid) or {}).get("region") in regions else "tab:blue" for lid in names}
    if names:
        ax.bar(names, [util.get(n) or 0.0 for n in names], color=[colour[n] for n in names])
        for x, n in enumerate(names):
            if lat.get(n) is not None:
                ax.annotate(f"{lat[n]:g} steps", (x, util.get(n) or 0.0), ha="center", va="bottom", fontsize=7)
        ax.set_ylim(0, 1.1)
        if regions:
            from matplotlib.patches import Patch
            ax.legend(handles=[Patch(color=REGION_COLOURS[i % len(REGION_COLOURS)], label=r)
                               for i, r in enumerate(regions)], fontsize=7)
    ax.set_ylabel("utilisation (work that entered a version)")
    ax.set_title("per learner: utilisation, version latency (p50)")

    ax = axes[2]
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

    fig.suptitle(report_title(summary))
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
