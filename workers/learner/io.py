"""The learner's I/O, declared once: what ``Learner`` calls on the part that sends its deltas and on
the part that brings it versions (SPEC §3, §6). Three pairs implement it - the threads of the
learner's own process (sender.py, receiver.py), one per syncer shard (shards.py) and the sync
agent in a child process (agent.py) - and the learner holds one pair without asking which.

``DeltaSender.logs_deltas``: the implementation writes each delta's ``delta`` event itself (the
agent does, off the training thread); ``writes_difference``: it takes ``submit_difference``, the
outer delta as (base, parameters) that it subtracts where the bytes go (the agent's shared memory)
instead of a computed delta.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from pipeline.types import DeltaHeader


@runtime_checkable
class DeltaSender(Protocol):
    logs_deltas: bool
    writes_difference: bool

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def submit(self, header: DeltaHeader, tensors: dict[str, np.ndarray]) -> None: ...
    def submit_difference(self, header: DeltaHeader, base: dict[str, np.ndarray], params: dict) -> None: ...
    def beat_soon(self) -> None: ...
    def drain(self, timeout_s: float) -> bool: ...
    def undelivered(self) -> int: ...
    @property
    def failed(self) -> str | None: ...
    @property
    def stats(self): ...          # workers.learner.sender.SenderStats


@runtime_checkable
class VersionReceiver(Protocol):
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def take(self) -> list: ...   # [workers.learner.receiver.Arrival]
    def opened(self) -> dict[int, tuple[int, int]]: ...
    @property
    def failed(self) -> str | None: ...
    @property
    def errors(self) -> int: ...
    @property
    def refused(self) -> int: ...
    @property
    def bytes_received(self) -> int: ...
    @property
    def awaited(self) -> int: ...
    @property
    def copy_misses(self) -> int: ...
    @property
    def copy_wait_s(self) -> float: ...


def no_difference(kind: str):
    """``submit_difference`` of a sender that takes computed deltas only (``writes_difference`` False)."""
    def submit_difference(self, header: DeltaHeader, base: dict[str, np.ndarray], params: dict) -> None:
        raise TypeError(f"{kind} takes computed deltas (submit); only the sync agent writes differences")
    return submit_difference
