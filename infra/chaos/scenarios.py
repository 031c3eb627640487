"""The chaos scenarios: name, description, the run, the fault schedule and the bounds (docs/chaos.md).

A schedule is a tuple of ``Fault``: an action at ``at_s`` seconds after training started (the first
merge commit), lasting ``duration_s`` where that means something (a killed process is restarted
after it, a paused one resumed, the S3 server and the bus restored). ``Bounds`` state what the
invariants allow: the longest gap between merge commits while at least ``quorum_alive`` learners
train, and how long a learner's step may take compared with its median before the loop counts as
blocked. ``checks`` name extra, scenario-specific invariants (``runner.EXTRA_CHECKS``).

The ``event-log`` scenario's schedule comes from a failure event log (the simulator's format,
infra/simulator/eventlog.py): one is drawn from ``--seed`` (Poisson failures per learner, fixed
repair time), written and read back, or ``--events PATH`` replays one the simulator wrote.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from pipeline.descriptor import VersionsConfig
from workers.launch import Schedule
from .harness import RunSpec

ACTIONS = ("kill-learner", "restart-learner", "pause-learner", "kill-syncer", "second-syncer", "s3-down",
           "blackhole", "rogue", "partition-region", "kill-agent")


@dataclass(frozen=True)
class Fault:
    at_s: float
    action: str
    target: str = ""           # learner id, or the rogue's attacks (comma-separated)
    duration_s: float = 0.0    # restart / resume / restore after this long (0: never, for kills)

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"fault action must be one of {ACTIONS}, got {self.action!r}")
        if not self.at_s >= 0 or not self.duration_s >= 0:
            raise ValueError(f"fault times must be >= 0, got at_s={self.at_s}, duration_s={self.duration_s}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Bounds:
    quorum_alive: int = 1          # K: the gap bound applies while at least this many learners train
    max_commit_gap_s: float = 5.0
    stall_factor: float = 25.0     # a step gap above max(stall_factor x median, stall_abs_s) is blocking
    stall_abs_s: float = 2.0
    margin_s: float = 1.0          # a (re)started learner counts as training this long after learner-start

    def __post_init__(self) -> None:
        if self.quorum_alive < 1 or self.max_commit_gap_s <= 0 or self.stall_factor < 1 or self.stall_abs_s <= 0:
            raise ValueError(f"bad bounds {self}")


@dataclass(frozen=True)
class Scenario:
    name: str
    kind: str
    description: str
    spec: RunSpec
    faults: tuple[Fault, ...] = ()
    bounds: Bounds = Bounds()
    checks: tuple[str, ...] = ()
    syncer_fault: str = ""          # "crash-before-commit[:N]": the first syncer life is infra/chaos/faulty_syncer.py
    restart_syncer_after_s: float = 1.0
    failure_rate_per_min: float = 0.0   # event-log scenario: failures per learner-minute
    repair_s: float = 3.0

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["faults"] = [f.to_dict() for f in self.faults]
        return d


# Learners paced to 20 ms steps (ddiloco learner --pace) and H = 12: each fragment's round every 240 ms,
# a commit every 80 ms. Unpaced, the tiny model steps in ~2 ms, and a syncer needing ~10 ms per
# signed commit cannot close a round before its fragment's next one replaces it (measured: 1.7 ms
# steps, 7-14 ms commits) - a regime no real run is in (steps >> merges, SPEC §4), in which the
# progress invariants (progress.py) rightly fail. At H = 6 a 120 ms round period was within reach
# of a loaded machine's hiccups (an announcement heard 100 ms late misses its round: 13 steps
# without a merge against a 2H = 12 bound). Padding, not stretching, keeps the pace when busy.
_BASE = RunSpec(learners=3, steps=420, slow=1.0, pace_s=0.02, schedule=Schedule(fragments=3, sync_every=12))
_ALL_BAD = "duplicate,reorder,truncated,corrupted,corrupt-frame,nan,inf,wrong-shape,unknown-fragment,too-old," \
           "tampered-spill,mislabeled-spill,oversized-spill,oversized,duplicate"
# the two region scenarios' run: 2 regions x 2 learners over the WAN, 0.2 s paced steps (see region-partition)
_REGION_RUN = dataclasses.replace(_BASE, learners=4, steps=190, slow=1.0, storage="wan", pace_s=0.2,
                                  schedule=Schedule(fragments=3, sync_every=30))


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("learner-kill", "SIGKILL a learner",
             "SIGKILL learner l2 while it trains, restart it 3 s later; the others never notice",
             _BASE, (Fault(2.0, "kill-learner", "l2", 3.0),), Bounds(max_commit_gap_s=4.0),
             checks=("restarted-learner-merged",)),
    Scenario("learner-pause", "SIGSTOP/SIGCONT a learner",
             "SIGSTOP learner l1 for 4 s (a straggler); its late deltas are merged against the current "
             "version or dropped with a reason",
             # l1 without --slow: that stretch sleeps (slow - 1) x the measured step time, so a step
             # that spans the SIGSTOP would add the pause again after SIGCONT (docs/chaos.md)
             dataclasses.replace(_BASE, slow_by=(("l1", 1.0),)), (Fault(2.0, "pause-learner", "l1", 4.0),),
             Bounds(max_commit_gap_s=4.0),
             checks=("all-learners-merged",)),
    Scenario("syncer-crash-mid-commit", "SIGKILL the syncer mid-commit",
             "the syncer dies (exit 137) after writing a round's inputs and version but before the commit "
             "(python -m infra.chaos.faulty_syncer --crash-before-commit 12); a new one recovers from the "
             "log and the orphan version is never named",
             # retain_bytes "none": the check looks at the orphan object itself, which the default
             # byte budget removes once the run is past its floor (issue 26: no commit names it)
             dataclasses.replace(_BASE, retain_bytes="none"), (), Bounds(max_commit_gap_s=20.0),
             checks=("syncer-recovered", "orphan-ignored"),
             syncer_fault="crash-before-commit:12", restart_syncer_after_s=1.0),
    Scenario("syncer-kill", "SIGKILL the syncer",
             "SIGKILL the syncer while it merges, restart it 2 s later; learners spill meanwhile",
             _BASE, (Fault(2.0, "kill-syncer", "syncer", 2.0),), Bounds(max_commit_gap_s=20.0),
             checks=("syncer-recovered",)),
    Scenario("second-syncer", "a second syncer on the same run",
             "start a second syncer on the same run (other ports; the bus relay fails over to it): the "
             "older one is fenced at its next commit and exits 3; exactly one epoch commits after that",
             _BASE, (Fault(2.0, "second-syncer", "syncer2"),), Bounds(max_commit_gap_s=20.0),
             checks=("fenced-once",)),
    Scenario("s3-outage", "stop the S3 server",
             "SIGKILL the S3 server (SeaweedFS) for 4 s: learners keep training with deltas in memory, the "
             "syncer retries with backoff, nothing acknowledged is lost",
             dataclasses.replace(_BASE, storage="s3"), (Fault(2.0, "s3-down", "", 4.0),),
             Bounds(max_commit_gap_s=16.0), checks=("all-learners-merged",)),
    # The spill path's own latency bounds the gap: a blackholed learner reads rounds from the storage
    # clock once no round was announced for 1 s (receiver.BUS_ROUNDS_FRESH_S) at its next poll
    # (<= 0.5 s), spills an answer 1 s (the ack timeout) after sending it, and the syncer lists the
    # inbox every 0.5 s: 3 s by design, 5 s with room for a busy machine (measured under three busy
    # loops: 1.5-3.3 s). 6 s of blackhole, so that a 5 s bound still needs merges from the inbox.
    Scenario("bus-blackhole", "blackhole the ZeroMQ path",
             "blackhole both ZeroMQ paths to the syncer for 6 s: deltas arrive through the spill "
             "inbox, versions through polling; held bytes arrive late and are merged at most once",
             _BASE, (Fault(2.0, "blackhole", "", 6.0),), Bounds(max_commit_gap_s=5.0),
             checks=("spilled-during-fault",)),
    Scenario("slow-learner", "slow a learner by a speed factor",
             "learner l1 runs 4x slower than the others the whole run; it still contributes with a "
             "lower token weight and nobody waits for it",
             dataclasses.replace(_BASE, slow_by=(("l1", 4.0),)), (), Bounds(max_commit_gap_s=3.0),
             checks=("all-learners-merged",)),
    Scenario("bad-input", "bad deltas from a listed key",
             "a rogue client with a listed key sends duplicated, reordered, truncated, corrupted, oversized, "
             "NaN/Inf, wrongly shaped, unknown-fragment and too-old deltas and tampers with spilled "
             "objects: each is rejected or recorded with its reason and nothing else changes",
             # A short retained window, so that the too-old attack's base falls out of it after a few
             # rounds even when tiny learners outpace the syncer's merges (loaded machines).
             dataclasses.replace(_BASE, learners=2, versions=VersionsConfig(retain=6)),
             (Fault(2.0, "rogue", _ALL_BAD),), Bounds(max_commit_gap_s=5.0)),
    Scenario("region-partition", "cut a region off for 20 s",
             "2 regions (a SeaweedFS server each) x 2 learners over rtt 100 ms / 100 Mbit/s links; every link "
             "between home and r1 (S3 both ways, the bus) is cut for 20 s: r1's learners keep training at their "
             "pace and spill into r1's bucket, home keeps committing; after the heal the syncer ingests r1's "
             "spills and r1's copy of the log catches up and matches the home log",
             # Paced steps (0.2 s): the step-gap bound (2x a learner's own median) then measures the
             # loop, not the load of a shared machine (a step must take over 0.4 s to break it; 0.28 s
             # was seen at 0.1 s pace with a load average of 13 on 2 cores); 190 steps outlast the
             # 20 s cut by ~10 s. H=30: a delta per learner every 2 s (H in the hundreds is the paper's).
             _REGION_RUN,
             (Fault(2.0, "partition-region", "r1", 20.0),),
             # 15 s, not 5: after the heal the syncer reads r1's inbox on its loop, HEAD + GET per
             # delta across the link (~0.25 s at rtt 100 ms), so the deltas r1 spilled hold commits
             # (docs/regions.md "Partition over the WAN"; 10.2 s for ~40 deltas at H=30, 0.1 s steps).
             Bounds(max_commit_gap_s=15.0),
             checks=("all-learners-merged", "region-kept-training", "regions-verified")),
    Scenario("region-blackhole", "blackhole a region for 20 s",
             "as region-partition, but the cut holds every byte and new connection between home and r1 "
             "(a blackhole, what a real partition does) instead of resetting them: calls across the link "
             "hang rather than fail; r1's learners must still keep their pace and spill into r1's bucket, "
             "the held bytes (bus deltas, S3 calls) arrive after the heal and are merged at most once",
             _REGION_RUN,
             (Fault(2.0, "partition-region", "r1:hold", 20.0),),
             Bounds(max_commit_gap_s=15.0),
             checks=("all-learners-merged", "region-kept-training", "regions-verified")),
    Scenario("event-log", "schedule from a failure event log",
             "learners fail (SIGKILL) and recover (restart) as a failure event log says: by default one "
             "drawn from --seed (Poisson, 6 failures per learner-minute, 3 s repair), or --events PATH",
             dataclasses.replace(_BASE, learners=3, steps=520), (), Bounds(max_commit_gap_s=5.0),
             failure_rate_per_min=6.0, repair_s=3.0),
)}


def get(name: str) -> Scenario:
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; `ddiloco chaos --list` shows them")
    return SCENARIOS[name]


def draw_failures(learners: int, duration_s: float, rate_per_min: float, repair_s: float, seed: int):
    """A failure event log (infra/simulator/eventlog.py ``Event``s): per learner, failures as a
    Poisson process of ``rate_per_min`` while it is up, each repaired after ``repair_s``; learner 0
    never fails, so the gap bound always has a learner to hold to."""
    from infra.simulator.eventlog import Event
    rng = np.random.default_rng(seed)
    events = []
    for m in range(1, learners):
        t = 0.0
        while rate_per_min > 0:
            t += rng.exponential(60.0 / rate_per_min)
            if t + repair_s >= duration_s:
                break
            events += [Event(round(t, 3), m, "fail"), Event(round(t + repair_s, 3), m, "recover")]
            t += repair_s
    return sorted(events, key=lambda e: (e.time_s, e.learner, e.event))


def faults_from_events(events, learners: int) -> tuple[Fault, ...]:
    """fail = SIGKILL the learner, recover = start it again (learner m is ``l<m>``)."""
    out = []
    for e in events:
        if e.learner >= learners:
            raise ValueError(f"the event log names learner {e.learner}, the scenario runs {learners}")
        out.append(Fault(e.time_s, "kill-learner" if e.event == "fail" else "restart-learner", f"l{e.learner}"))
    return tuple(out)
