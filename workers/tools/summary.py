"""The console summary of a ``ddiloco run``, in plain words: the outcome first (OK, interrupted or
failed, with the reasons), then what reached the model, quality, latency and where the outputs are.

Numbers are shown for reading, not for parsing (summary.json has them exactly): counts with
thousands separators, losses to 3 decimals, shares as percentages, per-learner maps as one line.
The cost estimate is shown only for runs on S3, labelled as an estimate at the run's own rate (a run
on a local directory costs nothing; summary.json keeps the figures either way).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .accounting import report_lines

OUTCOMES = {"ok": "OK", "interrupted": "INTERRUPTED", "failed": "FAILED"}


def outcome(summary: dict[str, Any]) -> str:
    """``ok``, ``interrupted`` or ``failed`` (summary.json's ``status``; old summaries: from ``ok``)."""
    return summary.get("status") or ("ok" if summary.get("ok") else "failed")


def _count(v: Any) -> str:
    if isinstance(v, float) and v.is_integer():     # token totals come back from JSON sums as floats
        v = int(v)
    return f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v)


def _share(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.0f}%"


def _per_learner(m: dict[str, Any] | None, fmt) -> str:
    if not m:
        return "n/a"
    return ", ".join(f"{k} {fmt(v) if v is not None else 'n/a'}" for k, v in sorted(m.items()))


def _seconds(v: float | None) -> str:
    return "n/a" if v is None else (f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s")


def summary_lines(summary: dict[str, Any], out: Path, plot: str) -> list[str]:
    """The lines ``ddiloco run`` prints at its end."""
    state = outcome(summary)
    head = f"run {OUTCOMES[state]}"
    if state != "ok" and summary.get("problems"):
        head += ": " + "; ".join(summary["problems"])
    lines = ["", head]
    rows: list[tuple[str, str]] = [("mode", str(summary.get("mode")))]
    if summary.get("run_uri"):
        rows.append(("run", str(summary["run_uri"])))
    if summary.get("final_eval_loss") is not None:
        init = summary.get("initial_eval_loss")
        rows.append(("held-out loss", (f"{init:.3f} -> " if init is not None else "")
                     + f"{summary['final_eval_loss']:.3f}"))
    if "tokens_merged" in summary and summary.get("tokens_merged") is not None:
        trained = summary.get("tokens_trained") or 0
        merged = summary["tokens_merged"]
        share = f" ({_share(merged / trained)} of {_count(trained)} trained)" if trained else ""
        rows.append(("tokens merged", _count(merged) + share))
    elif "tokens_trained" in summary:
        rows.append(("tokens trained", _count(summary["tokens_trained"])))
    if "deltas_merged" in summary:
        rows.append(("deltas", f"{_count(summary['deltas_merged'])} merged, {_count(summary.get('deltas_lost', 0))} "
                               f"lost, {_count(summary.get('deltas_harmless', 0))} harmless drops, "
                               f"{_count(summary.get('deltas_spilled', 0))} spilled to storage"))
    if summary.get("mean_round_size") is not None:
        rows.append(("learners per merge", f"{summary['mean_round_size']:.1f}"))
    if summary.get("utilisation"):
        rows.append(("utilisation", _per_learner(summary["utilisation"], _share)))
    if summary.get("version_latency_steps_p50"):
        rows.append(("version latency", _per_learner(summary["version_latency_steps_p50"], lambda v: f"{v:g}")
                     + " steps (p50, answer -> applied)"))
    if summary.get("publish_to_applied_p50_s") is not None:
        rows.append(("publish -> applied", f"{_seconds(summary['publish_to_applied_p50_s'])} (p50)"))
    if summary.get("wall_s") is not None:
        rows.append(("wall time", f"{summary['wall_s']:.1f} s"))
    lines += [f"  {k:<20} {v}" for k, v in rows]
    acct = summary.get("accounting")
    if acct and "error" not in acct:
        lines += report_lines(acct, cost=str(summary.get("run_uri")).startswith("s3://"))
    lines += [f"  {'report':<20} {plot}", f"  {'summary':<20} {out / 'summary.json'}"]
    if summary.get("run_uri"):       # a decoupled run: verify it later from its output directory
        lines.append(f"  {'replay':<20} ddiloco replay {out}" + (" --regions" if summary.get("region_stores") else ""))
    return lines
