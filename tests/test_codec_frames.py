"""Codec format version 2 (issue 15): the raw payload in frames, each stored or zstd'd where zstd
pays (pipeline/codec_frames.py, docs/formats.md "Tensor blobs")."""
from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zstandard

from pipeline.checksum import tensor_digest
from pipeline.codec import CHECKSUMS, RUN_FORMAT, VERSIONS, CodecConfig, decode, encode, peek_meta
from pipeline.codec_frames import FRAME_BYTES, STORED, ZSTD
from pipeline.envelope import seal, unseal
from pipeline.errors import FormatError

GOLDEN = Path(__file__).parent / "fixtures" / "codec_golden" / "v2"   # tests/fixtures/codec_make_golden_v2.py
META = {"learner": "L0", "seq": 5, "note": "golden v2"}


def _body(blob: bytes) -> dict:
    version, body = unseal(blob, "delta", (1, 2))
    assert version == 2
    return msgpack.unpackb(body, raw=False)


def _reseal(body: dict) -> bytes:
    return seal("delta", 2, msgpack.packb(body, use_bin_type=True))


def _golden_cases():
    manifest = json.loads((GOLDEN / "manifest.json").read_text())
    inputs = dict(np.load(GOLDEN / "inputs.npz"))
    for case, m in sorted(manifest.items()):
        yield pytest.param(case, m, {n: inputs[n] for n in m["names"]}, id=case)


@pytest.mark.parametrize("case, m, tensors", list(_golden_cases()))
def test_golden_v2_blobs_read_as_version_1_does_and_are_written_the_same(case, m, tensors):
    old = (GOLDEN / f"{case}.blob").read_bytes()
    assert hashlib.sha256(old).hexdigest() == m["blob_sha256"]
    assert [f[0] for f in _body(old)["frames"]] == m["methods"]
    cfg = CodecConfig(m["scheme"], m["block_size"], m["zstd_level"])
    # the same values as today's reader gives for a version 1 blob of the same tensors: framing is
    # below quantisation, so both versions carry the same raw payload
    v1 = decode(encode("delta", META, tensors, cfg), "delta")
    assert tensor_digest(decode(old, "delta").tensors) == m["values_digest"] == tensor_digest(v1.tensors)
    kw = {"version": 2, "min_saving": m["min_saving"], "frame_bytes": m["frame_bytes"]}
    assert encode("delta", META, tensors, cfg, **kw) == old
    with ThreadPoolExecutor(3) as pool:
        assert encode("delta", META, tensors, cfg, map_fn=pool.map, **kw) == old
        assert tensor_digest(decode(old, "delta", map_fn=pool.map).tensors) == m["values_digest"]


def test_encode_writes_the_configs_format_whose_default_is_a_new_runs():
    x = {"w": np.ones(10, np.float32)}
    assert CodecConfig().format == RUN_FORMAT == 3
    def version(blob: bytes) -> int:
        return unseal(blob, "delta", VERSIONS, checksums=CHECKSUMS)[0]
    assert version(encode("delta", {}, x, CodecConfig())) == 3
    assert version(encode("delta", {}, x, CodecConfig(format=1))) == 1
    assert version(encode("delta", {}, x, CodecConfig(format=1), version=2)) == 2


@pytest.mark.parametrize("scheme", ["int4", "bf16"])
def test_large_v2_blobs_are_the_same_bytes_and_values_at_any_thread_count(scheme):
    rng = np.random.default_rng(3)
    tensors = {"a": rng.standard_normal(2_500_000).astype(np.float32), "b": rng.standard_normal((300, 70))}
    cfg = CodecConfig(scheme, 64, 1)
    one = encode("delta", {}, tensors, cfg, version=2)
    assert len(_body(one)["frames"]) >= 2               # several frames of FRAME_BYTES
    with ThreadPoolExecutor(4) as pool:
        assert encode("delta", {}, tensors, cfg, version=2, map_fn=pool.map) == one
        threaded = decode(one, "delta", map_fn=pool.map).tensors
    want = decode(encode("delta", {}, tensors, cfg), "delta").tensors
    assert tensor_digest(threaded) == tensor_digest(decode(one, "delta").tensors) == tensor_digest(want)


def test_zstd_is_kept_only_on_frames_where_it_pays():
    rng = np.random.default_rng(4)
    noise = rng.uniform(-1, 1, 3 * FRAME_BYTES // 4).astype(np.float32)   # random mantissas: zstd saves ~8%
    tensors = {"noise": noise, "zeros": np.zeros(FRAME_BYTES // 2, np.float32)}
    methods = lambda blob: [f[0] for f in _body(blob)["frames"]]   # noqa: E731
    strict = encode("delta", {}, tensors, CodecConfig("fp32", 64, 1), version=2, min_saving=0.25)
    assert methods(strict) == [STORED, STORED, STORED, ZSTD, ZSTD]
    assert all(len(f[1]) == FRAME_BYTES for f in _body(strict)["frames"][:3])
    lax = encode("delta", {}, tensors, CodecConfig("fp32", 64, 1), version=2, min_saving=0.0)
    assert methods(lax) == [ZSTD] * 5 and len(lax) < len(strict)
    off = encode("delta", {}, tensors, CodecConfig("fp32", 64, 0), version=2)
    assert methods(off) == [STORED] * 5
    for blob in (strict, lax, off):
        np.testing.assert_array_equal(decode(blob, "delta").tensors["noise"], noise)


def test_encode_refuses_bad_version_and_framing():
    x = {"w": np.ones(10, np.float32)}
    with pytest.raises(ValueError, match="format version must be one of"):
        encode("delta", {}, x, CodecConfig(), version=4)
    with pytest.raises(ValueError, match="frame_bytes"):
        encode("delta", {}, x, CodecConfig(), version=2, frame_bytes=100)
    with pytest.raises(ValueError, match="min_saving"):
        encode("delta", {}, x, CodecConfig(), version=2, min_saving=1.0)


@pytest.fixture(scope="module")
def blob() -> bytes:   # three frames: zstd'd, zstd'd, stored (a short last frame of noise)
    rng = np.random.default_rng(5)
    x = np.concatenate([np.zeros(8192, np.float32), rng.uniform(-1, 1, 500).astype(np.float32)])
    b = encode("delta", {"seq": 1}, {"w": x}, CodecConfig("fp32", 64, 3), version=2, frame_bytes=16384,
               min_saving=0.2)
    assert [f[0] for f in _body(b)["frames"]] == [ZSTD, ZSTD, STORED]
    return b


def _edit(name):
    def frames(fn):
        def apply(b):
            fn(b["frames"])
            return b
        return apply
    return {
        "count": (frames(lambda f: f.pop()), "payload has 2 frames, expected 3"),
        "not list": (lambda b: {**b, "frames": b"x"}, "payload has bytes frames"),
        "method": (frames(lambda f: f[0].__setitem__(0, 2)), r"frame 0 is not \[method 0\|1, bytes\]"),
        "bool method": (frames(lambda f: f[2].__setitem__(0, False)), "frame 2 is not"),
        "stored length": (frames(lambda f: f[2].__setitem__(1, f[2][1] + b"\0")), "stored frame 2 has"),
        "not zstd": (frames(lambda f: f[0].__setitem__(1, b"garbage!" * 4)), "frame 0 is not a zstd frame"),
        "declared": (frames(lambda f: f[0].__setitem__(1, zstandard.ZstdCompressor().compress(b"\0" * 99))),
                     "zstd frame 0 declares 99 bytes, expected 16384"),
        "corrupt": (frames(lambda f: f[1].__setitem__(1, f[1][1][:-3] + b"\xff\xff\xff")),
                    "zstd frame 1 (does not decompress|decompresses to the wrong size)"),
        "trailing": (frames(lambda f: f[0].__setitem__(1, f[0][1] + zstandard.ZstdCompressor().compress(b"x"))),
                     "zstd frame 0 decompresses to the wrong size or has bytes after it"),
        "frame_bytes": (lambda b: {**b, "frame_bytes": 100}, "bad frame_bytes 100"),
        "raw_len": (lambda b: {**b, "raw_len": b["raw_len"] + 4}, "payload length"),
    }[name]


@pytest.mark.parametrize("name", ["count", "not list", "method", "bool method", "stored length", "not zstd",
                                  "declared", "corrupt", "trailing", "frame_bytes", "raw_len"])
def test_rejects_lies_in_a_resealed_v2_body(blob, name):
    edit, message = _edit(name)
    with pytest.raises(FormatError, match=message):
        decode(_reseal(edit(_body(blob))), "delta")


def test_v2_checksum_and_peek_meta(blob):
    assert peek_meta(blob, "delta") == {"seq": 1}
    damaged = bytearray(blob)
    damaged[len(blob) // 2] ^= 1
    with pytest.raises(FormatError, match="checksum mismatch"):
        decode(bytes(damaged), "delta")


@pytest.mark.parametrize("scheme", ["int4", "int8", "bf16", "fp32"])
def test_v2_edge_cases_round_trip(scheme):
    cases = [{}, {"empty": np.zeros((0, 3), np.float32)},
             {"h": np.linspace(-2, 2, 5).astype(np.float16), "d": np.linspace(-1, 1, 3), "s": np.array(0.5, np.float32)}]
    for tensors in cases:
        blob = encode("delta", {}, tensors, CodecConfig(scheme, 64, 3), version=2)
        assert len(_body(blob)["frames"]) == (1 if tensors and any(np.size(v) for v in tensors.values()) else 0)
        got = decode(blob, "delta").tensors
        want = decode(encode("delta", {}, tensors, CodecConfig(scheme, 64, 3)), "delta").tensors
        assert list(got) == list(tensors)
        for name in tensors:
            assert got[name].shape == np.shape(tensors[name]) and got[name].dtype == want[name].dtype
            np.testing.assert_array_equal(got[name], want[name])


def test_v2_checks_the_decoded_size_before_inflating(blob):
    with pytest.raises(FormatError, match="exceed the limit of 100 bytes"):
        decode(blob, "delta", max_bytes=100)
