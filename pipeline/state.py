"""The syncer's state and its checkpoint (SPEC §7): what every merge depends on, sealed.

``SyncerState`` holds each fragment's ``FragmentState`` (version, exact fp32 master values, outer
momentum, the published values of the retained versions), the high-water marks, the last folded
seq and, in rule-2 runs, the merged marks. The fold (pipeline/fold.py) makes a new state per
commit; ``to_bytes``/``from_bytes`` are the checkpoint blob (format: docs/algorithm.md "Syncer
checkpoint format"). Pure: no I/O.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import msgpack
import numpy as np

from .descriptor import RunDescriptor
from .envelope import DEFAULT_MAX_BYTES, seal, unseal
from .errors import FormatError
from .marks import MARKS_LINEAGE, MergedMarks, marks_from_body
from .codec_raw import payload_layout
from .version_chain import CHAIN_SCHEME, is_chained
from .version_history import VersionHistory

__all__ = ["FragmentState", "SyncerState", "CHECKPOINT_KIND", "CHECKPOINT_VERSION", "CHECKPOINT_READS"]

CHECKPOINT_KIND = "syncer-checkpoint"
CHECKPOINT_VERSION = 3      # v3: history as held (links); v2: + merged marks; v1: neither
CHECKPOINT_READS = (1, 2, 3)


@dataclass
class FragmentState:
    """One fragment: version, exact fp32 Theta_p, outer momentum, and the published values of the
    last ``retain_versions`` versions (current included) to reconstruct stale deltas."""

    version: int
    params: dict[str, np.ndarray]
    momentum: dict[str, np.ndarray]
    history: VersionHistory     # a dict given here is taken as full entries (pipeline/version_history.py)

    def __post_init__(self) -> None:
        self.history = VersionHistory.of(self.history)


@dataclass
class SyncerState:
    """Everything the syncer's merges depend on; a checkpoint is this, sealed."""

    fragments: list[FragmentState]
    high_water: list[dict[str, tuple[int, int]]]   # per fragment: learner -> newest merged (incarnation, seq)
    last_seq: int                                   # seq of the last commit folded (-1 before any)
    run_id: str = ""                                # checked against the descriptor when a checkpoint loads
    marks: list[MergedMarks] | None = None          # per fragment; None: rule 1 runs

    def to_bytes(self) -> bytes:
        """The checkpoint blob (docs/algorithm.md "Syncer checkpoint format"): envelope kind
        ``syncer-checkpoint`` v3 when a history holds int4 links (each retained version as it is
        held: 24 B per parameter at retain 16 instead of 72), else v2 with merged marks and v1
        (the very bytes written before issue 25) without."""
        compact = any(f.history.held(v)[1] is not None for f in self.fragments for v in f.history)

        def arrays(d: Mapping[str, np.ndarray]) -> dict[str, Any]:
            # a view of each array, not a copy: msgpack packs any buffer as bin (issue 31: the
            # checkpoint is the syncer's largest transient)
            return {n: {"shape": list(a.shape), "data": _le_bytes(a)} for n, a in sorted(d.items())}

        def history(h: VersionHistory) -> list:
            if not compact:
                return [[v, arrays(values)] for v, values in h.items()]
            out = []
            for v in h:
                values, link = h.held(v)
                out.append([v, None if values is None else arrays(values),
                            None if link is None else {n: link[n] for n in sorted(link)}])
            return out
        body = {
            "run_id": self.run_id,
            "last_seq": self.last_seq,
            "fragments": [{"version": f.version, "params": arrays(f.params), "momentum": arrays(f.momentum),
                           "history": history(f.history)}
                          for f in self.fragments],
            "high_water": [{m: list(o) for m, o in sorted(hw.items())} for hw in self.high_water],
        }
        if self.marks is not None:
            body["marks"] = [m.to_body() for m in self.marks]
        version = 3 if compact else 1 if self.marks is None else 2
        return seal(CHECKPOINT_KIND, version, msgpack.packb(body, use_bin_type=True))

    def with_seq(self, seq: int) -> "SyncerState":
        """The same state after commit ``seq`` that changed nothing else (a fence, a drop)."""
        return SyncerState(list(self.fragments), list(self.high_water), seq, self.run_id, self.marks)

    @classmethod
    def from_bytes(cls, blob: bytes, descriptor: RunDescriptor, what: str | None = None) -> "SyncerState":
        """Load and validate a checkpoint against the run descriptor (FormatError naming the problem)."""
        name = what or CHECKPOINT_KIND
        version, raw = unseal(blob, CHECKPOINT_KIND, CHECKPOINT_READS, max_bytes=DEFAULT_MAX_BYTES, what=name)
        rule = descriptor.versions.marks
        if version < 3 and (version == 2) != (rule == MARKS_LINEAGE):
            # A v1 state lacks the marks rule 2 needs (it would merge a merged delta again); a v2
            # one in a rule-1 run would not replay with the rule the run was written with.
            raise FormatError(f"{name}: a version {version} checkpoint, but the run's descriptor has versions.marks "
                              f"{rule} (which needs version {2 if rule == MARKS_LINEAGE else 1})")
        try:
            body = msgpack.unpackb(raw, raw=False, strict_map_key=False, max_bin_len=DEFAULT_MAX_BYTES)
        except Exception as exc:
            raise FormatError(f"{name}: body does not decode ({exc.__class__.__name__})") from None
        if version == 3 and isinstance(body, dict) and ("marks" in body) != (rule == MARKS_LINEAGE):
            raise FormatError(f"{name}: a version 3 checkpoint {'with' if 'marks' in body else 'without'} merged "
                              f"marks, but the run's descriptor has versions.marks {rule}")
        state = _state_from_body(body, descriptor, name, compact=version == 3)
        if version == 2 or (version == 3 and rule == MARKS_LINEAGE):
            state.marks = marks_from_body(body.get("marks"), [set(f.history) for f in state.fragments], name)
        return state


def _le_bytes(a: np.ndarray) -> memoryview:
    """The float32 little-endian C-order bytes of ``a``, as a view where ``a`` already is that."""
    return memoryview(np.ascontiguousarray(a, dtype="<f4").reshape(-1).view(np.uint8))


def _need(d: Any, key: str, typ: type | tuple, where: str) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise FormatError(f"{where}: missing field {key!r}")
    v = d[key]
    if not isinstance(v, typ) or (isinstance(v, bool) and typ is int):
        raise FormatError(f"{where}: field {key!r} has type {type(v).__name__}")
    return v


def _arrays_from(d: Any, specs: Mapping[str, tuple[int, ...]], where: str) -> dict[str, np.ndarray]:
    if not isinstance(d, dict) or set(d) != set(specs):
        got = sorted(d) if isinstance(d, dict) else type(d).__name__
        raise FormatError(f"{where}: tensors {got} do not match the descriptor's {sorted(specs)}")
    out = {}
    for n, shape in specs.items():
        shp = _need(d[n], "shape", list, f"{where} tensor {n}")
        data = _need(d[n], "data", bytes, f"{where} tensor {n}")
        if tuple(shp) != shape:
            raise FormatError(f"{where} tensor {n}: shape {shp} but the descriptor says {list(shape)}")
        if len(data) != 4 * math.prod(shape):
            raise FormatError(f"{where} tensor {n}: {len(data)} bytes for shape {list(shape)} (expected "
                              f"{4 * math.prod(shape)})")
        a = np.frombuffer(data, dtype="<f4").astype(np.float32, copy=False).reshape(shape)
        a.flags.writeable = False
        out[n] = a
    return out


def _state_from_body(body: Any, descriptor: RunDescriptor, name: str, compact: bool = False) -> SyncerState:
    if not isinstance(body, dict):
        raise FormatError(f"{name}: body is not a map")
    run_id = _need(body, "run_id", str, name)
    if run_id and run_id != descriptor.run_id:
        raise FormatError(f"{name}: checkpoint of run {run_id!r}, not of run {descriptor.run_id!r}")
    last_seq = _need(body, "last_seq", int, name)
    if last_seq < -1:
        raise FormatError(f"{name}: last_seq {last_seq} < -1")
    frags = _need(body, "fragments", list, name)
    hws = _need(body, "high_water", list, name)
    P = descriptor.num_fragments
    if len(frags) != P or len(hws) != P:
        raise FormatError(f"{name}: {len(frags)} fragments and {len(hws)} high-water maps, the descriptor has {P}")
    fragments = []
    for p, f in enumerate(frags):
        where = f"{name} fragment {p}"
        specs = {s.name: s.shape for s in descriptor.fragment_specs(p)}
        version = _need(f, "version", int, where)
        history = _history_from(_need(f, "history", list, where), specs, version, descriptor, compact, where)
        fragments.append(FragmentState(version, _arrays_from(_need(f, "params", dict, where), specs, f"{where} params"),
                                       _arrays_from(_need(f, "momentum", dict, where), specs, f"{where} momentum"),
                                       history))
    high_water = []
    for p, hw in enumerate(hws):
        if not isinstance(hw, dict):
            raise FormatError(f"{name}: high-water map of fragment {p} is not a map")
        m = {}
        for learner, o in hw.items():
            if not (isinstance(learner, str) and isinstance(o, list) and len(o) == 2
                    and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in o)):
                raise FormatError(f"{name}: bad high-water entry {learner!r}: {o!r} in fragment {p}")
            m[learner] = (o[0], o[1])
        high_water.append(m)
    return SyncerState(fragments, high_water, last_seq, run_id)


def _history_from(items: list, specs: Mapping[str, tuple[int, ...]], version: int, descriptor: RunDescriptor,
                  compact: bool, where: str) -> VersionHistory:
    """A fragment's retained versions: ``[v, values]`` entries (v1, v2) or ``[v, values | nil,
    link | nil]`` (v3: a version held as its int4 link, the newest with both)."""
    full: dict[int, dict[str, np.ndarray]] = {}
    links: dict[int, dict[str, bytes]] = {}
    seen: set[int] = set()
    for item in items:
        if not (isinstance(item, list) and len(item) == (3 if compact else 2) and isinstance(item[0], int)
                and not isinstance(item[0], bool)):
            raise FormatError(f"{where}: bad history entry")
        v = item[0]
        if v in seen or not 0 <= v <= version:
            raise FormatError(f"{where}: history version {v} is repeated or outside 0..{version}")
        seen.add(v)
        if item[1] is not None:
            full[v] = _arrays_from(item[1], specs, f"{where} history v{v}")
        if compact and item[2] is not None:
            links[v] = _links_from(item[2], specs, descriptor, f"{where} history v{v} link")
        elif item[1] is None:
            raise FormatError(f"{where}: history v{v} holds neither values nor a link")
    if version < 0 or version not in seen or len(seen) > descriptor.versions.retain:
        raise FormatError(f"{where}: version {version} with history {sorted(seen)} "
                          f"(must hold the current version and at most {descriptor.versions.retain})")
    try:
        return VersionHistory(full, links, descriptor.codec.block_size if links else 0)
    except ValueError as exc:        # oldest or newest not full, a link without its base
        raise FormatError(f"{where}: {exc}") from None


def _links_from(d: Any, specs: Mapping[str, tuple[int, ...]], descriptor: RunDescriptor,
                where: str) -> dict[str, bytes]:
    if not is_chained(descriptor.versions.dtype):
        raise FormatError(f"{where}: an int4 link in a run whose versions are {descriptor.versions.dtype}")
    if not isinstance(d, dict) or set(d) != set(specs):
        got = sorted(d) if isinstance(d, dict) else type(d).__name__
        raise FormatError(f"{where}: tensors {got} do not match the descriptor's {sorted(specs)}")
    bs = descriptor.codec.block_size
    for n, shape in specs.items():
        expected = payload_layout([shape], CHAIN_SCHEME, bs)[0][2]
        if not isinstance(d[n], bytes) or len(d[n]) != expected:
            got = len(d[n]) if isinstance(d[n], bytes) else type(d[n]).__name__
            raise FormatError(f"{where} tensor {n}: {got} bytes (expected {expected}: int4, block size {bs})")
    return dict(d)
