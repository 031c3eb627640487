"""The syncer's one state transition: fold a round's deltas into a fragment's next version.

SPEC §4 (merge of a round) and §7 (exactly once, replay). The live syncer, its restart recovery and
the replay tool all call :func:`fold`; a commit record holds everything needed to call it again, and
:func:`check_commit` does so and compares bit for bit. Pure and deterministic: inputs are sorted by
delta id, every decision is recorded, the input state is never mutated (arrays in a state are
read-only and shared between successive states).

Per round of fragment p, for each input (sorted by learner, incarnation, seq):
dropped with a recorded reason if rejected by the caller, for another fragment, already merged
(high-water mark, and in runs with ``versions.marks = 2`` the merged marks per lineage of
pipeline/marks.py, issue 25: ``duplicate``, ``superseded: ...``, ``stale-incarnation`` when a newer
life of its learner was merged; an answer overtaken by its learner's newer merged one is merged
like any late answer), without steps or tokens, based on a future or forgotten version, undecodable, of the wrong
shape, non-finite, or older than another delta of the same learner in the round. For survivors:
``theta_m = Theta^(base) - Delta_m`` and ``v_m = Theta^(current) - theta_m`` with published values
(what learners received), computed as ``(Theta^(current) - Theta^(base)) + Delta_m`` in float64 so
that a delta against the current version is taken exactly; token weights; merge (RDA or mean);
outer Nesterov step; new version published (fp32, bf16-rounded, or in an int4 run the previous
published values plus the int4 delta toward the master values: pipeline/version_chain.py) and kept
in the history.

The state it folds and its checkpoint (``SyncerState``) live in pipeline/state.py (docs/algorithm.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from .checksum import tensor_digest
from .errors import FormatError
from .marks import MARKS_LINEAGE, MergedMarks, prior_verdict
from .merge import MapFn, merge_fragment, token_weights
from .outer import nesterov_step
from .descriptor import RunDescriptor
from .types import CommitRecord, DeltaHeader, DroppedRecord, InputRecord
from .state import CHECKPOINT_KIND, CHECKPOINT_VERSION, FragmentState, SyncerState  # re-exported: their home before
from .version_chain import ChainStep, chain_step, is_chained

__all__ = ["FragmentState", "SyncerState", "RoundInput", "FoldResult", "ReplayMismatch", "DropReason", "published",
           "initial_state", "fold", "fold_fence", "check_commit", "compare_records", "CHECKPOINT_KIND",
           "CHECKPOINT_VERSION", "merged_before"]

NON_FINITE_RESULT = "non-finite-result"   # the merged step overflowed: the round's survivors are dropped


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.array(a, dtype=np.float32, copy=True)
    a.flags.writeable = False
    return a


def _sealed(a: np.ndarray) -> np.ndarray:
    """A float32 array this module just made (nobody else holds it), made read-only without a copy."""
    a.flags.writeable = False
    return a


def _finite(a: np.ndarray) -> bool:
    """Whether every value is finite: two read-only reductions (max and min propagate NaN)."""
    a = np.asarray(a)
    return a.size == 0 or (math.isfinite(float(a.max())) and math.isfinite(float(a.min())))


_STEP = 1 << 14
_GRAD_JOB = 1 << 20       # values per outer-gradient job handed to map_fn (elementwise: any split, same bits)


def _outer_gradient_range(current: np.ndarray, base: np.ndarray, delta: np.ndarray, out: np.ndarray,
                          lo: int, hi: int) -> None:
    """``out[lo:hi] = (current - base) + delta`` over flat views, in float64 steps that stay in cache."""
    t = np.empty(min(_STEP, hi - lo), np.float64)
    for a in range(lo, hi, _STEP):
        b = min(a + _STEP, hi)
        u = t[:b - a]
        np.subtract(current[a:b], base[a:b], out=u, dtype=np.float64)
        np.add(u, delta[a:b], out=u, dtype=np.float64)
        np.copyto(out[a:b], u, casting="same_kind")


def _outer_gradients(current: Mapping[str, np.ndarray], bases: Sequence[Mapping[str, np.ndarray]],
                     deltas: Sequence[Mapping[str, np.ndarray]], names: Sequence[str],
                     map_fn: MapFn | None) -> list[dict[str, np.ndarray]]:
    """``v = Theta^(current) - (Theta^(base) - Delta)`` of every input and tensor, as
    ``(current - base) + Delta`` in float64, rounded to float32. Against the current version
    (``base is current``) that is Delta itself, up to the sign of zeros, which neither RDA nor the
    weighted mean can see (they square and add to +0.0), so Delta is used as it is. The stale ones
    are computed in jobs of ``_GRAD_JOB`` values run by ``map_fn``: every value alone,
    so the result is the same bits whatever runs them."""
    grads: list[dict[str, np.ndarray]] = []
    jobs: list[tuple] = []
    for base, delta in zip(bases, deltas):
        g = {}
        for n in names:
            d = np.asarray(delta[n], dtype=np.float32)
            if base[n] is current[n]:
                g[n] = d
                continue
            g[n] = np.empty(d.shape, np.float32)
            flat = (current[n].reshape(-1), base[n].reshape(-1), d.reshape(-1), g[n].reshape(-1))
            jobs += [flat + (lo, min(lo + _GRAD_JOB, d.size)) for lo in range(0, d.size, _GRAD_JOB)]
        grads.append(g)
    list((map_fn or map)(lambda job: _outer_gradient_range(*job), jobs))
    return grads


def published(values: Mapping[str, np.ndarray], version_dtype: str) -> dict[str, np.ndarray]:
    """What learners receive for these values: an fp32 copy, or bf16-rounded values held in float32.
    An int4 run's full values (its version 0, an adopted version) are exact: an fp32 copy."""
    if version_dtype in ("fp32", "int4"):
        return {n: _frozen(a) for n, a in values.items()}
    if version_dtype == "bf16":
        from .codec import round_to_bf16   # lazy: only bf16 runs need the codec; it returns new arrays
        return {n: _sealed(round_to_bf16(np.asarray(a, dtype=np.float32))) for n, a in values.items()}
    raise ValueError(f"version_dtype {version_dtype!r} not one of fp32, bf16")


def initial_state(descriptor: RunDescriptor, init: Mapping[str, np.ndarray], *, last_seq: int = -1) -> SyncerState:
    """Version 0 of every fragment from the one initial model (SPEC §7), zero momentum."""
    names = {t.name for t in descriptor.layout.tensors}
    if set(init) != names:
        raise ValueError(f"initial model tensors differ from the descriptor's: missing {sorted(names - set(init))}, "
                         f"extra {sorted(set(init) - names)}")
    fragments = []
    for p in range(descriptor.num_fragments):
        params = {}
        for spec in descriptor.fragment_specs(p):
            a = np.asarray(init[spec.name])
            if a.shape != spec.shape:
                raise ValueError(f"initial tensor {spec.name} has shape {a.shape}, the descriptor says {spec.shape}")
            if not np.all(np.isfinite(a)):
                raise ValueError(f"initial tensor {spec.name} has non-finite values")
            params[spec.name] = _frozen(a)
        momentum = {n: _frozen(np.zeros(a.shape, np.float32)) for n, a in params.items()}
        fragments.append(FragmentState(0, params, momentum, {0: published(params, descriptor.versions.dtype)}))
    marks = [MergedMarks() for _ in fragments] if descriptor.versions.marks == MARKS_LINEAGE else None
    return SyncerState(fragments, [{} for _ in fragments], last_seq, descriptor.run_id, marks)


@dataclass(frozen=True)
class DropReason:
    """A recorded drop reason, typed: ``category`` (``shape-mismatch``, ``pending-overflow`` ...) and
    an optional ``detail``. Written in ``DroppedRecord.reason`` as ``"category: detail"`` (or the
    category alone); ``parse`` reads that back, so no caller splits the text itself."""

    category: str
    detail: str = ""

    def __post_init__(self) -> None:
        if not self.category or ":" in self.category:
            raise ValueError(f"drop reason category {self.category!r} must be non-empty and hold no ':'")

    def __str__(self) -> str:
        return f"{self.category}: {self.detail}" if self.detail else self.category

    @classmethod
    def parse(cls, text: str) -> "DropReason":
        category, _, detail = text.partition(":")
        return cls(category or "?", detail.strip())


@dataclass(frozen=True)
class RoundInput:
    """One delta offered to a round: its header, where it lies, and its decoded values (None if not decodable)."""

    header: DeltaHeader
    key: str
    checksum: str
    tensors: Mapping[str, np.ndarray] | None
    reject_reason: str = ""


@dataclass(frozen=True)
class FoldResult:
    state: SyncerState
    record: CommitRecord
    published: dict[str, np.ndarray] | None   # None when no new version
    link: ChainStep | None = None             # an int4 run's delta down (pipeline/version_chain.py)


class ReplayMismatch(FormatError):
    """A recomputed commit differs from the recorded one (the log or its inputs are not what was merged)."""

    def __init__(self, seq: int, fragment: int, tensor: str, max_abs_diff: float | None, detail: str):
        where = f" tensor {tensor}" if tensor else ""
        diff = f" (max abs diff {max_abs_diff:g})" if max_abs_diff is not None else ""
        super().__init__(f"replay mismatch at commit {seq}, fragment {fragment}{where}: {detail}{diff}")
        self.seq, self.fragment, self.tensor = seq, fragment, tensor
        self.max_abs_diff, self.detail = max_abs_diff, detail


def _check_seq(state: SyncerState, seq: int) -> None:
    if seq != state.last_seq + 1:
        raise ValueError(f"commit seq {seq} does not follow the last folded seq {state.last_seq} (the log is serial)")


def _prior_reason(h: DeltaHeader, mark: Sequence[int] | None, marks: MergedMarks | None, fs: FragmentState,
                  legacy: bool) -> str:
    """Why the merged history rules ``h`` out ("" = never merged, pipeline/marks.py). ``legacy``: a
    learner-driven run's log, replayed with the reasons it was written with (all ``duplicate``)."""
    if legacy:
        return "duplicate" if mark is not None and h.order <= tuple(mark) else ""
    # Below the mark with an older incarnation: a newer life of this learner id was merged - this
    # life restarted since, or two processes run under one id: stale-incarnation.
    category, detail = prior_verdict(h.learner, h.incarnation, h.seq, h.base_version, mark, marks, fs.history)
    return str(DropReason(category, detail)) if category else ""


def _fragment_marks(state: SyncerState, descriptor: RunDescriptor, fragment: int) -> MergedMarks | None:
    """Fragment ``fragment``'s merged marks; None under rule 1. ValueError when the state does not
    carry what the descriptor's rule needs (a rule-1 state in a rule-2 run, or the reverse)."""
    rule2 = descriptor.versions.marks == MARKS_LINEAGE
    if rule2 != (state.marks is not None) or (rule2 and len(state.marks) != len(state.fragments)):
        raise ValueError(f"the state {'lacks' if rule2 else 'holds'} merged marks, but the run's versions.marks is "
                         f"{descriptor.versions.marks}")
    return state.marks[fragment] if rule2 else None


def merged_before(state: SyncerState, descriptor: RunDescriptor, h: DeltaHeader) -> str:
    """Why the merged history rules ``h`` out ("" = it may count toward a quorum): the fold's own
    rule, and ``base-too-old`` for a delta below its learner's mark whose base left the history
    (it can never merge). The syncer's ingest asks this: an overtaken answer counts."""
    fs, mark = state.fragments[h.fragment], state.high_water[h.fragment].get(h.learner)
    prior = _prior_reason(h, mark, _fragment_marks(state, descriptor, h.fragment), fs,
                          descriptor.schedule.driver == "learner")
    below = mark is not None and h.order < tuple(mark)
    return prior or ("base-too-old" if below and h.base_version not in fs.history else "")


def _why_dropped(inp: RoundInput, fragment: int, fs: FragmentState, hw: Mapping[str, tuple[int, int]],
                 marks: MergedMarks | None, specs: Mapping[str, tuple[int, ...]], seen: set[str],
                 legacy: bool = False) -> str:
    """The reason to drop one input, or "" to keep it. Metadata first, then contents.
    ``legacy``: a learner-driven run's log, replayed with the reasons it was written with."""
    h = inp.header
    if inp.reject_reason:
        return inp.reject_reason
    if h.fragment != fragment:
        return "wrong-fragment"
    if h.id in seen:
        return "duplicate"
    prior = _prior_reason(h, hw.get(h.learner), marks, fs, legacy)
    if prior:
        return prior
    if h.c_steps == 0:
        return "zero-steps"
    if h.c_tokens == 0:    # weighs nothing (SPEC §4 token weight) and must never reach token_weights
        return "zero-tokens"
    if h.base_version > fs.version:
        return "base-from-future"
    if h.base_version not in fs.history:
        return "base-too-old"
    if inp.tensors is None:
        return "undecodable"
    for n in sorted(set(specs) | set(inp.tensors)):
        if n not in specs or n not in inp.tensors or np.shape(inp.tensors[n]) != specs[n]:
            return str(DropReason("shape-mismatch", n))
    for n in sorted(specs):
        if not _finite(inp.tensors[n]):
            return "non-finite"
    return ""


def _lineage(h: DeltaHeader, schedule: str) -> tuple:
    """Deltas that measure the same progress: the newest of a lineage carries all of it.

    A learner's delta is cumulative since its base version, so a newer delta on the same base
    (same learner life) holds an older one's progress and supersedes it. On another base the
    learner applied a version in between: the older delta's progress (a late answer, SPEC §4) is not
    in the newer one and both are merged. Learner-driven runs (old logs) kept one delta per learner.
    """
    if schedule == "learner":
        return (h.learner,)
    return (h.learner, h.incarnation, h.base_version)


def _dropped(inp: RoundInput, reason: str) -> DroppedRecord:
    h = inp.header
    return DroppedRecord(h.id, h.learner, inp.key, inp.checksum, reason, h.c_tokens)


def _select(inputs: Sequence[RoundInput], fragment: int, fs: FragmentState, hw: Mapping[str, tuple[int, int]],
            marks: MergedMarks | None, specs: Mapping[str, tuple[int, ...]], schedule: str
            ) -> tuple[list[RoundInput], list[DroppedRecord]]:
    """The round's survivors (sorted by learner, incarnation, seq) and its drops, every one with its
    reason (sorted by learner, delta id, key)."""
    ordered = sorted(inputs, key=lambda i: (i.header.learner, i.header.incarnation, i.header.seq, i.key, i.checksum))
    dropped: list[DroppedRecord] = []
    candidates: list[RoundInput] = []
    seen: set[str] = set()
    for inp in ordered:
        reason = _why_dropped(inp, fragment, fs, hw, marks, specs, seen, schedule == "learner")
        if reason:
            dropped.append(_dropped(inp, reason))
        else:                                    # a later copy of a kept delta (fast path + spill) is a duplicate
            seen.add(inp.header.id)
            candidates.append(inp)
    newest = {_lineage(i.header, schedule): i for i in candidates}   # sorted ascending: the last wins
    survivors = [i for i in candidates if newest[_lineage(i.header, schedule)] is i]
    dropped += [_dropped(i, "superseded") for i in candidates if newest[_lineage(i.header, schedule)] is not i]
    dropped.sort(key=lambda d: (d.learner, d.delta_id, d.key))
    return survivors, dropped


def fold(state: SyncerState, descriptor: RunDescriptor, fragment: int, inputs: Sequence[RoundInput], *,
         seq: int, epoch: int, output_key: str, round_size: int = 0, grace_wait_s: float = 0.0,
         info: dict | None = None, round_id: int = -1, map_fn: MapFn | None = None) -> FoldResult:
    """Fold one round of ``fragment`` into the next state and its commit record (see module doc).
    ``map_fn`` runs the merge's and the outer step's jobs (e.g. ``ThreadPoolExecutor.map``); the
    result is the same bit for bit whatever runs them. ``round_size``: the learners the round
    counted, stored in the record's historical ``quorum`` field (docs/formats.md)."""
    _check_seq(state, seq)
    if not 0 <= fragment < descriptor.num_fragments or len(state.fragments) != descriptor.num_fragments:
        raise ValueError(f"fragment {fragment} out of range for {descriptor.num_fragments} fragments "
                         f"(state has {len(state.fragments)})")
    fs = state.fragments[fragment]
    hw = state.high_water[fragment]
    marks = _fragment_marks(state, descriptor, fragment)
    specs = {s.name: s.shape for s in descriptor.fragment_specs(fragment)}
    survivors, dropped = _select(inputs, fragment, fs, hw, marks, specs, descriptor.schedule.driver)
    info = dict(info or {})

    def drop_commit(dropped: list[DroppedRecord]) -> FoldResult:
        new_state = state.with_seq(seq)
        record = CommitRecord(seq=seq, epoch=epoch, kind="drop", fragment=fragment, version=fs.version,
                              dropped=tuple(dropped), high_water={m: list(o) for m, o in sorted(hw.items())},
                              quorum=round_size, grace_wait_s=float(grace_wait_s), info=info, round=round_id)
        return FoldResult(new_state, record, None)

    if not survivors:
        return drop_commit(dropped)

    current = fs.history[fs.version]
    grads = _outer_gradients(current, [fs.history[i.header.base_version] for i in survivors],
                             [i.tensors for i in survivors], list(specs), map_fn)
    weights = token_weights([i.header.c_tokens for i in survivors], [i.header.c_steps for i in survivors])
    g = merge_fragment(grads, weights, descriptor.merge, map_fn=map_fn)
    params, momentum = nesterov_step(fs.params, fs.momentum, g, descriptor.outer.lr, descriptor.outer.momentum,
                                     map_fn=map_fn)
    if not all((map_fn or map)(_finite, [a for d in (params, momentum) for a in d.values()])):
        # Finite inputs whose merge overflows float32 (only without the norm guard, which caps
        # them): recorded, never published, never raised.
        every = dropped + [_dropped(i, NON_FINITE_RESULT) for i in survivors]
        return drop_commit(sorted(every, key=lambda d: (d.learner, d.delta_id, d.key)))
    params = {n: _sealed(a) for n, a in params.items()}       # fresh from nesterov_step: no copies
    momentum = {n: _sealed(a) for n, a in momentum.items()}
    version = fs.version + 1
    link = None
    if is_chained(descriptor.versions.dtype):   # int4 deltas against the last published values
        try:
            link = chain_step(params, current, descriptor.codec.block_size)
        except ValueError:       # the difference overflows float32: as a merge that overflows
            every = dropped + [_dropped(i, NON_FINITE_RESULT) for i in survivors]
            return drop_commit(sorted(every, key=lambda d: (d.learner, d.delta_id, d.key)))
        pub = link.published
    elif descriptor.versions.dtype == "fp32":   # the (read-only) parameters themselves
        pub = dict(params)
    else:                                       # bf16: their rounded values
        pub = published(params, descriptor.versions.dtype)
    keep = range(version - descriptor.versions.retain + 1, version)
    history = fs.history.advanced(version, pub, keep, link.raw if link is not None else None,
                                  descriptor.codec.block_size)

    new_hw = dict(hw)
    for inp in survivors:
        new_hw[inp.header.learner] = max(new_hw.get(inp.header.learner, (-1, -1)), inp.header.order)
    fragments = list(state.fragments)
    fragments[fragment] = FragmentState(version, params, momentum, history)
    high_water = list(state.high_water)
    high_water[fragment] = new_hw
    new_marks = None
    if marks is not None:     # each survivor's lineage marked; marks of bases that left the history pruned
        new_marks = list(state.marks)
        new_marks[fragment] = marks.merged([(i.header.learner, i.header.incarnation, i.header.seq,
                                             i.header.base_version) for i in survivors], history.keys())
    new_state = SyncerState(fragments, high_water, seq, state.run_id, new_marks)

    records = tuple(InputRecord(delta_id=i.header.id, learner=i.header.learner, incarnation=i.header.incarnation,
                                seq=i.header.seq, key=i.key, checksum=i.checksum, base_version=i.header.base_version,
                                c_steps=i.header.c_steps, c_tokens=i.header.c_tokens,
                                learner_step=i.header.learner_step, weight=float(w),
                                staleness=fs.version - i.header.base_version, round=i.header.round)
                    for i, w in zip(survivors, weights))
    record = CommitRecord(seq=seq, epoch=epoch, kind="merge", fragment=fragment, version=version, inputs=records,
                          dropped=tuple(dropped), output_key=output_key, output_checksum=tensor_digest(pub),
                          high_water={m: list(o) for m, o in sorted(new_hw.items())}, quorum=round_size,
                          grace_wait_s=float(grace_wait_s), info=info, round=round_id)
    return FoldResult(new_state, record, pub, link)


def fold_fence(state: SyncerState, seq: int, epoch: int, info: dict | None = None) -> FoldResult:
    """A fence commit (a new syncer epoch takes over): only ``last_seq`` advances."""
    _check_seq(state, seq)
    return FoldResult(state.with_seq(seq), CommitRecord(seq=seq, epoch=epoch, kind="fence", info=dict(info or {})),
                      None)


def compare_records(rec: CommitRecord, got: CommitRecord, recorded_output: Mapping[str, np.ndarray] | None,
                    pub: Mapping[str, np.ndarray] | None) -> None:
    """Raise :class:`ReplayMismatch` at the first difference between a recorded commit and its
    recomputation (kind, version, inputs, weights, drops, high-water marks, output checksum); the
    norm guard's norms are compared by pipeline/commit.py."""
    def fail(detail: str, tensor: str = "", diff: float | None = None) -> None:
        raise ReplayMismatch(rec.seq, rec.fragment, tensor, diff, detail)

    if got.kind != rec.kind:
        fail(f"recorded a {rec.kind!r} commit, recomputed a {got.kind!r} commit")
    if got.version != rec.version:
        fail(f"recorded version {rec.version}, recomputed {got.version}")
    if len(got.inputs) != len(rec.inputs):
        fail(f"recorded {len(rec.inputs)} merged inputs {[i.delta_id for i in rec.inputs]}, "
             f"recomputed {len(got.inputs)} {[i.delta_id for i in got.inputs]}")
    # Header fields first: a changed count also changes every weight, and the count is the cause.
    for k, (a, b) in enumerate(zip(rec.inputs, got.inputs)):
        da, db = a.to_dict(), b.to_dict()
        fields = [f for f in da if f != "weight" and da[f] != db[f]]
        if fields:
            fail(f"input {k} ({a.delta_id}): fields {fields} differ: recorded "
                 f"{[da[f] for f in fields]}, recomputed {[db[f] for f in fields]}")
    for k, (a, b) in enumerate(zip(rec.inputs, got.inputs)):
        if a.weight != b.weight:
            fail(f"input {k} ({a.delta_id}): weight recorded {a.weight!r}, recomputed {b.weight!r}",
                 diff=abs(a.weight - b.weight))
    if got.dropped != rec.dropped:
        ra = [(d.delta_id, d.reason) for d in rec.dropped]
        rb = [(d.delta_id, d.reason) for d in got.dropped]
        fail(f"dropped deltas differ: recorded {ra}, recomputed {rb}" if ra != rb else
             "dropped deltas differ in key, checksum or token count")
    if got.high_water != rec.high_water:
        fail(f"high-water marks differ: recorded {rec.high_water}, recomputed {got.high_water}")
    if got.output_checksum != rec.output_checksum:
        tensor, diff = "", None
        if recorded_output is not None and pub is not None:
            diffs = {n: float(np.max(np.abs(np.asarray(recorded_output[n], np.float64) - pub[n].astype(np.float64)),
                                     initial=0.0))
                     for n in sorted(pub) if n in recorded_output and np.shape(recorded_output[n]) == pub[n].shape}
            if diffs:
                tensor = max(diffs, key=lambda n: (diffs[n], n))
                diff = diffs[tensor]
        fail(f"output checksum recorded {rec.output_checksum[:16]}..., recomputed {got.output_checksum[:16]}...",
             tensor, diff)


def check_commit(state: SyncerState, descriptor: RunDescriptor, record: CommitRecord, inputs: Sequence[RoundInput],
                 *, recorded_output: Mapping[str, np.ndarray] | None = None, map_fn: MapFn | None = None
                 ) -> FoldResult:
    """Recompute a recorded commit from its inputs (replay and recovery) and check it bit for bit.

    Compares kind, version, merged inputs (weights exactly), dropped deltas, high-water marks and the
    output checksum; raises :class:`ReplayMismatch` naming the first difference. Pass the recorded
    output values as ``recorded_output`` to have a checksum mismatch name the worst tensor and its max
    abs diff. Timing fields (round size, grace, info) are informative and reused as recorded.
    """
    if record.kind == "fence":
        return fold_fence(state, record.seq, record.epoch, record.info)
    if record.kind not in ("merge", "drop"):
        raise ValueError(f"check_commit: a {record.kind!r} commit is not produced by fold")
    # The recorded info is reused as it is, but for the guard's norms: fold records none (they are
    # pipeline/commit.py's, which compares them), and a recomputed commit of another kind has none.
    info = {k: v for k, v in record.info.items() if k != "norms"}
    res = fold(state, descriptor, record.fragment, inputs, seq=record.seq, epoch=record.epoch, map_fn=map_fn,
               output_key=record.output_key, round_size=record.round_size, grace_wait_s=record.grace_wait_s, info=info,
               round_id=record.round)
    compare_records(record, res.record, recorded_output, res.published)
    return res
