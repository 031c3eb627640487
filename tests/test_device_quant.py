"""Device quantisation (issue 15, workers/learner/device_quant.py + pipeline/codec_raw.py): torch
kernels write the codec's raw int4/int8 payload byte for byte, ``seal_raw`` turns it into
``codec.encode``'s blob, non-finite input is refused the same way, and a learner forced onto the
device path stores the same delta bytes as the default path.

The tensors live on ``DDILOCO_TEST_DEVICE`` (default ``cpu``; e.g. ``cuda`` on a machine with a GPU:
that is the check docs/scale.md asks of a user with one)."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

from pipeline.codec import CodecConfig
from pipeline import codec, kernels
from pipeline.codec_raw import seal_raw
from storage.layout import spill_prefix
from storage.store import open_store
from workers.launch import Schedule
from workers.learner.device_quant import DeviceDelta, quantise_delta, quantise_payload
from workers.learner.learner import LearnerConfig

from test_hardening_learner import append_version, make_run, start_learner, tiny_model

SCHEMES = ("int4", "int8")
DEVICE = torch.device(os.environ.get("DDILOCO_TEST_DEVICE", "cpu"))


def _dev(v: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(v).to(DEVICE)


def _payload(tensors, scheme: str, bs: int) -> np.ndarray:
    return quantise_payload([_dev(v) for v in tensors], scheme, bs).cpu().numpy()


def _tensors(rng: np.random.Generator, scheme: str, bs: int) -> dict[str, np.ndarray]:
    """Random shapes (most with a padded last block), an all-zero block, subnormal and huge values."""
    big = 3.0e38 if scheme == "int4" else 2.0e36   # int8: 127 * (3e38 / 127) would overflow: refused
    out = {f"r{i}": (rng.standard_normal(tuple(rng.integers(1, 40, size=rng.integers(1, 4))))
                     * 10.0 ** rng.integers(-6, 6)).astype(np.float32) for i in range(6)}
    zeros_then = np.concatenate([np.zeros(bs, np.float32), rng.standard_normal(bs + 1).astype(np.float32)])
    out.update({"zeros": np.zeros(3 * bs, np.float32), "zero_block": zeros_then,
                "subnormal": (rng.standard_normal(5 * bs + 3) * 1e-41).astype(np.float32),
                "tiny_mixed": np.array([1e-45, -3e-44, 0.0, 1e-38, -1.2e-38] * bs, np.float32),
                "huge": np.array([big, -big, 1.0, -1e-30, 7.0], np.float32),
                "halves": (np.arange(-4 * bs, 4 * bs, dtype=np.float32) + 0.5),
                "empty": np.zeros((0, 3), np.float32), "scalar": np.array(-2.5, np.float32)})
    return out


def _specs(tensors):
    return [(n, tuple(v.shape), "float32") for n, v in tensors.items()]


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("bs", [2, 6, 64])
@pytest.mark.parametrize("c_kernel", [True, False])
def test_torch_kernels_write_the_codecs_payload(scheme, bs, c_kernel):
    if c_kernel and not kernels.AVAILABLE:
        pytest.skip("the C codec kernels are not built here: the numpy path is compared instead")
    rng = np.random.default_rng(bs * 7 + len(scheme))
    ts = _tensors(rng, scheme, bs)
    raw = _payload(ts.values(), scheme, bs)
    with kernels.use(c_kernel):
        want = b"".join(codec.quantize(v, scheme, bs) for v in ts.values())
    assert raw.tobytes() == want


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("fmt", [1, 2, 3])
@pytest.mark.parametrize("level", [0, 3])
def test_sealed_blob_is_encodes_blob(scheme, fmt, level):
    rng = np.random.default_rng(fmt * 10 + level)
    for bs in (4, 64):
        ts = _tensors(rng, scheme, bs)
        cfg = codec.CodecConfig(scheme, bs, level, fmt)
        meta = {"learner": "l0", "seq": 3}
        raw = _payload(ts.values(), scheme, bs)
        got = seal_raw("delta", meta, _specs(ts), raw, cfg)
        assert got == codec.encode("delta", meta, ts, cfg)
        back = codec.decode(got, "delta")
        assert list(back.tensors) == list(ts)


def test_a_large_tensor_crosses_chunks(monkeypatch):
    import workers.learner.device_quant as dq
    monkeypatch.setattr(dq, "CPU_CHUNK", 1000)   # many kernel calls, a chunk edge inside blocks' reach
    x = (np.random.default_rng(5).standard_normal(12_345) * 3).astype(np.float32)
    for scheme in SCHEMES:
        assert _payload([x], scheme, 64).tobytes() == codec.quantize(x, scheme, 64)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_refused_like_encode(scheme, bad):
    rng = np.random.default_rng(1)
    ts = {"ok": rng.standard_normal(100).astype(np.float32), "bad": rng.standard_normal(130).astype(np.float32),
          "later": np.full(10, np.nan, np.float32)}
    ts["bad"][77] = bad
    cfg = codec.CodecConfig(scheme, 64, 3, 3)
    with pytest.raises(ValueError) as want:
        codec.encode("delta", {}, ts, cfg)
    raw = _payload(ts.values(), scheme, 64)
    with pytest.raises(ValueError) as got:
        seal_raw("delta", {}, _specs(ts), raw, cfg)
    assert str(got.value) == str(want.value) and "tensor bad:" in str(got.value)


def test_int8_scale_overflow_refused_like_encode():
    ts = {"x": np.array([3.4028235e38, 1.0], np.float32)}   # 127 * (max / 127) rounds to inf in float32
    cfg = codec.CodecConfig("int8", 64, 3, 3)
    with pytest.raises(ValueError) as want:
        codec.encode("delta", {}, ts, cfg)
    raw = _payload([ts["x"]], "int8", 64)
    with pytest.raises(ValueError) as got:
        seal_raw("delta", {}, _specs(ts), raw, cfg)
    assert str(got.value) == str(want.value)
    int4 = codec.CodecConfig("int4", 64, 3, 3)   # int4's 7 * (max / 7) stays finite: accepted by both
    raw4 = _payload([ts["x"]], "int4", 64)
    assert seal_raw("delta", {}, _specs(ts), raw4, int4) == codec.encode("delta", {}, ts, int4)


def test_seal_raw_refuses_what_it_cannot_seal():
    x = np.ones(10, np.float32)
    raw = _payload([x], "int4", 4)
    cfg = codec.CodecConfig("int4", 4, 3, 3)
    with pytest.raises(ValueError, match="imply"):
        seal_raw("delta", {}, [("x", (13,), "float32")], raw, cfg)
    with pytest.raises(ValueError, match="seals"):
        seal_raw("delta", {}, [("x", (10,), "float32")], raw, codec.CodecConfig("bf16"))
    with pytest.raises(ValueError, match="dtype"):
        seal_raw("delta", {}, [("x", (10,), "int32")], raw, cfg)
    with pytest.raises(ValueError, match="contiguous"):
        seal_raw("delta", {}, [("x", (10,), "float32")], raw[::1].astype(np.int8), cfg)
    with pytest.raises(ValueError, match="device quantisation supports"):
        quantise_payload([torch.from_numpy(x)], "bf16", 4)


def test_quantise_delta_is_the_difference_and_waits_on_its_event():
    rng = np.random.default_rng(2)
    base = {"w": rng.standard_normal((5, 9)).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32)}
    params = {n: _dev(v + rng.standard_normal(v.shape).astype(np.float32) * 0.1) for n, v in base.items()}
    params["b"] = params["b"].to(torch.float16)   # a half-precision parameter: widened exactly
    dd = quantise_delta({n: _dev(v) for n, v in base.items()}, params, ["w", "b"], "int4", 8)
    dd.wait()   # the real copy first; then an event that records whether the sender waits on it
    want = {n: base[n] - params[n].float().cpu().numpy() for n in base}
    cfg = codec.CodecConfig("int4", 8, 3, 3)
    waited = []

    class Event:   # what a device event does for the sender: block until the copy is done
        def synchronize(self):
            waited.append(True)

    dd = DeviceDelta(dd.specs, dd.scheme, dd.block_size, dd.host, Event())
    assert dd.nbytes == sum(len(codec.quantize(v, "int4", 8)) for v in want.values())
    assert dd.seal_blob("delta", {"a": 1}, cfg) == codec.encode("delta", {"a": 1}, want, cfg)
    assert waited == [True]
    with pytest.raises(ValueError, match="quantised as int4/8"):
        dd.seal_blob("delta", {}, codec.CodecConfig("int4", 64, 3, 3))


def test_config_refuses_unknown_mode():
    with pytest.raises(ValueError, match="device_quantise"):
        LearnerConfig(device_quantise="gpu")


def _spills(store) -> dict[str, bytes]:
    return {k: store.get(k) for k in store.list(spill_prefix("l0", 1))}


def _run(tmp_path, mode: str, **cfg):
    """A version of fragment 1 applied, six steps on fixed data, a flush: two deltas spilled."""
    store = open_store(str(tmp_path / (mode + "".join(f"-{k}{v}" for k, v in cfg.items()))))
    model = tiny_model()
    desc = make_run(store, model)
    model.to(DEVICE)
    learner, _ = start_learner(store, model, device_quantise=mode, **cfg)
    try:
        append_version(store, desc, 1, 1, {t.name: np.full(t.shape, 0.25, np.float32) for t in desc.layout.tensors})
        deadline = time.monotonic() + 20
        while learner.apply_arrivals() == 0:
            assert time.monotonic() < deadline, "version 1 never arrived"
            time.sleep(0.01)
        torch.manual_seed(1)
        x, y = torch.randn(16, 8).to(DEVICE), torch.randn(16, 1).to(DEVICE)
        while learner.step_count < 6:
            learner.step(lambda: torch.nn.functional.mse_loss(learner.model(x), y), tokens=16)
    finally:
        drained = learner.close(flush=True)
    return store, learner, drained


def test_learner_on_the_device_path_stores_the_same_deltas(tmp_path):
    s_off, l_off, ok_off = _run(tmp_path, "off")
    s_on, l_on, ok_on = _run(tmp_path, "on")
    assert ok_off and ok_on
    assert l_on._device_quantise and not l_off._device_quantise
    assert all(p.device.type == DEVICE.type for p in l_on.model.parameters())
    spills_off, spills_on = _spills(s_off), _spills(s_on)
    assert len(spills_off) == 2 and spills_on == spills_off
    assert l_on.stats()["spilled"] == 2 and l_on.stats()["nonfinite_deltas"] == 0


def test_no_copy_of_the_bases_stays_with_the_parameters_unless_a_bounded_cache_is_asked_for(tmp_path):
    """Issue 28: an answer uploads its fragment's base for the quantisation only (on a CPU model not
    even that: the tensors are views of the host bases); with device_base_cache N at most N stay."""
    s_none, l_none, _ = _run(tmp_path, "on")
    s_one, l_one, _ = _run(tmp_path, "on", device_base_cache=1)
    assert _spills(s_none) == _spills(s_one)       # the same delta bytes either way
    assert l_none._device_base_kept() == {} and list(l_one._device_base_kept()) == [1]
    if DEVICE.type == "cpu":
        names = l_one.descriptor.layout.fragments[1]
        held = l_one._device_base_kept()[1]
        assert all(held[n].data_ptr() == l_one.base[1][n].__array_interface__["data"][0] for n in names)
    with pytest.raises(ValueError, match="device_base_cache"):
        LearnerConfig(device_base_cache=-1)


def test_auto_takes_the_device_path_only_off_the_cpu_and_on_refuses_what_it_cannot_do(tmp_path):
    store = open_store(str(tmp_path / "auto"))
    model = tiny_model()
    make_run(store, model)
    learner, _ = start_learner(store, model.to(DEVICE))
    try:
        assert learner._device_quantise == (DEVICE.type != "cpu")   # auto: a CPU model keeps today's path
    finally:
        learner.close(flush=False)
    from workers.launch import RunSettings, create_run
    bf = open_store(str(tmp_path / "bf16"))
    create_run(bf, {n: p.detach().cpu().numpy().copy() for n, p in model.named_parameters()},
               RunSettings(schedule=Schedule(fragments=2, sync_every=4), codec=CodecConfig(scheme="bf16")))
    with pytest.raises(ValueError, match="device_quantise='on' needs an int4/int8 run"):
        start_learner(bf, model, device_quantise="on")


def test_benchmark_checks_bytes_and_reports_ratios():
    from infra.lab.bench_device_quant import run
    out = run(3000, "int8", 64, 2, 1, str(DEVICE))
    assert set(out["median_ms"]) >= {"torch", "answer_off", "answer_on"}
    assert out["answer_on_over_off"] > 0 and ("torch_over_c" in out) == kernels.AVAILABLE


def test_sender_waits_for_the_copy_on_its_thread_and_drops_non_finite_like_encode(tmp_path):
    """``submit`` returns while the device's copy is still pending (the training thread never
    waits); the sender thread seals once the event completes, the same bytes ``encode`` gives; a
    non-finite delta is dropped with ``encode``'s error."""
    import threading

    from pipeline.types import DeltaHeader
    from runhelpers import Recorder
    from workers.learner.sender import Sender, SenderConfig

    cfg = codec.CodecConfig("int4", 64, 3, 3)
    events = Recorder()
    store = open_store(str(tmp_path / "run"))
    sender = Sender(store, cfg, SenderConfig(retry_s=0.05, max_retry_s=0.2), events, bus=None, identity=b"l0",
                    heartbeat=dict)
    sender.start()
    copied = threading.Event()

    class Pending:   # a device copy that completes only when the test says so
        def synchronize(self):
            assert threading.current_thread().name == "sender"
            copied.wait(10)

    def delta(values, seq):
        dd = quantise_delta({"w": _dev(np.zeros_like(values))}, {"w": _dev(-values)}, ["w"], "int4", 64)
        dd.wait()
        h = DeltaHeader("l0", 1, seq, seq, 0, c_steps=1, c_tokens=10, learner_step=seq)
        return h, DeviceDelta(dd.specs, dd.scheme, dd.block_size, dd.host, Pending())

    try:
        x = np.random.default_rng(3).standard_normal(1000).astype(np.float32)
        h, dd = delta(x, 0)
        t0 = time.monotonic()
        sender.submit(h, dd)
        assert time.monotonic() - t0 < 0.5 and sender.undelivered() == 1
        time.sleep(0.2)
        assert sender.stats.spilled == 0           # still waiting for the copy, on its own thread
        copied.set()
        assert sender.drain(10)
        assert store.get(store.list(spill_prefix("l0", 1))[0]) == codec.encode("delta", h.to_dict(), {"w": x}, cfg)
        bad = x.copy()
        bad[5] = np.nan
        h2, dd2 = delta(bad, 1)
        sender.submit(h2, dd2)
        assert sender.drain(10)
        with pytest.raises(ValueError) as want:
            codec.encode("delta", h2.to_dict(), {"w": bad}, cfg)
        dropped = events.named("delta-dropped")
        assert sender.stats.nonfinite == 1 and len(dropped) == 1 and dropped[0]["error"] == str(want.value)
    finally:
        sender.stop()


def test_bases_live_in_host_memory_pinned_only_beside_a_cuda_model(tmp_path):
    """Issue 28: every base (the one loaded at start and the one a version brought) is a host array
    that shares no memory with a parameter; page-locked when the model is on CUDA, plain otherwise."""
    _, learner, _ = _run(tmp_path, "off")
    cuda = DEVICE.type == "cuda"
    assert learner._pin_bases == cuda and learner.base_version[1] == 1      # fragment 1's base came with v1
    params = [p.detach() for p in learner.params.values()]
    for p, base in learner.base.items():
        for name, b in base.items():
            assert isinstance(b, np.ndarray) and b.dtype == np.float32
            held = torch.from_numpy(b)
            assert not any(held.data_ptr() == q.data_ptr() for q in params), (p, name)
            assert held.is_pinned() == cuda, (p, name)


def test_host_bases_copy_only_when_asked_and_pin_only_for_a_cuda_parameter(monkeypatch):
    from types import SimpleNamespace
    from workers.learner.host_bases import host_base, pin_bases
    values = {"a": np.arange(4, dtype=np.float32), "b": np.ones(2, np.float32)}
    kept = host_base(values, ["a"], pinned=False, copy=False)
    copied = host_base(values, ["a"], pinned=False, copy=True)
    assert list(kept) == ["a"] and kept["a"] is values["a"]
    assert np.array_equal(copied["a"], values["a"]) and not np.shares_memory(copied["a"], values["a"])
    cpu, gpu = SimpleNamespace(device=torch.device("cpu")), SimpleNamespace(device=torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pin_bases([cpu, gpu]) and not pin_bases([cpu])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not pin_bases([gpu])
