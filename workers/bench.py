"""`ddiloco bench`: throughput of the codec (SPEC §6) and of the fragment merge (SPEC §4) on this machine.

Every figure is printed beside this machine's memcpy bandwidth, measured in the same run on the same
size (``np.copyto``; for the merge, on the bytes of all its input deltas), so numbers from different machines compare as ratios. Sizes are MB of fp32
input (1 MB = 10^6 bytes). Timings take the best of ``--repeat`` runs (the least disturbed by other
processes). The merge bench imports ``pipeline.merge`` lazily so the codec bench works without it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from pipeline.codec import SCHEMES, CodecConfig, decode, encode

MB = 1e6


@dataclass(frozen=True)
class BenchConfig:
    """What to run and how big; validated before anything is measured."""

    what: str = "all"
    size_mb: float = 16.0
    merge_mb: float = 4.0
    repeat: int = 5
    block_size: int = 64
    zstd_level: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.what not in ("codec", "merge", "all"):
            raise ValueError(f"bench target {self.what!r} not one of codec, merge, all")
        for name in ("size_mb", "merge_mb"):
            v = getattr(self, name)
            if not 0 < v <= 4096:
                raise ValueError(f"--{name.replace('_', '-')} must lie in (0, 4096] MB, got {v}")
        if self.repeat < 1:
            raise ValueError(f"--repeat must be >= 1, got {self.repeat}")
        CodecConfig("int4", self.block_size, self.zstd_level)  # validates both


def _best_seconds(fn: Callable[[], Any], repeat: int, clock: Callable[[], float]) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return max(best, 1e-9)


def memcpy_mbps(nbytes: int, repeat: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """MB/s of ``np.copyto`` between two float32 arrays of ``nbytes`` (both already touched)."""
    src = np.ones(max(nbytes // 4, 1), np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    return src.nbytes / MB / _best_seconds(lambda: np.copyto(dst, src), repeat, clock)


def bench_codec(cfg: BenchConfig, clock: Callable[[], float] = time.perf_counter) -> dict:
    """Encode/decode MB/s and compression ratio for every scheme, with and without zstd."""
    n = int(cfg.size_mb * MB) // 4
    x = np.random.default_rng(cfg.seed).standard_normal(n, dtype=np.float32)
    tensors, mb = {"w": x}, x.nbytes / MB
    memcpy = memcpy_mbps(x.nbytes, cfg.repeat, clock)
    rows = []
    for scheme in SCHEMES:
        for level in (cfg.zstd_level, 0) if cfg.zstd_level else (0,):
            codec = CodecConfig(scheme, cfg.block_size, level)
            blob = encode("bench", {}, tensors, codec)
            enc = mb / _best_seconds(lambda: encode("bench", {}, tensors, codec), cfg.repeat, clock)
            dec = mb / _best_seconds(lambda: decode(blob, "bench", max_bytes=x.nbytes), cfg.repeat, clock)
            rows.append({"scheme": scheme, "zstd_level": level, "encode_mbps": enc, "decode_mbps": dec,
                         "ratio": x.nbytes / len(blob), "blob_bytes": len(blob),
                         "encode_vs_memcpy": enc / memcpy, "decode_vs_memcpy": dec / memcpy})
    return {"input_mb": mb, "memcpy_mbps": memcpy, "block_size": cfg.block_size, "rows": rows}


def bench_merge(cfg: BenchConfig, clock: Callable[[], float] = time.perf_counter) -> dict:
    """MB of delta input merged per second for M = 2, 4, 8 (RDA and plain mean)."""
    try:
        from pipeline.merge import MergeConfig, merge_fragment
    except ImportError as exc:
        return {"skipped": f"pipeline.merge unavailable ({exc})"}
    rng = np.random.default_rng(cfg.seed)
    # A fragment of a few tensors of unequal size, like one of a transformer's.
    n = int(cfg.merge_mb * MB) // 4
    sizes = {"attn.w": n // 2, "mlp.w": n // 4, "mlp.b": n // 8, "ln.w": n - n // 2 - n // 4 - n // 8}
    rows = []
    for M in (2, 4, 8):
        memcpy = memcpy_mbps(M * n * 4, cfg.repeat, clock)  # same bytes as the merge reads
        grads = [{k: rng.standard_normal(s, dtype=np.float32) for k, s in sizes.items()} for _ in range(M)]
        weights = [float(w) for w in rng.uniform(0.5, 1.5, M)]
        for method in ("rda", "mean"):
            mcfg = MergeConfig(method=method)
            merge_fragment(grads, weights, mcfg)  # warm up
            secs = _best_seconds(lambda: merge_fragment(grads, weights, mcfg), cfg.repeat, clock)
            mbps = M * n * 4 / MB / secs
            rows.append({"M": M, "method": method, "input_mb": M * n * 4 / MB, "seconds": secs,
                         "mbps": mbps, "memcpy_mbps": memcpy, "vs_memcpy": mbps / memcpy})
    return {"delta_mb": n * 4 / MB, "rows": rows}


def _print_codec(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"codec on {res['input_mb']:.1f} MB fp32 (block {res['block_size']}); "
                    f"memcpy {res['memcpy_mbps']:.0f} MB/s")
    for col in ("scheme", "zstd", "encode MB/s", "× memcpy", "decode MB/s", "× memcpy", "ratio"):
        t.add_column(col, justify="right")
    for r in res["rows"]:
        t.add_row(r["scheme"], str(r["zstd_level"] or "off"), f"{r['encode_mbps']:.0f}",
                  f"{r['encode_vs_memcpy']:.3f}", f"{r['decode_mbps']:.0f}", f"{r['decode_vs_memcpy']:.3f}",
                  f"{r['ratio']:.2f}")
    Console().print(t)


def _print_merge(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    if "skipped" in res:
        Console().print(f"merge: skipped: {res['skipped']}")
        return
    t = Table(title=f"merge_fragment, {res['delta_mb']:.1f} MB per delta")
    for col in ("M", "method", "input MB", "seconds", "MB/s", "memcpy MB/s", "× memcpy"):
        t.add_column(col, justify="right")
    for r in res["rows"]:
        t.add_row(str(r["M"]), r["method"], f"{r['input_mb']:.1f}", f"{r['seconds']:.4f}", f"{r['mbps']:.0f}",
                  f"{r['memcpy_mbps']:.0f}", f"{r['vs_memcpy']:.3f}")
    Console().print(t)


def configure(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    """Measure codec and merge throughput on this machine, beside its memcpy bandwidth."""
    parser.add_argument("what", nargs="?", default="all", choices=("codec", "merge", "all"))
    parser.add_argument("--size-mb", type=float, default=16.0, help="fp32 MB for the codec bench (default 16)")
    parser.add_argument("--merge-mb", type=float, default=4.0, help="fp32 MB per delta for the merge bench")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per figure; the best counts")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--zstd-level", type=int, default=3, help="level for the zstd rows (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")

    def handler(args: argparse.Namespace) -> int:
        try:
            cfg = BenchConfig(args.what, args.size_mb, args.merge_mb, args.repeat, args.block_size,
                              args.zstd_level, args.seed)
        except ValueError as exc:
            parser.error(str(exc))
        results: dict[str, Any] = {"config": dataclasses.asdict(cfg)}
        if cfg.what in ("codec", "all"):
            results["codec"] = bench_codec(cfg)
            _print_codec(results["codec"])
        if cfg.what in ("merge", "all"):
            results["merge"] = bench_merge(cfg)
            _print_merge(results["merge"])
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
        return 0

    return handler
