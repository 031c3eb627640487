"""Typed records shared by every component: delta headers, tensor specs, commit records.

Each has ``to_dict()`` (plain msgpack/JSON-able values) and ``from_dict()`` which validates and
raises ``FormatError`` naming the bad field. Their byte encodings (envelope kinds and versions)
live beside them so that one place owns each format; docs/formats.md describes them. The run
descriptor is in pipeline/descriptor.py.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

from .envelope import pack_record, unpack_record
from .errors import FormatError

LEARNER_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
DTYPES = ("float32", "float16", "bfloat16", "float64")


def check_learner_id(learner: str) -> str:
    """Learner ids appear in object keys: a short, safe alphabet only."""
    if not isinstance(learner, str) or not LEARNER_ID_RE.match(learner):
        raise ValueError(f"learner id {learner!r} must match {LEARNER_ID_RE.pattern}")
    return learner


def _get(d: dict, name: str, typ: type | tuple, what: str) -> Any:
    if not isinstance(d, dict):
        raise FormatError(f"{what}: expected a map, got {type(d).__name__}")
    if name not in d:
        raise FormatError(f"{what}: missing field {name!r}")
    value = d[name]
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, typ) or (isinstance(value, bool) and typ in (int, float)):
        raise FormatError(f"{what}: field {name!r} has type {type(value).__name__}, expected {typ}")
    return value


def delta_id(learner: str, incarnation: int, seq: int) -> str:
    """The unique id of a delta: who sent it, in which life, and its number in that life."""
    return f"{learner}/{incarnation}/{seq}"


@dataclass(frozen=True)
class DeltaHeader:
    """What a learner says about one outer delta (SPEC §3). ``seq`` counts deltas in one incarnation."""

    learner: str
    incarnation: int
    seq: int
    fragment: int
    base_version: int
    c_steps: int
    c_tokens: int
    learner_step: int
    round: int = -1       # the syncer's round this delta answers (SPEC §4); -1: learner-driven (old runs)

    KIND = "delta-header"
    VERSION = 1

    def __post_init__(self) -> None:
        check_learner_id(self.learner)
        for name in ("incarnation", "seq", "fragment", "base_version", "c_steps", "c_tokens", "learner_step"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"delta header field {name} must be a non-negative int, got {v!r}")
        if not isinstance(self.round, int) or isinstance(self.round, bool) or self.round < -1:
            raise ValueError(f"delta header field round must be an int >= -1, got {self.round!r}")

    @property
    def id(self) -> str:
        return delta_id(self.learner, self.incarnation, self.seq)

    @property
    def order(self) -> tuple[int, int]:
        """Position in the learner's history: later incarnations, then later seqs, are newer."""
        return (self.incarnation, self.seq)

    def to_dict(self) -> dict[str, Any]:
        # Field by field, not dataclasses.asdict (its deep copy: ~6 us warm, tens cold in a learner's
        # answer step; every field is a str or an int): the same dict, in the same order.
        return {"learner": self.learner, "incarnation": self.incarnation, "seq": self.seq,
                "fragment": self.fragment, "base_version": self.base_version, "c_steps": self.c_steps,
                "c_tokens": self.c_tokens, "learner_step": self.learner_step, "round": self.round}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DeltaHeader":
        what = "delta header"
        kw = {"learner": _get(d, "learner", str, what)}
        for name in ("incarnation", "seq", "fragment", "base_version", "c_steps", "c_tokens", "learner_step"):
            kw[name] = _get(d, name, int, what)
        if isinstance(d, dict) and "round" in d:      # absent in headers written before syncer-driven rounds
            kw["round"] = _get(d, "round", int, what)
        try:
            return cls(**kw)
        except ValueError as exc:
            raise FormatError(f"{what}: {exc}") from None


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one model tensor; fragments are made of whole tensors."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"tensor name must be a non-empty string, got {self.name!r}")
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if any(s < 0 for s in self.shape):
            raise ValueError(f"tensor {self.name}: negative dimension in shape {self.shape}")
        if self.dtype not in DTYPES:
            raise ValueError(f"tensor {self.name}: dtype {self.dtype!r} not one of {DTYPES}")

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}[self.dtype]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TensorSpec":
        what = "tensor spec"
        shape = _get(d, "shape", list, what)
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in shape):
            raise FormatError(f"{what}: shape {shape!r} must be a list of ints")
        try:
            return cls(_get(d, "name", str, what), tuple(shape), _get(d, "dtype", str, what))
        except ValueError as exc:
            raise FormatError(f"{what}: {exc}") from None


@dataclass(frozen=True)
class InputRecord:
    """One delta merged by a commit: enough to fetch it again and recompute the merge."""

    delta_id: str
    learner: str
    incarnation: int
    seq: int
    key: str              # object key of the delta blob (persisted before the commit)
    checksum: str         # sha256 of that blob
    base_version: int
    c_steps: int
    c_tokens: int
    learner_step: int
    weight: float         # normalised token weight used in the merge
    staleness: int        # current version minus base version at merge time
    round: int = -1       # the round the delta answered (its header's); -1 in learner-driven runs

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "InputRecord":
        what = "commit input"
        kw: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name == "round" and isinstance(d, dict) and "round" not in d:
                continue                              # records written before syncer-driven rounds
            typ = {"str": str, "int": int, "float": float}[f.type if isinstance(f.type, str) else f.type.__name__]
            kw[f.name] = _get(d, f.name, typ, what)
        return cls(**kw)


@dataclass(frozen=True)
class DroppedRecord:
    """A delta that reached the syncer but was not merged, and why (recorded, never silent)."""

    delta_id: str
    learner: str
    key: str              # may be "" when the delta never reached storage (e.g. rejected on the wire)
    checksum: str
    reason: str
    c_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DroppedRecord":
        what = "dropped record"
        return cls(_get(d, "delta_id", str, what), _get(d, "learner", str, what), _get(d, "key", str, what),
                   _get(d, "checksum", str, what), _get(d, "reason", str, what), _get(d, "c_tokens", int, what))


COMMIT_KINDS = ("init", "fence", "merge", "drop")  # drop: deltas rejected, no new version


@dataclass(frozen=True)
class CommitRecord:
    """One entry of the run's log (SPEC §7). ``seq`` is the log position; ``version`` the new
    fragment version (merge/init). Timing fields are informative and not checked by replay."""

    seq: int
    epoch: int
    kind: str
    fragment: int = -1
    version: int = -1
    inputs: tuple[InputRecord, ...] = ()
    dropped: tuple[DroppedRecord, ...] = ()
    output_key: str = ""
    output_checksum: str = ""
    high_water: dict[str, list[int]] = field(default_factory=dict)  # learner -> [incarnation, seq] for this fragment
    quorum: int = 0
    grace_wait_s: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)  # timings, syncer id; never secrets
    round: int = -1       # the round this commit closed (SPEC §4); -1: none (learner-driven runs, drops)
    # The norm guard's L2 norm of each merged input, in ``inputs`` order (merge commits of guarded
    # runs; None otherwise). Written as ``info["norms"]``, as every earlier record has it: ``info``
    # always mirrors this field, so the bytes written and old records read are unchanged.
    norms: tuple[float, ...] | None = None
    # The map this record was read from, exactly as decoded from its stored bytes (None for a record
    # built in memory). Signatures are checked over it, never over a re-encoding: a field
    # added to ``to_dict`` later (``round``, 488cdb7) otherwise changed the bytes an old signature
    # covered and every old signed run was refused as forged. Not an init argument, so that
    # ``dataclasses.replace`` - a changed record - never carries the old map along.
    stored: dict[str, Any] | None = field(default=None, init=False, compare=False, repr=False)

    KIND = "commit"
    # v1: ``round`` (the record's and each input's) optional, absent before 488cdb7; v2:
    # ``round`` always present. Readers take both (docs/formats.md "commit").
    VERSION = 2
    READS = (1, 2)

    def __post_init__(self) -> None:
        if self.kind not in COMMIT_KINDS:
            raise ValueError(f"commit kind {self.kind!r} not one of {COMMIT_KINDS}")
        if self.seq < 0 or self.epoch < 0:
            raise ValueError(f"commit seq/epoch must be non-negative, got {self.seq}/{self.epoch}")
        if not isinstance(self.info, dict):
            raise ValueError(f"commit info must be a map, got {type(self.info).__name__}")
        written = self.info.get("norms")
        if self.norms is None and written is None:
            return
        norms = _check_norms(self.norms if self.norms is not None else written)
        if self.kind != "merge" or len(norms) != len(self.inputs):
            raise ValueError(f"norms {list(norms)} on a {self.kind!r} commit of {len(self.inputs)} inputs (one "
                             "norm per merged input, merge commits only)")
        if written is not None and list(written) != list(norms):
            raise ValueError(f"norms {list(norms)} differ from info['norms'] {written!r}")
        object.__setattr__(self, "norms", norms)
        if written is None:
            object.__setattr__(self, "info", _info_with_norms(self.info, norms))

    @property
    def round_size(self) -> int:
        """How many distinct learners' deltas the commit's round counted (0 for init, fence and a
        drop of rejected deltas only). Stored as ``quorum``, a historical name (docs/formats.md):
        it is not the policy's quorum K; code reads it through this name."""
        return self.quorum

    def with_norms(self, norms: tuple[float, ...] | None) -> "CommitRecord":
        """The same record with other ``norms`` (``info["norms"]`` follows; None removes them)."""
        info = {k: v for k, v in self.info.items() if k != "norms"}
        return dataclasses.replace(self, norms=norms, info=info)

    def to_dict(self) -> dict[str, Any]:
        return {
            "seq": self.seq, "epoch": self.epoch, "kind": self.kind, "fragment": self.fragment,
            "version": self.version, "inputs": [i.to_dict() for i in self.inputs],
            "dropped": [d.to_dict() for d in self.dropped], "output_key": self.output_key,
            "output_checksum": self.output_checksum,
            "high_water": {k: list(v) for k, v in self.high_water.items()},
            "quorum": self.quorum, "grace_wait_s": self.grace_wait_s, "info": dict(self.info),
            "round": self.round,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], version: int = 1) -> "CommitRecord":
        """Validate a record (FormatError naming the field); ``info["norms"]``, when present, must be
        one finite float >= 0 per merged input of a merge commit and becomes ``norms``. ``version``:
        the format it was stored as (v2 requires ``round``; v1 has it optional). The result keeps
        ``d`` as ``stored``."""
        what = "commit record"
        if version not in cls.READS:
            raise FormatError(f"{what}: version {version!r} not one of {list(cls.READS)}")
        if version >= 2 and isinstance(d, dict):
            lacking = ["round"] if "round" not in d else []
            lacking += [f"inputs[{i}].round" for i, x in enumerate(d.get("inputs") or ())
                        if isinstance(x, dict) and "round" not in x]
            if lacking:
                raise FormatError(f"{what} (v{version}): missing {lacking}")
        hw = _get(d, "high_water", dict, what)
        for k, v in hw.items():
            if not (isinstance(k, str) and isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) for x in v)):
                raise FormatError(f"{what}: bad high-water entry {k!r}: {v!r}")
        try:
            rec = cls(
                seq=_get(d, "seq", int, what), epoch=_get(d, "epoch", int, what), kind=_get(d, "kind", str, what),
                fragment=_get(d, "fragment", int, what), version=_get(d, "version", int, what),
                inputs=tuple(InputRecord.from_dict(x) for x in _get(d, "inputs", list, what)),
                dropped=tuple(DroppedRecord.from_dict(x) for x in _get(d, "dropped", list, what)),
                output_key=_get(d, "output_key", str, what), output_checksum=_get(d, "output_checksum", str, what),
                high_water={k: list(v) for k, v in hw.items()}, quorum=_get(d, "quorum", int, what),
                grace_wait_s=_get(d, "grace_wait_s", float, what), info=_get(d, "info", dict, what),
                round=_get(d, "round", int, what) if isinstance(d, dict) and "round" in d else -1,
            )
        except ValueError as exc:
            if isinstance(exc, FormatError):
                raise
            raise FormatError(f"{what}: {exc}") from None
        object.__setattr__(rec, "stored", d)
        return rec

    def to_bytes(self) -> bytes:
        return pack_record(self.KIND, self.VERSION, self.to_dict())

    @classmethod
    def from_bytes(cls, blob: bytes, what: str | None = None) -> "CommitRecord":
        version, d = unpack_record(blob, cls.KIND, cls.READS, what=what)
        return cls.from_dict(d, version)


def _check_norms(norms: Any) -> tuple[float, ...]:
    """Recorded norms: a list of finite floats >= 0 (ValueError otherwise; ints are not what the
    guard computes, and replay compares them bit for bit)."""
    if not isinstance(norms, (list, tuple)) or \
            not all(isinstance(n, float) and math.isfinite(n) and n >= 0 for n in norms):
        raise ValueError(f"norms must be a list of finite floats >= 0, got {norms!r}")
    return tuple(norms)


def _info_with_norms(info: dict[str, Any], norms: tuple[float, ...]) -> dict[str, Any]:
    """``info`` with ``norms`` after the other entries and before the signature: where the syncer
    has always written them, so the record's bytes are unchanged."""
    out = {k: v for k, v in info.items() if k not in ("norms", "sig")}
    out["norms"] = list(norms)
    if "sig" in info:
        out["sig"] = info["sig"]
    return out
