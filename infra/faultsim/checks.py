"""The invariants every simulated run is judged by (SPEC §11; docs/faultsim.md).

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
  25 item 2), which freezes a fragment only sometimes but loses the outage's work every time;
- ``sim-spill-on-time``: an answer nobody acks is made durable by its learner within the ack
  timeout (+ ``SPILL_SLACK_S``) of the first unacked send of its lineage, wherever the store is up
  and the learner runs unhindered (SPEC §3: spill when the fast path is down or slow). Issue 25:
  each newer answer restarted the wait, so under a blackhole nothing spilled until the syncer was
  given up for dead (3 ack timeouts after the last ack).
"""
from __future__ import annotations

from infra.chaos import invariants as inv
from infra.chaos import progress
from infra.chaos.invariants import Check, Observation
from storage.layout import parse_spill_key
from storage.log import CommitLog

from .runner import STORE, SimResult

# Beyond the ack timeout: the sender's next turn and the spill's PUT on simulated time.
SPILL_SLACK_S = 1.0
# Events that settle a held delta (it is durable, refused or given up); a superseded one passes its
# lineage's wait on to the newer answer.
_SETTLED = ("delta-acked", "delta-spilled", "delta-rejected", "delta-evicted", "delta-dropped")
_HINDERED = {"pause": "resume", "slow": "restore", "skew": "restore", "down": "up"}


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
    return [crash, loop, drained, outlier, spill_on_time(res, obs)]


def _hindered(obs: Observation, who: str) -> list[tuple[float, float]]:
    """When ``who`` (a learner, or the store) was paused, slowed, skewed or down (marks)."""
    out, since = [], {}
    for m in obs.marks:
        if m["who"] != who:
            continue
        if m["what"] in _HINDERED:
            since.setdefault(_HINDERED[m["what"]], m["t"])
        elif m["what"] in since:
            out.append((since.pop(m["what"]), m["t"]))
    return out + [(t, float("inf")) for t in since.values()]


def spill_on_time(res: SimResult, obs: Observation) -> Check:
    """``sim-spill-on-time`` (module docstring): per learner life and lineage (fragment, base), from
    the first answer of the lineage not yet settled to the event that settles one of them."""
    bound = res.cfg.ack_timeout_s + SPILL_SLACK_S
    store = _hindered(obs, STORE)
    late, worst = [], 0.0
    for lid, events in sorted(obs.learner_events.items()):
        hindered = store + _hindered(obs, lid)
        lineage_of: dict[str, tuple] = {}
        since: dict[tuple, float] = {}
        for e in events:
            ev = e.get("event")
            if ev == "learner-start":
                lineage_of, since = {}, {}          # a new life: what the old one held is the ledger's
            elif ev == "delta":
                lineage_of[e["delta"]] = (e["fragment"], e["base"])
                since.setdefault((e["fragment"], e["base"]), e["t"])
            elif ev in _SETTLED and e.get("delta") in lineage_of:
                t0 = since.pop(lineage_of[e["delta"]], None)
                if t0 is None or any(a < e["t"] and b > t0 for a, b in hindered):
                    continue
                wait = e["t"] - t0
                worst = max(worst, wait)
                if wait > bound:
                    late.append((lid, e["delta"], round(t0, 2), round(wait, 2)))
    return Check("sim-spill-on-time", not late,
                 f"{len(late)} lineages waited longer than {bound:g} s to be made durable, first "
                 f"{late[0][1]} ({late[0][3]:g} s from t={late[0][2]:g})" if late else
                 f"every unacked answer was made durable within {bound:g} s (longest wait {worst:.2f} s)",
                 {"late": late[:10], "max_wait_s": round(worst, 3), "bound_s": bound})


def check_run(res: SimResult) -> list[Check]:
    """Every invariant, in a fixed order: bookkeeping, progress (a)-(e), bad input, the simulation's."""
    obs = observation(res)
    d = res.descriptor
    H, K, P = d.schedule.sync_every, d.policy.quorum, d.num_fragments
    checks = [inv.commit_sequence(obs.records, P), inv.token_ledger(obs, res.store),
              inv.replay_bitexact(res.store, d)]
    checks += progress.progress_checks(obs, H, K, P, d.policy.overlap)
    if obs.injections:
        checks.append(inv.bad_inputs_rejected(obs, progress.short_of_quorum(obs, K)))
    return checks + sim_checks(res, obs)


def failures(checks: list[Check]) -> list[str]:
    return [f"{c.name}: {c.detail}" for c in checks if not c.ok]
