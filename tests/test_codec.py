"""Tensor blob codec (SPEC §6): quantisation accuracy, bf16 rounding, exact decoding, damage detection.
Here in blob format 1, whose bytes its goldens pin (formats 2 and 3: tests/test_codec_frames.py)."""
from __future__ import annotations

import hashlib
import json
import sys
import functools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from pipeline.checksum import tensor_digest
from pipeline.codec import (
    SCHEMES, CodecConfig, Decoded, bf16_bits, decode, dequantize, encode, from_bf16_bits, peek_meta,
    quantize, round_to_bf16,
)
from pipeline.envelope import seal, unseal
from pipeline.errors import FormatError
from pipeline.types import DeltaHeader, TensorSpec

V1 = functools.partial(CodecConfig, format=1)   # the codec settings of a format 1 blob
FAST = settings(max_examples=60, deadline=None)
QMAX = {"int4": 7, "int8": 127}
META = DeltaHeader("L0", 1, 5, 2, 7, 10, 40960, 123).to_dict()

# Normal float32 magnitudes well inside the range: no subnormal scales, whose precision is reduced.
_values = st.one_of(st.just(0.0), st.floats(2.0**-60, 2.0**60, width=32), st.floats(-(2.0**60), -(2.0**-60), width=32))


def _tensors(seed=0):
    rng = np.random.default_rng(seed)
    return {"blocks.0.w": rng.standard_normal((33, 7)).astype(np.float32),  # 231: last block padded
            "blocks.0.b": rng.standard_normal(64).astype(np.float32),
            "scalar": np.array(0.25, np.float32),
            "empty": np.zeros((0, 3), np.float32),
            "zeros": np.zeros(130, np.float32)}


def _block_scales(x: np.ndarray, qmax: int, bs: int) -> np.ndarray:
    flat = np.ravel(x).astype(np.float32)
    pad = np.zeros(-(-flat.size // bs) * bs, np.float32)
    pad[:flat.size] = flat
    return np.repeat(np.abs(pad.reshape(-1, bs)).max(axis=1) / np.float32(qmax), bs)[:flat.size]


# ---------------------------------------------------------------------------- accuracy

@FAST
@given(hnp.arrays(np.float32, st.integers(1, 300), elements=_values), st.sampled_from(["int4", "int8"]),
       st.sampled_from([2, 4, 8, 64, 128]))
def test_int_error_at_most_half_a_step(x, scheme, bs):
    got = dequantize(quantize(x, scheme, bs), scheme, bs, x.size)
    scale = _block_scales(x, QMAX[scheme], bs)
    err = np.abs(got.astype(np.float64) - x.astype(np.float64))
    # half a step, plus float32 rounding of x/scale and q*scale (a few ulps of the value)
    assert (err <= scale / 2 * (1 + 1e-6) + np.abs(x) * 2.0**-22).all()


@FAST
@given(st.sampled_from(["int4", "int8"]), st.sampled_from([2, 8, 64]), st.integers(1, 5), st.integers(-30, 30),
       st.randoms())
def test_int_exact_on_multiples_of_the_block_scale(scheme, bs, nblocks, exp, rnd):
    qmax = QMAX[scheme]
    k = np.array([[rnd.randint(-qmax, qmax) for _ in range(bs)] for _ in range(nblocks)], np.float32)
    k[:, rnd.randrange(bs)] = qmax * rnd.choice([-1, 1])  # every block reaches absmax = qmax * step
    x = (k * np.float32(2.0**exp)).reshape(-1)
    assert np.array_equal(dequantize(quantize(x, scheme, bs), scheme, bs, x.size), x)


def test_all_zero_block_has_scale_zero_and_decodes_to_zeros():
    x = np.concatenate([np.zeros(8, np.float32), np.ones(8, np.float32)])
    buf = quantize(x, "int4", 8)
    assert np.frombuffer(buf[:8], "<f4").tolist() == [0.0, np.float32(1) / np.float32(7)]
    assert np.array_equal(dequantize(buf, "int4", 8, 16)[:8], np.zeros(8))


def test_int4_packing_is_offset_binary_low_nibble_first():
    buf = quantize(np.array([-7, 0, 7, 1], np.float32), "int4", 4)
    assert buf[4:] == bytes([0x1 | 0x8 << 4, 0xF | 0x9 << 4])


def test_rounding_is_half_to_even():
    # scale 1 (absmax 7): 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -0.5 -> 0
    x = np.array([7, 0.5, 1.5, 2.5, -0.5, -1.5, 0, 0], np.float32)
    assert dequantize(quantize(x, "int4", 8), "int4", 8, 8).tolist() == [7, 0, 2, 2, 0, -2, 0, 0]


# ------------------------------------------------------------------------------- bf16

def _torch_bf16_bits(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def test_bf16_matches_torch_bit_for_bit_including_ties():
    rng = np.random.default_rng(3)
    u = rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32)
    ties = (u & np.uint32(0xFFFF0000)) | np.uint32(0x8000)            # exactly half way
    near = (u & np.uint32(0xFFFF0000)) | rng.choice(np.array([0x7FFF, 0x8001], np.uint32), u.size)
    special = np.array([0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F800000, 0xFF800000, 0, 0x80000000, 1,
                        0x00008000, 0x00018000], np.uint32)          # max, overflow tie, inf, zeros, subnormals
    x = np.concatenate([u, ties, near, special]).view(np.float32)
    x = x[~np.isnan(x)]
    assert np.array_equal(bf16_bits(x), _torch_bf16_bits(x))
    assert np.array_equal(round_to_bf16(x).view(np.uint32),
                          torch.from_numpy(x).to(torch.bfloat16).float().numpy().view(np.uint32))
    assert np.array_equal(from_bf16_bits(bf16_bits(x)), round_to_bf16(x))


def test_bf16_nan_stays_nan():
    x = np.array([np.nan, -np.nan], np.float32)
    x[1] = np.uint32(0xFFFFFFFF).view(np.float32)  # a NaN that would carry into the sign bit
    assert np.isnan(round_to_bf16(x)).all()
    assert round_to_bf16(np.ones((2, 3), np.float64)).shape == (2, 3)


# ------------------------------------------------------------------------ round trips

@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("level", [0, 3])
def test_every_scheme_round_trips(scheme, level):
    tensors = _tensors()
    cfg = V1(scheme, 8, level)
    blob = encode("delta", META, tensors, cfg)
    out = decode(blob, "delta", expect=[TensorSpec(n, a.shape) for n, a in tensors.items()])
    assert isinstance(out, Decoded) and out.meta == META and out.scheme == scheme
    assert list(out.tensors) == list(tensors)
    for name, x in tensors.items():
        got = out.tensors[name]
        assert got.shape == x.shape and got.dtype == np.float32 and got.flags.writeable
        if scheme == "fp32":
            assert np.array_equal(got, x)
        elif scheme == "bf16":
            assert np.array_equal(got, round_to_bf16(x))
        else:
            assert (np.abs(got - x) <= _block_scales(x, QMAX[scheme], 8).reshape(x.shape) * 0.5001).all()
    assert not out.tensors["zeros"].any()


def test_fp32_passthrough_restores_float16_and_float64():
    tensors = {"h": np.array([1.5, -2.25], np.float16), "d": np.array([np.pi, 1e-300], np.float64)}
    out = decode(encode("v", {}, tensors, V1("fp32")), "v")
    assert out.tensors["h"].dtype == np.float16 and out.tensors["d"].dtype == np.float64
    assert np.array_equal(out.tensors["d"], tensors["d"]) and np.array_equal(out.tensors["h"], tensors["h"])
    lossy = decode(encode("v", {}, tensors, V1("int8")), "v")
    assert lossy.tensors["d"].dtype == np.float32


def test_encode_is_deterministic_and_compresses():
    rng = np.random.default_rng(1)
    x = {"w": rng.standard_normal(4096).astype(np.float32)}
    for scheme in SCHEMES:
        cfg = V1(scheme)
        assert encode("delta", META, x, cfg) == encode("delta", META, {"w": x["w"].copy()}, cfg)
    size = {s: len(encode("delta", META, x, V1(s))) for s in SCHEMES}
    assert size["int4"] < size["int8"] < size["bf16"] < size["fp32"]
    assert size["int4"] < 0.16 * x["w"].nbytes


@pytest.mark.parametrize("bad, scheme", [(np.nan, "int4"), (np.inf, "bf16"), (-np.inf, "fp32")])
def test_encode_refuses_non_finite_values_naming_the_tensor(bad, scheme):
    x = np.ones(10, np.float32)
    x[3] = bad
    with pytest.raises(ValueError, match=r"tensor blocks\.1\.w: has non-finite"):
        encode("delta", {}, {"ok": np.ones(2, np.float32), "blocks.1.w": x}, V1(scheme))


def test_encode_validation():
    with pytest.raises(ValueError, match="beyond float32 range"):
        encode("d", {}, {"big": np.array([1e300])}, V1("int8"))
    with pytest.raises(ValueError, match=r"tensor i: dtype int32"):
        encode("d", {}, {"i": np.ones(3, np.int32)}, V1())
    with pytest.raises(ValueError, match="meta is not plain"):
        encode("d", {"x": object()}, {}, V1())
    with pytest.raises(ValueError, match=r"scheme 'int2'"):
        V1("int2")
    with pytest.raises(ValueError, match=r"block_size must be an even int >= 2, got 7"):
        V1(block_size=7)
    with pytest.raises(ValueError, match=r"zstd_level .* got 23"):
        V1(zstd_level=23)


# ------------------------------------------------------------------------------ damage

@pytest.fixture(scope="module")
def blob():
    return encode("delta", META, _tensors(), V1("int4", 8, 3))


def test_rejects_truncation_and_every_flipped_byte(blob):
    for cut in (0, 1, 10, len(blob) // 2, len(blob) - 1):
        with pytest.raises(FormatError, match="truncated or corrupted|not a valid envelope"):
            decode(blob[:cut], "delta")
    for i in range(len(blob)):  # every position: header, body, checksum
        damaged = bytearray(blob)
        damaged[i] ^= 0x41
        with pytest.raises(FormatError):
            decode(bytes(damaged), "delta")


def test_rejects_wrong_version_kind_and_size(blob):
    _, body = unseal(blob, "delta", 1)
    with pytest.raises(FormatError, match="format version 4 is not supported"):
        decode(seal("delta", 4, body), "delta")
    with pytest.raises(FormatError, match="delta version 3 must carry the xxh3-128 checksum, not 'sha256'"):
        decode(seal("delta", 3, body), "delta")                                      # v3 sealed with sha256
    with pytest.raises(FormatError, match=r"missing \['frame_bytes', 'frames'\]"):   # a v1 body sealed as v2
        decode(seal("delta", 2, body), "delta")
    with pytest.raises(FormatError, match="is a 'delta' object, expected 'version'"):
        decode(blob, "version")
    with pytest.raises(FormatError, match="exceed the limit of 100 bytes"):
        decode(blob, "delta", max_bytes=100, what="deltas/L0/1/5")


def test_rejects_expect_mismatch(blob):
    specs = [TensorSpec(n, a.shape) for n, a in _tensors().items()]
    with pytest.raises(FormatError, match="expected tensor extra is missing"):
        decode(blob, "delta", expect=specs + [TensorSpec("extra", (1,))])
    with pytest.raises(FormatError, match="unexpected tensor scalar"):
        decode(blob, "delta", expect=[s for s in specs if s.name != "scalar"])
    specs[0] = TensorSpec("blocks.0.w", (7, 33))
    with pytest.raises(FormatError, match=r"tensor blocks\.0\.w has shape \(33, 7\), expected \(7, 33\)"):
        decode(blob, "delta", expect=specs)


def _reseal(blob: bytes, edit) -> bytes:
    _, body = unseal(blob, "delta", 1)
    d = msgpack.unpackb(body, raw=False)
    edit(d)
    return seal("delta", 1, msgpack.packb(d, use_bin_type=True))


def _raw(d):
    return zstandard.ZstdDecompressor().decompress(d["payload"]) if d["zstd"] else d["payload"]


def _set_raw(d, raw):
    d["zstd"], d["payload"], d["raw_len"] = False, raw, len(raw)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(raw_len=d["raw_len"] + 1), "payload length .* does not match"),
    (lambda d: _set_raw(d, _raw(d)[:-1]), "payload length .* does not match"),
    (lambda d: d.update(raw_len=d["raw_len"] - 1), "does not match"),
    (lambda d: d["tensors"][0].update(shape=[34, 7]), "does not match"),
    (lambda d: d.update(payload=_raw(d), zstd=True), "not a zstd frame"),
    (lambda d: d.update(payload=zstandard.ZstdCompressor().compress(_raw(d) + b"x")), "frame declares"),
    (lambda d: d.update(payload=d["payload"][:-4]), "does not decompress"),
    (lambda d: d.update(scheme="int3"), "unknown codec scheme 'int3'"),
    (lambda d: d.update(block_size=3), "bad block_size 3"),
    (lambda d: d.update(zstd=1), "field 'zstd' has type int"),
    (lambda d: d.update(meta=[1]), "field 'meta' has type list"),
    (lambda d: d.pop("meta"), r"missing \['meta'\]"),
    (lambda d: d.update(extra=1), r"unknown \['extra'\]"),
    (lambda d: d["tensors"][1].update(shape=[-64]), "bad shape"),
    (lambda d: d["tensors"][1].update(shape=[2**62, 2**62]), "bad shape"),
    (lambda d: d["tensors"][1].update(name="blocks.0.w"), "appears twice"),
    (lambda d: d["tensors"][1].update(dtype="int64"), "unsupported dtype"),
    (lambda d: d["tensors"].append({"name": "huge", "shape": [1 << 34], "dtype": "float32"}),
     "exceed the limit of"),
    (lambda d: _set_raw(d, np.float32(np.nan).tobytes() + _raw(d)[4:]), "non-finite, negative or out-of-range"),
    (lambda d: _set_raw(d, np.float32(-1).tobytes() + _raw(d)[4:]), "block scale"),
    (lambda d: _set_raw(d, np.float32(1e38).tobytes() + _raw(d)[4:]), "block scale"),
    (lambda d: _set_raw(d, _raw(d)[:-1] + b"\x00"), r"tensor zeros: int4 data has nibble 0"),
    (lambda d: _set_raw(d, _raw(d)[:-1] + b"\x80"), r"tensor zeros: int4 data has nibble 0"),
    (lambda d: _set_raw(d, _raw(d)[:-1] + b"\x08"), r"tensor zeros: int4 data has nibble 0"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_rejects_lies_in_a_resealed_body(blob, edit, message):
    with pytest.raises(FormatError, match=message):
        decode(_reseal(blob, edit), "delta", what="deltas/L0/1/5")


def test_rejects_bad_values_in_other_schemes():
    b8 = encode("delta", {}, {"w": np.ones(4, np.float32)}, V1("int8", 4, 0))
    with pytest.raises(FormatError, match="code -128"):
        decode(_reseal(b8, lambda d: d.update(payload=d["payload"][:4] + b"\x80\x01\x01\x01")), "delta")
    b16 = encode("delta", {}, {"w": np.ones(4, np.float32)}, V1("bf16", 4, 0))
    with pytest.raises(FormatError, match="tensor w decodes to non-finite"):
        decode(_reseal(b16, lambda d: d.update(payload=b"\xc0\x7f" + d["payload"][2:])), "delta")


def test_error_messages_name_the_object(blob):
    with pytest.raises(FormatError, match=r"^deltas/L0/1/5: "):
        decode(blob[:-3], "delta", what="deltas/L0/1/5")


def test_peek_meta_reads_the_header_without_decoding_tensors(blob):
    assert DeltaHeader.from_dict(peek_meta(blob, "delta")) == DeltaHeader.from_dict(META)
    lying = _reseal(blob, lambda d: d.update(raw_len=1))  # tensors are decode's business
    assert peek_meta(lying, "delta") == META
    with pytest.raises(FormatError, match="field 'meta' has type list"):
        peek_meta(_reseal(blob, lambda d: d.update(meta=[1])), "delta")
    with pytest.raises(FormatError, match="checksum mismatch"):
        peek_meta(blob[:-40] + bytes([blob[-40] ^ 1]) + blob[-39:], "delta")  # last payload byte


# ------------------------------------------------------ issue 15: the vectorised, threaded codec

GOLDEN = Path(__file__).parent / "fixtures" / "codec_golden"   # written by tests/fixtures/codec_make_golden.py
GOLDEN_META = {"learner": "L0", "seq": 5, "note": "golden"}


def _reference_quantize(x: np.ndarray, scheme: str, bs: int) -> bytes:
    """The int4/int8 encoder as it was before issue 15 (straight numpy, whole tensor at once)."""
    flat = np.ravel(np.asarray(x, dtype=np.float32))
    n, nb = flat.size, -(-flat.size // bs)
    blocks = np.zeros((nb, bs), np.float32)
    blocks.reshape(-1)[:n] = flat
    qmax = QMAX[scheme]
    scale = (np.abs(blocks).max(axis=1) / np.float32(qmax)).astype(np.float32) if nb else np.zeros(0, np.float32)
    q = blocks / np.where(scale > 0, scale, np.float32(1))[:, None]
    q = np.clip(np.rint(q), -qmax, qmax)
    if scheme == "int8":
        return scale.astype("<f4").tobytes() + q.astype(np.int8).tobytes()
    u = (q + 8).astype(np.uint8).reshape(-1, 2)
    return scale.astype("<f4").tobytes() + (u[:, 0] | (u[:, 1] << 4)).tobytes()


def _golden_cases():
    manifest = json.loads((GOLDEN / "manifest.json").read_text())
    inputs = np.load(GOLDEN / "inputs.npz")
    for case, m in sorted(manifest.items()):
        tensors = {n: inputs[f"{m['set']}/{n}"] for n in m["names"]}
        yield pytest.param(case, m, tensors, id=case)


@pytest.mark.parametrize("case, m, tensors", list(_golden_cases()))
def test_golden_blobs_read_the_same_and_are_written_the_same(case, m, tensors):
    old = (GOLDEN / f"{case}.blob").read_bytes()
    assert hashlib.sha256(old).hexdigest() == m["blob_sha256"]
    # today's reader reads the old encoder's blob to the same values the old reader gave
    assert tensor_digest(decode(old, "delta").tensors) == m["values_digest"]
    # today's encoder writes the same bytes for these (small: one-shot zstd) payloads
    new = encode("delta", GOLDEN_META, tensors, V1(m["scheme"], m["block_size"], m["zstd_level"]))
    assert new == old
    with ThreadPoolExecutor(3) as pool:
        assert encode("delta", GOLDEN_META, tensors, V1(m["scheme"], m["block_size"], m["zstd_level"]),
                      map_fn=pool.map) == old
        assert tensor_digest(decode(new, "delta", map_fn=pool.map).tensors) == m["values_digest"]


@settings(max_examples=80, deadline=None)
@given(hnp.arrays(st.sampled_from([np.float32, np.float16, np.float64]), st.integers(0, 700),
                  elements=st.floats(-1e4, 1e4, width=16)),
       st.sampled_from(["int4", "int8"]), st.sampled_from([2, 4, 6, 64, 128]), st.integers(-140, 30))
def test_quantize_matches_the_reference_encoder_byte_for_byte(x, scheme, bs, exp):
    if x.dtype != np.float16:   # float16 is converted as it is; the others scaled down to subnormal sizes
        x = x * x.dtype.type(2.0 ** exp)
    assert quantize(x, scheme, bs) == _reference_quantize(x, scheme, bs)   # incl. subnormal (clipped) scales


def _large(seed=5):
    rng = np.random.default_rng(seed)
    return {"a": (rng.standard_t(3, 1_300_000) * 1e-3).astype(np.float32),          # > one job, odd size
            "tiny": np.array([1.5, -2.0], np.float32),
            "b": rng.standard_normal((1000, 1003)).astype(np.float32),
            "empty": np.zeros(0, np.float32),
            "c": (rng.standard_normal(640_001) * 1e-40).astype(np.float32)}           # subnormal scales


@pytest.mark.parametrize("scheme", ["int4", "int8", "bf16"])
def test_large_blobs_are_the_same_bytes_at_any_thread_count(scheme):
    tensors = _large()
    cfg = V1(scheme, 64, 3)
    one = encode("delta", META, tensors, cfg)
    _, body = unseal(one, "delta", 1)
    for threads in (1, 2, 3):
        with ThreadPoolExecutor(threads) as pool:
            assert encode("delta", META, tensors, cfg, map_fn=pool.map) == one
    with ThreadPoolExecutor(2) as pool:
        got = decode(one, "delta", map_fn=pool.map).tensors
    alone = decode(one, "delta").tensors
    for name, x in tensors.items():
        assert got[name].tobytes() == alone[name].tobytes() and got[name].shape == x.shape
    # the payload is what the encoder before issue 15 wrote: the reference raw bytes, zstd's one-shot frame
    if scheme == "bf16":
        want = b"".join(_torch_bf16_bits(np.ravel(x)).tobytes() for x in tensors.values())
    else:
        want = b"".join(_reference_quantize(x, scheme, 64) for x in tensors.values())
    assert msgpack.unpackb(body, raw=False)["payload"] == zstandard.ZstdCompressor(level=3, write_content_size=True
                                                                                    ).compress(want)


def test_a_non_finite_value_in_a_late_job_is_refused_naming_its_tensor():
    tensors = _large()
    tensors["b"] = tensors["b"].copy()
    tensors["b"][999, 1000] = np.inf
    with ThreadPoolExecutor(2) as pool:
        with pytest.raises(ValueError, match=r"tensor b: has non-finite"):
            encode("delta", {}, tensors, V1("int4"), map_fn=pool.map)
    # the first refused tensor in order decides, values before a bad dtype
    with pytest.raises(ValueError, match=r"tensor b: has non-finite"):
        encode("delta", {}, {**tensors, "i": np.ones(3, np.int32)}, V1("bf16"))
    with pytest.raises(ValueError, match=r"tensor i: dtype int32"):
        encode("delta", {}, {"i": np.ones(3, np.int32), **tensors}, V1("int8"))


def test_damage_in_a_late_tensor_is_named_and_the_first_damaged_tensor_wins():
    x = {"first": np.ones(100, np.float32), "second": np.ones(3_000_000, np.float32)}
    blob = encode("delta", {}, x, V1("int4", 64, 0))
    bad = _reseal(blob, lambda d: d.update(payload=d["payload"][:-1] + b"\x80"))
    with ThreadPoolExecutor(2) as pool:
        with pytest.raises(FormatError, match=r"tensor second: int4 data has nibble 0"):
            decode(bad, "delta", map_fn=pool.map)
    both = _reseal(bad, lambda d: d.update(payload=np.float32(-1).tobytes() + d["payload"][4:]))
    with pytest.raises(FormatError, match=r"tensor first: int4 data has a non-finite, negative"):
        decode(both, "delta")


def test_the_numpy_path_writes_what_the_torch_path_writes(monkeypatch):
    # codec uses torch's row maximum when torch is imported (as here), numpy's otherwise: same bytes
    tensors = {"a": _large()["a"][:300_001], "c": _large()["c"][:70_000]}
    with_torch = [encode("d", {}, tensors, V1(s, 64, 0)) for s in ("int4", "int8")]
    monkeypatch.delitem(sys.modules, "torch")
    assert [encode("d", {}, tensors, V1(s, 64, 0)) for s in ("int4", "int8")] == with_torch


def test_a_damaged_large_zstd_payload_is_refused_while_streaming():
    x = np.random.default_rng(2).standard_normal(3_000_000).astype(np.float32)
    blob = encode("delta", {}, {"w": x, "v": np.ones(10, np.float32)}, V1("int4", 64, 3))
    for cut in (4, 1000, 1_000_000):   # the frame ends early: jobs may have started on the first tensor
        with ThreadPoolExecutor(2) as pool, pytest.raises(FormatError, match="does not decompress"):
            decode(_reseal(blob, lambda d: d.update(payload=d["payload"][:-cut])), "delta", map_fn=pool.map)
        with pytest.raises(FormatError, match="does not decompress"):
            decode(_reseal(blob, lambda d: d.update(payload=d["payload"][:-cut])), "delta")
