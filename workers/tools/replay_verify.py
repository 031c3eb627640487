"""Verify a run bit for bit: what `ddiloco replay` does (SPEC §7 'Replay'; issue "Replay and
inspection of a run's fragment log").

:func:`replay_run` drives ``workers.common.refold.rebuild`` — the very path the syncer's restart recovery
takes — from the nearest checkpoint before ``start`` (or the init commits), folding silently (every
commit still checked) up to ``start``, then verifying ``start..end``: each commit is recomputed from
its recorded inputs and compared with the record, norms included (``pipeline.commit.verify_commit``),
each stored version object is compared with the recomputed values (naming the worst tensor), and
each checkpoint passed is compared with the recomputed state. Nothing is written: damage stops the
replay with an error naming the object, the commit and what is wrong.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from pipeline.checksum import tensor_digest
from pipeline.codec import decode
from pipeline.commit import Commit
from pipeline.errors import FormatError
from pipeline.fold import ReplayMismatch, SyncerState
from pipeline.descriptor import RunDescriptor
from pipeline.types import CommitRecord
from pipeline.version_chain import apply_delta, is_chained
from storage.checkpoints import list_checkpoints, read_checkpoint
from storage.errors import NotFound, StoreError
from storage.layout import HEAD_HINT_KEY, RETENTION_KEY, published_keys, unpack_head_hint, unpack_retention_hint
from storage.log import CommitLog
from storage.store import ObjectStore
from workers.common.refold import ReplayStats, rebuild
from workers.common.versions import (VERSION_DELTA_KIND, VERSION_KIND, decode_version, decode_version_delta,
                                     max_fragment_bytes)


@dataclass
class ReplayReport:
    """What ``replay_run`` did: commits folded (and checked) to reach ``start``, and verified."""

    start: int
    end: int
    tail: int
    from_checkpoint: int | None
    caught_up: int               # commits folded before ``start``
    commits: int                 # commits verified in start..end
    versions: int                # of which new fragment versions (their stored objects checked too)
    checkpoints: int             # checkpoints in start..end equal to the recomputed state
    seconds: float
    warnings: list[str] = field(default_factory=list)


def retention_horizon(store: ObjectStore) -> int | None:
    """The horizon retention wrote (``hints/retention``; None when it never deleted anything or the
    hint is unreadable - then a replay starts from the beginning and says what is missing)."""
    try:
        return unpack_retention_hint(store.get(RETENTION_KEY), what=f"{store.uri}/{RETENTION_KEY}")
    except (NotFound, FormatError):
        return None


def log_bounds(store: ObjectStore, descriptor: RunDescriptor, start: int | None, end: int | None
               ) -> tuple[int, int, int]:
    """``(start, end, tail)`` of a replay. Defaults: the first commit after the init commits (those
    are checked as version 0 loads) - or, once retention removed what older commits named, the
    first after its horizon (``hints/retention``, issue 26) - and the tail. ``start`` 0 asks for
    the beginning whatever retention did. ValueError names a bound outside the log."""
    if (start is not None and start < 0) or (end is not None and end < 0):
        raise ValueError(f"--from/--to must be >= 0, got {start}/{end}")
    tail = CommitLog(store).tail()
    P = descriptor.num_fragments
    horizon = retention_horizon(store) if start is None else None
    if horizon is not None and P <= horizon < tail:
        start = horizon + 1
    if tail < P - 1:
        raise FormatError(f"{store.uri}: the log ends at commit {tail}, before the {P} init commits")
    lo = P if start is None else max(start, P)
    hi = tail if end is None else end
    if hi > tail:
        raise ValueError(f"--to {hi} is past the end of the log (the last commit is {tail})")
    if end is not None and end < P:
        raise ValueError(f"--to {end} is an init commit; commits 0..{P - 1} are checked as version 0 loads, "
                         f"replay verifies from commit {P}")
    if lo > hi and (start is not None or end is not None):
        raise ValueError(f"--from {lo} is after --to {hi}")
    return lo, hi, tail


class _Verifier:
    """The checks beyond ``verify_commit``, through ``rebuild``'s hooks: ``load_output`` hands the
    stored version to ``verify_commit`` (so a divergence names the tensor), ``after`` compares the
    stored version and any checkpoint with what was recomputed."""

    def __init__(self, store: ObjectStore, descriptor: RunDescriptor, state: SyncerState):
        self.store, self.descriptor = store, descriptor
        self.checkpoints = set(list_checkpoints(store))
        self.matched = 0
        self.stored: tuple[int, bytes, dict[str, np.ndarray]] | None = None
        self.state = state     # before the commit being verified (an int4 run's deltas start from it)

    def _base(self, rec: CommitRecord) -> dict[str, np.ndarray] | None:
        """An int4 run's values before ``rec``'s delta (the recomputed previous version), else None."""
        if not is_chained(self.descriptor.versions.dtype):
            return None
        base = self.state.fragments[rec.fragment].history.get(rec.version - 1)
        if base is None:
            raise FormatError(f"commit {rec.seq}: version {rec.version - 1} of fragment {rec.fragment}, the base "
                              "of its delta, is not in the recomputed state")
        return base

    def load_output(self, rec: CommitRecord) -> dict[str, np.ndarray]:
        blob, values = _stored_version(self.store, self.descriptor, rec, self._base(rec))
        self.stored = (rec.seq, blob, values)
        return values

    def after(self, rec: CommitRecord, result: Commit) -> None:
        if rec.kind == "merge" and result.published is not None:
            if self.stored is None or self.stored[0] != rec.seq:
                self.load_output(rec)
            _, blob, values = self.stored
            _compare_stored(rec, values, result.published)
            base = self._base(rec)
            try:   # and every check readers apply (in a signed run: the syncer's signature on it)
                if base is None:
                    decode_version(blob, self.descriptor, rec)
                else:
                    decode_version_delta(blob, self.descriptor, rec, base)
                    for key in published_keys(rec)[1:]:      # the full snapshot beside the delta
                        decode_version(self.store.get(key), self.descriptor, rec)
            except FormatError as exc:
                raise FormatError(f"commit {rec.seq}'s version {rec.version} of fragment {rec.fragment}: "
                                  f"{exc}") from None
        self.state = result.state
        if rec.seq in self.checkpoints:
            _compare_checkpoint(self.store, self.descriptor, rec.seq, result.state)
            self.matched += 1


def replay_run(store: ObjectStore, descriptor: RunDescriptor, start: int | None = None, end: int | None = None, *,
               progress: Callable[[str, CommitRecord, ReplayStats], None] | None = None,
               notify: Callable[[str], None] | None = None,
               clock: Callable[[], float] = time.monotonic) -> ReplayReport:
    """Verify commits ``start..end`` (default: every commit after the init commits); see the module
    docstring. ``progress(phase, record, stats)`` is called per commit with phase ``"catch-up"`` or
    ``"verify"``; ``notify(line)`` says where the replay started. Raises ReplayMismatch (a
    divergence), NotFound (a missing object) or FormatError (damage), each naming the commit."""
    t0 = clock()
    lo, hi, tail = log_bounds(store, descriptor, start, end)
    warnings = _hint_warnings(store, tail)
    at: dict = {"seq": None}   # the commit being folded (once known), for errors that do not name one

    def phase(name: str):
        def seen(rec: CommitRecord, stats: ReplayStats) -> None:
            at["seq"] = rec.seq + 1
            if progress is not None:
                progress(name, rec, stats)
        return seen

    with _at_commit(store, at):
        state, before = rebuild(store, descriptor, lo - 1, progress=phase("catch-up"))
    warnings += [f"skipped a checkpoint: {why}" for why in getattr(before, "rejected_checkpoints", [])]
    if notify is not None:
        origin = f"checkpoint {before.from_checkpoint}" if before.from_checkpoint is not None else "the init commits"
        notify(f"started from {origin}, caught up over {before.commits} commits; verifying")
    verifier = _Verifier(store, descriptor, state)
    at["seq"] = state.last_seq + 1
    try:
        with _at_commit(store, at):
            _, stats = rebuild(store, descriptor, hi, start_state=state, progress=phase("verify"),
                               load_output=verifier.load_output, on_commit=verifier.after)
    except ReplayMismatch as exc:
        stored = verifier.stored
        if (exc.detail.startswith("output checksum") and exc.max_abs_diff == 0.0 and stored is not None
                and stored[0] == exc.seq and tensor_digest(stored[2]) != CommitLog(store).read(exc.seq).output_checksum):
            # The stored version equals the recomputed one in every tensor and not its own commit's
            # checksum: the record is what changed.
            rec = CommitLog(store).read(exc.seq)
            raise ReplayMismatch(exc.seq, exc.fragment, "", None,
                                 f"the commit's recorded output_checksum {rec.output_checksum[:16]}... matches "
                                 f"neither the recomputed version nor the stored object {rec.output_key}, which "
                                 "agree with each other: the commit record was altered") from None
        raise
    return ReplayReport(start=lo, end=hi, tail=tail, from_checkpoint=before.from_checkpoint, caught_up=before.commits,
                        commits=stats.commits, versions=stats.versions, checkpoints=verifier.matched,
                        seconds=clock() - t0, warnings=warnings)


class _at_commit:
    """Name the commit (and for a missing object, what the commit calls it) in a store or format
    error that does not (types are kept)."""

    def __init__(self, store: ObjectStore, at: dict):
        self.store, self.at = store, at

    def __enter__(self) -> None:
        return None

    def __exit__(self, typ, exc, tb) -> bool:
        if exc is None or isinstance(exc, ReplayMismatch):
            return False
        seq = self.at["seq"]
        if seq is None:
            return False
        if isinstance(exc, NotFound) and f"commit {seq}" not in str(exc):
            raise NotFound(_missing(self.store, seq, exc.key), uri=exc.uri, key=exc.key) from None
        if isinstance(exc, FormatError) and not isinstance(exc, StoreError) and f"commit {seq}" not in str(exc) \
                and not str(exc).startswith("checkpoint "):
            raise FormatError(f"replaying commit {seq}: {exc}") from None
        return False


def _missing(store: ObjectStore, seq: int, key: str | None) -> str:
    """'missing: merged delta L/I/S, named by commit N' (or the like) for a missing object."""
    try:
        rec = CommitLog(store).read(seq)
    except (StoreError, FormatError):
        return f"missing (needed to replay commit {seq})"
    for i in rec.inputs:
        if i.key == key:
            return f"missing: merged delta {i.delta_id}, named by commit {seq}"
    for d in rec.dropped:
        if d.key == key:
            return f"missing: dropped delta {d.delta_id} ({d.reason}), named by commit {seq}"
    return f"missing (needed to replay commit {seq})"


def _stored_version(store: ObjectStore, descriptor: RunDescriptor, rec: CommitRecord,
                    base: Mapping[str, np.ndarray] | None = None) -> tuple[bytes, dict[str, np.ndarray]]:
    """A commit's stored version object and its values, decoded and shape-checked but *not* checked
    against the commit's checksum (``_compare_stored`` does that and can then name the tensor).
    ``base``: in an int4 run, the values the stored delta is added to."""
    key = rec.output_key
    try:
        blob = store.get(key)
    except NotFound:
        raise NotFound(f"missing: version {rec.version} of fragment {rec.fragment}, named by commit {rec.seq}",
                       uri=store.uri, key=key) from None
    try:
        dec = decode(blob, VERSION_KIND if base is None else VERSION_DELTA_KIND,
                     max_bytes=max_fragment_bytes(descriptor), expect=descriptor.fragment_specs(rec.fragment), what=key)
    except FormatError as exc:
        raise FormatError(f"commit {rec.seq}'s version {rec.version} of fragment {rec.fragment}: {exc}") from None
    if dec.meta.get("fragment") != rec.fragment or dec.meta.get("version") != rec.version:
        raise FormatError(f"{key}: holds fragment {dec.meta.get('fragment')} version {dec.meta.get('version')}, "
                          f"but commit {rec.seq} names fragment {rec.fragment} version {rec.version}")
    values = {n: np.asarray(a, dtype=np.float32) for n, a in dec.tensors.items()}
    return blob, values if base is None else apply_delta(base, values)


def max_abs_diff(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> tuple[str, float]:
    """The tensor (present in both, same shape) with the largest max abs difference, and that difference."""
    diffs = {n: float(np.max(np.abs(a[n].astype(np.float64) - b[n].astype(np.float64)), initial=0.0))
             for n in sorted(a) if n in b and np.shape(a[n]) == np.shape(b[n])}
    if not diffs:
        return "", float("nan")
    name = max(diffs, key=lambda n: (diffs[n], n))
    return name, diffs[name]


def _compare_stored(rec: CommitRecord, stored: Mapping[str, np.ndarray], recomputed: Mapping[str, np.ndarray]) -> None:
    """The recomputed version matched the commit's checksum; the stored object must hold it too."""
    if tensor_digest(stored) == rec.output_checksum:
        return
    tensor, diff = max_abs_diff(stored, recomputed)
    raise ReplayMismatch(rec.seq, rec.fragment, tensor, diff,
                         f"the stored version object {rec.output_key} differs from the recomputed version, which "
                         "matches the commit's output_checksum (the version object was altered or replaced)")


def _compare_checkpoint(store: ObjectStore, descriptor: RunDescriptor, seq: int, state: SyncerState) -> None:
    """Checkpoint ``seq`` must hold exactly the recomputed state after commit ``seq``."""
    what = f"checkpoint {seq}"
    try:
        payload = _checkpoint_state_bytes(store, descriptor, seq)
    except NotFound:
        return   # removed by retention since it was listed: nothing to compare
    except FormatError as exc:
        raise FormatError(f"{what} is damaged: {exc}") from None
    if payload == state.to_bytes():
        return                      # the common case: the same bytes
    # Otherwise compare what the checkpoint holds, not how it is encoded: a checkpoint
    # written by an older version (another envelope version, another field order) that holds the
    # recomputed state exactly is a match; only a difference in content is a mismatch.
    saved = SyncerState.from_bytes(payload, descriptor, what=what)
    difference = _state_difference(saved, state)
    if difference is not None:
        fragment, tensor, diff, detail = difference
        raise ReplayMismatch(seq, fragment, tensor, diff, f"{what} differs from the recomputed state: {detail}")


def _checkpoint_state_bytes(store: ObjectStore, descriptor: RunDescriptor, seq: int) -> bytes:
    payload = read_checkpoint(store, seq)
    if descriptor.security is None:
        return payload
    from workers.bus.signing import open_checkpoint      # signed runs: the state is inside the syncer's signature
    return open_checkpoint(payload, seq, descriptor.security.syncer.sign, descriptor.run_id, f"checkpoint {seq}")


def _state_difference(saved: SyncerState, got: SyncerState) -> tuple[int, str, float | None, str] | None:
    """(fragment, tensor, max abs diff, what) of the first difference between two states; None
    when they hold the same content."""
    if saved.last_seq != got.last_seq or saved.run_id != got.run_id:
        return -1, "", None, f"it is for seq {saved.last_seq} of run {saved.run_id!r}"
    for p, (a, b) in enumerate(zip(saved.fragments, got.fragments)):
        if a.version != b.version:
            return p, "", None, f"version {a.version}, recomputed {b.version}"
        for part in ("params", "momentum"):
            x, y = getattr(a, part), getattr(b, part)
            if tensor_digest(x) != tensor_digest(y):
                tensor, diff = max_abs_diff(x, y)
                return p, tensor, diff, f"outer {part} differ"
        if sorted(a.history) != sorted(b.history):
            return p, "", None, f"retained versions {sorted(a.history)}, recomputed {sorted(b.history)}"
        for v in sorted(a.history):
            if tensor_digest(a.history[v]) != tensor_digest(b.history[v]):
                tensor, diff = max_abs_diff(a.history[v], b.history[v])
                return p, tensor, diff, f"retained version {v} differs"
        if saved.high_water[p] != got.high_water[p]:
            return p, "", None, f"high-water marks {saved.high_water[p]}, recomputed {got.high_water[p]}"
        if saved.marks is not None and got.marks is not None and saved.marks[p] != got.marks[p]:   # issue 25
            return p, "", None, f"merged marks {saved.marks[p]}, recomputed {got.marks[p]}"
    if (saved.marks is None) != (got.marks is None):
        return -1, "", None, f"merged marks {'absent' if saved.marks is None else 'present'} in the checkpoint, " \
            f"{'absent' if got.marks is None else 'present'} in the recomputed state"
    return None


def _hint_warnings(store: ObjectStore, tail: int) -> list[str]:
    """The head hint never runs ahead of the log: if it does, commits after the tail were lost
    (or the store was copied while the run was writing)."""
    try:
        hinted = unpack_head_hint(store.get(HEAD_HINT_KEY), what=f"{store.uri}/{HEAD_HINT_KEY}")
    except NotFound:
        return []
    except FormatError as exc:
        return [f"{exc} (the advisory head hint is damaged)"]
    if hinted > tail:
        return [f"{HEAD_HINT_KEY} says commit {hinted} was written, but the log ends at commit {tail}: "
                f"commits {tail + 1}..{hinted} are missing (or the store was copied while the run was writing)"]
    return []
