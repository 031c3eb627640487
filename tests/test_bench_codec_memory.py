"""`ddiloco benchmark codec --memory both`: rows with glibc as it is and with kept memory (a child
process), each with the decode-into-place figure beside plain decode."""
import json
import subprocess
import sys

from workers.tools.bench import _child_argv


def test_child_argv_drops_memory_and_json_only():
    argv = ["benchmark", "codec", "--memory", "both", "--json", "x.json", "--repeat", "2", "--keep-memory",
            "--memory=both", "--size-mb", "1"]
    assert _child_argv(argv) == ["codec", "--repeat", "2", "--size-mb", "1"]


def test_bench_codec_memory_both_reports_both_and_decode_into(tmp_path):
    out = tmp_path / "codec.json"
    proc = subprocess.run([sys.executable, "-m", "workers.cli", "benchmark", "codec", "--size-mb", "1", "--repeat", "1",
                           "--schemes", "int4", "--formats", "3", "--threads", "1", "--zstd-level", "1",
                           "--memory", "both", "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["codec"]["rows"]
    assert sorted((r["memory"], r["zstd_level"]) for r in rows) == [("default", 0), ("default", 1),
                                                                    ("keep", 0), ("keep", 1)]
    for r in rows:
        assert r["same_bytes"] and r["decode_into_mbps"] > 0
        assert r["decode_into_vs_memcpy"] == r["decode_into_mbps"] / r["memcpy_mbps"]
    blobs = {(r["memory"], r["zstd_level"]): r["blob_bytes"] for r in rows}
    assert blobs[("default", 1)] == blobs[("keep", 1)]


def test_keep_memory_flag_conflicts_with_another_memory_choice():
    proc = subprocess.run([sys.executable, "-m", "workers.cli", "benchmark", "codec", "--keep-memory", "--memory",
                           "default"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "--keep-memory is --memory keep" in proc.stderr
