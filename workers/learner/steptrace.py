"""Per-step records of a learner's training loop, to find where slow steps come from.

``LearnerConfig.trace_steps`` turns it on (off by default: it costs a few clock reads and one
tuple per step). For each of the last ``stats_window`` steps it keeps the step's wall time and
its parts - answering rounds (encoding is not here: the sender does it on its own thread, the
training thread only extracts and subtracts the fragment), applying arrived versions, forward +
backward + optimizer (``compute``) - plus what happened in it: deltas handed over, versions
applied, Python garbage collections that ran (any generation; counted through ``gc.callbacks``),
and whether the step wrote a progress event. ``Learner.close`` writes them as one ``step-trace``
event (columns, not rows, to keep it short), which ``python -m infra.lab.overhead``
(infra/lab/overhead.py) reads to report the tails of each class of step.
"""
from __future__ import annotations

import gc
from collections import deque
from dataclasses import dataclass

COLUMNS = ("took_s", "answer_s", "apply_s", "compute_s", "answered", "applied", "gcs", "logged")


@dataclass
class StepParts:
    """One step's timings (seconds) and counts, as ``Learner.step`` measured them."""
    took_s: float
    answer_s: float
    apply_s: float
    compute_s: float
    answered: int
    applied: int
    logged: bool


class StepTrace:
    """The last ``window`` steps' parts; ``gcs`` counts collections started since the last record."""

    def __init__(self, window: int):
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"StepTrace window must be an int >= 1, got {window!r}")
        self.rows: deque[tuple] = deque(maxlen=window)
        self._gcs = 0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gcs += 1

    def record(self, parts: StepParts) -> None:
        """Kept as measured: rounding waits for ``columns`` (off the training loop)."""
        gcs, self._gcs = self._gcs, 0
        self.rows.append((parts.took_s, parts.answer_s, parts.apply_s, parts.compute_s, parts.answered,
                          parts.applied, gcs, int(parts.logged)))

    def columns(self) -> dict[str, list]:
        """The rows as one list per column (``COLUMNS``), oldest step first; seconds to the microsecond."""
        cols = list(zip(*self.rows)) if self.rows else [()] * len(COLUMNS)
        return {name: [round(x, 6) for x in col] if name.endswith("_s") else list(col)
                for name, col in zip(COLUMNS, cols)}

    def close(self) -> None:
        """Stop counting collections (the callback list is process-wide)."""
        try:
            gc.callbacks.remove(self._on_gc)
        except ValueError:
            pass
