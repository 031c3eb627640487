"""Benchmark: the learner's torch quantisation kernels (workers/learner/device_quant.py) against the
codec's C kernel (pipeline/kernels.py), on the CPU, side by side (issue 15, docs/results-overhead.md).

    flock /tmp/heavy.lock taskset -c 0 .venv/bin/python -m infra.lab.bench_device_quant --values 16777216

Each repetition runs every path once, in alternating order; the report gives each path's median
milliseconds and its ratio to the C kernel over the same repetitions. Paths:
- ``c``: ``kernels.quantize`` into preallocated scales and codes (what the sender thread runs today);
- ``torch``: ``quantise_payload`` of the delta (the device kernels, here on the CPU);
- ``answer_off``: what the training thread does today per answer: copy θ, ``base − θ`` (numpy);
- ``answer_on``: what it would do on the device path on a CPU model: ``quantise_delta`` (all of it).
The last two say why ``device_quantise="auto"`` keeps CPU models on the codec path.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from pipeline import codec, kernels
from pipeline.fragment import extract
from workers.learner import device_quant
from workers.learner.device_quant import QMAX, quantise_delta, quantise_payload


def _paths(base: np.ndarray, param: torch.Tensor, scheme: str, bs: int) -> dict:
    delta = base - param.cpu().numpy()
    nb = -(-delta.size // bs)
    scales = np.empty(nb, np.float32)
    codes = np.empty(nb * bs // (2 if scheme == "int4" else 1), np.uint8)
    dt, bt = torch.from_numpy(delta).to(param.device), torch.from_numpy(base).to(param.device)
    paths = {"torch": lambda: quantise_payload([dt], scheme, bs).cpu(),   # .cpu(): timed to completion
             "answer_off": lambda: base - extract({"w": param}, ["w"])["w"],
             "answer_on": lambda: quantise_delta({"w": bt}, {"w": param}, ["w"], scheme, bs).wait()}
    if kernels.AVAILABLE:
        paths["c"] = lambda: kernels.quantize(delta, QMAX[scheme], bs, scales, codes)
    return paths


def run(values: int, scheme: str, bs: int, reps: int, threads: int, device: str = "cpu") -> dict:
    torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    base = rng.standard_normal(values).astype(np.float32)
    param = torch.from_numpy(base + rng.standard_normal(values).astype(np.float32) * 1e-2).to(device)
    paths = _paths(base, param, scheme, bs)
    delta = base - param.cpu().numpy()
    got = quantise_payload([torch.from_numpy(delta).to(device)], scheme, bs).cpu().numpy()
    if got.tobytes() != codec.quantize(delta, scheme, bs):
        raise AssertionError("torch kernels and the codec disagree: not benchmarking different outputs")
    times: dict[str, list[float]] = {k: [] for k in paths}
    order = list(paths)
    for _ in range(1):   # warm-up
        for f in paths.values():
            f()
    for r in range(reps):
        for k in (order if r % 2 == 0 else order[::-1]):
            t0 = time.perf_counter()
            paths[k]()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    out = {"device": device, "values": values, "chunk": device_quant.CPU_CHUNK, "scheme": scheme, "block_size": bs, "reps": reps, "torch_threads": threads,
           "c_kernel": kernels.AVAILABLE, "median_ms": {k: round(v, 2) for k, v in med.items()}}
    ref = "c" if "c" in med else None
    if ref:
        ratios = [t / c for t, c in zip(times["torch"], times["c"])]
        out["torch_over_c"] = round(statistics.median(ratios), 3)
    out["answer_on_over_off"] = round(statistics.median(
        [a / b for a, b in zip(times["answer_on"], times["answer_off"])]), 3)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--values", type=int, default=1 << 24)
    ap.add_argument("--scheme", choices=tuple(QMAX), action="append")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--device", default="cpu", help="torch device of the model (e.g. cuda): checks bytes there too")
    ap.add_argument("--chunk", type=int, default=0, help="values per torch kernel call on the CPU (0: device_quant.CPU_CHUNK)")
    a = ap.parse_args(argv)
    if a.values < 1 or a.reps < 1 or a.threads < 1:
        raise SystemExit("--values, --reps and --threads must be >= 1")
    if a.chunk:
        device_quant.CPU_CHUNK = a.chunk
    for scheme in a.scheme or ["int4", "int8"]:
        print(json.dumps(run(a.values, scheme, a.block_size, a.reps, a.threads, a.device)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
