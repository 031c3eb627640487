"""The codec's C kernels (pipeline/_ckernels.c via pipeline/kernels.py) against its numpy path.

Issue 15: the fused kernels must write exactly the numpy path's bytes (encode) and values (decode),
refuse exactly what it refuses with the same messages, be the path in use where `pip install`
built them, and release the GIL while they run. Every comparison runs both paths in this process
(``kernels.use(False)``: the numpy path).
"""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from pipeline import kernels
from pipeline.codec import CodecConfig, decode, dequantize, encode, quantize
from pipeline.envelope import seal, unseal
from pipeline.errors import FormatError

ROOT = Path(__file__).resolve().parents[1]
F32 = np.finfo(np.float32)
BLOCKS = st.sampled_from([2, 4, 6, 8, 10, 64, 128, 130, 512, 1000])
# any finite float32: subnormals, zeros of both signs, values near the largest
_finite = st.floats(width=32, allow_nan=False, allow_infinity=False)


def _both(fn):
    """``fn()`` on the C kernels and on the numpy path."""
    with kernels.use(True):
        c = fn()
    with kernels.use(False):
        ref = fn()
    return c, ref


def _quantized_both(x, scheme, bs):
    """``quantize`` on both paths: the same bytes, or the same refusal (None: both refused)."""
    out = []
    for flag in (True, False):
        with kernels.use(flag):
            try:
                out.append(quantize(x, scheme, bs))
            except ValueError as exc:
                out.append(str(exc))
    assert type(out[0]) is type(out[1]) and out[0] == out[1], out
    return out[1] if isinstance(out[1], bytes) else None


def _raises_both(fn, exc, match):
    for flag in (True, False):
        with kernels.use(flag), pytest.raises(exc, match=match):
            fn()


def test_the_installed_environment_uses_the_compiled_kernels():
    # `pip install -e .` builds pipeline/_ckernels.c (setup.py); a silent fallback to numpy here
    # would mean the build failed and every figure of docs/scale.md's codec section is wrong.
    assert kernels.AVAILABLE, "pipeline._ckernels was not built: reinstall with `pip install -e '.[test]'`"
    assert kernels.enabled()
    from pipeline import _ckernels
    assert Path(_ckernels.__file__).suffix == ".so"
    calls = []
    real = kernels.quantize
    try:
        kernels.quantize = lambda *a: calls.append(1) or real(*a)
        encode("d", {}, {"w": np.ones(100, np.float32)}, CodecConfig("int4", 8))
    finally:
        kernels.quantize = real
    assert calls, "codec.encode did not go through the C kernel"


def test_without_the_built_module_the_numpy_path_writes_the_same_bytes():
    code = (
        "import sys; sys.modules['pipeline._ckernels'] = None\n"   # as on a machine without a compiler
        "import numpy as np\n"
        "from pipeline import kernels\n"
        "from pipeline.codec import CodecConfig, encode\n"
        "assert not kernels.AVAILABLE and not kernels.enabled()\n"
        "try:\n    kernels.set_enabled(True)\nexcept ValueError as e:\n    print('refused:', e)\n"
        "x = np.random.default_rng(1).standard_normal(5000).astype(np.float32)\n"
        "sys.stdout.write(encode('d', {}, {'w': x}, CodecConfig('int4', 64)).hex())\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    refused, blob = out.split("\n", 1)
    assert refused.startswith("refused: the C codec kernels were not built")
    x = np.random.default_rng(1).standard_normal(5000).astype(np.float32)
    assert bytes.fromhex(blob) == encode("d", {}, {"w": x}, CodecConfig("int4", 64))


@settings(max_examples=150, deadline=None)
@given(hnp.arrays(np.float32, st.integers(0, 3000), elements=_finite), st.sampled_from(["int4", "int8"]), BLOCKS)
def test_quantize_and_dequantize_match_numpy_bit_for_bit(x, scheme, bs):
    ref = _quantized_both(x, scheme, bs)    # refused by both: int8 blocks with absmax 3.4028235e38
    if ref is None:
        return
    c, ref = _both(lambda: dequantize(ref, scheme, bs, x.size))
    assert c.view(np.uint32).tobytes() == ref.view(np.uint32).tobytes()


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 40), st.integers(-149, 124), st.sampled_from(["int4", "int8"]), BLOCKS, st.integers(0, 2**32 - 1))
def test_scaled_gaussians_with_zero_blocks_match(nblocks, exp, scheme, bs, seed):
    # values of every magnitude (2**-149: subnormal scales, whose x / scale needs the clip), ties,
    # all-zero blocks and a padded last block
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(nblocks * bs + rng.integers(0, bs)) * 2.0**exp).astype(np.float32)
    x[: bs * min(2, nblocks)] = 0
    x[-bs // 2:] = np.round(x[-bs // 2:] * 2) / 2          # halves: round half to even
    c, ref = _both(lambda: quantize(x, scheme, bs))
    assert c == ref
    c, ref = _both(lambda: dequantize(ref, scheme, bs, x.size))
    assert c.view(np.uint32).tobytes() == ref.view(np.uint32).tobytes()


@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_extremes_match(scheme):
    tiny = np.array([1e-45, -1e-45, 3e-45, 1.1754942e-38, -1e-40, 5e-39, 0.0, -0.0], np.float32)
    huge = np.array([F32.max, -F32.max, 3e38, 1.0, -2.5e38, 1e-30, 0.5, 7.0], np.float32)
    below = np.where(np.abs(huge) == F32.max, np.nextafter(huge, np.float32(0)), huge)   # int8's largest
    for x in (tiny, huge, below, np.concatenate([tiny, huge]), np.concatenate([tiny, below]),
              np.zeros(1000, np.float32), np.full(9, -0.0, np.float32)):
        for bs in (2, 8, 16):
            ref = _quantized_both(x, scheme, bs)
            if ref is None:             # int8 with +-F32.max in a block (test_int8_near_the_float32_max...)
                assert scheme == "int8" and np.abs(x).max() == F32.max
                continue
            c, ref = _both(lambda: dequantize(ref, scheme, bs, x.size))
            assert c.view(np.uint32).tobytes() == ref.view(np.uint32).tobytes()


@pytest.mark.parametrize("version", [1, 2])
def test_whole_blobs_match_across_dtypes_jobs_and_threads(version):
    rng = np.random.default_rng(7)
    tensors = {"big": rng.standard_normal(2_500_003).astype(np.float32),   # several jobs, padded end
               "half": rng.standard_normal((300, 7)).astype(np.float16),
               "double": rng.standard_normal(1001) * 1e-3,
               "fortran": np.asfortranarray(rng.standard_normal((64, 33)).astype(np.float32)),
               "empty": np.zeros((0, 4), np.float32)}
    for scheme in ("int4", "int8"):
        cfg = CodecConfig(scheme, 64, 1)
        c, ref = _both(lambda: encode("delta", {"m": 1}, tensors, cfg, version=version, frame_bytes=1 << 18))
        assert c == ref
        with ThreadPoolExecutor(3) as pool, kernels.use(True):
            assert encode("delta", {"m": 1}, tensors, cfg, version=version, frame_bytes=1 << 18,
                          map_fn=pool.map) == ref
            threaded = decode(ref, "delta", map_fn=pool.map).tensors
        c, ref_dec = _both(lambda: decode(ref, "delta").tensors)
        for name in tensors:
            assert c[name].tobytes() == ref_dec[name].tobytes() == threaded[name].tobytes()


@pytest.mark.parametrize("scheme", ["int4", "int8"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values_are_refused_naming_the_tensor(scheme, bad):
    ok = np.ones(3_000_000, np.float32)
    late = ok.copy()
    late[-5] = bad                                         # in the last job and the padded last block
    _raises_both(lambda: encode("d", {}, {"a": ok, "b": late}, CodecConfig(scheme)), ValueError,
                 r"tensor b: has non-finite")
    _raises_both(lambda: quantize(np.array([0.0, bad, 1.0], np.float32), scheme, 2), ValueError, "non-finite")
    _raises_both(lambda: encode("d", {}, {"f64": np.array([1.0, 1e39])}, CodecConfig(scheme)), ValueError,
                 r"tensor f64: has non-finite")


@pytest.mark.parametrize("top", [F32.max, -F32.max])
def test_int8_at_the_float32_max_is_refused_not_written_to_decode_as_inf(top):
    """Old code: int8 encoded absmax 3.4028235e38 with scale float32(absmax / 127) = 2.6793886e36,
    rounded up, which passes the decoder's scale check, and decoded the code 127 to 127 * scale =
    inf. Encode now refuses it as it refuses Inf, on both paths; everything below is unchanged."""
    x = np.random.default_rng(5).standard_normal(3_000_000).astype(np.float32)
    x[-5] = top                                            # in the last job and the padded last block
    _raises_both(lambda: encode("d", {}, {"a": x[:10], "w": x}, CodecConfig("int8")), ValueError,
                 r"tensor w: has non-finite values \(NaN/Inf or beyond float32 range\)")
    _raises_both(lambda: quantize(np.array([0.0, top], np.float32), "int8", 2), ValueError, "beyond float32 range")
    _raises_both(lambda: encode("d", {}, {"f64": np.array([1.0, float(top)])}, CodecConfig("int8")), ValueError,
                 r"tensor f64: has non-finite")
    # the next value towards zero, and int4 at the maximum itself, encode on both paths and decode finite
    below = np.nextafter(np.float32(top), np.float32(0))
    for scheme, value in (("int8", below), ("int4", np.float32(top))):
        x[-5] = value
        c, ref = _both(lambda: encode("d", {}, {"w": x}, CodecConfig(scheme)))
        assert c == ref
        got = decode(ref, "d").tensors["w"]
        assert np.isfinite(got).all() and got[-5] == value   # the block's absmax decodes exactly


def test_both_paths_refuse_exactly_the_scales_whose_largest_code_overflows():
    # the top 4096 float32 values as block absmax: int8 refuses only the maximum, int4 none
    tops = (np.float32(F32.max).view(np.uint32) - np.arange(4096, dtype=np.uint32)).view(np.float32)
    for scheme, qmax in (("int4", 7), ("int8", 127)):
        refused = [m for m in tops if _quantized_both(np.array([m, -m / 3], np.float32), scheme, 2) is None]
        with np.errstate(over="ignore"):
            overflow = [m for m in tops if not np.isfinite(np.float32(m / np.float32(qmax)) * np.float32(qmax))]
        assert refused == overflow == ([F32.max] if scheme == "int8" else [])


def _int_blob(scheme: str, raw_edit) -> bytes:
    """A format 1 blob (one raw payload) of tensors a (3000 values: several blocks) and b, its raw
    payload edited."""
    rng = np.random.default_rng(3)
    blob = encode("delta", {}, {"a": rng.standard_normal(3000).astype(np.float32),
                                "b": rng.standard_normal(100).astype(np.float32)}, CodecConfig(scheme, 64, 0, format=1))
    d = msgpack.unpackb(unseal(blob, "delta", 1)[1], raw=False)
    raw = bytearray(d["payload"])
    raw_edit(raw)
    d["payload"] = bytes(raw)
    return seal("delta", 1, msgpack.packb(d, use_bin_type=True))


def _set(offset: int, data: bytes):
    def edit(raw: bytearray) -> None:
        raw[offset:offset + len(data)] = data
    return edit


_NB = 3000 // 64 + 1          # blocks of tensor a
_LIMIT = {"int4": np.float32(F32.max / 7), "int8": np.float32(F32.max / 127)}


@pytest.mark.parametrize("scheme, edit, message", [
    ("int4", _set(4 * _NB + 5, b"\x80"), "tensor a: int4 data has nibble 0"),
    ("int4", _set(4 * _NB + 1500, b"\x08"), "tensor a: int4 data has nibble 0"),
    ("int4", _set(4 * _NB + _NB * 32 - 1, b"\x00"), "tensor a: int4 data has nibble 0"),   # in the padding
    ("int8", _set(4 * _NB + 2999, b"\x80"), "tensor a: int8 data has code -128"),
    ("int8", _set(4 * _NB + _NB * 64 - 1, b"\x80"), "tensor a: int8 data has code -128"),  # in the padding
    ("int4", _set(4 * 7, np.float32(np.nan).tobytes()), "tensor a: int4 data has a non-finite, negative"),
    ("int4", _set(4 * 7, np.float32(-1e-30).tobytes()), "tensor a: int4 data has a non-finite, negative"),
    ("int8", _set(0, np.float32(np.inf).tobytes()), "tensor a: int8 data has a non-finite, negative"),
    ("int4", _set(4, np.nextafter(_LIMIT["int4"], np.float32(np.inf)).tobytes()), "out-of-range block scale"),
    ("int8", _set(4, np.nextafter(_LIMIT["int8"], np.float32(np.inf)).tobytes()), "out-of-range block scale"),
])
def test_bad_codes_and_scales_are_refused_with_the_same_message(scheme, edit, message):
    blob = _int_blob(scheme, edit)
    _raises_both(lambda: decode(blob, "delta"), FormatError, message)


@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_the_largest_allowed_scale_decodes_the_same(scheme):
    blob = _int_blob(scheme, _set(4, _LIMIT[scheme].tobytes()))   # on the limit: accepted by both
    c, ref = _both(lambda: decode(blob, "delta").tensors["a"])
    assert c.view(np.uint32).tobytes() == ref.view(np.uint32).tobytes()


def test_the_kernels_release_the_gil():
    # With a huge switch interval a thread that holds the GIL is never made to drop it, so the main
    # thread runs while the other thread is inside a call only if the kernel released the GIL (the
    # main thread itself drops it now and then, sleep(0), so that the calls can return).
    x = np.random.default_rng(0).standard_normal(4 << 20).astype(np.float32)
    nb = x.size // 64
    scales, codes, out = np.empty(nb, np.float32), np.empty(nb * 32, np.uint8), np.empty_like(x)
    started, done = threading.Event(), threading.Event()

    def work():
        started.set()
        for _ in range(20):
            kernels.quantize(x, 7, 64, scales, codes)
            kernels.dequantize(scales, codes, out, 7, 64)
        done.set()

    before = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        t = threading.Thread(target=work)
        t.start()
        started.wait()
        beside = 0
        while not done.is_set():
            beside += 1
            if beside % 100 == 0:
                time.sleep(0)
        t.join()
    finally:
        sys.setswitchinterval(before)
    assert beside > 1000, f"the main thread ran only {beside} loops beside 40 kernel calls"


def test_the_kernels_check_their_buffers():
    x = np.zeros(10, np.float32)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.quantize(x, 7, 4, np.empty(2, np.float32), np.empty(6, np.uint8))
    with pytest.raises(ValueError, match="qmax"):
        kernels.quantize(x, 8, 4, np.empty(3, np.float32), np.empty(6, np.uint8))
    with pytest.raises(ValueError, match="even"):
        kernels.dequantize(np.empty(4, np.float32), np.empty(6, np.uint8), x, 7, 3)
    with pytest.raises(ValueError, match="float32"):
        kernels.dequantize(np.empty(3, np.float32), np.empty(6, np.uint8), np.empty(5, np.uint8), 7, 4)


def test_bench_codec_measures_both_paths_and_their_bytes_agree():
    from workers.tools.bench import BenchConfig, bench_codec
    cfg = BenchConfig(what="codec", size_mb=0.3, repeat=1, threads=(1,), schemes=("int4", "int8"), formats=(1, 3),
                      zstd_level=1, kernels=("c", "numpy"))
    rows = bench_codec(cfg)["rows"]
    assert {(r["scheme"], r["format"], r["zstd_level"], r["kernel"]) for r in rows} == {
        (s, f, lv, k) for s in ("int4", "int8") for f in (1, 3) for lv in (1, 0) for k in ("c", "numpy")}
    assert all(r["same_bytes"] for r in rows)            # numpy rows compared with the C rows' blobs
    with pytest.raises(ValueError, match="--kernels must list some of"):
        BenchConfig(kernels=("fortran",))
