"""One commit, decided in one place: the norm guard, the fold and the norm window (SPEC §4, §7).

The live syncer (workers/syncer/syncer.py), its restart recovery (workers/syncer/recovery.py) and the replay tool
(workers/common/refold.py) all call :func:`apply_commit`, and nothing else decides what a round merges or
drops. Given the syncer state, the norm window (None when the run has no guard, pipeline/guard.py),
a fragment, the round's inputs and the commit's metadata, it returns the next state, the next
window, the commit record and the published values:

1. inputs the caller already rejected from their bytes or the round's set (``RoundInput.reject_reason``:
   ``bad-signature``, ``unsigned``, ``dtype-mismatch``, ``pending-overflow`` ...) pass through as they are;
2. the norm guard marks outliers ``norm-outlier`` against the window and the fragment's cap
   (non-finite deltas are left to the fold, which says ``non-finite``); a version-3 guard judges
   the round's inputs together, per step of work (``guard.round_verdicts``, issue 25);
3. the fold (pipeline/fold.py) drops for every other reason and merges the survivors;
4. a merge commit records the (raw) norm of each merged input, in ``inputs`` order
   (``CommitRecord.norms``), and only a merge commit moves the window, by exactly those norms
   (version 3: each divided by the square root of the input's recorded ``c_steps``,
   ``guard.window_values``, so the window is a function of the records alone).

Replay and recovery call :func:`verify_commit`, which is :func:`apply_commit` with the record's
own metadata followed by a bit-for-bit comparison (norms with ``guard.norms_agree``). Pure and
deterministic: no I/O; a window is a value, so a commit that is never appended changes nothing.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from .errors import FormatError
from .fold import (DropReason, ReplayMismatch, RoundInput, SyncerState, compare_records, fold,
                   fold_fence)
from .guard import (NormGuardConfig, NormWindow, cap_limit, delta_norm, guard_config, mark_outliers, norms_agree,
                    window_values)
from .merge import MapFn
from .descriptor import RunDescriptor
from .types import CommitRecord
from .version_chain import ChainStep

__all__ = ["CommitMeta", "Commit", "apply_commit", "verify_commit", "initial_window", "backfill_window",
           "window_after", "with_recorded_decisions", "PENDING_OVERFLOW", "BELOW_QUORUM", "RECORDED_REASONS"]

# Drop reasons replay takes from the commit record rather than recomputing: what the live syncer
# decided about the *set* of a round, not about a delta's bytes.
PENDING_OVERFLOW = "pending-overflow"
BELOW_QUORUM = "below-quorum"          # late answers of fewer than K learners, expired
RECORDED_REASONS = frozenset({PENDING_OVERFLOW, BELOW_QUORUM})
_END = object()


@dataclass(frozen=True)
class CommitMeta:
    """What the caller decides about a commit besides its inputs: its place in the log, the key
    of its version object and the informative fields (round size, grace wait, ``info``, round).
    ``round_size``: how many distinct learners the round counted, stored as the record's
    historical ``quorum`` field (``CommitRecord.round_size``)."""

    seq: int
    epoch: int
    output_key: str = ""
    round_size: int = 0
    grace_wait_s: float = 0.0
    info: Mapping[str, Any] = field(default_factory=dict)
    round: int = -1

    def __post_init__(self) -> None:
        if "norms" in self.info:
            raise ValueError("CommitMeta.info must not carry 'norms': apply_commit records them")

    @classmethod
    def of(cls, record: CommitRecord) -> "CommitMeta":
        """The metadata of a recorded commit (replay recomputes the rest)."""
        info = {k: v for k, v in record.info.items() if k != "norms"}
        return cls(record.seq, record.epoch, record.output_key, record.round_size, record.grace_wait_s, info,
                   record.round)


@dataclass(frozen=True)
class Commit:
    """The result of one commit: the next state and window, the record, the published values
    (None when no new version)."""

    state: SyncerState
    window: NormWindow | None
    record: CommitRecord
    published: dict[str, np.ndarray] | None
    link: ChainStep | None = None    # an int4 run's delta down: what the committer stores


def initial_window(descriptor: RunDescriptor) -> NormWindow | None:
    """An empty norm window for the run's guard, or None when the run has none."""
    cfg = guard_config(descriptor)
    return None if cfg is None else NormWindow.empty(descriptor.num_fragments, cfg)


def _check_window(descriptor: RunDescriptor, window: NormWindow | None) -> None:
    """The window must be the run's: a missing one would silently switch the guard off."""
    cfg = guard_config(descriptor)
    if cfg is None and window is not None:
        raise ValueError(f"run {descriptor.run_id} has no norm guard, but a norm window was passed")
    if cfg is not None and (window is None or window.cfg != cfg or window.fragments != descriptor.num_fragments):
        raise ValueError(f"run {descriptor.run_id} has a norm guard {cfg}: pass its window "
                         f"(initial_window(descriptor)), got {window!r:.120}")


def _run_job(job: Callable[[], Any]) -> Any:
    return job()


def _guard(inputs: Sequence[RoundInput], history: Sequence[float], cfg: NormGuardConfig,
           params: Mapping[str, np.ndarray], map_fn: MapFn) -> tuple[list[RoundInput], dict[str, float]]:
    """``guard.apply_guard`` with its norms computed as jobs of ``map_fn``: one per judged input
    and one for the cap (each a full read of a fragment, the guard's whole cost at large sizes).
    Every norm is order independent (``delta_norm``: fixed chunks, ``math.fsum``), so the verdicts
    and recorded norms are the same bits whatever runs the jobs (tests/test_commit_threads.py)."""
    judged = [k for k, i in enumerate(inputs) if not i.reject_reason and i.tensors is not None]
    jobs = [partial(cap_limit, params, cfg)] + [partial(delta_norm, inputs[k].tensors) for k in judged]
    limit, *values = list(map_fn(_run_job, jobs))
    return mark_outliers(inputs, judged, values, history, cfg, limit)


def apply_commit(state: SyncerState, window: NormWindow | None, descriptor: RunDescriptor, fragment: int,
                 inputs: Sequence[RoundInput], meta: CommitMeta, *, map_fn: MapFn | None = None) -> Commit:
    """Decide one commit of ``fragment`` (module docstring): guard, fold, record the merged norms,
    move the window. ``inputs`` may hold deltas the caller rejected (``reject_reason``).

    ``map_fn`` runs the guard's norms and the fold's jobs (e.g. ``ThreadPoolExecutor.map`` of a
    pool the caller owns; default ``map``, on this thread): the commit is the same bit for bit
    whatever runs them."""
    _check_window(descriptor, window)
    if not 0 <= fragment < len(state.fragments):
        raise ValueError(f"fragment {fragment} out of range for a state of {len(state.fragments)} fragments")
    norms: dict[str, float] = {}
    if window is not None and inputs:
        inputs, norms = _guard(inputs, window.history(fragment), window.cfg, state.fragments[fragment].params,
                               map_fn or map)
    res = fold(state, descriptor, fragment, inputs, seq=meta.seq, epoch=meta.epoch, output_key=meta.output_key,
               round_size=meta.round_size, grace_wait_s=meta.grace_wait_s, info=dict(meta.info), round_id=meta.round,
               map_fn=map_fn)
    record = res.record
    if window is not None and record.kind == "merge":
        # Every survivor was decoded and judged by the guard, so each has a norm.
        record = record.with_norms(tuple(norms[i.checksum] for i in record.inputs))
    return Commit(res.state, window_after(window, record), record, res.published, res.link)


def window_after(window: NormWindow | None, record: CommitRecord) -> NormWindow | None:
    """The window after ``record`` as recorded: only a merge commit's norms move it (a drop or a
    fence merged nothing). Recovery uses it for a commit it adopts rather than re-folds; one
    without valid norms adds nothing, as ``backfill_window`` skips it."""
    if window is None or record.kind != "merge" or record.norms is None \
            or not 0 <= record.fragment < window.fragments:
        return window
    return window.pushed(record.fragment, _window_values(window, record))


def _window_values(window: NormWindow, record: CommitRecord) -> tuple[float, ...]:
    """What a merge commit with valid norms adds to the window (``guard.window_values``)."""
    return window_values(window.cfg, record.norms, [i.c_steps for i in record.inputs])


def backfill_window(window: NormWindow, older: Iterable[CommitRecord | None]) -> NormWindow:
    """Fill ``window`` backwards from the commits before a starting point, ``older`` newest first
    (None: a commit that is missing or damaged), reading no further than needed: the window at a
    commit is a function of the log before it, wherever a replay or a recovery starts. A commit
    without valid norms adds nothing (recovery's salvage skips it the same way)."""
    records = iter(older)
    while not all(window.full(p) for p in range(window.fragments)):   # checked before each read
        rec = next(records, _END)
        if rec is _END:
            break
        if rec is not None and rec.kind == "merge" and rec.norms is not None \
                and 0 <= rec.fragment < window.fragments and not window.full(rec.fragment):
            window = window.prepended(rec.fragment, _window_values(window, rec))
    return window


def with_recorded_decisions(record: CommitRecord, inputs: Sequence[RoundInput]) -> list[RoundInput]:
    """Inputs in record order (merged, then dropped), with the drops that only the live syncer could
    decide taken from the record (``RECORDED_REASONS``): which deltas a round contains is the
    syncer's choice, not a function of the bytes."""
    out = list(inputs)
    for k, d in enumerate(record.dropped):
        i = len(record.inputs) + k
        if DropReason.parse(d.reason).category in RECORDED_REASONS and i < len(out):
            out[i] = dataclasses.replace(out[i], reject_reason=d.reason, tensors=None)
    return out


def verify_commit(state: SyncerState, window: NormWindow | None, descriptor: RunDescriptor, record: CommitRecord,
                  inputs: Sequence[RoundInput], *, recorded_output: Mapping[str, np.ndarray] | None = None,
                  map_fn: MapFn | None = None) -> Commit:
    """Recompute a recorded commit with :func:`apply_commit` and check it bit for bit (SPEC §7
    'Replay'): ReplayMismatch at the first difference, norms included; FormatError for a merge of
    a guarded run that records no norms. The window moves by the *recorded* norms (what the live
    syncer's later verdicts used; version-1 guard maps' norms may differ in the last bits)."""
    if record.kind == "fence":
        res = fold_fence(state, record.seq, record.epoch, record.info)
        return Commit(res.state, window, res.record, None)
    if record.kind not in ("merge", "drop"):
        raise ValueError(f"verify_commit: a {record.kind!r} commit is not produced by apply_commit")
    got = apply_commit(state, window, descriptor, record.fragment, inputs, CommitMeta.of(record), map_fn=map_fn)
    compare_records(record, got.record, recorded_output, got.published)
    if window is None or record.kind != "merge":
        return got
    if record.norms is None:
        raise FormatError(f"commit {record.seq}: the run has a norm guard but the commit records no valid norms "
                          f"for its {len(record.inputs)} inputs")
    if not norms_agree(record.norms, got.record.norms, window.cfg):
        raise ReplayMismatch(record.seq, record.fragment, "", None, f"recorded input norms {list(record.norms)} "
                             f"but the inputs have norms {list(got.record.norms)}")
    return dataclasses.replace(got, record=got.record.with_norms(record.norms), window=window_after(window, record))
