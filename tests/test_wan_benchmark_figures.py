"""The region benchmark's figures from a run's event logs (infra/wan_benchmark.py): answer-to-version
latency in steps and seconds, and the late share (merged answers to an earlier round than the
commit's), on hand-written logs whose answers are known."""
from __future__ import annotations

import json

from infra.wan_benchmark import answers


def _log(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_answers_gives_latency_and_late_share_per_learner(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    _log(logs / "syncer.jsonl", [
        {"t": 10.0, "event": "commit", "seq": 5, "round": 16, "inputs": ["l1/1/0", "l0/1/0"]},
        {"t": 20.0, "event": "commit", "seq": 6, "round": 32, "inputs": ["l1/1/1"]},   # l1's answer to 16: late
    ])
    _log(logs / "l1.jsonl", [
        {"t": 9.5, "event": "delta", "delta": "l1/1/0", "step": 15, "round": 16},
        {"t": 11.0, "event": "version-applied", "seq": 5, "step": 19},
        {"t": 12.0, "event": "delta", "delta": "l1/1/1", "step": 23, "round": 16},
        {"t": 21.0, "event": "version-applied", "seq": 6, "step": 40},
    ])
    _log(logs / "l0.jsonl", [{"t": 9.9, "event": "delta", "delta": "l0/1/0", "step": 15, "round": 16}])
    got = answers(tmp_path, ["l0", "l1"])
    assert got["l1"]["latency_steps"] == [19 - 16, 40 - 24]
    assert got["l1"]["latency_s"] == [1.5, 9.0]
    assert got["l1"]["late_share"] == 0.5
    assert got["l0"] == {"latency_steps": [], "latency_s": [], "late_share": 0.0}


def test_latency_parts_split_each_answer_at_the_close_the_commit_and_the_copy(tmp_path):
    from infra.wan_benchmark import latency_parts
    logs = tmp_path / "logs"
    logs.mkdir()
    _log(logs / "syncer.jsonl", [
        {"t": 10.3, "event": "commit", "seq": 5, "round": 16, "inputs": ["l1/1/0"], "sync_s": 0.1, "grace_s": 0.2},
        {"t": 10.6, "event": "replicated", "region": "r1", "seq": 5},
        {"t": 10.4, "event": "replicated", "region": "r2", "seq": 5},          # another region's copy: not r1's
        {"t": 20.0, "event": "commit", "seq": 6, "round": 32, "inputs": ["l1/1/1"], "sync_s": 0.1},   # never copied
    ])
    _log(logs / "l1.jsonl", [
        {"t": 10.0, "event": "delta", "delta": "l1/1/0", "step": 15, "round": 16},
        {"t": 11.0, "event": "version-applied", "seq": 5, "step": 19},
        {"t": 19.0, "event": "delta", "delta": "l1/1/1", "step": 30, "round": 32},
        {"t": 21.0, "event": "version-applied", "seq": 6, "step": 40},
    ])
    got = latency_parts(tmp_path, ["l1"], "r1")
    assert got == {"to_close": 0.2, "grace": 0.2, "commit": 0.1, "replicate": 0.3, "to_apply": 0.4, "total": 1.0}
