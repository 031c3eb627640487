"""One versioned, checksummed envelope for every blob the project writes or sends.

Layout (documented in docs/formats.md): a msgpack array
``[MAGIC, kind, version, body, sha256(body)]`` where ``body`` is raw bytes, or, for a version
whose reader asks for it (tensor blobs of codec version 3), ``[..., body, xxh3_128(body), "xxh3-128"]``.
Records (commits, descriptors, headers) put a msgpack map in ``body``; tensor blobs put the codec payload there.
Decoding checks size before unpacking, then magic, kind, version and checksum, and raises
``FormatError`` naming what is wrong; it never returns damaged data.
"""
from __future__ import annotations

import hashlib
from typing import Any, Iterable, Mapping

import msgpack

from .errors import FormatError

MAGIC = b"DDLC"
DEFAULT_MAX_BYTES = 1 << 31  # 2 GiB; callers with tighter knowledge pass a smaller limit


def digest(data: bytes | memoryview) -> str:
    """Hex sha256 of ``data``: the checksum every record names."""
    return hashlib.sha256(data).hexdigest()


CHECKSUMS = ("sha256", "xxh3-128")   # xxh3-128: ~40x faster on big bodies (docs/formats.md)


def _hasher(algorithm: str) -> Any:
    if algorithm == "xxh3-128":   # imported here: only tensor blobs of codec version 3 use it
        import xxhash
        return xxhash.xxh3_128()
    return hashlib.sha256()


def _checksum(algorithm: str, body: bytes | memoryview) -> bytes:
    h = _hasher(algorithm)
    h.update(body)
    return h.digest()


def bin_header(n: int) -> bytes:
    """msgpack's header of a bin of ``n`` bytes (what ``packb`` writes before bytes)."""
    if n < 1 << 8:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 1 << 16:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


def seal_parts(kind: str, version: int, parts: list, checksum: str = "sha256") -> bytes:
    """``seal(kind, version, b"".join(parts), checksum)``, byte for byte, with one copy of the parts
    instead of two (issue 15: a tensor blob's frames are megabytes; joining them into a body and
    then packing the body into the envelope copied them twice)."""
    if not kind or not isinstance(kind, str) or not isinstance(version, int) or version < 1:
        raise ValueError(f"envelope kind and version must be a non-empty string and a positive int, "
                         f"got {kind!r}, {version!r}")
    if checksum not in CHECKSUMS:
        raise ValueError(f"envelope checksum must be one of {CHECKSUMS}, got {checksum!r}")
    h = _hasher(checksum)
    size = 0
    for part in parts:
        h.update(part)
        size += memoryview(part).nbytes
    head = msgpack.packb([MAGIC, kind, version], use_bin_type=True)
    head = bytes([0x90 | (5 if checksum == "sha256" else 6)]) + head[1:] + bin_header(size)
    tail = msgpack.packb(h.digest(), use_bin_type=True) + \
        (b"" if checksum == "sha256" else msgpack.packb(checksum, use_bin_type=True))
    return b"".join([head, *parts, tail])


def seal(kind: str, version: int, body: bytes, checksum: str = "sha256") -> bytes:
    """Wrap ``body`` in the envelope; ``checksum`` "xxh3-128" adds the algorithm's name as a sixth
    element (docs/formats.md), "sha256" (the default) writes the five elements as always."""
    if not kind or not isinstance(kind, str):
        raise ValueError(f"envelope kind must be a non-empty string, got {kind!r}")
    if not isinstance(version, int) or version < 1:
        raise ValueError(f"envelope version must be a positive int, got {version!r}")
    if checksum not in CHECKSUMS:
        raise ValueError(f"envelope checksum must be one of {CHECKSUMS}, got {checksum!r}")
    fields = [MAGIC, kind, version, bytes(body), _checksum(checksum, body)]
    return msgpack.packb(fields + ([checksum] if checksum != "sha256" else []), use_bin_type=True)


def unseal(blob: bytes, kind: str, versions: Iterable[int] | int,
           max_bytes: int = DEFAULT_MAX_BYTES, what: str | None = None,
           checksums: Mapping[int, str] | None = None) -> tuple[int, bytes]:
    """Check and open an envelope of ``kind``; return ``(version, body)``.

    ``what`` names the object (a key, a message) in error messages. ``checksums`` maps a version
    to the checksum algorithm it must carry (default and unlisted versions: sha256).
    """
    name = what or kind
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise FormatError(f"{name}: expected bytes, got {type(blob).__name__}")
    if len(blob) > max_bytes:
        raise FormatError(f"{name}: {len(blob)} bytes exceeds the limit of {max_bytes}")
    try:
        obj = msgpack.unpackb(blob, raw=False, strict_map_key=True, use_list=True,
                              max_bin_len=max_bytes, max_str_len=1 << 16, max_array_len=8,
                              max_map_len=0, max_ext_len=0)
    except Exception as exc:  # msgpack raises several types; never leak them
        raise FormatError(f"{name}: not a valid envelope (truncated or corrupted: {exc.__class__.__name__})") from None
    return _checked(obj, kind, versions, what, checksums)


def _checked(obj: Any, kind: str, versions: Iterable[int] | int, what: str | None,
             checksums: Mapping[int, str] | None) -> tuple[int, Any]:
    """An unpacked envelope's ``(version, body)`` after checking its fields (``unseal``'s rules)."""
    name = what or kind
    if not isinstance(obj, list) or len(obj) not in (5, 6):
        raise FormatError(f"{name}: not a valid envelope (wrong structure)")
    magic, got_kind, version, body, checksum = obj[:5]
    algorithm = obj[5] if len(obj) == 6 else "sha256"
    if magic != MAGIC:
        raise FormatError(f"{name}: bad magic {magic!r} (not a decoupled-diloco object)")
    if got_kind != kind:
        raise FormatError(f"{name}: is a {got_kind!r} object, expected {kind!r}")
    allowed = {versions} if isinstance(versions, int) else set(versions)
    if version not in allowed:
        raise FormatError(f"{name}: {kind} format version {version!r} is not supported "
                          f"(this build reads {sorted(allowed)})")
    if not isinstance(body, (bytes, memoryview)) or not isinstance(checksum, bytes):
        raise FormatError(f"{name}: not a valid envelope (wrong field types)")
    want = (checksums or {}).get(version, "sha256")
    if algorithm != want or (len(obj) == 6 and algorithm == "sha256"):   # one way to write each
        raise FormatError(f"{name}: {kind} version {version} must carry the {want} checksum, not {algorithm!r}")
    if _checksum(algorithm, body) != checksum:
        raise FormatError(f"{name}: checksum mismatch (the body was altered or corrupted)")
    return version, body


def _head(mv: memoryview, max_bytes: int) -> tuple[list, int, int] | None:
    """``[magic, kind, version]``, the body's first byte and its length, read from a canonical
    envelope (an array header, then a bin body); None where the blob is laid out otherwise."""
    if not mv.nbytes or mv[0] not in (0x95, 0x96):
        return None
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=1 << 17, max_bin_len=16, max_str_len=1 << 16,
                                max_array_len=0, max_map_len=0, max_ext_len=0)
    unpacker.feed(mv[1:1 + min(mv.nbytes - 1, 1 << 17)])
    try:
        head = [unpacker.unpack() for _ in range(3)]
    except Exception:   # msgpack raises several types: unseal names the problem
        return None
    pos = 1 + unpacker.tell()
    sizes = {0xC4: 1, 0xC5: 2, 0xC6: 4}
    if pos >= mv.nbytes or mv[pos] not in sizes or pos + 1 + sizes[mv[pos]] > mv.nbytes:
        return None
    start = pos + 1 + sizes[mv[pos]]
    length = int.from_bytes(mv[pos + 1:start], "big")
    return (head, start, length) if length <= max_bytes and start + length <= mv.nbytes else None


def unseal_view(blob: bytes, kind: str, versions: Iterable[int] | int, max_bytes: int = DEFAULT_MAX_BYTES,
                what: str | None = None, checksums: Mapping[int, str] | None = None) -> tuple[int, memoryview]:
    """``unseal``, with the body as a view of ``blob`` instead of a copy (issue 15: a tensor blob's
    body is megabytes, and a fresh copy's pages cost page faults). The same checks and errors:
    anything but a canonical envelope with exactly a checksum (and its name) after the body goes
    through ``unseal``."""
    if not isinstance(blob, (bytes, bytearray, memoryview)) or len(blob) > max_bytes:
        return unseal(blob, kind, versions, max_bytes, what, checksums)
    mv = memoryview(blob).cast("B")
    found = _head(mv, max_bytes)
    if found is None:
        return unseal(blob, kind, versions, max_bytes, what, checksums)
    (magic, got_kind, version), start, length = found
    try:
        tail = msgpack.unpackb(bytes([0x90 | (mv[0] - 0x94)]) + bytes(mv[start + length:]),   # the 1 or 2 after the body
                               raw=False, max_bin_len=64, max_str_len=64, max_array_len=2, max_map_len=0,
                               max_ext_len=0)
    except Exception:   # msgpack raises several types: unseal names the problem
        return unseal(blob, kind, versions, max_bytes, what, checksums)
    body = mv[start:start + length]
    obj = [magic, got_kind, version, body, *tail]
    return _checked(obj, kind, versions, what, checksums)


def pack_record(kind: str, version: int, record: dict[str, Any]) -> bytes:
    """Seal a plain dict (msgpack body)."""
    return seal(kind, version, msgpack.packb(record, use_bin_type=True))


def unpack_record(blob: bytes, kind: str, versions: Iterable[int] | int,
                  max_bytes: int = 64 << 20, what: str | None = None) -> tuple[int, dict[str, Any]]:
    """Open a sealed record; return ``(version, dict)``."""
    version, body = unseal(blob, kind, versions, max_bytes=max_bytes, what=what)
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=False, max_bin_len=max_bytes)
    except Exception as exc:
        raise FormatError(f"{what or kind}: record body does not decode ({exc.__class__.__name__})") from None
    if not isinstance(obj, dict):
        raise FormatError(f"{what or kind}: record body is not a map")
    return version, obj
