"""Bounded running figures for long-lived processes: a syncer or learner that
runs for weeks must not keep one list entry per commit or step.

``RunningMean`` takes the place of a list that was only ever appended to and averaged: it keeps
count, sum, min and max (O(1) memory) and offers ``append`` so call sites need not change.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RunningMean:
    count: int = 0
    total: float = 0.0
    low: float = float("inf")
    high: float = float("-inf")

    def append(self, x: float) -> None:
        x = float(x)
        self.count += 1
        self.total += x
        self.low = min(self.low, x)
        self.high = max(self.high, x)

    @property
    def mean(self) -> float:
        """The mean of everything appended (0.0 before anything was)."""
        return self.total / self.count if self.count else 0.0

    def __len__(self) -> int:
        return self.count

    def __bool__(self) -> bool:
        return self.count > 0
