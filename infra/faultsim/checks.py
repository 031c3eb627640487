"""The invariants every simulated run is judged by (issue 25; SPEC §11; docs/faultsim.md).

The same checks as the real-process campaign, on the same kind of evidence: the run's commit log
and every component's event records, gathered into an ``infra.chaos.invariants.Observation``
(the harness's marks say when each fault began and ended). Bookkeeping from
infra/chaos/invariants.py (commits contiguous and versions monotonic, the token ledger: every
delta produced merged exactly once or recorded, replay bit for bit), progress (a)-(e) from
infra/chaos/progress.py, bad input refused, and what only a simulation can see for certain:

- ``sim-no-crash``: no component raised an exception its own loop should have handled;
- ``sim-train-loop-io``: the training loop made no storage request (SPEC §3: a learner step never
  waits on the network, the syncer or storage) - the store counts requests per simulated thread;
- ``sim-drained``: after training, the syncer committed every durable delta within ``drain_s``
  (else the ledger could not judge the end of the run);
- ``sim-no-false-outlier``: no learner's delta was dropped as a ``norm-outlier``. Every simulated
  learner is honest (bad input comes only from the planted objects), so such a drop is the norm
  guard throwing away real work - what the pre-issue-25 guard did to the work of an outage (issue
  25 item 2), which freezes a fragment only sometimes but loses the outage's work every time.
"""
from __future__ import annotations

from infra.chaos import invariants as inv
from infra.chaos import progress
from infra.chaos.invariants import Check, Observation
from storage.layout import parse_spill_key
from storage.log import CommitLog

from .runner import SimResult


def observation(res: SimResult) -> Observation:
    """What the run left behind, as the chaos checks read it."""
    log = CommitLog(res.store)
    records = list(log.read_range(0)) if log.tail() >= 0 else []
    injections = []
    for inj in res.injections:
        learner, inc, seq = parse_spill_key(inj["key"])
        injections.append({"attack": inj["what"], "delta_id": f"{learner}/{inc}/{seq}", "key": inj["key"],
                           "expect": ["rejected"], "t": inj["t"]})
    return Observation(records=records, learner_events=res.events_of("learner"),
                       syncer_events=res.events_of("syncer"), lives=res.lives, marks=res.marks,
                       injections=injections, drained=res.drained)


def sim_checks(res: SimResult, obs: Observation) -> list[Check]:
    """The simulation's own checks (module docstring)."""
    crash = Check("sim-no-crash", not res.crashes, res.crashes[0] if res.crashes else "no component crashed",
                  {"crashes": res.crashes[:10]})
    io = {thread: n for (thread, _op), n in res.store.ops.items() if thread == "train"}
    train_io = sum(io.values())
    loop = Check("sim-train-loop-io", train_io == 0,
                 f"the training loop made {train_io} storage requests" if train_io else
                 "the training loop made no storage request", {"requests": train_io})
    drained = Check("sim-drained", res.drained,
                    "every durable delta committed after training" if res.drained else
                    f"the syncer had not committed every durable delta {res.cfg.drain_s:g} s after training",
                    {"end_s": round(res.end_s, 2)})
    planted = {i["delta_id"] for i in obs.injections}
    false = [(rec.seq, d.delta_id, d.c_tokens) for rec in obs.records for d in rec.dropped
             if d.reason == "norm-outlier" and d.delta_id not in planted]
    outlier = Check("sim-no-false-outlier", not false,
                    f"{len(false)} honest deltas dropped as norm-outlier ({sum(t for *_, t in false)} tokens), "
                    f"first {false[0][1]} at commit {false[0][0]}" if false else
                    "no honest delta was dropped as a norm-outlier", {"dropped": false[:10]})
    return [crash, loop, drained, outlier]


def check_run(res: SimResult) -> list[Check]:
    """Every invariant, in a fixed order: bookkeeping, progress (a)-(e), bad input, the simulation's."""
    obs = observation(res)
    d = res.descriptor
    H, K, P = d.schedule.sync_every, d.policy.quorum, d.num_fragments
    checks = [inv.commit_sequence(obs.records, P), inv.token_ledger(obs, res.store),
              inv.replay_bitexact(res.store, d)]
    checks += progress.progress_checks(obs, H, K, P)
    if obs.injections:
        checks.append(inv.bad_inputs_rejected(obs, progress.short_of_quorum(obs, K)))
    return checks + sim_checks(res, obs)


def failures(checks: list[Check]) -> list[str]:
    return [f"{c.name}: {c.detail}" for c in checks if not c.ok]
