"""`python -m infra.lab.bench_cli scaling|load|versions`: the lab's throughput investigations.

Lab (issue 15's questions): does the codec and fold scale with threads (``scaling``,
infra/lab/bench_scaling.py)? what does one syncer round cost at 100M parameters and which shards
does 5B need (``load``, infra/lab/bench_load.py)? how much faster does a learner find new versions
in parallel than serially (``versions``, infra/lab/bench_versions.py)? Written up in docs/scale.md.
The codec and merge figures a user runs are ``ddiloco benchmark codec|merge``.
"""
from __future__ import annotations

import argparse
import sys
import tempfile

from workers.tools.bench import CLOCKS, add_arguments, config_from, keep_memory, write_results

KINDS = ("scaling", "load", "versions")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m infra.lab.bench_cli", description=__doc__.splitlines()[0])
    p.add_argument("what", choices=KINDS)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--params", type=int, default=100_000_000,
                   help="load: values in the fragment (default 100M: about 5 GB of memory at M = 8)")
    p.add_argument("--deltas", type=int, default=8, help="load: deltas per round (M, default 8)")
    p.add_argument("--rounds", type=int, default=3, help="load: rounds per thread count (median)")
    p.add_argument("--version-dtype", choices=("fp32", "bf16"), default="fp32", help="load: versions' dtype")
    p.add_argument("--rtt-ms", type=float, default=20.0, help="versions: milliseconds each request waits")
    add_arguments(p)
    args = p.parse_args(argv)
    cfg = config_from(p, args, args.what)
    kept = keep_memory(p, args, args.what) == "keep"
    results: dict = {"keep_memory": kept}
    if args.what == "load":
        from .bench_load import LoadConfig, bench_load, print_load
        try:
            load = LoadConfig(args.params, args.deltas, args.rounds, cfg.threads, "int4", cfg.block_size,
                              cfg.zstd_level, args.version_dtype, cfg.seed)
        except ValueError as exc:
            p.error(str(exc))
        results["load"] = bench_load(load, CLOCKS[cfg.clock])
        results["load"]["keep_memory"] = kept
        print_load(results["load"])
    elif args.what == "versions":
        from .bench_versions import bench_versions, print_versions
        if not 0 <= args.rtt_ms <= 10_000:
            p.error(f"--rtt-ms must lie in [0, 10000], got {args.rtt_ms}")
        with tempfile.TemporaryDirectory(prefix="ddiloco-bench-versions-") as d:
            results["versions"] = bench_versions(d + "/run", args.rtt_ms, repeat=cfg.repeat)
        print_versions(results["versions"])
    else:
        from .bench_scaling import bench_scaling, print_scaling
        results["scaling"] = bench_scaling(cfg, CLOCKS[cfg.clock])
        print_scaling(results["scaling"])
    return write_results(args.json, results)


if __name__ == "__main__":
    sys.exit(main())
