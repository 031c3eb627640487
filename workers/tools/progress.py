"""Live progress of a run, built from the processes' JSONL events: a rich table on a terminal,
plain lines every few seconds otherwise (CI logs, pipes)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from rich.console import Console
from rich.live import Live
from rich.table import Table


@dataclass
class _Row:
    step: int = 0
    loss: float | None = None
    tokens: int = 0
    tok_s: float = 0.0
    versions: dict = field(default_factory=dict)
    spilled: int = 0
    acked: int = 0
    status: str = "starting"
    last_t: float | None = None
    last_tokens: int = 0


MAX_NOTES = 50


class Progress:
    def __init__(self, learners: int, steps: int, descriptor, plain: bool = False):
        self.steps, self.descriptor, self.plain = steps, descriptor, plain
        self.rows: dict[str, _Row] = {f"l{m}": _Row() for m in range(learners)}
        self.syncer = {"commits": 0, "merged": 0, "dropped": 0, "quorum": [], "grace": [], "spill_in": 0,
                       "epoch": "-", "status": "starting"}
        self.eval_loss: float | None = None
        self.notes: list[str] = []
        self.console = Console()
        self._live: Live | None = None
        self._last_plain = 0.0

    def __enter__(self) -> "Progress":
        if not self.plain:
            self._live = Live(self._table(), console=self.console, refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.update(self._table())
            self._live.__exit__(*exc)
        else:
            self._print_plain(force=True)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)
            del self.notes[:-MAX_NOTES]      # bounded: error texts differ (keys), a long run has many
            if self.plain:
                print(text, flush=True)

    def total_tokens(self) -> int:
        return sum(r.tokens for r in self.rows.values())

    def update(self, name: str, events: list[dict], returncode: int | None) -> None:
        if name == "syncer" or name.startswith("syncer-s"):   # syncer-s<i>: a shard (--syncers N): added up
            self._update_syncer(events, returncode)
        else:
            row = self.rows.setdefault(name, _Row())
            for e in events:
                ev = e.get("event")
                if ev == "step":
                    if row.last_t is not None and e["t"] > row.last_t:
                        row.tok_s = (e["tokens"] - row.last_tokens) / (e["t"] - row.last_t)
                    row.last_t, row.last_tokens = e["t"], e["tokens"]
                    row.step, row.loss, row.tokens = e["step"], e["loss"], e["tokens"]
                    row.versions, row.spilled, row.acked = e.get("versions", {}), e.get("spilled", 0), e.get("acked", 0)
                    row.status = "training"
                elif ev == "learner-start":
                    row.status = "training"
                elif ev == "learner-stop":
                    row.status = "draining" if returncode is None else "done"
                    row.tokens = e.get("tokens", row.tokens)
                    if e.get("undelivered"):
                        self.note(f"{name}: {e['undelivered']} delta(s) never made durable: "
                                  f"{e.get('last_error') or 'not acknowledged in time'}")
                else:
                    self._trouble(name, row, ev, e)
            if returncode is not None:
                row.status = "done" if returncode == 0 else f"exit {returncode}"
        if self._live is not None:
            self._live.update(self._table())
        else:
            self._print_plain()

    def _trouble(self, name: str, row: _Row, ev: str, e: dict) -> None:
        """Problems a learner reports (issue 11 items 2, 11, 12) go into the table, never only a log."""
        if ev == "spill-failed":
            row.status = f"spill failing x{e.get('consecutive', 1)}"
            self.note(f"{name}: spilling deltas fails: {e.get('error', '')}")
        elif ev == "spill-recovered":
            row.status = "training"
        elif ev == "receiver-stuck":
            self.note(f"{name}: not receiving versions ({e.get('what')}): {e.get('error', '')}")
        elif ev == "nonfinite-step":
            self.note(f"{name}: non-finite steps skipped ({e.get('where')}; {e.get('action')})")
        elif ev == "delta-evicted":
            self.note(f"{name}: deltas evicted to bound memory (storage too slow)")

    def _update_syncer(self, events: list[dict], returncode: int | None) -> None:
        s = self.syncer
        for e in events:
            ev = e.get("event")
            if ev == "commit":
                s["commits"] += 1
                s["merged"] += len(e.get("inputs", []))
                s["dropped"] += len(e.get("dropped", []))
                s["quorum"] = (s["quorum"] + [e.get("quorum", 0)])[-50:]
                s["grace"] = (s["grace"] + [e.get("grace_s", 0.0)])[-50:]
                s["status"] = "merging"
            elif ev == "syncer-recovered":
                s["epoch"] = e.get("epoch")
                s["status"] = "running"
            elif ev == "syncer-fenced":
                s["status"] = "fenced"
        if returncode is not None:
            s["status"] = "stopped" if returncode == 0 else f"exit {returncode}"

    def _table(self) -> Table:
        d = self.descriptor
        t = Table(title=f"run {d.run_id}: P={d.num_fragments} H={d.schedule.sync_every} K={d.policy.quorum} "
                        f"{d.codec.scheme}"
                        + (f"   global eval loss {self.eval_loss:.4f}" if self.eval_loss is not None else ""))
        for col in ("learner", "step", "loss", "tokens/s", "versions applied", "acked", "spilled", "status"):
            t.add_column(col, justify="right" if col not in ("learner", "status") else "left")
        for name, r in sorted(self.rows.items()):
            t.add_row(name, f"{r.step}/{self.steps}" if self.steps else str(r.step), f"{r.loss:.3f}" if r.loss is not None else "-",
                      f"{r.tok_s:,.0f}", " ".join(f"{v}" for _, v in sorted(r.versions.items())) or "-",
                      str(r.acked), str(r.spilled), r.status)
        s = self.syncer
        q = sum(s["quorum"]) / len(s["quorum"]) if s["quorum"] else 0
        g = sum(s["grace"]) / len(s["grace"]) if s["grace"] else 0
        t.caption = (f"syncer epoch {s['epoch']} {s['status']}: {s['commits']} commits, {s['merged']} deltas merged, "
                     f"{s['dropped']} dropped, mean quorum {q:.1f}, mean grace {g * 1000:.0f} ms"
                     + ("\n" + "\n".join(self.notes[-3:]) if self.notes else ""))
        return t

    def _print_plain(self, force: bool = False) -> None:
        now = time.time()
        if not force and now - self._last_plain < 5.0:
            return
        self._last_plain = now
        parts = [f"{n} {r.step}{f'/{self.steps}' if self.steps else ''} loss {r.loss:.3f}" if r.loss is not None
                 else f"{n} {r.status}"
                 for n, r in sorted(self.rows.items())]
        s = self.syncer
        ev = f" | eval {self.eval_loss:.4f}" if self.eval_loss is not None else ""
        print(f"[{time.strftime('%H:%M:%S')}] " + ", ".join(parts) +
              f" | syncer {s['commits']} commits, {s['merged']} merged, {s['dropped']} dropped{ev}", flush=True)
