"""`python -m infra.lab.bench_cli scaling`: how the codec and the fold scale with threads, measured side by side.

For each operation (int4+zstd encode and decode of ``--size-mb`` of fp32 in each ``--formats``
version, with the codec path in force: the C kernels where built; the whole
``pipeline.fold.fold`` of an RDA round at M = 8 deltas of ``--merge-mb``) every repetition runs
it once at each thread count in turn (pinned to as many cores, ``bench.cores``; T = 1 on the
calling thread), so a busy moment of a shared machine hits every count alike. Each repetition
gives one speed-up per count (seconds at the first count / seconds at this one); the report is the
median seconds and the median speed-up over ``--repeat`` repetitions (not the best run: the
ratio of medians is what a shared machine can honestly claim). The bytes and bits must not depend
on the count: checked for every run.
"""
from __future__ import annotations

import hashlib
import statistics
import time
from typing import Callable

import numpy as np

from pipeline.codec import CodecConfig, decode, encode

MB = 1e6


def _codec_ops(cfg, x: np.ndarray) -> dict[str, Callable]:
    """int4+zstd encode and decode of ``x`` in each of ``cfg.formats`` (docs/formats.md "Tensor blobs")."""
    codec = CodecConfig("int4", cfg.block_size, cfg.zstd_level)
    tensors = {"w": x}
    ops: dict[str, Callable] = {}
    for fmt in cfg.formats:
        blob = encode("bench", {}, tensors, codec, version=fmt)

        def enc(map_fn, fmt=fmt):
            return encode("bench", {}, tensors, codec, map_fn=map_fn, version=fmt)

        def dec(map_fn, blob=blob):
            return decode(blob, "bench", max_bytes=x.nbytes, map_fn=map_fn).tensors["w"]
        ops[f"encode int4+zstd v{fmt}"], ops[f"decode int4+zstd v{fmt}"] = enc, dec
    return ops


def _digest(result) -> str:
    return result if isinstance(result, str) else hashlib.sha256(result).hexdigest()


def _fold_op(cfg) -> Callable:
    from pipeline.fold import fold
    from workers.tools.bench import _fold_case, _fragment

    rng = np.random.default_rng(cfg.seed)
    sizes = _fragment(cfg)
    grads = [{k: rng.standard_normal(s, dtype=np.float32) for k, s in sizes.items()} for _ in range(8)]
    desc, state, inputs = _fold_case(sizes, grads, rng)

    def run(map_fn):
        return fold(state, desc, 0, inputs, seq=0, epoch=1, output_key="v", map_fn=map_fn).record.output_checksum
    return run


def bench_scaling(cfg, clock: Callable[[], float] = time.perf_counter) -> dict:
    """Median seconds and median speed-up per operation and thread count (module docstring)."""
    from workers.tools.bench import cores, job_runner

    n = int(cfg.size_mb * MB) // 4
    x = np.random.default_rng(cfg.seed).standard_normal(n, dtype=np.float32)
    ops = {**_codec_ops(cfg, x), "fold RDA M=8": _fold_op(cfg)}
    sizes = {name: x.nbytes / MB for name in ops}
    sizes["fold RDA M=8"] = 8 * int(cfg.merge_mb * MB) // 4 * 4 / MB
    rows = []
    for name, op in ops.items():
        secs: dict[int, list[float]] = {t: [] for t in cfg.threads}
        digests = set()
        for _ in range(cfg.repeat):
            for threads in cfg.threads:
                with cores(threads), job_runner(threads) as map_fn:
                    op(map_fn)                      # warm: the pool's threads exist, pages touched
                    t0 = clock()
                    result = op(map_fn)
                    secs[threads].append(max(clock() - t0, 1e-9))
                    digests.add(_digest(result))   # after the clock: sha256 of 64 MB is ~30 ms
        first = secs[cfg.threads[0]]
        for threads, s in secs.items():
            rows.append({"op": name, "threads": threads, "input_mb": sizes[name], "median_s": statistics.median(s),
                         "mbps": sizes[name] / statistics.median(s),
                         "speedup": statistics.median(a / b for a, b in zip(first, s)),
                         "speedups": [a / b for a, b in zip(first, s)], "same_result": len(digests) == 1})
    return {"repeat": cfg.repeat, "rows": rows}


def print_scaling(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"thread scaling, side by side, medians of {res['repeat']} repetitions")
    for col in ("operation", "threads", "input MB", "median s", "MB/s", "speed-up (median)", "same result"):
        t.add_column(col, justify="right")
    for r in res["rows"]:
        t.add_row(r["op"], str(r["threads"]), f"{r['input_mb']:.0f}", f"{r['median_s']:.4f}", f"{r['mbps']:.0f}",
                  f"{r['speedup']:.2f}×", "yes" if r["same_result"] else "NO")
    Console().print(t)
