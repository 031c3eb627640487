"""A framed tensor blob's body written and read without copying its frames (docs/scale.md "The codec").

``msgpack.unpackb`` copies every bin into a new ``bytes``: for a version 2/3 body that is the whole
compressed payload once more (8 MB per 16M int4 values), whose fresh pages cost page faults with
glibc's default allocator. The writer (``pack``) puts ``frames`` last, each
``[method, bin]``: ``unpack`` reads the keys before it with msgpack and the frames by hand, as
memoryviews of the body. Anything else — another key order, a non-canonical encoding, a body
whose head does not fit the first 64 KiB — goes to ``msgpack.unpackb`` with the same limits, so
the result (and every error) is what ``unpackb`` gives, the frames' bytes aside being views.
"""
from __future__ import annotations

from typing import Any

import msgpack

from .envelope import bin_header

_HEAD = 1 << 16            # bytes of the body read for the keys before ``frames``
_BIN = {0xC4: 1, 0xC5: 2, 0xC6: 4}


def pack(fields: dict) -> list:
    """``msgpack.packb(fields)`` of a version 2/3 body (``frames`` its last key) as parts, the
    frames' bytes not copied: ``seal_parts`` copies them once, into the blob."""
    packer = msgpack.Packer(use_bin_type=True)
    head = [packer.pack_map_header(len(fields))]
    head += [packer.pack(k) + packer.pack(v) for k, v in fields.items() if k != "frames"]
    parts = [b"".join(head + [packer.pack("frames"), packer.pack_array_header(len(fields["frames"]))])]
    for method, data in fields["frames"]:
        parts += [b"\x92" + packer.pack(method) + bin_header(memoryview(data).nbytes), data]
    return parts


def _frames(mv: memoryview, pos: int, max_array_len: int) -> list | None:
    """The frames array at ``pos`` (to the body's end) as ``[method, view]``; None if not canonical."""
    n, end = mv.nbytes, mv.nbytes
    if pos >= end:
        return None
    b = mv[pos]
    if 0x90 <= b <= 0x9F:
        count, pos = b & 0x0F, pos + 1
    elif b in (0xDC, 0xDD) and pos + 1 + (2 if b == 0xDC else 4) <= end:
        w = 2 if b == 0xDC else 4
        count, pos = int.from_bytes(mv[pos + 1:pos + 1 + w], "big"), pos + 1 + w
    else:
        return None
    if count > max_array_len:
        return None
    out = []
    for _ in range(count):
        if pos + 3 > n or mv[pos] != 0x92 or mv[pos + 1] not in (0, 1) or mv[pos + 2] not in _BIN:
            return None
        w = _BIN[mv[pos + 2]]
        start = pos + 3 + w
        if start > n:
            return None
        stop = start + int.from_bytes(mv[pos + 3:start], "big")
        if stop > n:
            return None
        out.append([mv[pos + 1], mv[start:stop]])
        pos = stop
    return out if pos == end else None


def unpack(data: Any, **limits: Any) -> Any:
    """``msgpack.unpackb(data, **limits)``, with a framed body's frames as views of ``data``."""
    mv = memoryview(data).cast("B")
    try:
        unpacker = msgpack.Unpacker(**limits)
        unpacker.feed(mv[:_HEAD])
        size = unpacker.read_map_header()
        body: dict = {}
        for i in range(size):
            key = unpacker.unpack()
            if key == "frames" and i == size - 1:
                frames = _frames(mv, unpacker.tell(), limits.get("max_array_len", 1 << 31))
                if frames is not None:
                    body[key] = frames
                    return body
                break
            body[key] = unpacker.unpack()
    except Exception:   # out of the head's bytes, or anything msgpack refuses: unpackb says what
        pass
    return msgpack.unpackb(mv, **limits)
