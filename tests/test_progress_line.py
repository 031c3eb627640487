"""Issue 28: `ddiloco learner` and `ddiloco syncer` print a short human progress line every few seconds
on a terminal, from their own events (workers/common/progress_line.py)."""
from __future__ import annotations

import io
import subprocess
import sys

import pytest

from workers.common.events import EventLog
from workers.common.progress_line import ProgressLine, wanted


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_a_learner_line_every_few_seconds_from_its_events():
    out, clock = io.StringIO(), Clock()
    events = EventLog(None, "learner", "l3", clock=lambda: 1000.0 + clock.t)
    events.subscribe(ProgressLine("learner", "l3", out, every_s=5.0, clock=clock, wall=lambda: 0.0))
    events.emit("step", step=10, loss=2.5, tokens=1000, acked=1, spilled=0)      # the first line at once
    clock.t = 2.0
    events.emit("version-applied", fragment=0, version=1)
    events.emit("step", step=20, loss=2.25, tokens=3000, acked=2, spilled=1)     # within 5 s: no line
    clock.t = 6.0
    events.emit("step", step=30, loss=2.0, tokens=5000, acked=3, spilled=1)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "learner l3: step 10, loss 2.500" in lines[0]
    assert "step 30, loss 2.000, 500 tok/s, 1 versions applied, 3 acked, 1 spilled" in lines[1], lines[1]


def test_a_syncer_line_and_a_last_line_when_it_stops():
    out, clock = io.StringIO(), Clock()
    line = ProgressLine("syncer", "syncer", out, every_s=5.0, clock=clock, wall=lambda: 0.0)
    line({"event": "syncer-recovered", "epoch": 3, "t": 0})
    line({"event": "commit", "inputs": ["a", "b"], "dropped": ["c"], "quorum": 2, "grace_s": 0.02, "t": 1})
    line({"event": "syncer-stop", "t": 2})
    last = out.getvalue().splitlines()[-1]
    assert "syncer syncer (epoch 3): 1 commits, 2 deltas merged, 1 dropped, quorum 2.0, grace 20 ms" in last


def test_auto_prints_only_with_a_log_file_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self):
            return True
    assert wanted("auto", "x.jsonl", Tty()) and not wanted("auto", None, Tty())
    assert not wanted("auto", "x.jsonl", io.StringIO()) and wanted("on", None) and not wanted("off", "x", Tty())
    with pytest.raises(ValueError, match="--progress"):
        wanted("loud", None)


def test_the_syncer_command_prints_progress_lines_when_asked(tmp_path):
    from tests.test_evaluator import _run
    _run(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "workers.cli", "syncer", "--store", str(tmp_path / "run"),
                             "--no-bus", "--log", str(tmp_path / "s.jsonl"), "--progress", "on"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()     # the line of its recovery, at once
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
    assert first.startswith("[") and "syncer syncer (epoch 1)" in first, first
