"""Fault schedules for the simulation (docs/faultsim.md): what happens when, drawn from a
seed or written by hand, with a one-line text form that replays it (``--schedule``).

A :class:`Fault` is ``kind[:target]@at[+duration][xparam]``; a schedule joins faults with ``,``::

    kill-syncer@60+12,slow-learner:l1@75+20x3,store-down@110+8

Kinds (targets: learners by name; the syncer and the store need none):

| kind            | duration                      | param                       |
|-----------------|-------------------------------|-----------------------------|
| kill-syncer     | until a new syncer starts     | -                           |
| pause-syncer    | SIGSTOP until resumed         | -                           |
| second-syncer   | - (a new syncer takes over)   | -                           |
| kill-learner    | until restarted (0: it left)  | -                           |
| pause-learner   | SIGSTOP until resumed         | -                           |
| slow-learner    | slower steps                  | the factor (> 1)            |
| store-down      | every request fails           | -                           |
| store-slow      | every request waits           | seconds per request (> 0)   |
| disk-full       | writes fail                   | -                           |
| bad-input       | - (planted in the inbox)      | 0 garbage, 1 a re-keyed delta, 2 a truncated delta |
| bus-blackhole   | every bus message is lost     | - (runs with a bus only)    |
| clock-skew      | its wall clock reads ahead    | the seconds ahead (> 0)     |
| list-lag        | new objects list late         | seconds a listing lags (> 0) |

``draw_schedule`` picks 1-4 faults with kinds weighted by how much they are worth, times inside
the run's fault span, and keeps store faults apart (at least ``STORE_GAP_S`` between them): a
restart during a store fault waits for it (runner.py), and a restart must not straddle two.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np

KINDS = ("kill-syncer", "pause-syncer", "second-syncer", "kill-learner", "pause-learner", "slow-learner",
         "store-down", "store-slow", "disk-full", "bad-input", "bus-blackhole", "clock-skew", "list-lag")
TARGETED = ("kill-learner", "pause-learner", "slow-learner", "bad-input", "clock-skew")
INSTANT = ("second-syncer", "bad-input")
PARAMETERISED = ("slow-learner", "store-slow", "bad-input", "clock-skew", "list-lag")   # the kinds with an x...
STORE_KINDS = {"store-down": "down", "store-slow": "slow", "disk-full": "full", "list-lag": "lag"}
WEIGHTS = {"kill-syncer": 3, "kill-learner": 3, "pause-learner": 2, "slow-learner": 2, "store-down": 2,
           "pause-syncer": 1, "store-slow": 1, "bad-input": 1, "second-syncer": 1, "disk-full": 1,
           "bus-blackhole": 2, "clock-skew": 1, "list-lag": 2}
DURATIONS = {"kill-syncer": (1.0, 25.0), "pause-syncer": (2.0, 15.0), "kill-learner": (2.0, 20.0),
             "pause-learner": (2.0, 20.0), "slow-learner": (5.0, 30.0), "store-down": (2.0, 20.0),
             "store-slow": (5.0, 25.0), "disk-full": (3.0, 20.0), "bus-blackhole": (2.0, 20.0),
             "clock-skew": (5.0, 30.0), "list-lag": (10.0, 40.0)}
LONG_OUTAGE = (40.0, 95.0)   # one syncer kill in four lasts this long: ~7-16 H of steps on one base
STORE_GAP_S = 10.0
BAD_INPUTS = 3
_FORM = re.compile(r"^(?P<kind>[a-z-]+)(?::(?P<target>[A-Za-z0-9_.-]+))?@(?P<at>[0-9.]+)"
                   r"(?:\+(?P<duration>[0-9.]+))?(?:x(?P<param>[0-9.]+))?$")


@dataclass(frozen=True)
class Fault:
    """One fault: ``kind`` on ``target`` at simulated time ``at`` for ``duration`` seconds (module doc)."""

    kind: str
    at: float
    duration: float = 0.0
    target: str = ""
    param: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"fault kind {self.kind!r} is not one of {', '.join(KINDS)}")
        for name in ("at", "duration", "param"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise ValueError(f"fault {self.kind}: {name} must be a finite number >= 0, got {v!r}")
        if (self.kind in TARGETED) != bool(self.target):
            raise ValueError(f"fault {self.kind}: " + ("needs a target learner" if self.kind in TARGETED
                                                        else f"takes no target, got {self.target!r}"))
        if self.kind in INSTANT and self.duration:
            raise ValueError(f"fault {self.kind} is instantaneous: no duration, got {self.duration}")
        if self.kind not in INSTANT and self.kind != "kill-learner" and self.duration <= 0:
            raise ValueError(f"fault {self.kind} needs a duration > 0")
        if self.kind == "slow-learner" and self.param <= 1:
            raise ValueError(f"fault slow-learner needs a factor > 1 (x...), got {self.param}")
        if self.kind == "clock-skew" and self.param <= 0:
            raise ValueError(f"fault clock-skew needs the seconds its learner's clock reads ahead (x...), got {self.param}")
        if self.kind == "store-slow" and self.param <= 0:
            raise ValueError(f"fault store-slow needs seconds per request > 0 (x...), got {self.param}")
        if self.kind == "list-lag" and self.param <= 0:
            raise ValueError(f"fault list-lag needs the seconds a listing lags (x...), got {self.param}")
        if self.kind == "bad-input" and self.param not in range(BAD_INPUTS):
            raise ValueError(f"fault bad-input variant must be one of 0..{BAD_INPUTS - 1}, got {self.param}")
        if self.kind not in PARAMETERISED and self.param:
            raise ValueError(f"fault {self.kind} takes no parameter, got x{self.param}")

    @property
    def end(self) -> float:
        return self.at + self.duration

    def text(self) -> str:
        out = self.kind + (f":{self.target}" if self.target else "") + f"@{_num(self.at)}"
        if self.duration:
            out += f"+{_num(self.duration)}"
        if self.param:
            out += f"x{_num(self.param)}"
        return out


def _num(v: float) -> str:
    return f"{v:.6g}"


def schedule_text(faults: Sequence[Fault]) -> str:
    """The schedule's one-line form (``parse_schedule`` reads it back)."""
    return ",".join(f.text() for f in faults)


def parse_schedule(text: str) -> tuple[Fault, ...]:
    """Faults from their text form; ValueError names the piece that does not parse."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("a schedule is one or more faults like 'kill-syncer@60+12', joined by ','")
    out = []
    for piece in text.split(","):
        m = _FORM.match(piece.strip())
        if m is None:
            raise ValueError(f"fault {piece!r} does not read as kind[:target]@at[+duration][xparam], "
                             f"e.g. 'slow-learner:l1@75+20x3'")
        try:
            out.append(Fault(m["kind"], float(m["at"]), float(m["duration"] or 0), m["target"] or "",
                             float(m["param"] or 0)))
        except ValueError as exc:
            raise ValueError(f"fault {piece!r}: {exc}") from None
    return tuple(sorted(out, key=lambda f: (f.at, f.kind, f.target)))


def check_schedule(faults: Sequence[Fault], learners: Sequence[str], span: tuple[float, float],
                   bus: bool = True) -> None:
    """ValueError unless every fault targets a known learner and lies inside ``span`` (start, last
    end), and a bus fault has a bus to hit."""
    lo, hi = span
    for f in faults:
        if f.kind == "bus-blackhole" and not bus:
            raise ValueError(f"fault {f.text()}: this run has no bus (its world draws bus=False)")
        if f.target and f.target not in learners:
            raise ValueError(f"fault {f.text()}: no learner {f.target!r} (learners: {', '.join(learners)})")
        if f.at < lo or f.end > hi:
            raise ValueError(f"fault {f.text()}: must start at >= {lo:g} s and end by {hi:g} s of simulated time")


def draw_schedule(rng: np.random.Generator, learners: Sequence[str], span: tuple[float, float],
                  quorum: int = 1, max_faults: int = 4, bus: bool = True) -> tuple[Fault, ...]:
    """1..``max_faults`` faults drawn from ``rng`` (module docstring); store faults kept apart, and
    at least one learner running at any time. Fewer than ``quorum`` may run for a while: then no
    merge is possible by design (SPEC §9), and what the survivors answer must be held or dropped
    with a reason, never merged below K (invariant (e); keeping K running hid the late-expiry path
    that merged below K from the campaign, issue 25 mutation check). A draw that breaks either rule
    is left out, so a schedule may hold fewer faults than were drawn. Without a ``bus`` there is no
    bus to blackhole."""
    kinds = [k for k in WEIGHTS if bus or k != "bus-blackhole"]
    weights = np.array([WEIGHTS[k] for k in kinds], dtype=float)
    lo, hi = span
    out: list[Fault] = []
    for _ in range(int(rng.integers(1, max_faults + 1))):
        kind = kinds[int(rng.choice(len(kinds), p=weights / weights.sum()))]
        fault = _draw_one(rng, kind, learners, lo, hi)
        if kind in STORE_KINDS and any(_near(fault, g) for g in out if g.kind in STORE_KINDS):
            continue                                  # one store fault at a time (module docstring)
        if fewest_running([*out, fault], len(learners), hi) < 1:
            continue
        out.append(fault)
    return tuple(sorted(out, key=lambda f: (f.at, f.kind, f.target)))


def fewest_running(faults: Sequence[Fault], learners: int, end: float) -> int:
    """The fewest learners running (neither killed nor paused) at any time before ``end``."""
    down = [(f.at, f.end if (f.duration or f.kind != "kill-learner") else end, f.target) for f in faults
            if f.kind in ("kill-learner", "pause-learner")]
    fewest = learners
    for t in sorted({a for a, _, _ in down}):
        fewest = min(fewest, learners - len({who for a, b, who in down if a <= t < b}))
    return fewest


def _draw_one(rng: np.random.Generator, kind: str, learners: Sequence[str], lo: float, hi: float) -> Fault:
    target = learners[int(rng.integers(len(learners)))] if kind in TARGETED else ""
    if kind in INSTANT:
        param = float(rng.integers(BAD_INPUTS)) if kind == "bad-input" else 0.0
        return Fault(kind, round(float(rng.uniform(lo, hi)), 2), 0.0, target, param)
    dlo, dhi = DURATIONS[kind]
    duration = round(float(rng.uniform(dlo, min(dhi, hi - lo))), 2)
    if kind == "kill-learner" and rng.random() < 0.2:
        duration = 0.0                                # the learner leaves for good
    elif kind == "kill-syncer" and rng.random() < 0.25:
        # A long outage (a region down for minutes): answers made on one base grow to many H of
        # steps, what the pre-issue-25 norm guard dropped as outliers (item 2); at <= 25 s they
        # stayed within its factor and the campaign could not see it.
        duration = round(float(rng.uniform(LONG_OUTAGE[0], min(LONG_OUTAGE[1], hi - lo))), 2)
    at = round(float(rng.uniform(lo, hi - max(duration, 0.0))), 2)
    param = 0.0
    if kind == "slow-learner":
        param = round(float(rng.uniform(2.0, 5.0)), 2)
    elif kind == "store-slow":
        param = round(float(rng.uniform(0.05, 0.5)), 3)
    elif kind == "clock-skew":
        param = round(float(rng.uniform(2.0, 40.0)), 2)   # seconds: 2 to 40 of the world's ~1 s steps
    elif kind == "list-lag":
        param = round(float(rng.uniform(2.0, 15.0)), 2)   # seconds: longer than a fragment's round
    return Fault(kind, at, duration, target, param)


def _near(a: Fault, b: Fault) -> bool:
    return a.at < b.end + STORE_GAP_S and b.at < a.end + STORE_GAP_S
