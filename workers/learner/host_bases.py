"""Where a learner keeps its fragments' bases θ_p (the global version it last took, SPEC §3; issue 28).

Bases live in host memory, never beside the parameters: the model's device holds no second copy of
the model (``device_base_cache`` aside, answers.py). When the model is on a CUDA device the bases
are page-locked (pinned), so the upload an answer makes of its fragment's base (``_device_base``)
is a DMA transfer instead of a copy through a staging buffer. Pinned memory is
allocated by torch's caching host allocator, so a base replaced by a newer version returns its pages
to that cache for the next one."""
from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping

import numpy as np
import torch


def tensor_of(a: np.ndarray) -> torch.Tensor:
    """A CPU tensor over ``a`` without a copy, for reading. An int4 run's bases are the version
    tracker's read-only arrays (workers/common/versions.py: the chain's head); torch warns about
    any read-only array, though a base is only ever read (a write would break the chain, which the
    next version's digest check catches)."""
    if a.flags.writeable:
        return torch.from_numpy(a)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(a)


def pin_bases(params: Iterable[torch.Tensor]) -> bool:
    """Whether this learner's bases go to pinned memory: some parameter lives on a CUDA device."""
    return torch.cuda.is_available() and any(p.device.type == "cuda" for p in params)


def host_base(values: Mapping[str, np.ndarray], names: Iterable[str], pinned: bool,
              copy: bool) -> dict[str, np.ndarray]:
    """Fragment ``names`` of ``values`` as a base: numpy arrays over pinned pages when ``pinned``
    (always a copy: the array keeps its pinned tensor alive), else the arrays themselves or, with
    ``copy``, copies of them (a base must not alias the parameters' staging arrays)."""
    if pinned:
        return {n: tensor_of(np.ascontiguousarray(values[n])).pin_memory().numpy() for n in names}
    return {n: values[n].copy() if copy else values[n] for n in names}
