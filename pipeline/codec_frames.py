"""Tensor blob version 2's payload: the raw payload cut into frames, each stored or zstd'd.

SPEC §6 (zstd after quantisation) and issue 15 ("codec at line rate"): version 1 compresses the
whole raw payload with one zstd call on one thread. Version 2 cuts it into frames of
``frame_bytes`` raw bytes (the last one shorter); each frame is compressed on its own, so a pool
(``map_fn``) compresses and decompresses frames side by side, and a frame is kept compressed only
when zstd pays on it: it must save at least ``min_saving`` of the frame's bytes, or the frame is
stored as it is (decoding a stored frame is a copy). A sample from the middle of the frame is
tried first so a frame zstd cannot shrink costs a fraction of a full compression: 64 KiB in
version 2, 16 KiB in version 3 (``SAMPLE``; on int4 deltas, where every frame pays, the sample is
pure overhead: 6% of zstd's time at 64 KiB, 1.6% at 16 KiB). Layout: docs/formats.md ("Tensor
blobs", versions 2 and 3).

Which frames are compressed is a pure function of the raw bytes, the level and ``min_saving``
(never of timing or of the pool), so a blob's bytes are the same at any thread count.

Decoding trusts nothing: every frame's method, length and zstd content size are checked against
what ``raw_len`` and ``frame_bytes`` imply before anything is allocated or decompressed, and a
frame that decompresses to the wrong size raises ``FormatError``.

Where ``pipeline.zstd_into`` is available, frames are compressed into one output buffer the caller
lends (``out``, ``out_bytes`` long) and decompressed straight into the raw payload's buffer: no
``bytes`` per frame (docs/scale.md, "The codec": fresh pages cost page faults); the bytes are the same.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Iterable

import numpy as np
import zstandard

from . import zstd_into
from .errors import FormatError

STORED, ZSTD = 0, 1                 # a frame's method: its raw bytes, or one zstd frame of them
FRAME_BYTES = 1 << 20               # raw bytes per frame written: 1 MiB (~1.9 M int4 values at block 64)
MIN_FRAME_BYTES, MAX_FRAME_BYTES = 1 << 12, 1 << 26
MIN_SAVING = 0.02                   # default: keep zstd's output when it saves >= 2% of the frame
SAMPLE = {2: 1 << 16, 3: 1 << 14}  # per format version, bytes tried first: a frame whose sample does not pay
                                    # is stored (frames of at least 4 samples; smaller ones are tried whole)

MapFn = Callable[[Callable[[Any], Any], Iterable[Any]], Iterable[Any]]


def frame_ranges(raw_len: int, frame_bytes: int) -> list[tuple[int, int]]:
    """(lo, hi) of every frame of a raw payload of ``raw_len`` bytes (none for an empty payload)."""
    return [(lo, min(lo + frame_bytes, raw_len)) for lo in range(0, raw_len, frame_bytes)]


def _pays(size: int, packed: int, min_saving: float) -> bool:
    return packed <= size * (1.0 - min_saving)


def out_bytes(raw_len: int, frame_bytes: int, level: int, version: int) -> int:
    """Bytes of the ``out`` buffer ``compress_frames`` takes for this payload (0: it takes none)."""
    if version == 1 or level <= 0 or not zstd_into.AVAILABLE or not raw_len:
        return 0
    return len(frame_ranges(raw_len, frame_bytes)) * zstd_into.compress_bound(frame_bytes)


def _zstd(data: np.ndarray, level: int, out: np.ndarray | None) -> Any:
    """zstd of ``data``: into ``out`` (a view of it returned) where given, else new bytes."""
    if out is None:
        return zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False).compress(data)
    return memoryview(out[:zstd_into.compress_into(data, level, out)])


def _compress_frame(job: tuple[int, tuple[int, int]], raw: np.ndarray, level: int, min_saving: float, sample: int,
                    frame_bytes: int, out: np.ndarray | None) -> list:
    """Frame ``i`` as ``[method, bytes]``: zstd's output if it pays (in its share of ``out`` where
    given), else the raw bytes."""
    i, (lo, hi) = job
    data = raw[lo:hi]
    if level <= 0:
        return [STORED, memoryview(data)]
    dst = None
    if out is not None:   # frame i's share: compress_bound(frame_bytes) bytes (out_bytes)
        bound = out.size // len(frame_ranges(raw.size, frame_bytes))
        dst = out[i * bound:(i + 1) * bound]
    if data.size >= 4 * sample:   # a middle sample: cheap evidence that the whole frame will not pay
        mid = (data.size - sample) // 2
        # only its length is used: into a small buffer of its own, not the frame's share of ``out``,
        # whose pages a stored frame then never touches (fp32 versions: ~all of a 400 MB ``out``)
        tmp = None if dst is None else np.empty(zstd_into.compress_bound(sample), np.uint8)
        if not _pays(sample, len(_zstd(data[mid:mid + sample], level, tmp)), min_saving):
            return [STORED, memoryview(data)]
    packed = _zstd(data, level, dst)
    return [ZSTD, packed] if _pays(data.size, len(packed), min_saving) else [STORED, memoryview(data)]


def check_framing(frame_bytes: Any, min_saving: Any) -> None:
    """ValueError for a frame size or a ``min_saving`` the writer does not take."""
    if not isinstance(frame_bytes, int) or isinstance(frame_bytes, bool) \
            or not MIN_FRAME_BYTES <= frame_bytes <= MAX_FRAME_BYTES:
        raise ValueError(f"frame_bytes must be an int in {MIN_FRAME_BYTES}..{MAX_FRAME_BYTES}, got {frame_bytes!r}")
    if not isinstance(min_saving, (int, float)) or isinstance(min_saving, bool) or not 0.0 <= min_saving < 1.0:
        raise ValueError(f"min_saving must be a number in [0, 1), got {min_saving!r}")


def compress_frames(raw: np.ndarray, frame_bytes: int, level: int, min_saving: float,
                    map_fn: MapFn, version: int = 2, out: np.ndarray | None = None) -> list[list]:
    """The frames of ``raw`` (uint8), each ``[method, bytes]``, compressed on ``map_fn`` with the
    sample size of format ``version`` (2 or 3); into ``out`` (uint8, ``out_bytes(...)`` long, which
    must outlive the frames) where given and ``out_bytes`` is not 0."""
    check_framing(frame_bytes, min_saving)
    ranges = frame_ranges(raw.size, frame_bytes)
    size = out_bytes(raw.size, frame_bytes, level, version)
    out = out[:size] if out is not None and size and out.size >= size else None
    work = partial(_compress_frame, raw=raw, level=level, min_saving=min_saving, sample=SAMPLE[version],
                   frame_bytes=frame_bytes, out=out)
    return list(map_fn(work, enumerate(ranges)))


def check_frames(frames: Any, raw_len: int, frame_bytes: Any, name: str) -> list[tuple[int, bytes]]:
    """The frames of a body as ``(method, data)`` after checking their count, methods, stored
    lengths and zstd content sizes against ``raw_len`` and ``frame_bytes``."""
    if not isinstance(frame_bytes, int) or isinstance(frame_bytes, bool) \
            or not MIN_FRAME_BYTES <= frame_bytes <= MAX_FRAME_BYTES:
        raise FormatError(f"{name}: bad frame_bytes {frame_bytes!r}")
    ranges = frame_ranges(raw_len, frame_bytes)
    if not isinstance(frames, list) or len(frames) != len(ranges):
        got = len(frames) if isinstance(frames, list) else type(frames).__name__
        raise FormatError(f"{name}: payload has {got} frames, expected {len(ranges)}")
    out = []
    for i, (f, (lo, hi)) in enumerate(zip(frames, ranges)):
        if not isinstance(f, list) or len(f) != 2 or f[0] not in (STORED, ZSTD) or isinstance(f[0], bool) \
                or not isinstance(f[1], (bytes, memoryview)):   # views: pipeline/codec_body.py
            raise FormatError(f"{name}: frame {i} is not [method 0|1, bytes]")
        method, data = f
        if method == STORED and len(data) != hi - lo:
            raise FormatError(f"{name}: stored frame {i} has {len(data)} bytes, expected {hi - lo}")
        if method == ZSTD:
            try:
                declared = zstandard.frame_content_size(data)
            except zstandard.ZstdError:
                raise FormatError(f"{name}: frame {i} is not a zstd frame") from None
            if declared != hi - lo:   # zstd would allocate what the frame declares: check it first
                raise FormatError(f"{name}: zstd frame {i} declares {declared} bytes, expected {hi - lo}")
        out.append((method, data))
    return out


def _inflate_frame(job: tuple[int, tuple[int, bytes]], buf: np.ndarray, frame_bytes: int) -> str:
    """Frame ``i`` into its bytes of ``buf``; an error, or ""."""
    i, (method, data) = job
    lo = i * frame_bytes
    hi = min(lo + frame_bytes, buf.size)
    if method == STORED:
        buf[lo:hi] = np.frombuffer(data, np.uint8)
        return ""
    if zstd_into.AVAILABLE:   # the declared content size was checked: the frame fits buf[lo:hi] exactly
        err = zstd_into.decompress_into(data, buf[lo:hi])
        return f"zstd frame {i} {err}" if err else ""
    dobj = zstandard.ZstdDecompressor().decompressobj()
    try:   # the declared content size was checked: zstd writes no more than hi - lo bytes
        out = dobj.decompress(data)
    except zstandard.ZstdError as exc:
        return f"zstd frame {i} does not decompress ({exc})"
    if len(out) != hi - lo or not dobj.eof or dobj.unused_data:
        return f"zstd frame {i} decompresses to the wrong size or has bytes after it"
    buf[lo:hi] = np.frombuffer(out, np.uint8)
    return ""


def inflate_frames(frames: list[tuple[int, bytes]], raw_len: int, frame_bytes: int, name: str,
                   map_fn: MapFn, out: np.ndarray | None = None) -> np.ndarray:
    """The raw payload of checked ``frames``, decompressed on ``map_fn`` into ``out`` (uint8 of
    ``raw_len`` bytes, e.g. a scratch buffer) or a new array; FormatError if one fails."""
    buf = np.empty(raw_len, np.uint8) if out is None else out
    if buf.size != raw_len or buf.dtype != np.uint8:
        raise ValueError(f"inflate_frames: out must be {raw_len} uint8 bytes, got {buf.size} {buf.dtype}")
    work = partial(_inflate_frame, buf=buf, frame_bytes=frame_bytes)
    err = next(filter(None, list(map_fn(work, enumerate(frames)))), "")
    if err:
        raise FormatError(f"{name}: {err}")
    return buf
