"""How long a learner waits for a sent delta's ack before it spills the delta (SPEC §7, issue 31).

The syncer acks a bus delta once it is in the inbox, on its one loop thread, so an ack can only be
as fast as a loop turn, and a loop turn holds a whole merge: measured at 101M parameters, 1.1-3.5 s.
A fixed 2 s deadline spilled 15 of 18 deltas the bus had delivered (the upload paid twice). The wait
therefore follows the acks the learner has seen:

    wait = clamp(factor * max(last ``window`` ack latencies), floor, cap)

*Choices*: the max, not a mean or a percentile, because one spill costs a whole delta's upload while
waiting longer only delays a spill that the fast path already made unnecessary; factor 2 leaves room
for a merge longer than any seen; the floor is the configured ``ack_timeout_s`` (a small model's
acks take milliseconds, and the floor keeps today's behaviour there); the cap bounds how long a
delta the bus silently lost stays non-durable. Only acks of deltas that were sent count (a
``durable`` ack of a delta already merged says nothing about the round).

Pure: the caller passes each measured latency; no clock here.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

__all__ = ["AckWaitConfig", "AckWait"]


@dataclass(frozen=True)
class AckWaitConfig:
    floor_s: float = 2.0      # never spill sooner than this after sending (SenderConfig.ack_timeout_s)
    cap_s: float = 30.0       # never wait longer than this for an ack
    factor: float = 2.0
    window: int = 16          # ack latencies remembered

    def __post_init__(self) -> None:
        for name in ("floor_s", "cap_s", "factor"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        if self.cap_s < self.floor_s:
            raise ValueError(f"cap_s ({self.cap_s}) must be >= floor_s ({self.floor_s})")
        if self.factor < 1:
            raise ValueError(f"factor must be >= 1, got {self.factor}")
        if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 1:
            raise ValueError(f"window must be an int >= 1, got {self.window!r}")


class AckWait:
    """The spill deadline after a send, from the recent ack latencies."""

    def __init__(self, cfg: AckWaitConfig):
        self.cfg = cfg
        self._recent: deque[float] = deque(maxlen=cfg.window)
        self._wait = cfg.floor_s       # kept up to date by observe(): read every sender turn

    def observe(self, latency_s: float) -> None:
        """One sent delta's ack came ``latency_s`` after it was sent. Nonsense (negative, not
        finite: a clock that stepped) is ignored rather than allowed to set the deadline."""
        if isinstance(latency_s, (int, float)) and math.isfinite(latency_s) and latency_s >= 0:
            self._recent.append(float(latency_s))
            self._wait = min(self.cfg.cap_s, max(self.cfg.floor_s, self.cfg.factor * self.longest_s))

    @property
    def longest_s(self) -> float:
        """The longest ack latency remembered (0 before any)."""
        return max(self._recent, default=0.0)

    def wait_s(self) -> float:
        """Seconds after a send before the delta is spilled."""
        return self._wait
