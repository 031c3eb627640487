"""The lab's `python -m infra.lab.bench_cli scaling` and `... load` (issue 15): they run, check that every thread
count gives the same bits, and report figures that are consistent with each other. No timing is
asserted (timings belong to the benchmark's output, not to tests)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from workers.tools.bench import BenchConfig
from infra.lab.bench_load import LoadConfig, _one_round, bench_load
from infra.lab.bench_scaling import bench_scaling


def test_load_config_refuses_bad_values():
    for kw, word in (({"params": 10}, "--params"), ({"deltas": 0}, "--deltas"), ({"rounds": 0}, "--rounds"),
                     ({"threads": ()}, "--threads"), ({"threads": (0,)}, "--threads")):
        with pytest.raises(ValueError, match=word):
            LoadConfig(**kw)
    with pytest.raises(ValueError):
        LoadConfig(version_dtype="fp16")
    with pytest.raises(ValueError, match="bench target"):
        BenchConfig(what="loud")


def test_load_sizes_add_up():
    cfg = LoadConfig(params=1_234_567)
    assert sum(cfg.sizes().values()) == 1_234_567 and min(cfg.sizes().values()) > 0


def test_load_runs_rounds_at_each_thread_count_with_the_same_bits():
    res = bench_load(LoadConfig(params=40_000, deltas=4, rounds=3, threads=(1, 3)))
    assert res["same_bits"] and [r["threads"] for r in res["rows"]] == [1, 3]
    for r in res["rows"]:
        assert len(r["rounds"]) == 3
        assert r["round_s"] == pytest.approx(sorted(r["rounds"])[1])
        assert r["rounds_per_s"] == pytest.approx(1 / r["round_s"])
        assert r["ns_per_param_delta"] == pytest.approx(r["round_s"] / (40_000 * 4) * 1e9)
    assert res["rows"][0]["speedup"] == 1.0


def test_load_refuses_a_round_that_differs_between_thread_counts(monkeypatch):
    """The check is real: a run whose commit depends on the thread count is refused."""
    import infra.lab.bench_load as bl

    def skewed(desc, state, window, blobs, rnd, map_fn, clock):
        phases, commit, blob = _one_round(desc, state, window, blobs, rnd, map_fn, clock)
        return phases, commit, blob + (b"x" if map_fn is not None else b"")
    monkeypatch.setattr(bl, "_one_round", skewed)
    with pytest.raises(RuntimeError, match="differs"):
        bench_load(LoadConfig(params=20_000, deltas=2, rounds=1, threads=(1, 2)))


def test_scaling_reports_medians_and_same_results():
    cfg = BenchConfig(what="scaling", size_mb=0.5, merge_mb=0.25, repeat=3, threads=(1, 2), formats=(1, 3))
    res = bench_scaling(cfg)
    ops = {r["op"] for r in res["rows"]}
    assert ops == {"encode int4+zstd v1", "decode int4+zstd v1", "encode int4+zstd v3", "decode int4+zstd v3",
                   "fold RDA M=8"}
    for r in res["rows"]:
        assert r["same_result"] and len(r["speedups"]) == 3
        assert r["speedup"] == pytest.approx(sorted(r["speedups"])[1])
        if r["threads"] == 1:
            assert r["speedups"] == [1.0, 1.0, 1.0]


def test_bench_load_cli_writes_json(tmp_path):
    out = tmp_path / "load.json"
    proc = subprocess.run([sys.executable, "-m", "infra.lab.bench_cli", "load", "--params", "20000", "--deltas", "2",
                           "--rounds", "1", "--threads", "1,2", "--json", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())["load"]
    assert res["params"] == 20_000 and res["deltas"] == 2 and res["same_bits"]
    assert {r["threads"] for r in res["rows"]} == {1, 2}


def test_bench_versions_loads_every_new_version_both_ways_and_counts_requests(tmp_path):
    from infra.lab.bench_versions import bench_versions

    res = bench_versions(str(tmp_path / "run"), rtt_ms=0.0, commits=(0, 1, 3), repeat=2, values_per_fragment=1000,
                         threads=4)
    rows = {r["new_commits"]: r for r in res["rows"]}
    assert rows[0]["serial_requests"] == rows[0]["fast_requests"] == {"get": 1.0}, "idle: one GET either way"
    # serial: k + 1 commit reads (the last NotFound), then per version a HEAD and a GET
    assert rows[3]["serial_requests"] == {"get": 3 + 1 + 3, "head": 3}
    # fast: the same plus the head hint
    assert rows[3]["fast_requests"] == {"get": 3 + 1 + 3 + 1, "head": 3}
