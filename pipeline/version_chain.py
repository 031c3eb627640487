"""Versions down as int4 deltas against the previous published version, with error feedback (issue 31).

In a run whose ``versions.dtype`` is ``int4`` a fragment's published values form a chain
(docs/algorithm.md "Versions down"; SPEC §6 applies int4 to deltas up, this applies it down):

    pub_0 = Theta_0                                  (the initial model, exact fp32)
    q_v   = Q4(Theta_v - pub_{v-1})                  (the codec's int4, per tensor, the run's block size)
    pub_v = pub_{v-1} + D4(q_v)                      (float32 addition, element by element)

``Theta_v`` is the syncer's exact fp32 master state; ``pub_v`` is what learners, the syncer's
reconstruction of stale deltas and replay hold. Because every ``q_v`` is taken against the
previous *published* values, the quantisation error of one version is part of the next version's
difference (error feedback): ``Theta_v - pub_v`` stays one quantisation step, it never accumulates.
``D4`` is the codec's own decoder (the function ``decode`` runs) and the addition is IEEE float32,
so a learner that decodes the stored bytes and adds them to its ``pub_{v-1}`` holds ``pub_v`` bit
for bit; the commit names ``pub_v``'s digest, so a broken chain is caught by the digest check.

Pure: no I/O. ``chain_step`` is what the fold calls, ``apply_delta`` what every reader calls.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from .codec import dequantize, quantize

__all__ = ["CHAIN_DTYPES", "CHAIN_SCHEME", "ChainStep", "chain_step", "apply_delta", "is_chained", "needs_snapshot"]

CHAIN_DTYPES = ("int4",)   # versions dtypes whose versions travel as deltas
CHAIN_SCHEME = "int4"


def is_chained(version_dtype: str) -> bool:
    """Whether versions of this dtype are published as a chain of deltas."""
    return version_dtype in CHAIN_DTYPES


def needs_snapshot(version: int, full_every: int, first_of_epoch: bool) -> bool:
    """Whether the commit of ``version`` also stores its full values: every ``full_every`` versions
    (so a new learner reads one snapshot and fewer than ``full_every`` deltas) and the first commit
    of a fragment in a syncer's epoch (recovery may have changed the values a delta would start
    from: an adopted or lost version)."""
    return first_of_epoch or version % full_every == 0


class ChainStep:
    """One link: the published values and the raw int4 payload per tensor (the delta blob's bytes
    before compression, docs/formats.md "Tensor blobs"), in fragment order."""

    __slots__ = ("published", "raw")

    def __init__(self, published: dict[str, np.ndarray], raw: dict[str, bytes]):
        self.published = published
        self.raw = raw

    def payload(self, names: Sequence[str]) -> np.ndarray:
        """The blob's raw payload: the tensors' encodings concatenated in ``names`` order."""
        return np.frombuffer(b"".join(self.raw[n] for n in names), dtype=np.uint8)


def _read_only(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def chain_step(params: Mapping[str, np.ndarray], prev: Mapping[str, np.ndarray], block_size: int) -> ChainStep:
    """The next link from the master values ``params`` and the previous published values ``prev``.
    ValueError when a difference is not finite (float32 overflow; the fold drops such a round)."""
    published, raw = {}, {}
    for n, a in params.items():
        diff = np.subtract(a, prev[n], dtype=np.float32)
        raw[n] = quantize(diff, CHAIN_SCHEME, block_size)
        d = dequantize(raw[n], CHAIN_SCHEME, block_size, diff.size).reshape(diff.shape)
        published[n] = _read_only(np.add(prev[n], d, dtype=np.float32))
    return ChainStep(published, raw)


def apply_delta(prev: Mapping[str, np.ndarray], delta: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``pub_v`` from ``pub_{v-1}`` and a decoded delta: the one addition every reader makes.
    ValueError when the tensors differ."""
    if set(prev) != set(delta):
        raise ValueError(f"a version delta holds tensors {sorted(delta)}, its base {sorted(prev)}")
    out = {}
    for n, a in prev.items():
        d = delta[n]
        if d.shape != a.shape:
            raise ValueError(f"a version delta's tensor {n} has shape {d.shape}, its base {a.shape}")
        out[n] = _read_only(np.add(a, np.asarray(d, dtype=np.float32), dtype=np.float32))
    return out
