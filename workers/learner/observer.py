"""What a step observer sees of a learner's training loop: each step's parts, as ``Learner.step``
measured them (``LearnerConfig.step_observer``; none by default, then nothing is recorded).

The parts: the step's wall time, answering rounds (encoding is not here: the sender does it on its
own thread, the training thread only extracts and subtracts the fragment), applying arrived
versions, forward + backward + optimizer (``compute``), and what happened in it: deltas handed
over, versions applied, whether the step wrote a progress event. The overhead investigation's
trace (infra/lab/steptrace.py) is one observer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass
class StepParts:
    """One step's timings (seconds) and counts."""
    took_s: float
    answer_s: float
    apply_s: float
    compute_s: float
    answered: int
    applied: int
    logged: bool


class StepObserver(Protocol):
    """Called on the training thread: keep ``record`` cheap (a few clock reads and a tuple)."""

    def record(self, parts: StepParts) -> None: ...

    def close(self) -> None:
        """The learner closed: nothing more is recorded."""
