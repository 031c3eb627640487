"""A learner that is a torchrun job (issue 17; workers/learner/group.py): 2 learners of 2 CPU ranks
each (gloo, every listener on 127.0.0.1 through workers/learner/localrun.py) and a syncer, as real
processes. The run trains (the global model's held-out loss goes down), every rank of a learner
holds the same weights after every applied version (the ranks' logged digests agree), and the
counters are the group's (tokens = steps x world size x local batch)."""
from __future__ import annotations

import os
import signal
from collections import defaultdict

import pytest
import torch

from tests.runhelpers import TinyRun
from workers.common.events import read_events
from workers.learner.group import decode_header, encode_header, rank_log_path, torchrun_env
from workers.learner.localrun import torchrun_argv

RANKS = 2
STEPS = 60
BATCH, BLOCK = 4, 32      # TinyRun's job: batch_size 4, TINY.block_size 32


def _rank_logs(run: TinyRun, lid: str) -> list[list[dict]]:
    base = run.cluster.log_path(lid)
    return [read_events(rank_log_path(base, r)) for r in range(RANKS)]


def _applies(events: list[dict]) -> dict[int, dict]:
    """A rank's broadcasts by their number (the first, n=1, is the initial model at start)."""
    out = {e["n"]: e for e in events if e.get("event") == "group-apply"}
    assert sorted(out) == list(range(1, len(out) + 1)), sorted(out)
    return out


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.getcwd())
    run = TinyRun(str(out / "store"), out, env, steps=STEPS, learners=2)
    run.create()
    try:
        run.syncer()
        run.cluster.wait_ready("syncer")
        # l0 trains its budget; l1 has no end and is stopped (SIGTERM to torchrun and its ranks) once
        # l0 is done: its ranks must leave together, at one step boundary, with rank 0 drained.
        for lid, steps in (("l0", STEPS), ("l1", 10**6)):
            argv = ["--nproc-per-node", str(RANKS), "-m", "workers.cli", "learner", "--id", lid,
                    *run.key_args(lid), *run.cluster.bus_args(), "--steps", str(steps), "--poll", "0.2",
                    "--group-digests"]
            run.cluster.spawn(lid, "learner", argv, module="workers.learner.localrun")
        codes = {"l0": run.wait("l0", timeout=150)}
        run.cluster.terminate("l1")
        codes["l1"] = run.wait("l1", timeout=60)
        assert codes == {"l0": 0, "l1": 128 + signal.SIGTERM}, {lid: run.stderr(lid) for lid in codes}
        assert run.wait_inbox_empty(60), run.drain_status
        yield run
    finally:
        run.stop_all()


def test_every_rank_holds_the_same_weights_after_each_applied_version(finished):
    for lid in ("l0", "l1"):
        logs = _rank_logs(finished, lid)
        per_rank = [_applies(events) for events in logs]
        assert per_rank[0], f"{lid}: rank 0 logged no broadcast"
        assert [len(a) for a in per_rank[1:]] == [len(per_rank[0])] * (RANKS - 1), \
            f"{lid}: ranks logged different numbers of broadcasts"
        for n, first in per_rank[0].items():
            for r, applies in enumerate(per_rank[1:], start=1):
                other = applies[n]
                assert (other["step"], other["versions"]) == (first["step"], first["versions"]), (lid, n, r)
                assert other["digest"] == first["digest"], f"{lid}: rank {r} differs from rank 0 after broadcast {n}"
        # Every version rank 0 applied went out in the broadcast of that step boundary.
        applied = [e for e in logs[0] if e.get("event") == "version-applied"]
        assert len(applied) >= 3 and len(per_rank[0]) >= 3, (lid, len(applied), len(per_rank[0]))
        sent = defaultdict(dict)
        for a in per_rank[0].values():
            sent[a["step"]].update(a["versions"])
        for e in applied:
            assert sent[e["step"]].get(str(e["fragment"]), -1) >= e["version"], e
        starts = [e for events in logs for e in events if e.get("event") == "group-start"]
        assert sorted(e["rank"] for e in starts) == list(range(RANKS)) and {e["world_size"] for e in starts} == {RANKS}
        # Only rank 0 speaks as the learner: tools that list learners by role see one per group.
        assert {e["role"] for events in logs[1:] for e in events} == {"rank"}


def test_counters_are_the_groups(finished):
    for lid in ("l0", "l1"):
        done = [e for e in finished.events(lid) if e.get("event") == "learner-done"][-1]
        assert done["world_size"] == RANKS and done["drained"], done
        assert done["tokens"] == done["steps"] * RANKS * BATCH * BLOCK
        deltas = [e for e in finished.events(lid) if e.get("event") == "delta"]
        assert deltas and all(d["tokens"] == d["steps"] * RANKS * BATCH * BLOCK for d in deltas)
    assert [e for e in finished.events("l0") if e.get("event") == "learner-done"][-1]["steps"] == STEPS


def test_a_stopped_group_leaves_together_at_one_boundary(finished):
    stops = [[e for e in events if e.get("event") == "group-stop"] for events in _rank_logs(finished, "l1")]
    assert all(len(s) == 1 for s in stops), stops
    steps = {s[0]["steps"] for s in stops}
    assert len(steps) == 1 and steps.pop() > 10, stops     # one boundary, after it trained
    # Rank 0 made every delta durable before the group left (a learner that leaves early flushes).
    stop = [e for e in finished.events("l1") if e.get("event") == "learner-stop"][-1]
    assert stop["drained"] and stop["undelivered"] == 0, stop


def test_loss_goes_down(finished):
    # Held-out loss of the global model in storage, against the one initial model (TinyRun.create).
    assert finished.global_loss() < finished.init_loss - 0.5, (finished.global_loss(), finished.init_loss)


def test_header_round_trip_and_refusals():
    assert decode_header(encode_header(4, {0: 3, 2: 0}), 4) == {0: 3, 2: 0}
    bad = encode_header(4, {1: 7})
    bad[3] += 1
    with pytest.raises(ValueError, match="checksum"):
        decode_header(bad, 4)
    with pytest.raises(ValueError, match="fragments"):
        decode_header(encode_header(3, {}), 4)
    assert torchrun_env({"RANK": "0", "WORLD_SIZE": "1"}) is None
    assert torchrun_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}) == (1, 2, 1)
    with pytest.raises(ValueError):
        torchrun_env({"RANK": "2", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="127.0.0.1"):
        torchrun_argv(["--nproc-per-node", "2", "--master-addr", "0.0.0.0", "-m", "workers.cli"])
    assert torchrun_argv(["--nproc-per-node", "2", "-m", "workers.cli", "learner", "--log", "x"]) == \
        (["--nproc-per-node", "2", "-m", "workers.cli"], ["learner", "--log", "x"])
    assert torch.distributed.is_available()
