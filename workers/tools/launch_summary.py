"""The summary of a ``ddiloco launch`` (workers/launcher.py): ``ddiloco run``'s figures
(workers/tools/run_figures.py) plus what is particular to the user's own script - how often each
learner was restarted and where each life resumed (storage/learner_state.py)."""
from __future__ import annotations

from pathlib import Path

from workers.tools.run_figures import accounting_figures, log_figures, rounds_figures, run_summary


def launch_summary(store, store_uri: str, desc, events: list[dict], wall: float, drained: bool, interrupted: bool,
                   lc, restarts: dict[str, int]) -> dict:
    evals = [e for e in events if e.get("event") == "eval" and e.get("loss") is not None]
    first, last = (evals[0], evals[-1]) if evals else (None, None)
    summary = run_summary(store_uri, desc, events, first["loss"] if first else None,
                          (last["loss"], last.get("versions", {})) if last else None, wall, drained, lc.learners,
                          lc.insecure, interrupted, evaluated=lc.eval or bool(lc.eval_command))
    summary["mode"] = "launch"
    summary["settings"] = {"learners": lc.learners, "nproc_per_learner": lc.nproc_per_learner,
                           "fragments": desc.num_fragments, "sync_every": desc.schedule.sync_every,
                           "quorum": desc.policy.quorum, "compression": desc.codec.scheme}
    summary["restarts"] = dict(sorted(restarts.items()))
    summary["resumed"] = {e["id"]: {"step": e.get("step"), "tokens": e.get("tokens"),
                                    "from_incarnation": e.get("from_incarnation")}
                          for e in events if e.get("event") == "learner-resumed"}
    created = next((e for e in events if e.get("event") == "run-created"), None)
    summary["initial_model_from"] = created.get("initial_model_from") if created else None
    summary["replay_uri"] = store_uri if "://" in store_uri else str(Path(store_uri).resolve())
    summary.update(rounds_figures(store, desc, events))
    summary.update(log_figures(store, desc))
    summary["accounting"] = accounting_figures(events, desc, None)
    return summary
