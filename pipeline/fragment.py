"""Which tensors form which fragment, when each fragment falls due, and moving values in and out.

SPEC §5 (balanced tensor fragmentation) and §2 (offsets t_p). The paper splits the model into P
fragments of whole tensors with greedy bin packing so that every step sends about the same number of
bytes; Streaming DiLoCo (arXiv 2501.18512) instead uses runs of consecutive layers. Both, and plain
tensor-wise round robin, are offered so the benchmarks can compare peak bandwidth.

A layout is ``list[list[str]]``: fragment p is the list of its tensor names, sorted. Every layout is
a pure function of the specs (names, shapes, dtypes), their order (model order, for ``layerwise`` and
``roundrobin`` only) and P, so every process computes the same one; the run descriptor records it.
"""
from __future__ import annotations

import heapq
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, MutableMapping, Sequence

import numpy as np

from .types import DTYPES, TensorSpec

STRATEGIES = ("balanced", "layerwise", "roundrobin")

# "blocks.3.", "h.3.", "layers.3.", optionally after a module prefix ("transformer.h.3.", "model.layers.3.").
_LAYER_RE = re.compile(r"(?:^|\.)(?:blocks|block|h|layers|layer)\.(\d+)\.")


def _check(specs: Sequence[TensorSpec], P: int) -> None:
    if not isinstance(P, int) or isinstance(P, bool) or P < 1:
        raise ValueError(f"number of fragments P must be an int >= 1, got {P!r}")
    names = [s.name for s in specs]
    if P > len(names):
        raise ValueError(f"P={P} fragments but only {len(names)} tensors: every fragment needs a whole tensor")
    seen: set[str] = set()
    for n in names:
        if n in seen:
            raise ValueError(f"duplicate tensor name {n!r} in specs")
        seen.add(n)


def balanced_layout(specs: Sequence[TensorSpec], P: int) -> list[list[str]]:
    """Greedy longest-processing-time bin packing (SPEC §5).

    Tensors by size descending (ties: name ascending) each go to the currently lightest fragment
    (ties: an empty fragment first, then the lowest index). The "empty first" rule only matters for
    zero-sized tensors and guarantees that no fragment stays empty. The result does not depend on the
    order of ``specs``. LPT's makespan is within 4/3 of the optimum (Graham 1969).
    """
    _check(specs, P)
    order = sorted(specs, key=lambda s: (-s.nbytes, s.name))
    heap = [(0, 0, p) for p in range(P)]  # (bytes, 0 if empty else 1, index)
    out: list[list[str]] = [[] for _ in range(P)]
    for s in order:
        load, _, p = heapq.heappop(heap)
        out[p].append(s.name)
        heapq.heappush(heap, (load + s.nbytes, 1, p))
    return [sorted(f) for f in out]


def _layer_key(name: str) -> str | None:
    m = _LAYER_RE.search(name)
    return name[: m.end()] if m else None


def _contiguous(n_units: int, P: int) -> list[int]:
    """Unit i of n goes to fragment (i * P) // n: consecutive runs whose sizes differ by at most one."""
    return [(i * P) // n_units for i in range(n_units)]


def layerwise_layout(specs: Sequence[TensorSpec], P: int) -> list[list[str]]:
    """Runs of consecutive layers, about the same NUMBER of layers per fragment (Streaming DiLoCo).

    A layer is the set of tensors sharing a prefix such as ``blocks.3.`` / ``h.3.`` / ``layers.3.``.
    Tensors outside any layer join their neighbour in model order: leading ones (embeddings) the
    first layer, later ones (final norm, output head) the layer before them. With fewer layers than
    fragments (or none), it falls back to consecutive runs of equal tensor counts.
    """
    _check(specs, P)
    groups: list[list[str]] = []
    index: dict[str, int] = {}
    leading: list[str] = []
    current = -1  # group of the previous tensor in model order
    for s in specs:
        key = _layer_key(s.name)
        if key is not None:
            current = index.setdefault(key, len(groups))
            if current == len(groups):
                groups.append([])
        (groups[current] if current >= 0 else leading).append(s.name)
    if len(groups) < P:
        units = [[s.name] for s in specs]
    else:
        groups[0][:0] = leading
        units = groups
    out: list[list[str]] = [[] for _ in range(P)]
    for unit, p in zip(units, _contiguous(len(units), P)):
        out[p].extend(unit)
    return [sorted(f) for f in out]


def roundrobin_layout(specs: Sequence[TensorSpec], P: int) -> list[list[str]]:
    """Plain tensor-wise assignment: tensor i in model order goes to fragment i % P."""
    _check(specs, P)
    out: list[list[str]] = [[] for _ in range(P)]
    for i, s in enumerate(specs):
        out[i % P].append(s.name)
    return [sorted(f) for f in out]


def make_layout(specs: Sequence[TensorSpec], P: int, strategy: str = "balanced") -> list[list[str]]:
    """The layout for ``strategy`` (one of ``STRATEGIES``)."""
    if strategy == "balanced":
        return balanced_layout(specs, P)
    if strategy == "layerwise":
        return layerwise_layout(specs, P)
    if strategy == "roundrobin":
        return roundrobin_layout(specs, P)
    raise ValueError(f"fragment strategy {strategy!r} not one of {STRATEGIES}")


@dataclass(frozen=True)
class FragmentLayout:
    """The run's tensors and which fragment holds each (the run descriptor's ``layout``): fragment p
    is ``fragments[p]``, whole tensors by name, every tensor in exactly one; ``strategy`` (one of
    STRATEGIES) records how ``make_layout`` made it."""

    tensors: tuple[TensorSpec, ...]
    fragments: tuple[tuple[str, ...], ...]
    strategy: str = "balanced"

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensors", tuple(self.tensors))
        object.__setattr__(self, "fragments", tuple(tuple(f) for f in self.fragments))
        if not all(isinstance(t, TensorSpec) for t in self.tensors):
            raise ValueError("layout tensors must be TensorSpecs")
        if len(self.fragments) < 1:
            raise ValueError("a run needs at least one fragment")
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError("duplicate tensor names in the layout")
        if sorted(n for frag in self.fragments for n in frag) != sorted(names):
            raise ValueError("fragments must place every tensor exactly once")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"layout strategy {self.strategy!r} not one of {STRATEGIES}")

    @property
    def num_fragments(self) -> int:
        return len(self.fragments)

    def spec(self, name: str) -> TensorSpec:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

    def fragment_specs(self, p: int) -> list[TensorSpec]:
        by_name = {t.name: t for t in self.tensors}
        return [by_name[n] for n in self.fragments[p]]


def fragment_offsets(P: int, H: int) -> list[int]:
    """Step offsets t_p = (p*H)//P: distinct (needs P <= H) and evenly spread over 0..H-1 (SPEC §2)."""
    if not isinstance(H, int) or isinstance(H, bool) or H < 1:
        raise ValueError(f"sync interval H must be an int >= 1, got {H!r}")
    if not isinstance(P, int) or isinstance(P, bool) or P < 1:
        raise ValueError(f"number of fragments P must be an int >= 1, got {P!r}")
    if P > H:
        raise ValueError(f"P={P} fragments cannot have distinct offsets within H={H} steps (need P <= H)")
    return [(p * H) // P for p in range(P)]


def due_fragments(step: int, H: int, offsets: Sequence[int]) -> list[int]:
    """Fragments p due at inner step ``step``: those with ``step % H == offsets[p]``."""
    if not isinstance(H, int) or H < 1:
        raise ValueError(f"sync interval H must be an int >= 1, got {H!r}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    r = step % H
    return [p for p, t in enumerate(offsets) if t == r]


def fragment_bytes(specs: Sequence[TensorSpec], layout: Sequence[Sequence[str]]) -> list[int]:
    """Bytes (in each tensor's own dtype) of every fragment."""
    size = {s.name: s.nbytes for s in specs}
    out = []
    for p, names in enumerate(layout):
        total = 0
        for n in names:
            if n not in size:
                raise ValueError(f"fragment {p} names tensor {n!r}, which is not in the specs")
            total += size[n]
        out.append(total)
    return out


def layout_stats(specs: Sequence[TensorSpec], layout: Sequence[Sequence[str]]) -> dict:
    """Size summary: ``imbalance`` = max/mean (1.0 is perfect; 1.0 for an all-empty model)."""
    b = fragment_bytes(specs, layout)
    mean = sum(b) / len(b) if b else 0.0
    return {"max_bytes": max(b, default=0), "min_bytes": min(b, default=0), "mean_bytes": mean,
            "imbalance": (max(b) / mean) if mean > 0 else 1.0, "fragments": len(b)}


def _dtype_name(dtype: Any) -> str:
    # numpy: "float32"; torch: "torch.float32" (str() without importing torch).
    return str(dtype).removeprefix("torch.")


def specs_from_arrays(named: Mapping[str, Any]) -> list[TensorSpec]:
    """TensorSpecs (model order kept) for objects with ``.shape`` and ``.dtype`` (numpy or torch)."""
    out = []
    for name, a in named.items():
        dtype = _dtype_name(a.dtype)
        if dtype not in DTYPES:
            raise ValueError(f"tensor {name}: dtype {dtype!r} not one of {DTYPES}")
        out.append(TensorSpec(name, tuple(int(d) for d in a.shape), dtype))
    return out


def _to_numpy_f32(name: str, obj: Any) -> np.ndarray:
    if hasattr(obj, "detach"):  # torch.Tensor, duck-typed: pipeline must not import torch
        obj = obj.detach().cpu().float().numpy()
    try:
        # copy=True: .numpy() of a CPU float32 tensor shares its memory; a live view would change under us.
        return np.array(obj, dtype=np.float32, copy=True)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"tensor {name}: cannot convert {type(obj).__name__} to float32 ({exc})") from None


def extract(state: Mapping[str, Any], names: Sequence[str]) -> dict[str, np.ndarray]:
    """Float32 numpy copies of ``state[name]`` for each name (numpy arrays or torch tensors)."""
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate tensor names in {list(names)}")
    out = {}
    for n in names:
        if n not in state:
            raise ValueError(f"tensor {n!r} is not in the state")
        out[n] = _to_numpy_f32(n, state[n])
    return out


def assign(state: MutableMapping[str, Any], values: Mapping[str, np.ndarray],
           from_numpy: Callable[[np.ndarray], Any] | None = None) -> None:
    """Write ``values`` into the existing arrays/tensors of ``state`` in place, casting to their dtype.

    All names and shapes are checked before anything is written, so a bad call changes nothing.
    Torch tensors get ``dst.data.copy_(src)`` where ``src = from_numpy(v)`` if given, else
    ``dst.new_tensor(v)`` (a tensor of dst's dtype and device; no torch import needed here).
    """
    for n, v in values.items():
        if n not in state:
            raise ValueError(f"tensor {n!r} is not in the state")
        dst_shape, src_shape = tuple(state[n].shape), tuple(np.shape(v))
        if dst_shape != src_shape:
            raise ValueError(f"tensor {n}: shape mismatch, state has {dst_shape}, value has {src_shape}")
    for n, v in values.items():
        dst = state[n]
        if isinstance(dst, np.ndarray):
            np.copyto(dst, v, casting="unsafe")
        elif hasattr(dst, "copy_"):
            src = from_numpy(np.ascontiguousarray(v)) if from_numpy else dst.new_tensor(np.asarray(v))
            dst.data.copy_(src)
        else:
            raise ValueError(f"tensor {n}: cannot assign into {type(dst).__name__} (not numpy or torch)")
