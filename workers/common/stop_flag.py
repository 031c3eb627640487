"""A stop flag that a signal handler may set: SIGTERM/SIGINT ask a role or a user's script to stop.

``threading.Event`` is not safe for that: ``Event.set`` takes the event's lock, and a Python signal
handler runs in the main thread between two bytecodes - also while that thread holds the same lock
inside ``Event.wait`` (Condition.wait re-acquires it before returning). The handler then waits for
a lock its own thread holds, forever. That hung a SLURM-cancelled learner held at a test's gate
(``stop_requested().wait(0.05)``, issue 25: one clean-clone run in ~10), and any user script that
waits on the flag could hang the same way at a SIGTERM, until SLURM's or Kubernetes' SIGKILL.

:class:`StopFlag` takes no lock to set: a bool and one byte written to a non-blocking pipe; ``wait``
sleeps in ``select`` on the pipe, which the byte wakes (in the main thread the signal interrupts
``select``, the handler runs, ``select`` sees the byte). Once set it stays set.
"""
from __future__ import annotations

import os
import select

__all__ = ["StopFlag"]


class StopFlag:
    """``set``, ``is_set`` and ``wait`` like ``threading.Event``, safe to set from a signal handler."""

    def __init__(self) -> None:
        self._flag = False
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    def set(self) -> None:
        self._flag = True
        try:
            os.write(self._w, b"s")
        except (BlockingIOError, OSError):   # a full pipe already wakes every waiter
            pass

    def is_set(self) -> bool:
        return self._flag

    def wait(self, timeout: float | None = None) -> bool:
        """True once set; waits at most ``timeout`` seconds (None: until set)."""
        if not self._flag:
            select.select([self._r], [], [], timeout)
        return self._flag
