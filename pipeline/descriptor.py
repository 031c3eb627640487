"""The run descriptor: everything fixed for a run, written once with version 0 of the model.

Format v2 (docs/formats.md "Run descriptor"): a map of typed sections, each one the config type of
the component that uses it - ``layout`` (pipeline/fragment.py), ``schedule`` (pipeline/schedule.py),
``policy`` (pipeline/policy.py), ``codec`` (pipeline/codec.py), ``merge`` (pipeline/merge.py),
``outer`` (pipeline/outer.py), ``guard`` (pipeline/guard.py), ``security`` (pipeline/security.py),
``regions`` (pipeline/regions.py; format v3 only, below),
and ``versions`` and ``learner`` (defined here: their users live in workers/, which pipeline/ cannot
import). ``job`` is the default job's settings as a plain map (workers/job/job.py types it), ``model``
the model config, ``extra`` free-form notes no component reads. Carries no secrets.

Validated once, in ``from_dict``: every error is a FormatError naming the field's path (``descriptor
policy.quorum: ...``); unknown sections and fields are refused (a setting a reader does not know
could change the math, so it is never ignored). Version 1 documents (flat fields, sections inside
``extra``) are migrated in memory by ``migrate_v1``; their bytes stay as they are on storage.

Format v3 is v2 plus the ``regions`` section (the run topology). It is written only by
runs that have one: a single-region run still writes v2, byte for byte as before, and a reader of
v2 only refuses a v3 document (unknown version) instead of silently training in the wrong region.

Format v5 (what runs write now): the same sections, plus ``features`` = {reader, writer}:
the optional parts v3 and v4 made document versions of, by name (``RunDescriptor.features``), so a
reader refuses a run by the name of what it lacks. v2-v4 documents keep their meaning and bytes.

Format v4 (docs/scale.md "Sharded syncer") adds ``syncers``: the number N >= 2 of syncer
shards; shard i owns the fragments p with p % N == i, each with its own epochs and log (storage/
layout.py ``shard_store``). Written only by sharded runs (N = 1 writes v2/v3 as before), so every
tool knows the topology from the run alone and an older reader refuses a sharded run instead of
reading one shard's log as the whole run. A v4 document may also carry ``regions``.

``codec.format`` (docs/formats.md "Run descriptor"): the tensor blob format version
(pipeline/codec.py) every writer of the run's deltas and versions uses. Written only when it is not
1, so every descriptor written before it keeps its exact bytes and means 1 (the format those runs
wrote); new runs (workers/launch.py ``RunSettings``) write 3. No document version changes with it:
readers of v2..v4 refuse unknown fields, so a reader that does not know ``codec.format`` refuses
such a run by name instead of writing another format into it; an explicit ``format: 1`` is
refused (a document has one spelling per meaning, so rewriting it gives its bytes back).

``versions.marks`` (pipeline/marks.py): the exactly-once rule, by the same pattern -
written only when it is not 1, so older descriptors keep their bytes and their rule; new runs write 2.

``guard.version`` (pipeline/guard.py): 3 = per-step norms and round agreement, written by
new runs; versions 1 and 2 keep their rules. A version-3 map has the fields of a version-2 one, so no
document version changes; a reader that knows only 1 and 2 refuses it by name (``guard.version``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .codec import VERSION as FORMAT_WHEN_ABSENT, CodecConfig
from .envelope import pack_record, unpack_record
from .errors import FormatError
from .fragment import FragmentLayout
from .guard import NormGuardConfig
from .marks import MARKS_ISSUE_11, MARKS_LINEAGE
from .merge import MergeConfig
from .outer import OuterConfig
from .policy import PolicyConfig
from .regions import RegionsConfig, parse_regions
from .schedule import ScheduleConfig
from .security import RunSecurity
from .types import TensorSpec

__all__ = ["RunDescriptor", "VersionsConfig", "LearnerRules", "migrate_v1", "VERSION_DTYPES"]

VERSION_DTYPES = ("fp32", "bf16", "int4")   # int4: a chain of deltas (pipeline/version_chain.py)
FULL_EVERY_DEFAULT = 8
RESERVED_EXTRA = ("security", "norm_guard", "job")    # v1 kept these in extra; v2 has sections


@dataclass(frozen=True)
class VersionsConfig:
    """How merged fragment versions travel (``dtype``, the syncer keeps fp32 master state) and how
    many recent versions of each fragment are kept (``retain``; the fold, recovery and gc read it).
    ``marks``: the exactly-once rule (pipeline/marks.py, issue 25): 1 = one high-water mark per
    learner (every run before issue 25; the section is written without the field), 2 = merged marks
    per lineage within the retained versions. The defaults are a new run's: int4 versions and rule 2.
    ``dtype`` ``int4`` (since issue 31; before, bf16): each version travels as an int4 delta against
    the previous published one, with error feedback (pipeline/version_chain.py: a third of bf16's
    bytes down, the fp32 master state stays with the syncer), and every ``full_every``-th version
    (and a fragment's first in each syncer epoch) also as a full fp32 snapshot; ``full_every`` is
    written only for such runs and must not exceed ``retain`` (retention keeps a snapshot within
    the retained versions; left out, it is ``min(8, retain)``), and ``retain`` must be at least 2."""

    dtype: str = "int4"
    retain: int = 16
    marks: int = MARKS_LINEAGE
    full_every: int = 0        # 0: min(FULL_EVERY_DEFAULT, retain) in an int4 run, else nothing

    def __post_init__(self) -> None:
        if self.full_every == 0 and isinstance(self.retain, int) and not isinstance(self.full_every, bool):
            object.__setattr__(self, "full_every", min(FULL_EVERY_DEFAULT, self.retain) if self.dtype == "int4" else 0)
        if self.dtype not in VERSION_DTYPES:
            raise ValueError(f"versions dtype {self.dtype!r} not one of {VERSION_DTYPES}")
        if not isinstance(self.retain, int) or isinstance(self.retain, bool) or self.retain < 1:
            raise ValueError(f"versions retain must be an int >= 1, got {self.retain!r}")
        if self.marks not in (MARKS_ISSUE_11, MARKS_LINEAGE) or isinstance(self.marks, bool):
            raise ValueError(f"versions marks must be {MARKS_ISSUE_11} or {MARKS_LINEAGE}, got {self.marks!r}")
        if self.dtype != "int4" and self.full_every != 0:
            raise ValueError(f"versions full_every applies to int4 versions only (dtype {self.dtype!r})")
        if self.dtype == "int4" and (not isinstance(self.full_every, int) or isinstance(self.full_every, bool)
                                     or self.full_every < 1):
            raise ValueError(f"versions full_every must be an int >= 1, got {self.full_every!r}")
        if self.dtype == "int4" and self.retain < 2:
            raise ValueError(f"int4 versions need retain >= 2 (a delta is republished from the version "
                             f"before it), got {self.retain}")
        if self.dtype == "int4" and self.full_every > self.retain:
            raise ValueError(f"versions full_every {self.full_every} exceeds retain {self.retain}: the "
                             f"retained versions must hold a full snapshot")


@dataclass(frozen=True)
class LearnerRules:
    """What a learner does when a new version lands (workers/learner/learner.py): mix its replica into it
    with weight ``mixing_alpha`` (0: take the version), and ``keep_progress`` (keep its steps since
    the answer it sent)."""

    mixing_alpha: float = 0.0
    keep_progress: bool = False

    def __post_init__(self) -> None:
        a = self.mixing_alpha
        if not isinstance(a, (int, float)) or isinstance(a, bool) or not 0.0 <= a < 1.0:
            raise ValueError(f"learner mixing_alpha must lie in [0, 1), got {a!r}")
        if not isinstance(self.keep_progress, bool):
            raise ValueError(f"learner keep_progress must be a bool, got {self.keep_progress!r}")


@dataclass(frozen=True, kw_only=True)
class RunSections:
    """The six sections of a run's rules - when a round closes, how deltas are coded, which
    versions are kept, how deltas merge, the outer step, what a learner does with a version -
    each with its one set of defaults (its class's). Declared once: the descriptor holds them, and
    so do the two configurations a run is made from (workers/launch.py ``RunSettings``,
    workers/run_config.py ``RunConfig``), by inheriting them (keyword-only, so that a subclass
    may still declare fields without defaults)."""

    policy: PolicyConfig = PolicyConfig()
    codec: CodecConfig = CodecConfig()
    versions: VersionsConfig = VersionsConfig()
    merge: MergeConfig = MergeConfig()
    outer: OuterConfig = OuterConfig()
    learner: LearnerRules = LearnerRules()


@dataclass(frozen=True)
class RunDescriptor(RunSections):
    """Everything fixed for a run (see the module docstring). ``layout`` says which tensors form each
    fragment, ``schedule`` when each falls due (H, offsets t_p); the rule sections (``RunSections``)
    default to what ``create_run`` chooses without settings (their classes' defaults: one per knob).
    ``guard``/``security``/``job`` None: none."""

    run_id: str
    layout: FragmentLayout
    schedule: ScheduleConfig
    guard: NormGuardConfig | None = None
    security: RunSecurity | None = None
    job: dict[str, Any] | None = None      # the default job's settings (workers/job/job.py JobSettings)
    seed: int = 0
    model: dict[str, Any] = field(default_factory=dict)   # model config for jobs that build one
    extra: dict[str, Any] = field(default_factory=dict)   # free-form notes; no component reads them
    regions: RegionsConfig | None = None   # None: one region, the store the descriptor is in
    syncers: int = 1       # syncer shards: shard i owns fragments p % syncers == i (v4 when > 1)

    # What this build writes and how it reads the writer's version. Runs created since issue 26
    # write v5, whose optional parts are *named features* (``features``, module docstring), not
    # document versions; v2, v3 (regions) and v4 (sharded) documents are read as they were and
    # stay on storage byte for byte.
    KIND = "run-descriptor"
    VERSION = 5
    READS = (1, 2, 3, 4, 5)
    # the features a v5 document may name, by kind, that this build understands
    READER_FEATURES = ("regions", "shards")
    WRITER_FEATURES = ("regions", "shards", "syncer-rounds")
    # features a v5 document named that this build lacks, by kind (set by from_bytes; a run with
    # unknown writer features is read - replay, log, export - but never written: check_writable)
    unknown_writer_features: tuple[str, ...] = field(default=(), init=False, compare=False, repr=False)
    # the document version it was read from (from_bytes): re-writing a v2-v4 run's descriptor gives
    # its very bytes (region copies, relaunch checks); a new or changed descriptor writes VERSION
    read_version: int = field(default=VERSION, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.run_id, str) or not self.run_id:
            raise ValueError("run_id must be a non-empty string")
        for name, typ in _SECTION_TYPES.items():
            value = getattr(self, name)
            if not isinstance(value, typ) and not (value is None and name in _OPTIONAL):
                raise ValueError(f"{name} must be a {typ.__name__}, got {type(value).__name__}")
        if len(self.schedule.offsets) != self.layout.num_fragments:
            raise ValueError(f"{self.layout.num_fragments} fragments but {len(self.schedule.offsets)} offsets")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.regions is not None and not isinstance(self.regions, RegionsConfig):
            raise ValueError(f"regions must be a RegionsConfig or None, got {type(self.regions).__name__}")
        if not isinstance(self.syncers, int) or isinstance(self.syncers, bool) \
                or not 1 <= self.syncers <= self.layout.num_fragments:
            raise ValueError(f"syncers must be an int in 1..{self.layout.num_fragments} (the fragment count: "
                             f"every shard owns at least one fragment), got {self.syncers!r}")
        if self.syncers > 1 and self.regions is not None:
            raise ValueError("a sharded run (syncers > 1) with regions is not supported yet: "
                             "each shard would need its own replicator")
        for name in ("job", "model", "extra"):
            value = getattr(self, name)
            if value is None and name == "job":
                continue
            if not isinstance(value, dict):
                raise ValueError(f"{name} must be a map, got {type(value).__name__}")
            _check_plain(value, name)
        reserved = sorted(set(self.extra) & set(RESERVED_EXTRA))
        if reserved:
            raise ValueError(f"extra must not hold {reserved}: they are sections of the descriptor")

    # -- conveniences: the layout is read everywhere ---------------------------------------------

    @property
    def num_fragments(self) -> int:
        return self.layout.num_fragments

    def spec(self, name: str) -> TensorSpec:
        return self.layout.spec(name)

    def fragment_specs(self, p: int) -> list[TensorSpec]:
        return self.layout.fragment_specs(p)

    # -- the document ------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The v2 map (every section present; fixed key order, so equal descriptors write equal
        bytes), plus ``regions`` last when the run has regions (v3)."""
        d = self._v2_dict()
        if self.regions is not None:
            d["regions"] = self.regions.to_dict()
        if self.syncers > 1:
            d["syncers"] = self.syncers
        return d

    def _v2_dict(self) -> dict[str, Any]:
        plain = dataclasses.asdict
        return {
            "run_id": self.run_id, "seed": self.seed,
            "layout": {"tensors": [t.to_dict() for t in self.layout.tensors],
                       "fragments": [list(f) for f in self.layout.fragments], "strategy": self.layout.strategy},
            "schedule": {"sync_every": self.schedule.sync_every, "offsets": list(self.schedule.offsets),
                         "driver": self.schedule.driver},
            "policy": plain(self.policy), "codec": _codec_dict(self.codec), "versions": _versions_dict(self.versions),
            "merge": {"method": self.merge.method, "embedding_tensors": sorted(self.merge.embedding_tensors)},
            "outer": plain(self.outer), "learner": plain(self.learner),
            "guard": None if self.guard is None else dataclasses.asdict(self.guard),
            "security": None if self.security is None else self.security.to_dict(),
            "job": None if self.job is None else dict(self.job),
            "model": dict(self.model), "extra": dict(self.extra),
        }

    @classmethod
    def from_dict(cls, d: Any) -> "RunDescriptor":
        """Validate a v2 map, or a v3 one (``regions`` present); FormatError naming the field's
        path. See ``migrate_v1`` for v1 maps."""
        _fields(d, "descriptor", (*_TOP, "regions", "syncers"), _TOP)
        kw: dict[str, Any] = {"run_id": _typed(d["run_id"], str, "descriptor run_id"),
                              "seed": _typed(d["seed"], int, "descriptor seed")}
        for name, parse in _PARSERS.items():
            value = d[name]
            if value is None and name in _OPTIONAL:
                kw[name] = None
            else:
                kw[name] = parse(value, f"descriptor {name}")
        if "regions" in d:
            kw["regions"] = parse_regions(d["regions"], "descriptor regions")
        if "syncers" in d:
            kw["syncers"] = _typed(d["syncers"], int, "descriptor syncers")
            if kw["syncers"] < 2:
                raise FormatError(f"descriptor syncers: {kw['syncers']} written as a section (only N >= 2 is)")
        try:
            return cls(**kw)
        except ValueError as exc:
            raise FormatError(f"descriptor: {exc}") from None

    def features(self) -> dict[str, list[str]]:
        """The named features this run uses (v5's ``features``): ``reader`` - what a reader must
        understand to read the run correctly (``regions``: the run spans regions; ``shards``: it
        has N syncer logs); ``writer`` - what a syncer or learner must support to append to it
        (those, and ``syncer-rounds``: the syncer drives the rounds, SPEC §3)."""
        reader = (["regions"] if self.regions is not None else []) + (["shards"] if self.syncers > 1 else [])
        writer = sorted(reader + (["syncer-rounds"] if self.schedule.driver == "syncer" else []))
        return {"reader": sorted(reader), "writer": writer}

    def check_writable(self, role: str) -> None:
        """FormatError naming the writer features this build lacks (``role`` writes to the run)."""
        if self.unknown_writer_features:
            raise FormatError(f"run {self.run_id}: a {role} of this version lacks the writer features "
                              f"{list(self.unknown_writer_features)} the run needs: upgrade decoupled-diloco "
                              "(it can still be replayed, logged and exported)")

    def to_bytes(self) -> bytes:
        """The v5 document: the sections, then ``features`` last - or, for a descriptor read from
        a v2, v3 or v4 document, that document's bytes again (v2; v3 with regions; v4 sharded)."""
        if self.read_version in (2, 3, 4):
            version = 4 if self.syncers > 1 else 2 if self.regions is None else 3
            return pack_record(self.KIND, version, self.to_dict())
        return pack_record(self.KIND, self.VERSION, {**self.to_dict(), "features": self.features()})

    @classmethod
    def from_bytes(cls, blob: bytes, what: str | None = None) -> "RunDescriptor":
        """Read a stored descriptor of any version (v1 is migrated in memory). ``regions`` is
        exactly the difference between v2 and v3: a v2 document with it, or a v3 one without it,
        is refused."""
        version, d = unpack_record(blob, cls.KIND, cls.READS, what=what)
        try:
            if version == 5:
                return cls._from_v5(d)
            if version in (2, 3) and isinstance(d, dict) and ("regions" in d) != (version == 3):
                raise FormatError(f"descriptor: a version {version} document must "
                                  f"{'not ' if version == 2 else ''}have a regions section")
            if version in (2, 3) and isinstance(d, dict) and "syncers" in d:
                raise FormatError(f"descriptor: a version {version} document must not have a syncers section")
            if version == 4 and isinstance(d, dict) and "syncers" not in d:
                raise FormatError("descriptor: a version 4 document must have a syncers section")
            desc = cls.from_dict(migrate_v1(d) if version == 1 else d)
            if version > 1:
                object.__setattr__(desc, "read_version", version)
            return desc
        except FormatError as exc:
            raise FormatError(f"{what}: {exc}" if what else str(exc)) from None

    @classmethod
    def _from_v5(cls, d: Any) -> "RunDescriptor":
        """A v5 document: its ``features`` first - a reader feature this build lacks refuses the
        run by that name (rather than misreading it); then the sections, which must use exactly
        the features named."""
        if not isinstance(d, dict) or "features" not in d:
            raise FormatError("descriptor (v5): missing features")
        feats = d["features"]
        if not isinstance(feats, dict) or set(feats) != {"reader", "writer"} or not all(
                isinstance(v, list) and all(isinstance(x, str) for x in v) for v in feats.values()):
            raise FormatError(f"descriptor features: expected {{reader: [str], writer: [str]}}, got {feats!r}")
        lacking = sorted(set(feats["reader"]) - set(cls.READER_FEATURES))
        if lacking:
            raise FormatError(f"descriptor: this build lacks the reader features {lacking} the run needs "
                              f"(it reads {list(cls.READER_FEATURES)}): upgrade decoupled-diloco")
        desc = cls.from_dict({k: v for k, v in d.items() if k != "features"})
        unknown = tuple(sorted(set(feats["writer"]) - set(cls.WRITER_FEATURES)))
        named = {"reader": sorted(feats["reader"]),
                 "writer": sorted(set(feats["writer"]) & set(cls.WRITER_FEATURES))}
        if named != desc.features():
            raise FormatError(f"descriptor features: {feats!r} do not match the sections, which use "
                              f"{desc.features()}")
        object.__setattr__(desc, "unknown_writer_features", unknown)
        return desc


# -- v1 -> v2 --------------------------------------------------------------------------------------

# Every v1 field and the default its dataclass gave a document without it (older writers left
# out fields added later); None: required.
_V1 = {"run_id": None, "tensors": None, "fragments": None, "offsets": None, "sync_every": None, "overlap": 1,
       "quorum": 1, "compression": "int4", "block_size": 64, "zstd_level": 3, "version_dtype": "fp32",
       "merge": "rda", "embedding_tensors": [], "outer_lr": 0.7, "outer_momentum": 0.9, "grace_gamma": 0.5,
       "grace_cap_s": 0.0, "retain_versions": 16, "mixing_alpha": 0.0, "fragment_strategy": "balanced",
       "schedule": "learner", "keep_progress": False, "seed": 0, "model": {}, "extra": {}}


# The norm guard's fields as v1 writers left them out: the guard's defaults of that time (fixed
# here, so that a later default never changes how a v1 run reads).
_V1_GUARD = {"factor": 10.0, "window": 32, "min_history": 8, "cap": 10.0, "enabled": True, "version": 2}


def migrate_v1(d: Any) -> dict[str, Any]:
    """The v2 map of a v1 map: flat fields grouped into sections, ``extra["security"]``,
    ``extra["norm_guard"]`` and ``extra["job"]`` moved to their sections, v1 defaults filled in (a
    v1 map without ``schedule`` was written before syncer-driven rounds: driver "learner"; a norm
    guard map without ``version`` is version 1, without a cap). Pure; checks only the v1 shape, the
    result is validated by ``RunDescriptor.from_dict``."""
    _fields(d, "descriptor (v1)", _V1, [k for k, v in _V1.items() if v is None])
    v = {**_V1, **d}
    extra = _typed(v["extra"], dict, "descriptor (v1) extra")
    extra = dict(extra)
    guard = extra.pop("norm_guard", None)
    if isinstance(guard, dict):
        known = {f.name for f in dataclasses.fields(NormGuardConfig)}
        _fields(guard, "descriptor (v1) extra.norm_guard", known, ())
        guard = {**_V1_GUARD, **guard} if "version" in guard else {**_V1_GUARD, **guard, "version": 1, "cap": None}
    return {
        "run_id": v["run_id"], "seed": v["seed"],
        "layout": {"tensors": v["tensors"], "fragments": v["fragments"], "strategy": v["fragment_strategy"]},
        "schedule": {"sync_every": v["sync_every"], "offsets": v["offsets"], "driver": v["schedule"]},
        "policy": {"quorum": v["quorum"], "overlap": v["overlap"], "gamma": v["grace_gamma"],
                   "cap_s": v["grace_cap_s"]},
        "codec": {"scheme": v["compression"], "block_size": v["block_size"], "zstd_level": v["zstd_level"]},
        "versions": {"dtype": v["version_dtype"], "retain": v["retain_versions"]},
        "merge": {"method": v["merge"], "embedding_tensors": v["embedding_tensors"]},
        "outer": {"lr": v["outer_lr"], "momentum": v["outer_momentum"]},
        "learner": {"mixing_alpha": v["mixing_alpha"], "keep_progress": v["keep_progress"]},
        "guard": guard, "security": extra.pop("security", None), "job": extra.pop("job", None),
        "model": v["model"], "extra": extra,
    }


# -- validation helpers ----------------------------------------------------------------------------

def _fields(d: Any, path: str, allowed, required) -> None:
    if not isinstance(d, dict):
        raise FormatError(f"{path} must be a map, got {type(d).__name__}")
    unknown = sorted(set(d) - set(allowed), key=str)
    if unknown:
        raise FormatError(f"{path}: unknown fields {unknown}")
    missing = sorted(set(required) - set(d))
    if missing:
        raise FormatError(f"{path}: missing fields {missing}")


def _typed(value: Any, typ: type | tuple, path: str) -> Any:
    """``value`` if it has type ``typ`` (ints are taken for floats; bools are never ints)."""
    types = typ if isinstance(typ, tuple) else (typ,)
    if value is None and type(None) in types:
        return None
    if float in types and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) and bool not in types or not isinstance(value, tuple(t for t in types if t)):
        names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
        raise FormatError(f"{path} must be {names}, got {type(value).__name__} {value!r}"[:300])
    return value


def _check_plain(value: Any, path: str) -> None:
    """A msgpack-able map of plain values with string keys (ValueError naming the path)."""
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{path} has a non-string key {k!r}")
            _check_plain(v, f"{path}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_plain(v, f"{path}[{i}]")
    elif value is not None and not isinstance(value, (bool, int, float, str, bytes)):
        raise ValueError(f"{path} holds a {type(value).__name__}, not a plain value")


def _config(cls, types: Mapping[str, type | tuple]) -> Callable[[Any, str], Any]:
    """A parser for a section that is exactly the fields of the config dataclass ``cls``."""
    def parse(m: Any, path: str) -> Any:
        _fields(m, path, types, types)
        kw = {k: _typed(m[k], t, f"{path}.{k}") for k, t in types.items()}
        try:
            return cls(**kw)
        except ValueError as exc:
            raise FormatError(f"{path}{_culprit(cls, kw)}: {exc}") from None
    return parse


def _culprit(cls, kw: Mapping[str, Any]) -> str:
    """``.field`` for the one field whose value the config refuses on its own ("" when it takes
    the combination: a check across fields failed)."""
    for k, v in kw.items():
        try:
            cls(**{k: v})
        except (ValueError, TypeError):
            return f".{k}"
    return ""


def _list_of(value: Any, typ: type, path: str) -> list:
    return [_typed(x, typ, f"{path}[{i}]") for i, x in enumerate(_typed(value, list, path))]


def _layout(m: Any, path: str) -> FragmentLayout:
    _fields(m, path, ("tensors", "fragments", "strategy"), ("tensors", "fragments", "strategy"))
    tensors = []
    for i, t in enumerate(_typed(m["tensors"], list, f"{path}.tensors")):
        try:
            tensors.append(TensorSpec.from_dict(t))
        except FormatError as exc:
            raise FormatError(f"{path}.tensors[{i}]: {exc}") from None
    fragments = [tuple(_list_of(f, str, f"{path}.fragments[{p}]"))
                 for p, f in enumerate(_typed(m["fragments"], list, f"{path}.fragments"))]
    try:
        return FragmentLayout(tuple(tensors), tuple(fragments), _typed(m["strategy"], str, f"{path}.strategy"))
    except ValueError as exc:
        raise FormatError(f"{path}: {exc}") from None


def _schedule(m: Any, path: str) -> ScheduleConfig:
    _fields(m, path, ("sync_every", "offsets", "driver"), ("sync_every", "offsets", "driver"))
    kw = {"sync_every": _typed(m["sync_every"], int, f"{path}.sync_every"),
          "offsets": tuple(_list_of(m["offsets"], int, f"{path}.offsets")),
          "driver": _typed(m["driver"], str, f"{path}.driver")}
    try:
        return ScheduleConfig(**kw)
    except ValueError as exc:
        field_ = "sync_every" if "sync_every" in str(exc) else "offsets" if "offsets" in str(exc) else "driver"
        raise FormatError(f"{path}.{field_}: {exc}") from None


def _merge(m: Any, path: str) -> MergeConfig:
    _fields(m, path, ("method", "embedding_tensors"), ("method", "embedding_tensors"))
    method = _typed(m["method"], str, f"{path}.method")
    names = _list_of(m["embedding_tensors"], str, f"{path}.embedding_tensors")
    try:
        return MergeConfig(method, frozenset(names))
    except ValueError as exc:
        raise FormatError(f"{path}.{'method' if 'method' in str(exc) else 'embedding_tensors'}: {exc}") from None


_CODEC_FIELDS = {"scheme": str, "block_size": int, "zstd_level": int}
_parse_codec = _config(CodecConfig, {**_CODEC_FIELDS, "format": int})


def _codec_dict(codec: CodecConfig) -> dict[str, Any]:
    """The ``codec`` section: ``format`` only when it is not 1 (module docstring)."""
    d = {k: getattr(codec, k) for k in _CODEC_FIELDS}
    if codec.format != FORMAT_WHEN_ABSENT:
        d["format"] = codec.format
    return d


def _codec(m: Any, path: str) -> CodecConfig:
    """The ``codec`` section; without ``format`` it is format 1 (written before the field existed)."""
    _fields(m, path, (*_CODEC_FIELDS, "format"), _CODEC_FIELDS)
    if "format" not in m:
        return _parse_codec({**m, "format": FORMAT_WHEN_ABSENT}, path)
    if _typed(m["format"], int, f"{path}.format") == FORMAT_WHEN_ABSENT:
        raise FormatError(f"{path}.format: {FORMAT_WHEN_ABSENT} is written by leaving the field out "
                          f"(a descriptor without it means format {FORMAT_WHEN_ABSENT})")
    return _parse_codec(m, path)


_VERSIONS_FIELDS = {"dtype": str, "retain": int}
_parse_versions = _config(VersionsConfig, {**_VERSIONS_FIELDS, "marks": int, "full_every": int})


def _versions_dict(v: VersionsConfig) -> dict[str, Any]:
    """The ``versions`` section: ``marks`` only when it is not 1, so every descriptor written
    before issue 25 keeps its exact bytes (and its runs replay with the rule they were written with)."""
    d = {k: getattr(v, k) for k in _VERSIONS_FIELDS}
    if v.marks != MARKS_ISSUE_11:
        d["marks"] = v.marks
    if v.dtype == "int4":      # only int4 runs have the field: older descriptors keep their bytes
        d["full_every"] = v.full_every
    return d


def _versions(m: Any, path: str) -> VersionsConfig:
    """The ``versions`` section; without ``marks`` it is rule 1 (written before the field existed);
    ``full_every`` is present exactly in int4 runs."""
    _fields(m, path, (*_VERSIONS_FIELDS, "marks", "full_every"), _VERSIONS_FIELDS)
    if (m.get("dtype") == "int4") != ("full_every" in m):
        raise FormatError(f"{path}.full_every: written exactly for int4 versions (dtype {m.get('dtype')!r})")
    if "full_every" in m and _typed(m["full_every"], int, f"{path}.full_every") < 1:
        raise FormatError(f"{path}.full_every: must be >= 1, got {m['full_every']}")
    m = {**m, "full_every": m.get("full_every", 0)}
    if "marks" not in m:
        return _parse_versions({**m, "marks": MARKS_ISSUE_11}, path)
    if _typed(m["marks"], int, f"{path}.marks") == MARKS_ISSUE_11:
        raise FormatError(f"{path}.marks: {MARKS_ISSUE_11} is written by leaving the field out "
                          f"(a descriptor without it means rule {MARKS_ISSUE_11})")
    return _parse_versions(m, path)


def _security(m: Any, path: str) -> RunSecurity:
    return RunSecurity.from_dict(m, path)


def _plain_map(m: Any, path: str) -> dict[str, Any]:
    try:
        _check_plain(_typed(m, dict, path), path.removeprefix("descriptor "))
    except ValueError as exc:
        raise FormatError(f"descriptor {exc}") from None
    return dict(m)


_PARSERS: dict[str, Callable[[Any, str], Any]] = {
    "layout": _layout, "schedule": _schedule,
    "policy": _config(PolicyConfig, {"quorum": int, "overlap": int, "gamma": float, "cap_s": float}),
    "codec": _codec,
    "versions": _versions,
    "merge": _merge,
    "outer": _config(OuterConfig, {"lr": float, "momentum": float}),
    "learner": _config(LearnerRules, {"mixing_alpha": float, "keep_progress": bool}),
    "guard": _config(NormGuardConfig, {"factor": float, "window": int, "min_history": int,
                                       "cap": (float, type(None)), "enabled": bool, "version": int}),
    "security": _security, "job": _plain_map, "model": _plain_map, "extra": _plain_map,
}
_TOP = ("run_id", "seed", *_PARSERS)
_OPTIONAL = ("guard", "security", "job")
_SECTION_TYPES = {"layout": FragmentLayout, "schedule": ScheduleConfig, "policy": PolicyConfig, "codec": CodecConfig,
                  "versions": VersionsConfig, "merge": MergeConfig, "outer": OuterConfig, "learner": LearnerRules,
                  "guard": NormGuardConfig, "security": RunSecurity}
