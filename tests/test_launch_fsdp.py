"""Issue 28: FSDP2 learners. `ddiloco launch --nproc-per-learner 2 -- python examples/fsdp.py` trains two
learners of two ranks each (gloo on CPU); after every broadcast each rank's shards, gathered, are the
version rank 0 applied (digests); the run replays. Plus the pieces: the host copy's names, the chunks."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import torch

from tests.test_launch import DEADLINE_S, _env, _events, _launch_cmd, _replay
from workers.learner.fsdp import _local_chunk, host_module

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fsdp.py"


def test_two_fsdp2_learners_of_two_ranks_train_hold_the_applied_versions_and_replay(tmp_path):
    out = tmp_path / "fsdp"
    cmd = _launch_cmd(out, EXAMPLE, 120, "--nproc-per-learner", "2")
    done = subprocess.run([*cmd, "--digests"], capture_output=True, text=True, env=_env(), timeout=DEADLINE_S * 2)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] and summary["merge_commits"] > 0 and summary["settings"]["nproc_per_learner"] == 2
    for lid in ("l0", "l1"):
        rank0 = [e for e in _events(out, lid) if e.get("event") == "fsdp-apply"]
        rank1 = [e for e in _events(out, f"{lid}.rank1") if e.get("event") == "fsdp-apply"]
        assert len(rank0) == len(rank1) > 3, (len(rank0), len(rank1))   # version 0 and later merges
        for a, b in zip(rank0, rank1):
            assert a["n"] == b["n"] and a["versions"] == b["versions"]
            assert a["held"] == b["held"] == a["applied"], (lid, a, b)
        assert any(int(v) > 0 for a in rank0 for v in a["versions"].values())   # merged versions reached the shards
        losses = [e["loss"] for e in _events(out, lid) if e.get("event") == "step"]
        assert losses[-1] < losses[0], (lid, losses[:3], losses[-3:])
        assert summary["per_learner"][lid]["step"] == 120
    _replay(out)


def test_the_host_copy_has_the_models_names_and_shards_are_torch_chunks():
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    host = host_module({n: tuple(p.shape) for n, p in model.named_parameters()})
    assert {n: tuple(p.shape) for n, p in host.named_parameters()} == {n: tuple(p.shape) for n, p in
                                                                        model.named_parameters()}
    full = torch.arange(7.0)
    assert [len(_local_chunk(full, r, 2)) for r in range(2)] == [4, 3]
    assert [len(_local_chunk(torch.arange(2.0), r, 4)) for r in range(4)] == [1, 1, 0, 0]


def test_a_non_finite_step_on_one_rank_is_skipped_by_every_rank(tmp_path):
    out = tmp_path / "nan"
    fixture = Path(__file__).resolve().parent / "fixtures" / "fsdp_nan.py"
    cmd = _launch_cmd(out, fixture, 30, "--nproc-per-learner", "2")
    cmd[cmd.index("--learners") + 1] = "1"          # one learner of two ranks
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(NAN_AT="10"), timeout=DEADLINE_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for name in ("l0", "l0.rank1"):
        events = _events(out, name)
        assert [e["step"] for e in events if e.get("event") == "nonfinite-step"] == [10], name
        stop = next(e for e in events if e.get("event") == "fsdp-stop")
        assert stop["steps"] == 30 and stop["skipped"] == 1, stop
    _replay(out)
