"""workers/commands.py ``_stop_flag``: a role that does not exit after SIGTERM writes every thread's
stack to stderr (issue 29's SLURM test once had a syncer hang in its shutdown with no trace of where)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runhelpers import wait_for

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[1]
HANGS = """
import threading, time
from workers.commands import _stop_flag
flag = _stop_flag(report_s=0.5)
print("armed", flush=True)
flag.wait()
print("stopping", flush=True)
threading.Event().wait()        # a shutdown that never ends
"""
EXITS = """
from workers.commands import _stop_flag
flag = _stop_flag(report_s=0.5)
print("armed", flush=True)
flag.wait()
"""


def _start(code: str, tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    err = tmp_path / "stderr"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=err.open("wb"),
                            text=True, env=env)
    assert proc.stdout.readline().strip() == "armed"
    return proc, err


def test_a_role_that_hangs_after_sigterm_dumps_its_threads(tmp_path):
    proc, err = _start(HANGS, tmp_path)
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.stdout.readline().strip() == "stopping"      # the flag was set: a clean stop began
        wait_for(lambda: "most recent call first" in err.read_text(), 120, "the stack dump on stderr")
        text = err.read_text()
        assert "most recent call first" in text and "wait" in text, text
        assert proc.poll() is None                                # reported, not killed: SIGKILL stays the stop
    finally:
        proc.kill()
        proc.wait(60)


def test_a_role_that_stops_cleanly_writes_nothing(tmp_path):
    proc, err = _start(EXITS, tmp_path)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(120) == 0
    assert err.read_text() == ""
