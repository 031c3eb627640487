"""A learner whose model turns non-finite keeps training (SPEC §3, §8).

A step whose loss or gradients are not finite is *skipped*: the optimizer does not step (so the
inner optimizer state never sees a NaN), nothing is counted, and a ``nonfinite-step`` event says
what happened. Then the fragments that can have caused it go back to their last good version:

- **suspects**: fragments whose version changed since the last finite step (a version that makes
  the loss explode, e.g. a finite "value bomb" the syncer merged), and fragments whose parameters
  are themselves non-finite. Each goes back to the version it held at the last finite step.
- with no suspect, one bad batch is just skipped; after ``streak_limit`` non-finite steps in a row
  the learner's own training diverged, and every fragment goes back to its current version
  (its local work since that version is discarded, as a restart would, SPEC §8);
- if that does not help either (another ``streak_limit`` in a row, no finite step between), the
  current versions themselves are the trouble (e.g. the learner *started* from a bad one): every
  fragment steps back to its previous committed version, read from storage, and further back each
  time, until a step is finite again or there is nothing older (then it keeps skipping, reporting).

The last good version's values are the ones the learner loaded from storage and checked against
their commit (workers/common/versions.py): they are kept by reference while a newer version is on
probation (until the next finite step), so recovery needs no storage round trip and works while
storage is down. After a reload the fragment's counters restart at zero and its base is that
version, so the next delta is reconstructed correctly by the syncer (SPEC §4: a stale base is
fine). Versions newer than the one refused are applied normally when they arrive.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np
import torch

from pipeline.errors import FormatError
from storage.errors import StoreError
from workers.learner.host_bases import tensor_of

STREAK_LIMIT = 3       # non-finite steps in a row, with no suspect version, before the model is reset
MAX_SCAN = 10_000      # commits read back (newest first) looking for an older version of a fragment


# The cheap check (``_grads_finite_fused``): gradients scaled by 2^86 and back, exact for float32.
_SCALE_EXP = 86
_BIG = 2.0 ** (128 - _SCALE_EXP)     # 2^42 ~ 4.4e12: an entry this large overflows when scaled up
_MAX_FUSED = 2 ** 40                  # entries: below it, entries < 2^42 keep the norm < 2^62


def grads_finite(params: Iterable[torch.nn.Parameter]) -> bool:
    """Whether every gradient is finite and none is huge: every entry finite and below 2^42
    (4.4e12), and their total L2 norm finite in float32. A step refused here is a divergence
    anyway (AdamW's second moment would turn inf), so it is skipped like a non-finite one.

    CPU float32 gradients (the demo job, any CPU model) take the fused check below; others
    (an accelerator, other dtypes, sparse) the total norm, as before (issue 15: inside the
    training loop the norm cost 0.32 ms of the default job's 13 ms step - 29 per-tensor kernels on
    a cold cache - the fused check 0.13 ms; docs/scale.md). Both refuse every step the norm alone did:
    with all entries below 2^42 and at most 2^40 of them the norm is below 2^62."""
    grads = [g for p in params if (g := p.grad) is not None]
    if not grads:
        return True
    if _fusable(grads):
        return _grads_finite_fused(grads)
    # One reduction and one device sync, as the norm alone was: the largest |entry| (a NaN makes it
    # NaN, which is not below the bound). Below the bound, at most 2^40 entries keep the L2 norm finite.
    if not float(torch.nn.utils.get_total_norm(grads, float("inf"))) < _BIG:
        return False
    return sum(g.numel() for g in grads) <= _MAX_FUSED or bool(torch.isfinite(torch.nn.utils.get_total_norm(grads)))


def _fusable(grads: list[torch.Tensor]) -> bool:
    """CPU float32 dense gradients outside autograd, at most ``_MAX_FUSED`` entries in all (one
    loop, ``is_cpu`` rather than ``device.type``: 16 vs 41 us per step inside the training loop)."""
    f32, strided, n = torch.float32, torch.strided, 0
    for g in grads:
        if g.dtype is not f32 or not g.is_cpu or g.layout is not strided or g.requires_grad:
            return False
        n += g.numel()
    return n <= _MAX_FUSED


_UP = torch.tensor(2.0 ** _SCALE_EXP, dtype=torch.float32)
_DOWN = torch.tensor(2.0 ** -_SCALE_EXP, dtype=torch.float32)


def _grads_finite_fused(grads: list[torch.Tensor]) -> bool:
    """Two passes of torch's fused multi-tensor check (the one GradScaler uses): it flags a
    non-finite *input* and multiplies in place. Pass 1 flags non-finite entries and scales by 2^86;
    pass 2 flags entries that overflowed (|g| >= 2^42) and scales back. Scaling by a power of two
    is exact in float32 both ways (subnormals included, -0.0 kept), so an accepted step's
    gradients are bit for bit unchanged; a refused step's are discarded (its step is skipped)."""
    found = torch.zeros((), dtype=torch.float32)
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, _UP)
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, _DOWN)
    return found.item() == 0.0


def older_version(tracker, fragment: int, before: int) -> tuple[int, dict[str, np.ndarray]] | None:
    """The newest committed version of ``fragment`` older than ``before`` that loads and checks
    (workers/common/versions.py), scanning the log back from its tail; None if there is none (or storage
    cannot be read now). A damaged or deleted (retention) version is passed over."""
    try:
        seq = tracker.log.tail()
        for _ in range(MAX_SCAN):
            if seq < 0:
                return None
            rec = tracker.log.read(seq)
            seq -= 1
            if rec.kind in ("init", "merge") and rec.fragment == fragment and rec.version < before:
                try:
                    return rec.version, tracker.load(rec)
                except (StoreError, FormatError):
                    continue
    except (StoreError, FormatError):
        return None
    return None


@dataclass
class NonFiniteGuard:
    """Per-learner bookkeeping: the last good version of every fragment and the current streak.
    ``tracker``: a VersionTracker of its own (the receiver's belongs to the receiver thread),
    used only for the last resort of stepping back to older versions."""

    tracker: object = None
    streak_limit: int = STREAK_LIMIT
    good: dict[int, tuple[int, dict[str, np.ndarray]]] = field(default_factory=dict)
    streak: int = 0
    skipped: int = 0          # steps skipped in total
    reloads: int = 0          # fragments reloaded in total
    _reset_done: bool = False  # reset to the current versions since the last finite step

    def __post_init__(self) -> None:
        if not isinstance(self.streak_limit, int) or self.streak_limit < 1:
            raise ValueError(f"streak_limit must be an int >= 1, got {self.streak_limit!r}")

    def check(self, learner, loss: torch.Tensor, value: float | None = None) -> bool:
        """True when the step may go on. Otherwise the step is to be skipped; this has already
        reported it and reloaded what needed reloading (module docstring). ``value``: the loss as a
        float when the caller has it already (one read of the loss per step)."""
        value = float(loss.detach()) if value is None else value
        where = "loss" if not math.isfinite(value) else \
            "gradient" if not grads_finite(learner.params.values()) else ""
        if not where:
            self._mark_good(learner)
            return True
        self.streak += 1
        self.skipped += 1
        P = learner.descriptor.num_fragments
        suspects = {p for p in range(P) if p in self.good and self.good[p][0] != learner.base_version[p]}
        suspects |= {p for p in range(P) if not _fragment_finite(learner, p)}
        action, targets = "skip", []
        if suspects:
            action, targets = "reload-last-good", sorted(suspects)
        elif self.streak >= self.streak_limit:
            action = "step-back" if self._reset_done else "reset-to-current"
            targets = list(range(P))
            self._reset_done = True
        reloaded = {}
        for p in targets:
            version = self._reload(learner, p, action)
            if version is not None:
                reloaded[str(p)] = version
        n = self.streak
        if targets or n & (n - 1) == 0:     # every reload; otherwise the 1st, 2nd, 4th... in a row
            learner.events.emit("nonfinite-step", where=where, loss=repr(value), step=learner.step_count,
                                streak=n, skipped=self.skipped, action=action, reloaded=reloaded,
                                **({"stuck": "no older version to step back to"} if targets and not reloaded else {}))
        if targets:
            self.streak = 0
        return False

    def _mark_good(self, learner) -> None:
        self.streak = 0
        self._reset_done = False
        for p, v in learner.base_version.items():
            if self.good.get(p, (None,))[0] != v:
                self.good[p] = (v, learner.base[p])

    def _reload(self, learner, p: int, action: str) -> int | None:
        """Overwrite fragment ``p`` with the version ``action`` names; its version, or None."""
        if action == "reload-last-good" and p in self.good:
            version, values = self.good[p]
        elif action == "step-back":
            found = older_version(self.tracker, p, learner.base_version[p]) if self.tracker is not None else None
            if found is None:
                return None
            version, values = found
        else:
            version, values = learner.base_version[p], learner.base[p]
        with torch.no_grad():
            for name in learner.descriptor.layout.fragments[p]:
                param = learner.params[name]
                param.copy_(tensor_of(np.asarray(values[name])).to(param.dtype))
                param.grad = None
        learner.base[p] = values
        learner.base_version[p] = version
        self.good[p] = (version, values)
        learner.c_steps[p] = 0
        learner.c_tokens[p] = 0
        getattr(learner, "_at_answer", {}).pop(p, None)   # keep_progress: the work since that answer is gone
        self.reloads += 1
        return version


def _fragment_finite(learner, p: int) -> bool:
    with torch.no_grad():
        return all(bool(torch.isfinite(learner.params[n]).all()) for n in learner.descriptor.layout.fragments[p])
