"""The figures of a finished run, shared by ``ddiloco run`` (workers/run.py) and ``ddiloco launch``
(workers/launcher.py): the summary dict, utilisation and latency in steps, the log's token figures,
the traffic accounting, and the outputs (summary.json, report.png, the summary lines)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from storage.shards import run_records
from storage.store import ObjectStore
from workers.tools.accounting import traffic_report
from workers.tools.cost import parse_prices
from workers.tools.logview import stored_base, token_figures
from workers.tools.report import plot_run
from workers.tools.summary import summary_lines
from workers.tools.utilisation import latency_steps, p50, utilisation


def run_summary(store_uri, desc, events, init_loss, final, wall, drained, learners_wanted: int, insecure: bool,
                interrupted: bool, evaluated: bool = True) -> dict:
    """The summary of a decoupled run from its events and log (``evaluated`` False: no held-out
    loss is expected: a launch of the user's own script without an evaluator)."""
    commits = [e for e in events if e.get("event") == "commit"]
    done = {e["id"]: e for e in events if e.get("event") == "learner-stop"}
    versions = {}
    for c in commits:
        if c.get("kind") == "merge":
            versions[str(c["fragment"])] = c["version"]
    merged = sum(len(c.get("inputs", [])) for c in commits)
    dropped = sum(len(c.get("dropped", [])) for c in commits)
    learners = {lid: {k: d.get(k) for k in ("step", "tokens", "deltas", "acked", "spilled", "superseded",
                                            "evicted", "bytes_sent", "bytes_spilled", "bytes_received",
                                            "versions_applied", "median_step_s", "max_gap_s", "drained",
                                            "spill_errors", "last_error", "nonfinite_steps", "receiver_failed")}
                for lid, d in sorted(done.items())}
    latencies = [e["latency_s"] for e in events if e.get("event") == "version-applied" and e.get("latency_s") is not None]
    final_loss = final[0] if final else None
    stop = next((e for e in reversed(events) if e.get("event") == "syncer-stop"), {})
    problems = [p for p, bad in (("interrupted (Ctrl-C or SIGTERM)", interrupted),
                                 ("the global model could not be evaluated", evaluated and final is None),
                                 ("the syncer did not commit everything before stopping", not drained),
                                 (f"{learners_wanted - len(done)} of {learners_wanted} learner(s) did not finish",
                                  len(done) != learners_wanted)) if bad]
    return {
        "ok": not problems, "status": "interrupted" if interrupted else "ok" if not problems else "failed",
        "problems": problems,
        "mode": "decoupled", "run_uri": store_uri, "run_id": desc.run_id, "learners": learners_wanted,
        # where `ddiloco replay OUT` reads the run: a local store by its absolute path (the
        # summary may be read from another directory); a --wan run's topology replaces it with its copy
        "replay_uri": store_uri if "://" in store_uri else str(Path(store_uri).resolve()),
        "commits": len(commits), "merge_commits": sum(c.get("kind") == "merge" for c in commits),
        "versions_per_fragment": versions, "tokens_trained": sum((d.get("tokens") or 0) for d in done.values()),
        "initial_eval_loss": init_loss, "final_eval_loss": final_loss,
        "deltas_merged": merged, "deltas_dropped": dropped,
        "deltas_spilled": sum((d.get("spilled") or 0) for d in done.values()),
        "bytes_sent_per_learner": {lid: (d.get("bytes_sent") or 0) + (d.get("bytes_spilled") or 0)
                                   for lid, d in learners.items()},     # deltas up
        "bytes_received_per_learner": {lid: d.get("bytes_received") or 0 for lid, d in learners.items()},  # versions down
        # issue 11 item 16: named for what they measure (the commit record's time to a learner
        # applying it), next to the figure a user means by "latency" (a delta's publication to the
        # first version that merged it being applied by another learner)
        "commit_to_applied_p50_s": pct(latencies, 50), "commit_to_applied_p99_s": pct(latencies, 99),
        **publish_to_applied(events),
        "drained": drained, "wall_s": round(wall, 2), "per_learner": learners,
        "security": "off" if insecure else "signed",
        "rejections": stop.get("rejections", {}), "drops_by_reason": stop.get("drops", {}),
    }


def pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def publish_to_applied(events: list[dict]) -> dict:
    """Seconds from each merged delta's publication (its learner's ``delta`` event) to the first
    application of a version that merged it by another learner (by its own learner in a
    one-learner run): what the τ-step overlap has to hide (SPEC §2-3)."""
    published = {e["delta"]: e["t"] for e in events if e.get("event") == "delta" and "delta" in e}
    applied: dict[int, list[tuple[str, int, float]]] = {}
    for e in events:
        if e.get("event") == "version-applied":
            applied.setdefault(e.get("fragment"), []).append((e.get("id"), e.get("version", -1), e["t"]))
    alone = len({lid for rows in applied.values() for lid, _, _ in rows}) <= 1
    lat = []
    for c in events:
        if c.get("event") != "commit" or c.get("kind") != "merge":
            continue
        for did in c.get("inputs", []):
            if did not in published:
                continue
            producer = did.rsplit("/", 2)[0]
            times = [t for lid, v, t in applied.get(c.get("fragment"), ()) if v >= c.get("version", 0)
                     and (alone or lid != producer)]
            if times:
                lat.append(min(times) - published[did])
    return {"publish_to_applied_p50_s": pct(lat, 50), "publish_to_applied_p99_s": pct(lat, 99)}


def log_figures(store: ObjectStore, desc) -> dict:
    """Tokens that entered the model (each counted once) and drops split into harmless ones and lost
    work, from the commit log - the numbers ``ddiloco log`` prints (workers/tools/logview.py)."""
    try:
        return token_figures(run_records(store, desc), desc.num_fragments, stored_base(store, desc))
    except Exception as exc:   # figures never fail a run
        return {"tokens_merged": None, "figures_error": str(exc)}


def accounting_figures(events: list[dict], desc, prices: str | None) -> dict | None:
    """Requests and bytes per region, link, learner and outer step, the monthly cost estimate and
    the data-parallel comparison (workers/tools/accounting.py); figures never fail a run."""
    try:
        return traffic_report(events, params=sum(t.numel for t in desc.layout.tensors),
                              sync_every=desc.schedule.sync_every, prices=parse_prices(prices))
    except Exception as exc:   # noqa: BLE001 - see the docstring
        return {"error": f"{exc.__class__.__name__}: {exc}"}


def rounds_figures(store: ObjectStore, desc, events: list[dict]) -> dict:
    """Utilisation (share of each learner's steps whose work entered a version) and version latency
    in steps (answer -> applied), from the commit log and the event logs (workers/tools/utilisation.py)."""
    try:
        records = run_records(store, desc)    # every shard's log in a sharded run
    except Exception as exc:   # figures never fail a run
        return {"utilisation": None, "figures_error": str(exc)}
    by_learner: dict[str, list[dict]] = {}
    for e in events:
        if e.get("role") == "learner":
            by_learner.setdefault(e["id"], []).append(e)
    steps = {m: max((e.get("step", 0) for e in ev if e.get("event") == "learner-stop"), default=0)
             for m, ev in by_learner.items()}
    lat = latency_steps(records, by_learner)
    merges = [r for r in records if r.kind == "merge" and r.round >= 0]
    inputs = [i for r in merges for i in r.inputs]
    late = sum(1 for r in merges for i in r.inputs if i.round < r.round)
    return {"utilisation": utilisation(records, desc.num_fragments, steps),
            "late_answer_share": round(late / len(inputs), 4) if inputs else None,
            "version_latency_steps_p50": {m: p50(v) for m, v in sorted(lat.items())},
            "mean_round_size": round(sum(len(r.inputs) for r in merges) / len(merges), 3) if merges else None}


def write_outputs(out: Path, summary: dict, events: list[dict], args) -> None:
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    if args.summary:
        Path(args.summary).parent.mkdir(parents=True, exist_ok=True)
        Path(args.summary).write_text(json.dumps(summary, indent=2))
    try:
        plot = plot_run(events, out / "report.png", summary)
        summary_plot = str(plot)
    except Exception as exc:  # a plotting failure must not hide the run's result
        summary_plot = f"(plot failed: {exc})"
    print("\n".join(summary_lines(summary, out, summary_plot)))
