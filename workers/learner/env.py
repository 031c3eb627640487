"""The learner's environment contract: what ``ddiloco launch`` (or SLURM, Kubernetes, a shell) hands a
training script, so that the script takes no ddiloco arguments (issue 28; like torchrun's RANK).

``Learner(model, optimizer)`` with no store and no learner id reads these (docs/running.md
"The environment contract"):

| variable               | meaning                                                               |
|------------------------|-----------------------------------------------------------------------|
| DDILOCO_STORE          | the run's location: a directory or ``s3://bucket/prefix`` (required)  |
| DDILOCO_S3_ENDPOINT    | S3 endpoint URL (default: AWS_ENDPOINT_URL or AWS)                    |
| DDILOCO_LEARNER_ID     | this learner's id (required; letters, digits, ``_ . -``)              |
| DDILOCO_REGION         | the run region it is in (docs/regions.md; default: the store's)       |
| DDILOCO_INGEST         | the syncer's ingest endpoint(s); unset or empty: storage only, no bus |
| DDILOCO_ANNOUNCE       | the syncer's announce endpoint(s) (set together with INGEST)          |
| DDILOCO_KEY            | this learner's secret key file (a signed run)                         |
| DDILOCO_SYNCER_KEY     | the syncer's public key file it pins (a signed run)                   |
| DDILOCO_LOG            | where its JSONL events go (default: none kept)                        |
| DDILOCO_PROPOSE        | 1: on a store with no run yet, propose this model as version 0         |
| DDILOCO_PROPOSE_WAIT   | seconds to wait for the run to be created from the proposal (600)     |
| DDILOCO_STATE_EVERY    | seconds between resume records (default 5; 0: none)                    |
| DDILOCO_SAVE_OPTIMIZER_EVERY | steps between snapshots of the inner optimizer's state (unset: none) |
| DDILOCO_STEPS          | the step budget the launcher was given (``LearnerEnv.steps``; a hint)  |
| DDILOCO_DISCOVER       | 1: find the syncer's bus in the store (workers/bus/discovery.py) instead of INGEST/ANNOUNCE |
| DDILOCO_ROLE           | ``learner`` (default) or ``evaluator`` (``ddiloco launch --eval``)      |

Secrets are only ever read from files; a variable holds a path, never a key.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from pipeline.types import check_learner_id

PREFIX = "DDILOCO_"
NAMES = ("STORE", "S3_ENDPOINT", "LEARNER_ID", "REGION", "INGEST", "ANNOUNCE", "KEY", "SYNCER_KEY", "LOG",
         "PROPOSE", "PROPOSE_WAIT", "STATE_EVERY", "STEPS", "ROLE", "SAVE_OPTIMIZER_EVERY", "DISCOVER")
ROLES = ("learner", "evaluator")
DEFAULT_STATE_EVERY_S = 5.0
DEFAULT_PROPOSE_WAIT_S = 600.0


@dataclass(frozen=True)
class LearnerEnv:
    """One learner's settings as the environment gives them (``from_environ``; ``to_environ`` back)."""

    store: str
    learner_id: str
    s3_endpoint: str | None = None
    region: str | None = None
    ingest: str = ""
    announce: str = ""
    key: str | None = None
    syncer_key: str | None = None
    log: str | None = None
    propose: bool = False
    propose_wait_s: float = DEFAULT_PROPOSE_WAIT_S
    state_every_s: float = DEFAULT_STATE_EVERY_S
    steps: int | None = None
    role: str = "learner"
    optimizer_every: int | None = None
    discover: bool = False

    def __post_init__(self) -> None:
        if self.discover and self.ingest:
            raise ValueError(f"{PREFIX}DISCOVER and {PREFIX}INGEST exclude each other: the endpoints are found in the store")
        if self.optimizer_every is not None and self.optimizer_every < 1:
            raise ValueError(f"{PREFIX}SAVE_OPTIMIZER_EVERY must be >= 1 steps, got {self.optimizer_every}")
        if self.role not in ROLES:
            raise ValueError(f"{PREFIX}ROLE must be one of {ROLES}, got {self.role!r}")
        if not self.store:
            raise ValueError(f"{PREFIX}STORE: the run's location is required")
        try:
            check_learner_id(self.learner_id)
        except ValueError as exc:
            raise ValueError(f"{PREFIX}LEARNER_ID: {exc}") from None
        if bool(self.ingest) != bool(self.announce):
            raise ValueError(f"{PREFIX}INGEST and {PREFIX}ANNOUNCE go together (both set, or neither for "
                             f"storage only), got ingest {self.ingest!r}, announce {self.announce!r}")
        if bool(self.key) != bool(self.syncer_key):
            raise ValueError(f"{PREFIX}KEY and {PREFIX}SYNCER_KEY go together (a signed run needs this learner's "
                             f"secret key file and the syncer's public key file)")
        if not self.propose_wait_s > 0:
            raise ValueError(f"{PREFIX}PROPOSE_WAIT must be > 0 seconds, got {self.propose_wait_s}")
        if not self.state_every_s >= 0:
            raise ValueError(f"{PREFIX}STATE_EVERY must be >= 0 seconds, got {self.state_every_s}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"{PREFIX}STEPS must be >= 1, got {self.steps}")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> "LearnerEnv | None":
        """The contract from ``environ``; None when ``DDILOCO_STORE`` is not set (no launcher),
        ``ValueError`` naming the variable for a value that is set but wrong."""
        get = lambda name: (environ.get(PREFIX + name) or "").strip()   # noqa: E731
        if not get("STORE"):
            return None
        if not get("LEARNER_ID"):
            raise ValueError(f"{PREFIX}STORE is set but {PREFIX}LEARNER_ID is not: every learner needs its own id")
        propose, discover = get("PROPOSE").lower(), get("DISCOVER").lower()
        for name, v in (("PROPOSE", propose), ("DISCOVER", discover)):
            if v not in ("", "0", "1"):
                raise ValueError(f"{PREFIX}{name} must be 0 or 1, got {v!r}")
        return cls(store=get("STORE"), learner_id=get("LEARNER_ID"), s3_endpoint=get("S3_ENDPOINT") or None,
                   region=get("REGION") or None, ingest=get("INGEST"), announce=get("ANNOUNCE"),
                   key=get("KEY") or None, syncer_key=get("SYNCER_KEY") or None, log=get("LOG") or None,
                   propose=propose == "1",
                   propose_wait_s=_number(get, "PROPOSE_WAIT", float, DEFAULT_PROPOSE_WAIT_S),
                   state_every_s=_number(get, "STATE_EVERY", float, DEFAULT_STATE_EVERY_S),
                   steps=_number(get, "STEPS", int, None), role=get("ROLE") or "learner",
                   optimizer_every=_number(get, "SAVE_OPTIMIZER_EVERY", int, None), discover=discover == "1")

    def to_environ(self) -> dict[str, str]:
        """The variables that say this (what a launcher adds to a script's environment)."""
        out = {"STORE": self.store, "LEARNER_ID": self.learner_id, "S3_ENDPOINT": self.s3_endpoint,
               "REGION": self.region, "INGEST": self.ingest, "ANNOUNCE": self.announce, "KEY": self.key,
               "SYNCER_KEY": self.syncer_key, "LOG": self.log, "PROPOSE": "1" if self.propose else "0",
               "PROPOSE_WAIT": repr(self.propose_wait_s),
               "STATE_EVERY": repr(self.state_every_s), "STEPS": None if self.steps is None else str(self.steps),
               "ROLE": self.role,
               "SAVE_OPTIMIZER_EVERY": None if self.optimizer_every is None else str(self.optimizer_every),
               "DISCOVER": "1" if self.discover else None}
        return {PREFIX + k: v for k, v in out.items() if v}


def _number(get, name: str, kind: type, default):
    text = get(name)
    if not text:
        return default
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"{PREFIX}{name} must be {'an int' if kind is int else 'a number'}, got {text!r}") from None
