"""`ddiloco benchmark codec|merge`: throughput of the codec (SPEC §6) and of the syncer's merge (SPEC §4) on this machine.

Every figure is printed beside this machine's memcpy bandwidth, measured in the same run on the same
size (``np.copyto``; for the merge, on the bytes of all its input deltas), so numbers from different
machines compare as ratios. Sizes are MB of fp32 input (1 MB = 10^6 bytes); the codec's default,
64 MB, is a 16M-value tensor. Timings take the best of ``--repeat`` runs (the least disturbed by
other processes).

Each figure is measured once per ``--threads`` count T: the process is pinned to T cores (where
the OS allows it: ``os.sched_setaffinity``), memcpy is measured there, and the codec and the merge
run their jobs on a pool of T threads (T = 1: on the calling thread; zstd runs on the calling thread).
The codec rows also say whether the blob's bytes were the same at every thread count (they must be).
The merge rows give nanoseconds per parameter per delta: the time to merge M deltas of n values over
n * M. The fold rows time the whole ``pipeline.fold.fold`` of a round (drop checks, RDA merge,
outer Nesterov step, the published version's digest) at M = 8.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from pipeline import kernels
from pipeline.codec import SCHEMES, VERSIONS, CodecConfig, decode, encode

MB = 1e6
# wall: elapsed time (what a caller waits); cpu: this process's CPU time, all its threads together
# (on a machine shared with other work, the cost of one thread's work without the waiting)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
# all: codec and merge; the lab's targets (scaling, load, versions: infra/lab/bench_cli.py) use this config too
TARGETS = ("codec", "merge", "all", "scaling", "load", "versions")
KERNELS = ("c", "numpy")   # the codec's fused C kernels or its numpy path (same bytes; pipeline/kernels.py)


@dataclass(frozen=True)
class BenchConfig:
    """What to run and how big; validated before anything is measured."""

    what: str = "all"
    size_mb: float = 64.0
    merge_mb: float = 4.0
    repeat: int = 5
    block_size: int = 64
    zstd_level: int = 3
    seed: int = 0
    threads: tuple[int, ...] = (1, 2)
    schemes: tuple[str, ...] = SCHEMES
    clock: str = "wall"
    formats: tuple[int, ...] = VERSIONS   # codec format versions (docs/formats.md "Tensor blobs")
    kernels: tuple[str, ...] = ("c",) if kernels.AVAILABLE else ("numpy",)   # codec paths (pipeline/kernels.py)

    def __post_init__(self) -> None:
        if self.what not in TARGETS:
            raise ValueError(f"bench target {self.what!r} not one of {', '.join(TARGETS)}")
        for name in ("size_mb", "merge_mb"):
            v = getattr(self, name)
            if not 0 < v <= 4096:
                raise ValueError(f"--{name.replace('_', '-')} must lie in (0, 4096] MB, got {v}")
        if self.repeat < 1:
            raise ValueError(f"--repeat must be >= 1, got {self.repeat}")
        if not self.threads or any(not isinstance(t, int) or t < 1 for t in self.threads):
            raise ValueError(f"--threads must list ints >= 1, got {self.threads}")
        if self.clock not in CLOCKS:
            raise ValueError(f"--clock must be one of {sorted(CLOCKS)}, got {self.clock!r}")
        bad = [s for s in self.schemes if s not in SCHEMES]
        if bad or not self.schemes:
            raise ValueError(f"--schemes must name some of {SCHEMES}, got {self.schemes}")
        if not self.formats or any(f not in VERSIONS for f in self.formats):
            raise ValueError(f"--formats must list some of {VERSIONS}, got {self.formats}")
        if not self.kernels or any(k not in KERNELS for k in self.kernels):
            raise ValueError(f"--kernels must list some of {KERNELS}, got {self.kernels}")
        if "c" in self.kernels and not kernels.AVAILABLE:
            raise ValueError("--kernels c: the C codec kernels were not built (pipeline/_ckernels.c)")
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


@contextlib.contextmanager
def cores(n: int) -> Iterator[int]:
    """Pin this process to ``n`` of its cores while inside (threads started inside inherit it);
    yields how many it got (all of them where pinning is not available)."""
    if not hasattr(os, "sched_setaffinity"):
        yield os.cpu_count() or 1
        return
    before = os.sched_getaffinity(0)
    use = set(sorted(before)[:n])
    os.sched_setaffinity(0, use)
    try:
        yield len(use)
    finally:
        os.sched_setaffinity(0, before)


@contextlib.contextmanager
def job_runner(n: int) -> Iterator[Callable | None]:
    """The ``map_fn`` the codec and the merge take: None (their own thread) for 1, else a pool's map."""
    if n == 1:
        yield None
        return
    with ThreadPoolExecutor(n, thread_name_prefix="bench") as pool:
        yield pool.map


def _zstd_frames(blob: bytes, fmt: int, level: int) -> str:
    """How many of a blob's frames zstd kept (formats 2, 3: where it paid), as "k/n"; format 1: one frame."""
    if fmt == 1:
        return "1/1" if level else "0/1"
    import msgpack
    from pipeline.codec import CHECKSUMS
    from pipeline.envelope import unseal
    frames = msgpack.unpackb(unseal(blob, "bench", fmt, checksums=CHECKSUMS)[1], raw=False)["frames"]
    return f"{sum(m for m, _ in frames)}/{len(frames)}"


def bench_codec(cfg: BenchConfig, clock: Callable[[], float] = time.perf_counter) -> dict:
    """Encode/decode MB/s and compression ratio per scheme, format, kernel path (C or numpy), with and
    without zstd, per thread count; "same bytes": as the first row of its scheme, level and format.
    torch is imported first where installed, as in a learner (the codec then uses its row maximum)."""
    try:
        import torch  # noqa: F401  (loaded, as in a learner)
    except ImportError:
        pass
    n = int(cfg.size_mb * MB) // 4
    x = np.random.default_rng(cfg.seed).standard_normal(n, dtype=np.float32)
    tensors, mb = {"w": x}, x.nbytes / MB
    dest = {"w": np.zeros_like(x)}   # decode into place: a caller's own buffer, pages already touched
    rows, digests = [], {}
    for threads in cfg.threads:
        with cores(threads) as got, job_runner(threads) as map_fn:
            memcpy = memcpy_mbps(x.nbytes, cfg.repeat, clock)
            for scheme, level, fmt, path in ((s, lv, f, k) for s in cfg.schemes for f in cfg.formats
                                             for lv in ((cfg.zstd_level, 0) if cfg.zstd_level else (0,))
                                             for k in cfg.kernels):
                codec = CodecConfig(scheme, cfg.block_size, level)
                with kernels.use(path == "c"):
                    blob = encode("bench", {}, tensors, codec, map_fn=map_fn, version=fmt)
                    enc = mb / _best_seconds(lambda: encode("bench", {}, tensors, codec, map_fn=map_fn,
                                                            version=fmt), cfg.repeat, clock)
                    dec = mb / _best_seconds(lambda: decode(blob, "bench", max_bytes=x.nbytes, map_fn=map_fn),
                                             cfg.repeat, clock)
                    into = mb / _best_seconds(lambda: decode(blob, "bench", max_bytes=x.nbytes, map_fn=map_fn,
                                                             out=dest), cfg.repeat, clock)
                digest = digests.setdefault((scheme, level, fmt), hashlib.sha256(blob).hexdigest())
                rows.append({"threads": threads, "cores": got, "memcpy_mbps": memcpy, "scheme": scheme, "kernel": path,
                             "format": fmt, "zstd_frames": _zstd_frames(blob, fmt, level),
                             "zstd_level": level, "encode_mbps": enc, "decode_mbps": dec, "decode_into_mbps": into,
                             "decode_into_vs_memcpy": into / memcpy,
                             "ratio": x.nbytes / len(blob), "blob_bytes": len(blob),
                             "encode_vs_memcpy": enc / memcpy, "decode_vs_memcpy": dec / memcpy,
                             "same_bytes": hashlib.sha256(blob).hexdigest() == digest})
    return {"input_mb": mb, "values": n, "block_size": cfg.block_size, "rows": rows,
            "row_max": "torch" if "torch" in sys.modules else "numpy"}


def codec_with_kept_memory(argv: list[str]) -> dict:
    """``benchmark codec`` rerun in a child process with ``--keep-memory`` (glibc's setting cannot be
    undone in this one): its codec results."""
    import subprocess
    import tempfile
    with tempfile.TemporaryDirectory(prefix="ddiloco-bench-") as d:
        out = os.path.join(d, "keep.json")
        subprocess.run([sys.executable, "-m", "workers.cli", "benchmark", *argv, "--memory", "keep", "--json", out],
                       check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)["codec"]


def _fragment(cfg: BenchConfig) -> dict[str, int]:
    """A fragment of a few tensors of unequal size, like one of a transformer's."""
    n = int(cfg.merge_mb * MB) // 4
    return {"attn.w": n // 2, "mlp.w": n // 4, "mlp.b": n // 8, "ln.w": n - n // 2 - n // 4 - n // 8}


def _fold_case(sizes: dict[str, int], grads: list[dict[str, np.ndarray]], rng: np.random.Generator) -> tuple:
    """A one-fragment run at version 0 and a round of deltas against it, for ``fold``."""
    from pipeline.descriptor import RunDescriptor
    from pipeline.fold import RoundInput, initial_state
    from pipeline.fragment import FragmentLayout
    from pipeline.schedule import ScheduleConfig
    from pipeline.types import DeltaHeader, TensorSpec

    layout = FragmentLayout(tuple(TensorSpec(k, (s,)) for k, s in sizes.items()), (tuple(sizes),))
    desc = RunDescriptor(run_id="bench", layout=layout, schedule=ScheduleConfig(1, (0,)))
    state = initial_state(desc, {k: rng.standard_normal(s, dtype=np.float32) for k, s in sizes.items()})
    inputs = [RoundInput(DeltaHeader(f"l{m}", 0, 0, 0, 0, 10, 1000 + 10 * m, 10), f"d/l{m}", f"c{m}", g)
              for m, g in enumerate(grads)]
    return desc, state, inputs


def bench_merge(cfg: BenchConfig, clock: Callable[[], float] = time.perf_counter) -> dict:
    """merge_fragment (RDA and plain mean, M = 2, 4, 8) and the whole fold (RDA, M = 8), per thread
    count: MB of delta input merged per second and nanoseconds per parameter per delta."""
    try:
        from pipeline.fold import fold
        from pipeline.merge import MergeConfig, merge_fragment
    except ImportError as exc:
        return {"skipped": f"pipeline.merge unavailable ({exc})"}
    rng = np.random.default_rng(cfg.seed)
    sizes = _fragment(cfg)
    n = sum(sizes.values())
    grads = {M: [{k: rng.standard_normal(s, dtype=np.float32) for k, s in sizes.items()} for _ in range(M)]
             for M in (2, 4, 8)}
    weights = {M: [float(w) for w in rng.uniform(0.5, 1.5, M)] for M in grads}
    desc, state, inputs = _fold_case(sizes, grads[8], rng)
    rows = []
    for threads in cfg.threads:
        with cores(threads) as got, job_runner(threads) as map_fn:
            cases = [(M, method, lambda M=M, c=MergeConfig(method=method): merge_fragment(
                grads[M], weights[M], c, map_fn=map_fn)) for M in grads for method in ("rda", "mean")]
            cases.append((8, "fold", lambda: fold(state, desc, 0, inputs, seq=0, epoch=1, output_key="v",
                                                  map_fn=map_fn)))
            for M, method, fn in cases:
                memcpy = memcpy_mbps(M * n * 4, cfg.repeat, clock)  # same bytes as the merge reads
                fn()  # warm up
                secs = _best_seconds(fn, cfg.repeat, clock)
                mbps = M * n * 4 / MB / secs
                rows.append({"threads": threads, "cores": got, "M": M, "method": method, "input_mb": M * n * 4 / MB,
                             "seconds": secs, "mbps": mbps, "memcpy_mbps": memcpy, "vs_memcpy": mbps / memcpy,
                             "ns_per_param_delta": secs / (n * M) * 1e9})
    return {"delta_mb": n * 4 / MB, "params": n, "rows": rows}


def _print_codec(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"codec on {res['input_mb']:.1f} MB fp32 ({res['values']:,} values, block {res['block_size']}, "
                    f"row maximum by {res['row_max']}; memory: default = glibc as it is, keep = --keep-memory)")
    for col in ("memory", "threads", "scheme", "kernel", "format", "zstd", "zstd frames", "encode MB/s", "× memcpy",
                "decode MB/s", "× memcpy", "decode into MB/s", "× memcpy", "ratio", "memcpy MB/s", "same bytes"):
        t.add_column(col, justify="right")
    for r in res["rows"]:
        t.add_row(r.get("memory", "default"), f"{r['threads']} ({r['cores']} cores)", r["scheme"], r["kernel"], str(r["format"]), str(r["zstd_level"] or "off"),
                  r["zstd_frames"],
                  f"{r['encode_mbps']:.0f}", f"{r['encode_vs_memcpy']:.3f}", f"{r['decode_mbps']:.0f}",
                  f"{r['decode_vs_memcpy']:.3f}", f"{r['decode_into_mbps']:.0f}", f"{r['decode_into_vs_memcpy']:.3f}",
                  f"{r['ratio']:.2f}", f"{r['memcpy_mbps']:.0f}",
                  "yes" if r["same_bytes"] else "NO")
    Console().print(t)


def _print_merge(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    if "skipped" in res:
        Console().print(f"merge: skipped: {res['skipped']}")
        return
    t = Table(title=f"merge_fragment and fold, {res['delta_mb']:.1f} MB ({res['params']:,} values) per delta")
    for col in ("threads", "M", "method", "input MB", "seconds", "MB/s", "memcpy MB/s", "× memcpy",
                "ns/param/delta"):
        t.add_column(col, justify="right")
    for r in res["rows"]:
        t.add_row(f"{r['threads']} ({r['cores']} cores)", str(r["M"]), r["method"], f"{r['input_mb']:.1f}",
                  f"{r['seconds']:.4f}", f"{r['mbps']:.0f}", f"{r['memcpy_mbps']:.0f}", f"{r['vs_memcpy']:.3f}",
                  f"{r['ns_per_param_delta']:.2f}")
    Console().print(t)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def _child_argv(argv: list[str]) -> list[str]:
    """``argv`` after ``benchmark`` without ``--memory``/``--json``/``--keep-memory`` (and their values)."""
    argv = argv[argv.index("benchmark") + 1:] if "benchmark" in argv else argv
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--memory", "--json"):
            skip = True
        elif not (a.startswith("--memory=") or a.startswith("--json=") or a == "--keep-memory"):
            out.append(a)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The codec and merge benchmarks' options (``ddiloco benchmark codec|merge``; the caller adds
    ``--json``)."""
    g = parser.add_argument_group("codec and merge (ddiloco benchmark codec|merge|throughput)")
    g.add_argument("--size-mb", type=float, default=64.0, help="fp32 MB for the codec bench (default 64: 16M values)")
    g.add_argument("--merge-mb", type=float, default=4.0, help="fp32 MB per delta for the merge bench")
    g.add_argument("--repeat", type=int, default=5, help="timed runs per figure; the best counts")
    g.add_argument("--block-size", type=int, default=64)
    g.add_argument("--zstd-level", type=int, default=3, help="level for the zstd rows (0: none)")
    g.add_argument("--seed", type=int, default=0, help="seed of the benchmark's data")
    g.add_argument("--threads", type=_int_list, default=(1, 2),
                   help="thread counts to measure, comma-separated (default 1,2), each pinned to as many cores")
    g.add_argument("--schemes", type=lambda s: tuple(s.split(",")), default=SCHEMES,
                   help=f"codec schemes, comma-separated (default {','.join(SCHEMES)})")
    g.add_argument("--formats", type=_int_list, default=VERSIONS,
                   help="codec: format versions to measure, comma-separated (default 1,2,3; 2: framed, zstd "
                        "only where it pays; 3: 2 with an xxh3-128 checksum)")
    g.add_argument("--kernels", type=lambda s: tuple(s.split(",")), default=BenchConfig.kernels,
                   help="codec: c (the fused C kernels, default where built), numpy, or c,numpy side by side")
    g.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="wall time (default) or this process's CPU time (1 thread on a busy machine)")
    g.add_argument("--keep-memory", action="store_true",
                   help="codec: keep freed memory in the process first (workers/common/memory.py), as a syncer "
                        "process can, so decoded arrays reuse pages instead of fresh zeroed ones (--memory keep)")
    g.add_argument("--memory", choices=("default", "keep", "both"), default=None,
                   help="codec: glibc's allocator as it is (default), kept freed memory (keep, as --keep-memory), "
                        "or both: default here, then keep in a child process, rows side by side")


def config_from(parser: argparse.ArgumentParser, args: argparse.Namespace, what: str) -> BenchConfig:
    """The benchmark's config from ``add_arguments``' options (``parser.error`` on a refused value)."""
    try:
        return BenchConfig(what, args.size_mb, args.merge_mb, args.repeat, args.block_size, args.zstd_level,
                           args.seed, args.threads, args.schemes, args.clock, args.formats, args.kernels)
    except ValueError as exc:
        parser.error(str(exc))


def keep_memory(parser: argparse.ArgumentParser, args: argparse.Namespace, what: str) -> str:
    """``default``, ``keep`` or ``both`` from ``--memory``/``--keep-memory``; with keep, glibc keeps
    freed memory from here on (set before anything allocates)."""
    memory = args.memory or ("keep" if args.keep_memory else "default")
    if args.keep_memory and memory != "keep":
        parser.error("--keep-memory is --memory keep")
    if memory == "both" and what != "codec":
        parser.error("--memory both: for the codec target only")
    if memory == "keep":
        from workers.common.memory import keep_freed_memory
        if not keep_freed_memory():
            parser.error("--keep-memory: this platform's allocator does not take the setting (glibc only)")
    return memory


def run_bench(parser: argparse.ArgumentParser, args: argparse.Namespace, what: str) -> int:
    """``ddiloco benchmark codec|merge|throughput`` (throughput: both): measure, print, write ``--json``."""
    cfg = config_from(parser, args, {"throughput": "all"}.get(what, what))
    memory = keep_memory(parser, args, cfg.what)
    results: dict[str, Any] = {"config": dataclasses.asdict(cfg), "keep_memory": memory == "keep"}
    if cfg.what in ("codec", "all"):
        results["codec"] = bench_codec(cfg, CLOCKS[cfg.clock])
        for r in results["codec"]["rows"]:
            r["memory"] = "keep" if memory == "keep" else "default"
        if memory == "both":   # the child gets this run's arguments but --memory/--json
            results["codec"]["rows"] += codec_with_kept_memory(_child_argv(sys.argv[1:]))["rows"]
        _print_codec(results["codec"])
    if cfg.what in ("merge", "all"):
        results["merge"] = bench_merge(cfg, CLOCKS[cfg.clock])
        _print_merge(results["merge"])
    return write_results(args.json, results)


def write_results(path: str | None, results: dict[str, Any]) -> int:
    """Write a benchmark's results as JSON to ``path`` (``--json``; none: nothing); 0."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2)
    return 0
