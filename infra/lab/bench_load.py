"""`python -m infra.lab.bench_cli load`: a synthetic syncer round at large sizes (issue 15), per thread count.

One fragment of ``params`` values in a few tensors of unequal size (like a transformer block's),
``deltas`` int4+zstd deltas from as many learners (half on the current version, half one version
stale once there is one, so the outer-gradient reconstruction of SPEC §4 runs too), and per round
exactly the CPU work of the live syncer's ``_merge`` between receiving the blobs and writing the
version (workers/syncer/syncer.py):

1. decode: ``workers.common.deltas.round_input`` of every blob (digest, header, int4+zstd decode),
   one delta per job of the pool (what the syncer gets by mapping ``round_input`` over its pool);
2. commit: ``pipeline.commit.apply_commit`` with the pool's ``map_fn`` (norm guard with its cap,
   outer gradients, RDA merge, Nesterov step, finiteness check, the published version's digest);
3. version: ``workers.common.versions.encode_version`` of the published values with the pool.

Storage I/O, signing and the bus are left out: they overlap with this work or are done by other
threads. Every round is run at each thread count from the same state, the thread counts taking
turns (side by side: a busy moment of the machine hits them alike), and the commits must be the
same bits (checked: the record and the version blob). Reported: the median seconds per phase and
per round, rounds per second for one shard (one syncer process), nanoseconds per parameter per
delta, the median per-round speed-up over the first thread count, and the process's CPU seconds
per round in user space and in the kernel, and its minor page faults per round (``getrusage``: at
large sizes the kernel's zeroing of freshly mapped pages for the round's new arrays is a large
share, docs/scale.md; numpy asks for huge pages, so a fault can be 2 MiB). docs/scale.md turns these
into the number of shards the paper's setting needs.
"""
from __future__ import annotations

import gc
import hashlib
import resource
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from pipeline.codec import RUN_FORMAT, CodecConfig, encode
from pipeline.commit import CommitMeta, apply_commit, initial_window
from pipeline.descriptor import RunDescriptor, VersionsConfig
from pipeline.fold import SyncerState, initial_state
from pipeline.fragment import FragmentLayout
from pipeline.guard import NormGuardConfig
from pipeline.schedule import ScheduleConfig
from pipeline.types import DeltaHeader, TensorSpec
from storage.layout import delta_key, version_key
from workers.common.deltas import round_input
from workers.common.versions import encode_version

PHASES = ("decode", "commit", "version")
CPU = ("user", "sys")     # CPU seconds of the whole process (all threads) in user space and in the kernel
# A fragment's tensors, as shares of its values: two big matrices, a smaller one, a vector.
SHARES = {"attn.qkv.w": 0.375, "mlp.fc.w": 0.5, "attn.proj.w": 0.124}


@dataclass(frozen=True)
class LoadConfig:
    """What the load test runs; validated before anything is allocated."""

    params: int = 100_000_000
    deltas: int = 8
    rounds: int = 3
    threads: tuple[int, ...] = (1, 2)
    scheme: str = "int4"
    block_size: int = 64
    zstd_level: int = 3
    version_dtype: str = "fp32"
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.params, int) or not 1_000 <= self.params <= 2_000_000_000:
            raise ValueError(f"--params must be an int in [1000, 2e9], got {self.params!r}")
        if not 1 <= self.deltas <= 256:
            raise ValueError(f"--deltas must lie in 1..256, got {self.deltas}")
        if self.rounds < 1:
            raise ValueError(f"--rounds must be >= 1, got {self.rounds}")
        if not self.threads or any(not isinstance(t, int) or t < 1 for t in self.threads):
            raise ValueError(f"--threads must list ints >= 1, got {self.threads}")
        VersionsConfig(dtype=self.version_dtype)
        CodecConfig(self.scheme, self.block_size, self.zstd_level)

    def sizes(self) -> dict[str, int]:
        sizes = {n: int(self.params * s) for n, s in SHARES.items()}
        sizes["ln.w"] = self.params - sum(sizes.values())
        return sizes


def _descriptor(cfg: LoadConfig) -> RunDescriptor:
    layout = FragmentLayout(tuple(TensorSpec(n, (s,)) for n, s in cfg.sizes().items()), (tuple(cfg.sizes()),))
    # retain 2: enough for one-version-stale deltas, and it bounds the test's memory (the history
    # holds retain versions of the fragment; docs/scale.md counts what a real syncer keeps)
    return RunDescriptor(run_id="bench-load", layout=layout, schedule=ScheduleConfig(1, (0,)),
                         # the tensor-blob format new runs write (deltas and versions alike)
                         codec=CodecConfig(cfg.scheme, cfg.block_size, cfg.zstd_level, format=RUN_FORMAT),
                         versions=VersionsConfig(dtype=cfg.version_dtype, retain=2), guard=NormGuardConfig())


def _delta_blobs(cfg: LoadConfig, desc: RunDescriptor, rnd: int, version: int,
                 rng: np.random.Generator) -> list[tuple[str, bytes]]:
    """The round's deltas as the syncer receives them: (key, encoded blob), from distinct learners."""
    out = []
    for m in range(cfg.deltas):
        base = version - 1 if m % 2 and version > 0 else version
        header = DeltaHeader(f"l{m}", 1, rnd, 0, base, 10, 10_000 + 100 * m, learner_step=10 * rnd, round=rnd)
        tensors = {n: (rng.standard_normal(s, dtype=np.float32) * 1e-3) for n, s in cfg.sizes().items()}
        out.append((delta_key(header.learner, 1, rnd), encode("delta", header.to_dict(), tensors, desc.codec)))
    return out


def _one_round(desc: RunDescriptor, state: SyncerState, window, blobs, rnd: int, map_fn,
               clock: Callable[[], float]) -> tuple[dict[str, float], object, bytes]:
    run = map_fn or map
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = clock()
    inputs = list(run(lambda kb: round_input(kb[1], kb[0], desc, None), blobs))
    t1 = clock()
    meta = CommitMeta(seq=state.last_seq + 1, epoch=1, output_key=version_key(0, state.fragments[0].version + 1, 1),
                      round=rnd)
    commit = apply_commit(state, window, desc, 0, inputs, meta, map_fn=map_fn)
    t2 = clock()
    rec = commit.record
    if rec.kind != "merge":
        raise RuntimeError(f"bench load: round {rnd} did not merge: {[d.reason for d in rec.dropped]}")
    blob = encode_version(desc, 0, rec.version, rec.seq, rec.epoch, commit.published,
                          values_digest=rec.output_checksum, map_fn=map_fn)
    t3 = clock()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return {"decode": t1 - t0, "commit": t2 - t1, "version": t3 - t2, "user": r1.ru_utime - r0.ru_utime,
            "sys": r1.ru_stime - r0.ru_stime, "faults": r1.ru_minflt - r0.ru_minflt}, commit, blob


def bench_load(cfg: LoadConfig, clock: Callable[[], float] = time.perf_counter) -> dict:
    """Run ``cfg.rounds`` rounds at every thread count (module docstring); medians per thread count."""
    from workers.tools.bench import cores, job_runner   # bench imports this module lazily

    desc = _descriptor(cfg)
    rng = np.random.default_rng(cfg.seed)
    state = initial_state(desc, {n: rng.standard_normal(s, dtype=np.float32) for n, s in cfg.sizes().items()})
    window = initial_window(desc)
    times: dict[int, list[dict[str, float]]] = {t: [] for t in cfg.threads}
    blob_bytes = 0
    for rnd in range(cfg.rounds):
        blobs = _delta_blobs(cfg, desc, rnd, state.fragments[0].version, rng)
        blob_bytes = sum(len(b) for _, b in blobs)
        first = None
        for threads in cfg.threads:
            gc.collect()
            with cores(threads), job_runner(threads) as map_fn:
                phases, commit, vblob = _one_round(desc, state, window, blobs, rnd, map_fn, clock)
            times[threads].append(phases)
            mine = (commit.record, hashlib.sha256(vblob).hexdigest())
            if first is None:
                first, keep = mine, commit
            elif mine != first:
                raise RuntimeError(f"bench load: round {rnd} at {threads} threads differs from {cfg.threads[0]}")
            del commit, vblob
        state, window = keep.state, keep.window
        del keep, blobs
    return _summary(cfg, times, blob_bytes)


def _summary(cfg: LoadConfig, times: dict[int, list[dict[str, float]]], blob_bytes: int) -> dict:
    rows = []
    base = [sum(p[ph] for ph in PHASES) for p in times[cfg.threads[0]]]
    for threads, per_round in times.items():
        totals = [sum(p[ph] for ph in PHASES) for p in per_round]
        med = statistics.median(totals)
        rows.append({"threads": threads, "round_s": med, "rounds_per_s": 1.0 / med,
                     **{f"{ph}_s": statistics.median(p[ph] for p in per_round) for ph in PHASES + CPU},
                     "faults": statistics.median(p["faults"] for p in per_round),   # minor, per round
                     "ns_per_param_delta": med / (cfg.params * cfg.deltas) * 1e9,
                     "speedup": statistics.median(b / t for b, t in zip(base, totals)),
                     "rounds": totals})
    return {"params": cfg.params, "deltas": cfg.deltas, "rounds": cfg.rounds, "scheme": cfg.scheme,
            "version_dtype": cfg.version_dtype, "delta_blob_mb": blob_bytes / cfg.deltas / 1e6, "same_bits": True,
            "rows": rows}


def print_load(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"synthetic syncer round: {res['params']:,} params, M = {res['deltas']} {res['scheme']} deltas "
                    f"({res['delta_blob_mb']:.1f} MB each), {res['version_dtype']} version, "
                    f"median of {res['rounds']} rounds, same bits at every thread count")
    for col in ("threads", "decode s", "commit s", "version s", "round s", "rounds/s/shard", "ns/param/delta",
                "speed-up", "CPU user s", "CPU sys s", "faults"):
        t.add_column(col, justify="right")
    for r in res["rows"]:
        t.add_row(str(r["threads"]), f"{r['decode_s']:.2f}", f"{r['commit_s']:.2f}", f"{r['version_s']:.2f}",
                  f"{r['round_s']:.2f}", f"{r['rounds_per_s']:.3f}", f"{r['ns_per_param_delta']:.2f}",
                  f"{r['speedup']:.2f}×", f"{r['user_s']:.2f}", f"{r['sys_s']:.2f}", f"{r['faults']:,.0f}")
    Console().print(t)
