"""The chaos report: ``report.json`` and ``timeline.png`` (docs/chaos.md "Reading the report").

The timeline has one row per process and per shared resource, over wall time from the run's
creation: a learner is *training* (green) from its ``learner-start`` to its last produced delta,
*starting* (grey) between spawn and ``learner-start`` (imports, loading the model from storage),
*stalled* (orange) while SIGSTOPped, *down* (red) between a SIGKILL and its next start; a syncer
is *up* (blue) or *down*; the S3 row is red while the server is stopped; the bus row is black while
blackholed; purple ticks are rogue injections. Below: merge commits over time (cumulative) and drop
commits (crosses), on the same axis, so a gap in the commit stream lines up with its cause.
"""
from __future__ import annotations

import json
from pathlib import Path

from .invariants import Observation, _lives_of

COLORS = {"training": "#3a9d23", "starting": "#bbbbbb", "stalled": "#f0a020", "down": "#d43d3d",
          "up": "#2f6db5", "blackhole": "#111111", "rogue": "#8e44ad"}


def write_report(report: dict, obs: Observation, out: Path) -> tuple[Path, Path | None]:
    js = out / "report.json"
    png = out / "timeline.png"
    try:
        plot_timeline(report, obs, png)
        report["timeline_png"] = str(png)
    except Exception as exc:       # a plotting failure must not hide the verdict
        report["timeline_png"] = f"(plot failed: {exc})"
        png = None
    js.write_text(json.dumps(report, indent=2, default=str))
    return js, png


def _spans(marks: list[dict], who: str, start: str, end: tuple[str, ...], horizon: float) -> list[tuple[float, float]]:
    out, at = [], None
    for m in marks:
        if m["who"] != who:
            continue
        if m["what"] == start and at is None:
            at = m["t"]
        elif m["what"] in end and at is not None:
            out.append((at, m["t"]))
            at = None
    if at is not None:
        out.append((at, horizon))
    return out


def rows(obs: Observation) -> dict[str, list[tuple[float, float, str]]]:
    """(start, end, state) spans per row, in wall-clock seconds."""
    marks = obs.marks
    horizon = max([m["t"] for m in marks] + [r.info.get("committed_at") or 0 for r in obs.records])
    out: dict[str, list[tuple[float, float, str]]] = {}
    for lid, events in sorted(obs.learner_events.items()):
        spans = []
        for life in _lives_of(events):
            started = next(e["t"] for e in life if e.get("event") == "learner-start")
            deltas = [e["t"] for e in life if e.get("event") in ("delta", "step")]
            proc = obs.process_of(lid, life)
            if proc:
                spans.append((proc["started"], started, "starting"))
            spans.append((started, deltas[-1] if deltas else started, "training"))
        for a, b in _spans(marks, lid, "kill", ("start",), horizon):
            spans.append((a, b, "down"))
        for a, b in _spans(marks, lid, "pause", ("resume", "kill", "terminate"), horizon):
            spans.append((a, b, "stalled"))
        out[lid] = spans
    for name in sorted(obs.syncer_events):
        spans = [(life["started"], life["ended"] or horizon, "up") for life in obs.lives.get(name, [])]
        ends = [life["ended"] for life in obs.lives.get(name, []) if life["ended"]]
        starts = [life["started"] for life in obs.lives.get(name, [])][1:]
        spans += [(e, s, "down") for e, s in zip(ends, starts) if s > e]
        out[name] = spans
    s3 = [(a, b, "down") for a, b in _spans(marks, "s3", "down", ("up",), horizon)]
    if s3:
        out["s3"] = s3
    bus = [(a, b, "blackhole") for a, b in _spans(marks, "bus", "blackhole", ("restore",), horizon)]
    if bus:
        out["bus"] = bus
    return out


def plot_timeline(report: dict, obs: Observation, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t0 = min(m["t"] for m in obs.marks)
    table = rows(obs)
    names = list(table)
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(12, 1.2 + 0.45 * len(names) + 2.6), sharex=True,
                                 gridspec_kw={"height_ratios": [max(1, len(names)), 3]})
    for y, name in enumerate(names):
        for a, b, state in table[name]:
            ax.barh(y, max(b - a, 0.02), left=a - t0, height=0.6, color=COLORS[state], linewidth=0)
    for inj in obs.injections:
        ax.axvline(inj["t"] - t0, color=COLORS["rogue"], lw=0.6, alpha=0.6)
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    verdict = "all invariants hold" if report.get("ok") else "INVARIANT VIOLATED: " + ", ".join(
        c["name"] for c in report.get("checks", []) if not c["ok"])
    ax.set_title(f"chaos {report.get('scenario')} (seed {report.get('seed')}): {verdict}", fontsize=10)
    ax.legend(handles=[Patch(color=c, label=s) for s, c in COLORS.items()], fontsize=7, ncol=7,
              loc="upper center", bbox_to_anchor=(0.5, -0.02), frameon=False)
    merges = sorted((r.info.get("committed_at") or 0) - t0 for r in obs.merges() if r.info.get("committed_at"))
    drops = sorted((r.info.get("committed_at") or 0) - t0 for r in obs.records
                   if r.kind == "drop" and r.info.get("committed_at"))
    bx.step(merges, range(1, len(merges) + 1), where="post", color=COLORS["up"], label="merge commits")
    if drops:
        import bisect
        bx.plot(drops, [bisect.bisect_right(merges, t) for t in drops], "x", color=COLORS["down"], label="drop commits")
    bx.set_xlabel("seconds since the run was created")
    bx.set_ylabel("commits")
    bx.legend(fontsize=8, loc="upper left")
    bx.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
