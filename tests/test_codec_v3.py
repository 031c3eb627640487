"""Codec format version 3 (issue 15): version 2's framed body under an xxh3-128 envelope checksum
(pipeline/codec.py, pipeline/envelope.py; docs/formats.md "Tensor blobs", version 3)."""
from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash
import msgpack
import numpy as np
import pytest

from pipeline.checksum import tensor_digest
from pipeline.codec import CHECKSUMS, CodecConfig, decode, encode, peek_meta
from pipeline.codec_frames import SAMPLE, STORED, ZSTD
from pipeline.envelope import MAGIC, pack_record, seal, seal_parts, unpack_record, unseal
from pipeline.errors import FormatError

META = {"learner": "L0", "seq": 9}


def _tensors():
    rng = np.random.default_rng(11)
    return {"w": rng.standard_normal(700_001).astype(np.float32),          # several 64 KiB frames
            "half": rng.standard_normal(150_000).astype(np.float16),
            "b": (rng.standard_normal(77) * 1e-3).astype(np.float64)}


def _parts(blob: bytes) -> list:
    return msgpack.unpackb(blob, raw=False)


@pytest.mark.parametrize("scheme", ["int4", "int8", "bf16", "fp32"])
def test_version_3_is_version_2s_body_under_an_xxh3_checksum(scheme):
    cfg = CodecConfig(scheme, 64, 1)
    v2 = encode("delta", META, _tensors(), cfg, version=2, frame_bytes=1 << 16)
    v3 = encode("delta", META, _tensors(), cfg, version=3, frame_bytes=1 << 16)
    magic, kind, version, body, digest, algorithm = _parts(v3)
    assert (magic, kind, version, algorithm) == (MAGIC, "delta", 3, "xxh3-128")
    assert digest == xxhash.xxh3_128_digest(body)
    b2, b3 = msgpack.unpackb(_parts(v2)[3], raw=False), msgpack.unpackb(body, raw=False)
    assert b2.keys() == b3.keys()
    # the raw payload is the same bytes; only the frame sample (16 KiB, not 64 KiB) may differ
    assert {k: b2[k] for k in b2 if k != "frames"} == {k: b3[k] for k in b3 if k != "frames"}
    for name, a in decode(v2, "delta").tensors.items():
        assert decode(v3, "delta").tensors[name].tobytes() == a.tobytes()
    assert peek_meta(v3, "delta") == META
    with ThreadPoolExecutor(3) as pool:
        assert encode("delta", META, _tensors(), cfg, version=3, frame_bytes=1 << 16, map_fn=pool.map) == v3


def test_the_frame_sample_decides_alone_when_it_does_not_pay():
    # One 256 KiB frame of noise with zeros at 96-120 KiB and 136-160 KiB, then a frame of zeros.
    # Version 2's 64 KiB middle sample (96-160 KiB) is 3/4 zeros: it pays, the whole frame is
    # compressed and pays too (it saves > 10%). Version 3's 16 KiB sample (120-136 KiB) is noise: the
    # frame is stored without compressing the rest (the price of a cheap sample: docs/formats.md).
    assert (SAMPLE[2], SAMPLE[3]) == (1 << 16, 1 << 14)
    k = 1 << 10
    frame = np.random.default_rng(2).integers(0, 256, 256 * k, dtype=np.uint8)
    frame[96 * k:120 * k] = 0
    frame[136 * k:160 * k] = 0
    frame[3::4] &= 0x3F                  # no NaN/Inf among the float32s (fp32 refuses them): noise saves ~6%
    x = {"x": np.concatenate([frame, np.zeros(256 * k, np.uint8)]).view(np.float32)}
    for version, first in ((2, ZSTD), (3, STORED)):
        blob = encode("delta", {}, x, CodecConfig("fp32", zstd_level=1), version=version, frame_bytes=256 * k,
                      min_saving=0.1)
        frames = msgpack.unpackb(unseal(blob, "delta", version, checksums=CHECKSUMS)[1], raw=False)["frames"]
        assert [m for m, _ in frames] == [first, ZSTD]
        assert decode(blob, "delta").tensors["x"].tobytes() == x["x"].tobytes()


def test_a_damaged_or_relabelled_version_3_blob_is_refused():
    blob = encode("delta", META, {"w": np.ones(5000, np.float32)}, CodecConfig("int4", 64, 1), version=3)
    magic, kind, version, body, digest, algorithm = _parts(blob)
    flipped = bytearray(body)
    flipped[len(body) // 2] ^= 1
    cases = [
        (msgpack.packb([magic, kind, version, bytes(flipped), digest, algorithm]), "checksum mismatch"),
        (seal("delta", 3, body), "version 3 must carry the xxh3-128 checksum, not 'sha256'"),     # 5 elements
        (msgpack.packb([magic, kind, version, body, digest, "sha256"]), "must carry the xxh3-128 checksum"),
        (msgpack.packb([magic, kind, version, body, digest, "md5"]), "must carry the xxh3-128 checksum, not 'md5'"),
        (seal("delta", 2, body, checksum="xxh3-128"), "version 2 must carry the sha256 checksum, not 'xxh3-128'"),
        (msgpack.packb([magic, kind, version, body, digest, "xxh3-128", 1]), "wrong structure"),
    ]
    for bad, message in cases:
        with pytest.raises(FormatError, match=message):
            decode(bad, "delta")


def test_other_records_keep_the_five_element_sha256_envelope():
    blob = pack_record("commit", 1, {"a": 1})
    assert len(_parts(blob)) == 5
    assert unpack_record(blob, "commit", 1) == (1, {"a": 1})
    relabelled = seal("commit", 1, _parts(blob)[3], checksum="xxh3-128")
    with pytest.raises(FormatError, match="commit version 1 must carry the sha256 checksum, not 'xxh3-128'"):
        unpack_record(relabelled, "commit", 1)
    with pytest.raises(ValueError, match="checksum must be one of"):
        seal("commit", 1, b"", checksum="crc32")


@pytest.mark.parametrize("checksum", ["sha256", "xxh3-128"])
@pytest.mark.parametrize("sizes", [[], [0], [3, 200], [255, 256, 65535, 65536], [70_000, 1]])
def test_seal_parts_is_seal_of_the_joined_parts(checksum, sizes):
    rng = np.random.default_rng(sum(sizes))
    parts = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    parts += [memoryview(b"tail")]                         # memoryviews (stored frames) too
    assert seal_parts("delta", 3, parts, checksum) == seal("delta", 3, b"".join(parts), checksum)
    with pytest.raises(ValueError, match="checksum must be one of"):
        seal_parts("delta", 3, parts, "crc32")


@pytest.mark.parametrize("version", [2, 3])
def test_framed_bodies_are_what_packb_writes(version):
    # the body is assembled from parts (one copy of the frames); it must be the bytes packb gives
    blob = encode("delta", META, _tensors(), CodecConfig("int4", 64, 1), version=version, frame_bytes=1 << 14)
    body = unseal(blob, "delta", version, checksums=CHECKSUMS)[1]
    assert msgpack.packb(msgpack.unpackb(body, raw=False), use_bin_type=True) == body


GOLDEN = Path(__file__).parent / "fixtures" / "codec_golden"   # v3: tests/fixtures/codec_make_golden_v3.py


def _golden_v3():
    manifest = json.loads((GOLDEN / "v3" / "manifest.json").read_text())
    v2 = json.loads((GOLDEN / "v2" / "manifest.json").read_text())
    inputs = dict(np.load(GOLDEN / "v2" / "inputs.npz"))
    for case, m in sorted(manifest.items()):
        yield pytest.param(case, m, v2[case], {n: inputs[n] for n in m["names"]}, id=case)


@pytest.mark.parametrize("case, m, m2, tensors", list(_golden_v3()))
def test_golden_v3_blobs_read_the_same_and_are_written_the_same(case, m, m2, tensors):
    old = (GOLDEN / "v3" / f"{case}.blob").read_bytes()
    assert hashlib.sha256(old).hexdigest() == m["blob_sha256"]
    # the same values as version 2's golden blob of the same tensors: the raw payload is the same
    assert tensor_digest(decode(old, "delta").tensors) == m["values_digest"] == m2["values_digest"]
    cfg = CodecConfig(m["scheme"], m["block_size"], m["zstd_level"])
    kw = {"version": 3, "min_saving": m["min_saving"], "frame_bytes": m["frame_bytes"]}
    meta = {"learner": "L0", "seq": 5, "note": "golden v3"}
    assert encode("delta", meta, tensors, cfg, **kw) == old
    with ThreadPoolExecutor(3) as pool:
        assert encode("delta", meta, tensors, cfg, map_fn=pool.map, **kw) == old
