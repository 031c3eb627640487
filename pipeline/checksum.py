"""Canonical digests of tensor values.

A commit's ``output_checksum`` is the digest of the *values* it published, not of the compressed
blob, so replay compares what matters and stays valid across zstd library versions.
"""
from __future__ import annotations

import hashlib
from typing import Mapping

import numpy as np


def tensor_digest(tensors: Mapping[str, np.ndarray]) -> str:
    """Hex sha256 over (name, dtype, shape, C-order bytes) of each tensor, in sorted name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        h.update(name.encode())
        h.update(b"\0")
        h.update(str(a.dtype).encode())
        h.update(repr(tuple(a.shape)).encode())
        h.update(a.tobytes())
    return h.hexdigest()
