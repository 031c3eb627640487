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

With ``--save-optimizer-every N`` the learner also keeps its inner optimizer's state
(``learner-optimizer/<id>``, kind ``learner-optimizer`` version 1): ``{"learner", "incarnation", "step",
"groups": [param group map, ...], "tensors": [[param index, name, dtype, shape, bytes], ...],
"scalars": [[param index, name, value], ...]}`` - an optimizer ``state_dict`` without pickle.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.envelope import pack_record, unpack_record
from pipeline.errors import FormatError
from pipeline.types import check_learner_id

from .errors import NotFound
from .layout import learner_optimizer_key, learner_state_key
from .store import ObjectStore

STATE_KIND, STATE_VERSION = "learner-state", 1
OPTIMIZER_KIND, OPTIMIZER_VERSION = "learner-optimizer", 1
OPTIMIZER_DTYPES = ("float32", "float64", "float16", "int64", "int32", "bool")
MAX_OPTIMIZER_BYTES = 1 << 31


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
    return _read_own(store, learner_state_key(learner), LearnerState.from_bytes, learner)


def _read_own(store: ObjectStore, key: str, decode, learner: str):
    """The record at ``key`` decoded (None when absent); FormatError when it names another learner."""
    try:
        blob = store.get(key)
    except NotFound:
        return None
    record = decode(blob, f"{store.uri}/{key}")
    if record.learner != learner:
        raise FormatError(f"{store.uri}/{key}: the record names learner {record.learner!r}, not {learner!r}")
    return record


@dataclass(frozen=True)
class OptimizerState:
    """An inner optimizer's ``state_dict`` as plain data: param groups (plain maps), per-parameter
    tensors (numpy) and scalars, by the optimizer's parameter index."""

    learner: str
    incarnation: int
    step: int
    groups: list[dict[str, Any]]
    tensors: dict[tuple[int, str], np.ndarray] = field(default_factory=dict)
    scalars: dict[tuple[int, str], Any] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        rows = []
        for (i, name), a in sorted(self.tensors.items()):
            a = np.asarray(a)
            a = a if a.flags.c_contiguous else a.copy(order="C")   # (ascontiguousarray makes a 0-d array 1-d)
            if str(a.dtype) not in OPTIMIZER_DTYPES:
                raise ValueError(f"optimizer state {i}.{name} is {a.dtype}: kept dtypes are {OPTIMIZER_DTYPES}")
            rows.append([i, name, str(a.dtype), list(a.shape), a.tobytes()])
        try:
            return pack_record(OPTIMIZER_KIND, OPTIMIZER_VERSION, {
                "learner": self.learner, "incarnation": self.incarnation, "step": self.step, "groups": self.groups,
                "tensors": rows, "scalars": [[i, n, v] for (i, n), v in sorted(self.scalars.items())]})
        except TypeError as exc:
            raise ValueError(f"the optimizer's state holds a value that is not plain data: {exc}") from None

    @classmethod
    def from_bytes(cls, blob: bytes, what: str) -> "OptimizerState":
        _, rec = unpack_record(blob, OPTIMIZER_KIND, OPTIMIZER_VERSION, max_bytes=MAX_OPTIMIZER_BYTES, what=what)
        try:
            tensors = {}
            for i, name, dtype, shape, data in rec["tensors"]:
                if dtype not in OPTIMIZER_DTYPES:
                    raise ValueError(f"dtype {dtype!r}")
                tensors[(int(i), str(name))] = np.frombuffer(data, dtype=dtype).reshape(tuple(shape)).copy()
            return cls(str(rec["learner"]), int(rec["incarnation"]), int(rec["step"]), list(rec["groups"]), tensors,
                       {(int(i), str(n)): v for i, n, v in rec["scalars"]})
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"{what}: malformed optimizer state ({exc.__class__.__name__}: {exc})") from None


def write_optimizer(store: ObjectStore, state: OptimizerState) -> None:
    store.put(learner_optimizer_key(state.learner), state.to_bytes())


def read_optimizer(store: ObjectStore, learner: str) -> OptimizerState | None:
    """The learner id's kept optimizer state, or None."""
    return _read_own(store, learner_optimizer_key(learner), OptimizerState.from_bytes, learner)
