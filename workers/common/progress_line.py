"""A short human progress line from one role's own events, every few seconds (issue 28).

``ddiloco learner`` and ``ddiloco syncer`` write JSONL events (``--log``); on a terminal they also
print one line like ``[12:00:05] learner l0: step 1200, loss 2.314, 4,100 tok/s, 37 versions applied,
58 acked, 2 spilled`` or ``[12:00:05] syncer (epoch 2): 140 commits, 280 deltas merged, 3 dropped,
quorum 2.0, grace 18 ms``. It subscribes to the role's EventLog (workers/common/events.py) and never
reads anything else: quick, on the emitting thread, at most one line per ``every_s``.
"""
from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

MODES = ("auto", "on", "off")


def wanted(mode: str, log: str | None, out: TextIO = sys.stdout) -> bool:
    """``auto``: with ``--log`` (events go to a file) on a terminal; ``on``/``off``: always/never."""
    if mode not in MODES:
        raise ValueError(f"--progress must be one of {MODES}, got {mode!r}")
    return mode == "on" or (mode == "auto" and log is not None and out.isatty())


class ProgressLine:
    def __init__(self, role: str, ident: str, out: TextIO = sys.stdout, every_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):
        self.role, self.ident, self.out, self.every_s, self.clock, self.wall = role, ident, out, every_s, clock, wall
        self._last: float | None = None
        self.s = {"step": 0, "loss": None, "tok_s": 0.0, "applied": 0, "acked": 0, "spilled": 0, "commits": 0,
                  "merged": 0, "dropped": 0, "quorum": [], "grace": [], "epoch": "-"}
        self._prev: tuple[float, int] | None = None   # (t, tokens) of the last step event

    def __call__(self, e: dict) -> None:
        try:
            self._take(e)
            now = self.clock()
            if self._last is None or now - self._last >= self.every_s or e.get("event") in ("learner-stop",
                                                                                              "syncer-stop"):
                self._last = now
                self.out.write(self.line() + "\n")
                self.out.flush()
        except Exception:   # noqa: BLE001 - a progress line must never break the role
            pass

    def _take(self, e: dict) -> None:
        s, ev = self.s, e.get("event")
        if ev == "step":
            if self._prev is not None and e["t"] > self._prev[0]:
                s["tok_s"] = (e["tokens"] - self._prev[1]) / (e["t"] - self._prev[0])
            self._prev = (e["t"], e["tokens"])
            s.update(step=e["step"], loss=e.get("loss"), acked=e.get("acked", 0), spilled=e.get("spilled", 0))
        elif ev == "version-applied":
            s["applied"] += 1
        elif ev == "commit":
            s["commits"] += 1
            s["merged"] += len(e.get("inputs", []))
            s["dropped"] += len(e.get("dropped", []))
            s["quorum"] = (s["quorum"] + [e.get("quorum", 0)])[-50:]
            s["grace"] = (s["grace"] + [e.get("grace_s", 0.0)])[-50:]
        elif ev == "syncer-recovered":
            s["epoch"] = e.get("epoch", "-")

    def line(self) -> str:
        s, at = self.s, time.strftime("%H:%M:%S", time.localtime(self.wall()))
        if self.role == "syncer":
            q = sum(s["quorum"]) / len(s["quorum"]) if s["quorum"] else 0.0
            g = sum(s["grace"]) / len(s["grace"]) if s["grace"] else 0.0
            return (f"[{at}] syncer {self.ident} (epoch {s['epoch']}): {s['commits']} commits, {s['merged']} deltas "
                    f"merged, {s['dropped']} dropped, quorum {q:.1f}, grace {g * 1000:.0f} ms")
        loss = f"{s['loss']:.3f}" if s["loss"] is not None else "-"
        return (f"[{at}] learner {self.ident}: step {s['step']}, loss {loss}, {s['tok_s']:,.0f} tok/s, "
                f"{s['applied']} versions applied, {s['acked']} acked, {s['spilled']} spilled")
