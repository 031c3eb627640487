"""The learner <-> sync-agent channel (workers/learner/agent.py): frames and shared slots.

Both ends of one learner, on one host: the training process and the child process that runs its
sender and receiver. Two things cross:

* **messages**, on a socketpair, as ``multiprocessing.connection`` byte frames (length-prefixed;
  never pickle): ``crc32 (4 bytes, big-endian) || msgpack({"v": WIRE_VERSION, "type": ..., fields})``. A
  frame whose checksum or version does not match is refused (``FormatError``): both ends come from
  the same install, so that is a bug or a stray writer, never something to guess around.
* **tensor values**, in one shared memory file (``memfd``, inherited by the child: no name on the
  file system, gone when both ends close it) cut into equal *slots*, each big enough for the
  largest fragment in float32. A fragment's tensors lie in a slot in the run layout's order, each
  at a 64-byte aligned offset (``fragment_offsets``): both ends compute the same offsets from the
  descriptor, so a message names only the fragment and the slot. The first ``delta_slots`` slots
  carry deltas to the agent, the rest versions to the learner; a slot belongs to one side until
  the other hands it back (``dfree`` / ``vfree``), so neither end ever reads a slot being written.

Documented in docs/scale.md ("The learner's sync agent").
"""
from __future__ import annotations

import mmap
import os
import zlib
from typing import Any

import msgpack
import numpy as np

from pipeline.errors import FormatError
from pipeline.descriptor import RunDescriptor

WIRE_VERSION = 5      # 2: opened rounds, arrivals and freed slots moved to the board (agent_board.py);
                      # 3: a ``report`` frame (counters now), ``stats`` at most every 1 s instead of 0.25;
                      # 4: ``stats`` name the deltas settled since the last (``settled``), so a
                      # killed agent's learner knows which it still held; ``config`` has ``drain_s``, ``life``;
                      # 5: ``config`` carries the run descriptor (``descriptor``: its envelope
                      # bytes), so a child starts without a GET (a replacement during an S3 outage)
ALIGN = 64


def pack(kind: str, **fields: Any) -> bytes:
    body = msgpack.packb({"v": WIRE_VERSION, "type": kind, **fields}, use_bin_type=True)
    return zlib.crc32(body).to_bytes(4, "big") + body


def unpack(frame: bytes) -> dict:
    if len(frame) < 5 or zlib.crc32(frame[4:]) != int.from_bytes(frame[:4], "big"):
        raise FormatError("sync agent frame: checksum mismatch")
    try:
        msg = msgpack.unpackb(frame[4:], raw=False, strict_map_key=False)
    except Exception as exc:   # noqa: BLE001 - msgpack raises several types
        raise FormatError(f"sync agent frame: not msgpack ({exc})") from None
    if not isinstance(msg, dict) or msg.get("v") != WIRE_VERSION or not isinstance(msg.get("type"), str):
        raise FormatError(f"sync agent frame: version {msg.get('v') if isinstance(msg, dict) else None!r}, "
                          f"expected {WIRE_VERSION}")
    return msg


def fragment_offsets(d: RunDescriptor, p: int) -> list[tuple[str, tuple[int, ...], int]]:
    """(name, shape, byte offset) of fragment ``p``'s tensors in a slot."""
    shapes = {t.name: tuple(t.shape) for t in d.layout.tensors}
    out, at = [], 0
    for name in d.layout.fragments[p]:
        out.append((name, shapes[name], at))
        at += -(-int(np.prod(shapes[name], dtype=np.int64)) * 4 // ALIGN) * ALIGN
    return out


def slot_bytes(d: RunDescriptor) -> int:
    """The largest fragment's float32 bytes, aligned: every slot's size."""
    best = ALIGN
    for p in range(d.num_fragments):
        name, shape, at = fragment_offsets(d, p)[-1]
        best = max(best, at + -(-int(np.prod(shape, dtype=np.int64)) * 4 // ALIGN) * ALIGN)
    return best


class Slots:
    """The shared slots (module docstring) mapped from ``fd``; ``create`` makes the memfd."""

    def __init__(self, d: RunDescriptor, count: int, fd: int | None = None):
        self.d, self.count, self.size = d, count, slot_bytes(d)
        if fd is None:
            fd = os.memfd_create("ddiloco-sync-agent", 0)   # Linux; AttributeError elsewhere: no agent
            os.ftruncate(fd, self.size * count)
        self.fd = fd
        self.map = mmap.mmap(fd, self.size * count)
        self.buf = np.frombuffer(self.map, dtype=np.uint8)
        self._views: dict[tuple[int, int], dict[str, np.ndarray]] = {}

    def views(self, slot: int, p: int) -> dict[str, np.ndarray]:
        """Fragment ``p``'s tensors in ``slot``, as float32 arrays over the shared memory."""
        if not 0 <= slot < self.count:
            raise FormatError(f"sync agent: slot {slot} out of range 0..{self.count - 1}")
        if not 0 <= p < self.d.num_fragments:
            raise FormatError(f"sync agent: fragment {p} out of range")
        views = self._views.get((slot, p))
        if views is None:      # built once per (slot, fragment): not again on every answer step
            base = slot * self.size
            views = {name: self.buf[base + at: base + at + 4 * int(np.prod(shape, dtype=np.int64))]
                     .view(np.float32).reshape(shape) for name, shape, at in fragment_offsets(self.d, p)}
            self._views[(slot, p)] = views
        return views

    def write(self, slot: int, p: int, values: dict[str, np.ndarray]) -> None:
        for name, view in self.views(slot, p).items():
            np.copyto(view, values[name], casting="same_kind")

    def read(self, slot: int, p: int) -> dict[str, np.ndarray]:
        """Copies (the slot is handed back right after)."""
        return {name: view.copy() for name, view in self.views(slot, p).items()}

    def close(self, close_fd: bool = True) -> None:
        self.buf, self._views = None, {}
        unmap(self.map, self.fd if close_fd else None)


def unmap(mapping: mmap.mmap, fd: int | None) -> None:
    """Close a shared mapping (and ``fd``, unless None): the slots' and the board's."""
    try:
        mapping.close()
    except BufferError:
        pass   # a view still alive somewhere: the mapping goes with the process
    if fd is not None:
        os.close(fd)
