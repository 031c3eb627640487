"""workers/common/stop_flag.py: the stop flag SIGTERM sets can be waited on without deadlock.

A ``threading.Event`` set from a signal handler deadlocks when the signal lands while the main
thread holds the event's lock inside ``Event.wait`` (a SLURM-cancelled learner held at a gate hung
until SIGKILL, issue 25). The first test shows that hazard is real in this Python (so the second
could fail); the second takes the same hold with a StopFlag, and the last sends SIGTERM to a
script that waits on ``stop_requested()`` in a tight loop, many times.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from workers.common.stop_flag import StopFlag

ROOT = Path(__file__).resolve().parents[1]

HOLD = """
import os, signal, threading, sys
sys.path.insert(0, {root!r})
from workers.common.stop_flag import StopFlag
flag = {make}
signal.signal(signal.SIGUSR1, lambda *_: flag.set())
held = getattr(flag, "_cond", None) or threading.Lock()   # the Event's own lock, which its wait holds
with held:
    os.kill(os.getpid(), signal.SIGUSR1)
    x = [i for i in range(100)]          # bytecodes: the handler runs here, in this thread
print("set" if flag.is_set() else "not set", flush=True)
"""


def _hold(make: str) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run([sys.executable, "-c", HOLD.format(root=str(ROOT), make=make)],
                              capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return None


def test_an_event_set_by_a_handler_while_its_lock_is_held_deadlocks():
    assert _hold("threading.Event()") is None         # the hazard StopFlag exists for


def test_a_stop_flag_set_by_a_handler_at_the_same_point_is_set():
    done = _hold("StopFlag()")
    assert done is not None and done.returncode == 0 and done.stdout.strip() == "set", done


def test_wait_returns_once_set_from_another_thread_and_times_out_otherwise():
    flag = StopFlag()
    t0 = time.monotonic()
    assert flag.wait(0.05) is False and time.monotonic() - t0 >= 0.04
    threading.Timer(0.1, flag.set).start()
    assert flag.wait(30) is True and flag.is_set()
    assert flag.wait() is True                       # stays set


WAITER = """
import sys, time
sys.path.insert(0, {root!r})
from workers.learner.bootstrap import stop_requested
stop = stop_requested()
print("ready", flush=True)
while not stop.wait(0.0001):                          # the gate loop's wait, as tight as it gets
    pass
print("stopped", flush=True)
"""


def test_sigterm_ends_a_tight_wait_on_stop_requested_every_time():
    for _ in range(8):
        proc = subprocess.Popen([sys.executable, "-c", WAITER.format(root=str(ROOT))], stdout=subprocess.PIPE,
                                text=True)
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError("a SIGTERM'd script waiting on stop_requested() did not stop")
        assert out.strip() == "stopped" and proc.returncode == 0
