"""Per-step records of a learner's training loop, to find where slow steps come from (the
question of docs/results-overhead.md).

A step observer (``LearnerConfig(step_observer=StepTrace(window))``, workers/learner/observer.py):
for each of the last ``window`` steps it keeps the parts the learner measured, plus the Python
garbage collections that ran in the step (any generation; counted through ``gc.callbacks``).
The lab's learner (infra/lab/overhead_roles.py) writes them as one ``step-trace`` event (columns,
not rows, to keep it short), which ``python -m infra.lab.overhead`` reads to report the tails of
each class of step.
"""
from __future__ import annotations

import gc
from collections import deque

from workers.learner.observer import StepParts

COLUMNS = ("took_s", "answer_s", "apply_s", "compute_s", "answered", "applied", "gcs", "logged")

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
