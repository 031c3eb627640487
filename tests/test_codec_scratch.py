"""The codec's allocation-sparing paths (issue 15): zstd into owned buffers, pooled scratch buffers,
decode into the caller's arrays. Same bytes and values as the plain paths, whatever the threads."""
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import zstandard

from pipeline import codec_frames, scratch, zstd_into
from pipeline.codec import CodecConfig, decode, encode
from pipeline.errors import FormatError

needs_cffi = pytest.mark.skipif(not zstd_into.AVAILABLE, reason="zstandard's cffi backend not loadable here")


def _tensors(seed=0):
    rng = np.random.default_rng(seed)
    return {"a": rng.standard_normal((300, 77), dtype=np.float32), "b": rng.standard_normal(5000).astype(np.float32)}


@needs_cffi
@pytest.mark.parametrize("level", [1, 3, 9])
def test_compress_into_writes_the_c_backends_bytes(level):
    rng = np.random.default_rng(level)
    for data in (rng.integers(0, 16, 1 << 18, dtype=np.uint8), np.zeros(5000, np.uint8),
                 rng.integers(0, 256, 4097, dtype=np.uint8)):
        out = np.empty(zstd_into.compress_bound(data.size), np.uint8)
        n = zstd_into.compress_into(data, level, out)
        want = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False).compress(data)
        assert bytes(out[:n]) == want
        back = np.empty(data.size, np.uint8)
        assert zstd_into.decompress_into(want, back) == "" and np.array_equal(back, data)
        assert "bytes after it" in zstd_into.decompress_into(want + want, back)
        assert zstd_into.decompress_into(want, np.empty(data.size + 1, np.uint8)) != ""


@pytest.mark.parametrize("version", [1, 2, 3])
def test_same_bytes_with_and_without_zstd_into(monkeypatch, version):
    cfg = CodecConfig("int4", 64, 1)
    kw = {"frame_bytes": 4096} if version > 1 else {}
    fast = encode("delta", {"k": 1}, _tensors(), cfg, version=version, **kw)
    monkeypatch.setattr(zstd_into, "AVAILABLE", False)
    assert encode("delta", {"k": 1}, _tensors(), cfg, version=version, **kw) == fast
    plain = decode(fast, "delta").tensors
    monkeypatch.undo()
    for k, v in decode(fast, "delta").tensors.items():
        assert np.array_equal(v, plain[k])


def test_pooled_buffers_do_not_leak_between_concurrent_encodes():
    cfg = CodecConfig("int4", 64, 1)
    inputs = [_tensors(s) for s in range(6)]
    want = [encode("delta", {}, t, cfg, version=3, frame_bytes=4096) for t in inputs]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            got = list(pool.map(lambda t: encode("delta", {}, t, cfg, version=3, frame_bytes=4096), inputs))
            assert got == want
            dec = list(pool.map(lambda b: decode(b, "delta").tensors["b"], want))
            assert all(np.array_equal(d, decode(b, "delta").tensors["b"]) for d, b in zip(dec, want))
    assert len(scratch._pool) <= scratch.KEEP


@pytest.mark.parametrize("scheme,version", [("int4", 3), ("int8", 2), ("bf16", 1), ("fp32", 3)])
def test_decode_into_the_callers_arrays(scheme, version):
    blob = encode("delta", {}, _tensors(), CodecConfig(scheme, 64, 1), version=version)
    plain = decode(blob, "delta").tensors
    out = {"b": np.full(5000, 7.0, np.float32), "a": np.full((300, 77), 7.0, np.float32)}
    got = decode(blob, "delta", out=out).tensors
    for k in plain:
        assert np.array_equal(out[k], plain[k]) and np.shares_memory(got[k], out[k])


def test_decode_into_refuses_arrays_it_cannot_fill():
    blob = encode("delta", {}, _tensors(), CodecConfig("int4", 64, 1), version=3)
    good = {"a": np.empty((300, 77), np.float32), "b": np.empty(5000, np.float32)}
    with pytest.raises(FormatError, match="do not match"):
        decode(blob, "delta", out={"a": good["a"]})
    with pytest.raises(FormatError, match="shape"):
        decode(blob, "delta", out={**good, "b": np.empty(4999, np.float32)})
    with pytest.raises(ValueError, match="float32"):
        decode(blob, "delta", out={**good, "b": np.empty(5000, np.float64)})
    with pytest.raises(ValueError, match="C-contiguous"):
        decode(blob, "delta", out={**good, "a": np.empty((77, 300), np.float32).T})


def test_compress_frames_into_out_keeps_frames_in_their_share():
    raw = np.random.default_rng(3).integers(0, 16, 3 * 4096 + 100, dtype=np.uint8)
    size = codec_frames.out_bytes(raw.size, 4096, 1, 3)
    out = np.zeros(size, np.uint8) if size else None
    frames = codec_frames.compress_frames(raw, 4096, 1, 0.0, map, 3, out=out)
    plain = codec_frames.compress_frames(raw, 4096, 1, 0.0, map, 3)
    assert [(m, bytes(d)) for m, d in frames] == [(m, bytes(d)) for m, d in plain]


def test_the_pool_keeps_no_buffer_over_its_bound_and_bounded_bytes_in_all(monkeypatch):
    monkeypatch.setattr(scratch, "_pool", [])
    monkeypatch.setattr(scratch, "MAX_KEPT", 1 << 16)
    monkeypatch.setattr(scratch, "KEEP_BYTES", 3 << 16)
    with scratch.borrow((1 << 16) + 1) as big:   # over MAX_KEPT: freed after the block
        big[:] = 1
    assert scratch._pool == []
    with scratch.borrow(1 << 16) as a:   # at the bound: kept, and lent again
        a[:] = 2
    kept = scratch._pool[0].a
    with scratch.borrow(100) as b:
        assert np.shares_memory(b, kept)
    for n in (1 << 16, 1 << 16, 1 << 16, 1 << 16):   # four at once: KEEP_BYTES holds three
        stack = [scratch.borrow(n) for _ in range(4)]
        [s.__enter__() for s in stack]
        [s.__exit__(None, None, None) for s in stack]
    assert len(scratch._pool) == 3 and scratch.kept_bytes() <= scratch.KEEP_BYTES


@needs_cffi
def test_stored_frames_leave_the_output_buffer_untouched():
    raw = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)   # zstd cannot shrink it
    out = np.full(codec_frames.out_bytes(raw.size, 1 << 16, 3, 3), 7, np.uint8)
    got = codec_frames.compress_frames(raw, 1 << 16, 3, 0.02, map, 3, out=out)
    assert all(m == codec_frames.STORED for m, _ in got) and (out == 7).all()
