"""A learner's resume record: where a learner id stands, so that its next life continues there.

Issue 28 "Resume": a learner that restarts (killed and restarted by ``ddiloco launch``, or the same
launch command run again) keeps its step count and its data position instead of starting again at
step 0 with a fresh budget and the same batch order. Its learner writes this record off the
training loop (workers/learner/bootstrap.py ``StateRecorder``, every few seconds and at close);
the next life reads it in ``Learner.start`` and starts its counters there. It is advisory: a life
killed between two writes resumes from the older record and retrains at most those steps (their
work was never merged twice: deltas are per life, SPEC §7). The model itself always comes from the
run's latest global version (the paper's recovery); the inner optimizer starts fresh.

Record (docs/formats.md "Learner state"): envelope kind ``learner-state`` version 1, a msgpack map
``{"learner", "incarnation", "step", "tokens", "wall"}``, overwritten at ``learner-state/<id>``.
"""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.envelope import pack_record, unpack_record
from pipeline.errors import FormatError
from pipeline.types import check_learner_id

from .errors import NotFound
from .layout import learner_state_key
from .store import ObjectStore

STATE_KIND, STATE_VERSION = "learner-state", 1


@dataclass(frozen=True)
class LearnerState:
    learner: str
    incarnation: int
    step: int
    tokens: int
    wall: float

    def __post_init__(self) -> None:
        check_learner_id(self.learner)
        for name in ("incarnation", "step", "tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"learner state {name} must be an int >= 0, got {v!r}")

    def to_bytes(self) -> bytes:
        return pack_record(STATE_KIND, STATE_VERSION, {"learner": self.learner, "incarnation": self.incarnation,
                                                       "step": self.step, "tokens": self.tokens, "wall": self.wall})

    @classmethod
    def from_bytes(cls, blob: bytes, what: str) -> "LearnerState":
        _, rec = unpack_record(blob, STATE_KIND, STATE_VERSION, max_bytes=1 << 16, what=what)
        try:
            return cls(str(rec["learner"]), int(rec["incarnation"]), int(rec["step"]), int(rec["tokens"]),
                       float(rec["wall"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"{what}: malformed learner state ({exc})") from None


def write_state(store: ObjectStore, state: LearnerState) -> None:
    store.put(learner_state_key(state.learner), state.to_bytes())


def read_state(store: ObjectStore, learner: str) -> LearnerState | None:
    """The learner id's last recorded state, or None when it never wrote one."""
    key = learner_state_key(learner)
    try:
        blob = store.get(key)
    except NotFound:
        return None
    state = LearnerState.from_bytes(blob, f"{store.uri}/{key}")
    if state.learner != learner:
        raise FormatError(f"{store.uri}/{key}: the record names learner {state.learner!r}, not {learner!r}")
    return state
