"""Issue 11 items 11 and 15: what a user reads when something is wrong. One ``error: cause — fix``
line and a non-zero exit, never a traceback; a mistyped local store path is never created; a
learner that could not make its deltas durable (a full disk) says so instead of exiting 4 silently."""
from __future__ import annotations

import io
import socket

import numpy as np
import pytest
import torch
import zmq

from pipeline.types import DeltaHeader
from storage.errors import Unavailable
from storage.store import open_store
from workers import cli
from workers.commands import learner_exit
from workers.launch import RunSettings, Schedule, create_run
from workers.learner.learner import Learner, LearnerConfig
from workers.learner.sender import SenderConfig


def run_cli(argv, capsys) -> tuple[int, str, str]:
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("warning:")]
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("error: "), err
    return lines[0]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("role", [["syncer"], ["learner", "--id", "l0"]])
def test_a_mistyped_store_path_is_an_error_and_is_not_created(tmp_path, capsys, role):
    """Old code: the directory was created (an empty store) and a NotFound traceback printed."""
    typo = tmp_path / "runs" / "mnie"
    rc, _, err = run_cli([*role, "--store", typo, "--no-bus"], capsys)
    line = one_error_line(err)
    assert rc != 0 and "no run at" in line and "ddiloco run" in line
    assert not typo.exists() and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("command", ["replay", "log", "gc"])
def test_read_only_commands_do_not_create_a_mistyped_path(tmp_path, capsys, command):
    typo = tmp_path / "nope"
    rc, _, err = run_cli([command, typo], capsys)
    assert rc == 2 and "no run at" in err and "Traceback" not in err
    assert not typo.exists()


def test_an_s3_store_that_is_down_is_one_line(monkeypatch, capsys):
    """Old code: a botocore/Unavailable traceback."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    rc, _, err = run_cli(["syncer", "--store", "s3://bucket/run", "--s3-endpoint",
                          f"http://127.0.0.1:{closed_port()}", "--no-bus"], capsys)
    line = one_error_line(err)
    assert rc != 0 and "did not answer" in line and "--s3-endpoint" in line


def test_an_endpoint_in_use_is_one_line(tmp_path, capsys):
    store = open_store(str(tmp_path / "run"))
    create_run(store, {"w": np.zeros((4, 4), np.float32)}, RunSettings(schedule=Schedule(fragments=1, sync_every=4)))
    ctx = zmq.Context.instance()
    holder = ctx.socket(zmq.ROUTER)
    port = holder.bind_to_random_port("tcp://127.0.0.1")
    try:
        rc, _, err = run_cli(["syncer", "--store", tmp_path / "run", "--ingest", f"tcp://127.0.0.1:{port}",
                              "--announce", f"tcp://127.0.0.1:{closed_port()}", "--log", tmp_path / "s.jsonl"], capsys)
    finally:
        holder.close(0)
    line = one_error_line(err)
    assert rc != 0 and "--ingest/--announce" in line


def test_a_command_refusal_reads_as_an_error_line(tmp_path, capsys):
    store = open_store(str(tmp_path / "run"))
    create_run(store, {"w": np.zeros((4, 4), np.float32)}, RunSettings(schedule=Schedule(fragments=1, sync_every=4)))
    rc, _, err = run_cli(["syncer", "--store", tmp_path / "run", "--no-bus", "--key", tmp_path / "missing.key_secret"],
                         capsys)
    line = one_error_line(err)
    assert rc == 2 and "unsigned" in line


class DiskFull:
    """Spills fail like a full disk (LocalStore maps ENOSPC to Unavailable)."""

    def __init__(self, inner):
        self.inner, self.uri = inner, inner.uri

    def put_if_absent(self, key, data):
        if key.startswith("spill/"):
            raise Unavailable("write failed: No space left on device", uri=self.uri, key=key)
        return self.inner.put_if_absent(key, data)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_full_disk_is_reported_at_stop_and_by_the_exit(tmp_path):
    """Old code: spill_errors/last_error were never reported; `ddiloco learner` exited 4 silently."""
    inner = open_store(str(tmp_path / "run"))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    create_run(inner, {n: p.detach().numpy().copy() for n, p in model.named_parameters()},
               RunSettings(schedule=Schedule(fragments=1, sync_every=4)))
    learner = Learner(model, torch.optim.AdamW(model.parameters()), DiskFull(inner), "l0",
                      LearnerConfig(drain_s=0.5, sender=SenderConfig(retry_s=0.05, max_retry_s=0.1))).start()
    for seq in range(3):
        learner.sender.submit(DeltaHeader("l0", learner.incarnation, seq, 0, 0, 1, 16, seq),
                              {n: np.zeros(tuple(p.shape), np.float32) for n, p in model.named_parameters()})
    drained = learner.close()
    stats = learner.stats()
    assert not drained and stats["undelivered"] >= 1 and stats["spill_errors"] >= 1
    assert "No space left on device" in stats["last_error"]
    err = io.StringIO()
    assert learner_exit("l0", "runs/x", {"drained": drained, **stats}, err) == 4
    line = one_error_line(err.getvalue())
    assert "never made durable" in line and "No space left on device" in line and "free space" in line


def test_learner_trouble_shows_in_the_live_progress(capsys):
    """Spill failures, stuck receivers, skipped steps and lost deltas reach the launcher's table."""
    from types import SimpleNamespace
    from workers.tools.progress import Progress
    desc = SimpleNamespace(run_id="r", num_fragments=2, sync_every=8, quorum=1, compression="int4")
    progress = Progress(1, 10, desc, plain=True)
    progress.update("l0", [
        {"event": "spill-failed", "t": 1.0, "consecutive": 2, "error": "No space left on device"},
        {"event": "receiver-stuck", "t": 1.0, "what": "fragment 1", "error": "store unreachable"},
        {"event": "nonfinite-step", "t": 1.0, "where": "loss", "action": "reload-last-good"},
        {"event": "learner-stop", "t": 2.0, "undelivered": 3, "last_error": "No space left on device"}], None)
    notes = "\n".join(progress.notes)
    for text in ("spilling deltas fails: No space left", "not receiving versions (fragment 1)",
                 "non-finite steps skipped (loss; reload-last-good)", "3 delta(s) never made durable"):
        assert text in notes, notes
