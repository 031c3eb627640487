"""Quantise a fragment's delta where the model lives; copy only the packed bytes to the host.

Issue 15 ("device-agnostic" codec): with the model on an accelerator, the learner's answer
(SPEC §3: ``Δ_p = base_p − θ_p``) is computed and int4/int8-quantised on that device by torch ops,
into exactly the raw payload ``pipeline.codec.encode`` writes (docs/formats.md "Tensor blobs": per
tensor the block scales, float32 little-endian, then the codes; int4 two per byte, low nibble
first). The bytes go to pinned host memory by a non-blocking copy followed by a recorded event: the
training thread never waits; the sender thread waits on the event (``DeviceDelta.wait``) and seals
the payload with ``pipeline.codec_raw.seal_raw``: the same blob bytes as ``encode``.

Why every op is exact on every device (the codec's arithmetic, SPEC §6: round half to even):
- ``base - θ``: one IEEE float32 subtraction, as numpy's; ``.float()`` of float16/bfloat16 is exact.
- ``abs``, ``amax`` (a max is exact in any order; it propagates NaN), ``where``, ``clamp``, padding
  with zeros, integer ``&``, ``|``, ``<<`` and bit views: no rounding at all.
- ``absmax / qmax`` and ``x / scale``: IEEE float32 division, correctly rounded — but only when the
  divisor is a *tensor on the device*: CUDA (and XPU) kernels replace division by a CPU scalar with
  multiplication by its reciprocal ("may lose one bit of precision", aten/src/ATen/native/cuda/
  BinaryDivTrueKernel.cu), so ``qmax`` is passed as a device tensor here.
- ``+ MAGIC``: one float32 addition (``MAGIC`` is exact in float32; a fused ``a + 1·b`` rounds once too).
- Subnormals: CUDA kernels are built without flush-to-zero; on CPU ``torch.set_flush_denormal(True)``
  would change subnormal scales' codes, so it must stay off (the default).

Non-finite values are detected from the scales on the host (pipeline/codec_raw.py): no device sync.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from pipeline import codec_raw
from pipeline.codec import _MAGIC, _QMAX as QMAX, CodecConfig   # the codec's own constants: the same codes
# Values per kernel call: bounds the temporaries (about 4 float32 copies of a chunk). An accelerator
# wants few, large calls (each launches ~12 kernels from the training thread); the CPU wants chunks
# whose temporaries are not fresh pages: 16M-value chunks took 145 ms per 16M int4 values, 1M 23 ms
# (infra/lab/bench_device_quant.py, docs/scale.md).
CHUNK = 1 << 24
CPU_CHUNK = 1 << 20


def _quantise_chunk(x: torch.Tensor, scheme: str, bs: int, qmax_t: torch.Tensor, one_t: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 values ``x`` (a whole number of blocks) -> (scales float32, codes uint8)."""
    qmax = QMAX[scheme]
    xb = x.view(-1, bs)
    scales = torch.amax(torch.abs(xb), dim=1) / qmax_t          # a device tensor divisor: IEEE division
    safe = torch.where(scales > 0, scales, one_t)               # an all-zero block: scale 0, codes 0
    t = xb / safe[:, None]
    # The codec clips only where a scale is subnormal; with a normal scale |t| <= qmax (1 + 2**-23)
    # rounds to qmax anyway, so clipping every block gives the same codes.
    t.clamp_(-qmax, qmax).add_(float(_MAGIC[scheme]))                  # round half to even, never stochastic
    low = torch.bitwise_and(t.view(torch.int32).view(-1), 0xFF)   # int4: q + 8; int8: q mod 256
    if scheme == "int4":
        low = torch.bitwise_or(low[0::2], torch.bitwise_left_shift(low[1::2], 4))
    return scales, low.to(torch.uint8)


def quantise_into(out: torch.Tensor, offset: int, values: Callable[[int, int], torch.Tensor], numel: int,
                  scheme: str, bs: int) -> int:
    """Quantise ``numel`` values (``values(lo, hi)`` gives float32 ``lo:hi``) into ``out`` (uint8, the
    device payload) at ``offset``: scales then codes; the offset after them."""
    nb = -(-numel // bs)
    per_byte = 2 if scheme == "int4" else 1
    codes_at = offset + 4 * nb
    qmax_t = torch.full((1,), float(QMAX[scheme]), dtype=torch.float32, device=out.device)
    one_t = torch.ones((1,), dtype=torch.float32, device=out.device)
    step = max(bs, (CPU_CHUNK if out.device.type == "cpu" else CHUNK) // bs * bs)
    for lo in range(0, numel, step):
        hi = min(lo + step, numel)
        x = values(lo, hi)
        if (hi - lo) % bs:   # the zero-padded last block
            x = torch.nn.functional.pad(x, (0, bs - (hi - lo) % bs))
        scales, codes = _quantise_chunk(x, scheme, bs, qmax_t, one_t)
        b0 = lo // bs
        out[offset + 4 * b0:offset + 4 * (b0 + scales.numel())].copy_(scales.view(torch.uint8))
        c0 = codes_at + b0 * bs // per_byte
        out[c0:c0 + codes.numel()].copy_(codes)
    return codes_at + nb * bs // per_byte


def _payload(sources: Sequence[tuple[tuple[int, ...], Callable[[int, int], torch.Tensor]]], device: torch.device,
             scheme: str, bs: int) -> torch.Tensor:
    """The raw payload (uint8, on ``device``) of tensors given as (shape, ``values(lo, hi)``), as
    ``codec.encode`` lays it out."""
    if scheme not in QMAX:
        raise ValueError(f"device quantisation supports {tuple(QMAX)}, not {scheme!r}")
    if sys.byteorder != "little":   # scales are written as the device's float32 bytes: little-endian
        raise ValueError("device quantisation needs a little-endian host")
    layout = codec_raw.payload_layout([shape for shape, _ in sources], scheme, bs)
    out = torch.empty(sum(n for _, _, n in layout), dtype=torch.uint8, device=device)
    with torch.no_grad():
        for (shape, values), (off, _, _) in zip(sources, layout):
            quantise_into(out, off, values, int(np.prod(shape, dtype=np.int64)), scheme, bs)
    return out


def quantise_payload(tensors: Sequence[torch.Tensor], scheme: str, bs: int) -> torch.Tensor:
    """The raw payload (uint8, on the tensors' device) of float tensors, as ``codec.encode`` lays it out."""
    flats = [t.detach().reshape(-1) for t in tensors]
    return _payload([(tuple(t.shape), lambda lo, hi, f=f: f[lo:hi].float()) for t, f in zip(tensors, flats)],
                    tensors[0].device if tensors else torch.device("cpu"), scheme, bs)


@dataclass
class DeviceDelta:
    """A quantised delta on its way to the host: what the learner hands the sender instead of arrays.
    ``nbytes``: host bytes held. ``wait`` and ``seal_blob`` run on the sender thread."""

    specs: list[tuple[str, tuple[int, ...], str]]
    scheme: str
    block_size: int
    host: torch.Tensor                  # uint8, pinned where the device allows; filled once ``event`` completes
    event: Any = None                   # None: already on the host (a CPU model)
    device_buf: Any = field(default=None, repr=False)   # kept alive until the copy completed

    @property
    def nbytes(self) -> int:
        return int(self.host.numel())

    def wait(self) -> np.ndarray:
        """The raw payload on the host, once the device copied it (blocks this thread only)."""
        if self.event is not None:
            self.event.synchronize()
            self.event, self.device_buf = None, None
        return self.host.numpy()

    def seal_blob(self, kind: str, meta: dict, cfg: CodecConfig, map_fn=None) -> bytes:
        """``codec.encode``'s blob for these tensors (ValueError as it for non-finite values)."""
        if (cfg.scheme, cfg.block_size) != (self.scheme, self.block_size):
            raise ValueError(f"delta quantised as {self.scheme}/{self.block_size}, the run's codec is "
                             f"{cfg.scheme}/{cfg.block_size}")
        return codec_raw.seal_raw(kind, meta, self.specs, self.wait(), cfg, map_fn=map_fn)


def _to_host(buf: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """A non-blocking copy of ``buf`` into pinned host memory and an event recorded after it."""
    if buf.device.type == "cpu":
        return buf, None
    try:
        host = torch.empty(buf.numel(), dtype=torch.uint8, pin_memory=True)
    except RuntimeError:   # no pinned memory for this device: a pageable copy (it may block)
        host = torch.empty(buf.numel(), dtype=torch.uint8)
    host.copy_(buf, non_blocking=True)
    if buf.device.type == "cuda":   # on the stream of buf's device (not the current device's: multi-GPU)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(buf.device))
    else:
        event = torch.Event(buf.device)
        event.record()
    return host, event


def quantise_delta(base: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor], names: Sequence[str],
                   scheme: str, bs: int) -> DeviceDelta:
    """``base[n] − params[n]`` for each name, quantised on the parameters' device, its bytes on their
    way to the host (``base`` float32 on the same device). Enqueued on the current stream, so later
    in-place updates of the parameters (the next optimizer step) cannot race it."""
    specs = [(n, tuple(params[n].shape), "float32") for n in names]
    flat = {n: (base[n].reshape(-1), params[n].detach().reshape(-1)) for n in names}
    sources = [(shape, lambda lo, hi, b=flat[n][0], p=flat[n][1]: b[lo:hi] - p[lo:hi].float()) for n, shape, _ in specs]
    out = _payload(sources, params[names[0]].device if names else torch.device("cpu"), scheme, bs)
    host, event = _to_host(out)
    return DeviceDelta(specs, scheme, bs, host, event, out if event is not None else None)
