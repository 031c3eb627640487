"""What a run looks like right now, for `ddiloco dashboard`: learners, fragments,
syncer, held-out loss and regions, built from the run's commit log (SPEC §7) and the processes'
JSONL event logs (workers/common/events.py) and nothing else.

Read-only and incremental, so that watching never slows training: the store is opened without
creating anything; each refresh asks the log for its tail (the hint plus a few HEAD probes) and
reads only the commits after the last one read (at most ``max_commits_per_refresh`` per refresh,
so a long finished run is caught up over a few refreshes); each event file is tailed from the
byte where the previous refresh stopped. Nobody is signalled, paused or asked anything. Memory is
bounded: chart series are thinned, windows are fixed-size deques.

The commit totals are ``workers.tools.logview.LogTotals`` fed with the same records, so the page's
commits, merges, drops and tokens equal ``ddiloco log RUN --json``'s totals line for the commits
read (tests/test_dashboard.py checks it). The state's JSON shape: docs/dashboard.md.
"""
from __future__ import annotations

import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from pipeline.descriptor import RunDescriptor
from pipeline.errors import FormatError
from pipeline.types import CommitRecord
from storage.errors import StoreError
from storage.layout import read_descriptor
from storage.log import CommitLog
from storage.store import ObjectStore, open_store
from workers.common.events import Tail
from workers.tools.logview import LogTotals, stored_base

STATE_FORMAT = "ddiloco.dashboard.state"
STATE_VERSION = 1
# A learner's events that settle a delta it published without any commit naming it.
SETTLED_BY_LEARNER = ("delta-dropped", "delta-rejected", "delta-superseded", "delta-evicted")
TROUBLE = ("spill-failed", "receiver-stuck", "nonfinite-step", "store-error", "replicate-error", "syncer-fenced",
           "sender-failed", "ingest-store-error", "delta-evicted", "member-refused", "peer-denied")
MAX_NOTES = 12
ACCOUNTING_FORMAT = 1     # the ``accounting`` events read for bytes per region (workers/common/traffic.py)
REQUEST_KINDS = ("put", "put_if_absent", "multipart_puts", "get", "head", "list", "delete")   # StoreCounters


@dataclass(frozen=True)
class ViewConfig:
    """How the view reads the run. ``refresh_s``: at most one read of store and logs per this many
    seconds, however many pages poll; ``silent_s``: a learner with no event for this long is shown
    as silent (not alive); ``rate_window_s``: commits/s and tokens/s are measured over this window;
    ``series_points``: points kept per chart series."""

    refresh_s: float = 1.0
    silent_s: float = 15.0
    rate_window_s: float = 30.0
    max_commits_per_refresh: int = 2000
    series_points: int = 300

    def __post_init__(self) -> None:
        for name in ("refresh_s", "silent_s", "rate_window_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"ViewConfig.{name} must be a number > 0, got {value!r}")
        for name in ("max_commits_per_refresh", "series_points"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 2:
                raise ValueError(f"ViewConfig.{name} must be an int >= 2, got {value!r}")


class Series:
    """A chart series of bounded size: when it holds more than ``cap`` points every other point is
    dropped and from then on only every ``stride``-th point is kept; the newest point is always shown."""

    def __init__(self, cap: int):
        self.cap, self.stride, self.n = cap, 1, 0
        self.points: list[tuple[float, float]] = []
        self.last: tuple[float, float] | None = None

    def add(self, x: float, y: float) -> None:
        self.last = (x, y)
        if self.n % self.stride == 0:
            self.points.append((x, y))
            if len(self.points) > self.cap:
                self.points = self.points[::2]
                self.stride *= 2
        self.n += 1

    def to_list(self) -> list[list[float]]:
        pts = list(self.points)
        if self.last is not None and (not pts or pts[-1] != self.last):
            pts.append(self.last)
        return [[x, y] for x, y in pts]


@dataclass
class LearnerView:
    """One learner as its event log tells it (all its lives)."""

    id: str
    cap: int
    stopped: bool = False
    incarnation: int | None = None
    step: int = 0
    tokens: int = 0
    loss: float | None = None
    step_time_s: float | None = None
    versions: dict[str, int] = field(default_factory=dict)
    last_applied: dict[str, Any] | None = None
    applied: int = 0
    acked: int = 0
    spilled: int = 0
    bytes_sent: int = 0
    bytes_received: int | None = None
    undelivered: int = 0
    published: int = 0
    last_t: float | None = None
    region: str | None = None
    metrics_url: str | None = None
    outstanding: set[str] = field(default_factory=set)     # published, no commit names it yet
    recent: deque = field(default_factory=lambda: deque(maxlen=256))   # (t, tokens) of step events
    loss_series: Series = field(init=False)

    def __post_init__(self) -> None:
        self.loss_series = Series(self.cap)

    def tokens_per_s(self, window_s: float) -> float | None:
        """Tokens per second over the last ``window_s`` of its step events (None: too few)."""
        if len(self.recent) < 2:
            return None
        t1, k1 = self.recent[-1]
        t0, k0 = next(((t, k) for t, k in self.recent if t >= t1 - window_s), self.recent[0])
        if t1 <= t0:
            t0, k0 = self.recent[-2]
        return (k1 - k0) / (t1 - t0) if t1 > t0 else None


@dataclass
class FragmentView:
    version: int = -1
    merges: int = 0
    last_seq: int = -1
    round_size: int = 0          # learners merged by its last merge (the commit's quorum)
    inputs: int = 0              # deltas merged by its last merge
    grace_wait_s: float = 0.0
    input_staleness: list[int] = field(default_factory=list)   # of the last merge's inputs
    committed_at: float | None = None


class RunView:
    """The dashboard's model of one run (module docstring). ``state()`` is thread-safe and reads the
    store and the logs at most once per ``ViewConfig.refresh_s``; ``wall`` is the clock of the
    ages and rates shown (the event logs' ``t`` and commits' ``committed_at`` are wall time)."""

    def __init__(self, store_uri: str, events_dir: Path | None, *, s3_endpoint: str | None = None,
                 config: ViewConfig = ViewConfig(), wall: Callable[[], float] = time.time,
                 opener: Callable[[str], ObjectStore] | None = None):
        if not isinstance(store_uri, str) or not store_uri.strip():
            raise ValueError(f"the run's store URI must be a non-empty string, got {store_uri!r}")
        self.uri, self.cfg, self.wall = store_uri, config, wall
        self.events_dir = Path(events_dir) if events_dir is not None else None
        self._open_store = opener or (lambda uri: open_store(uri, s3_endpoint=s3_endpoint, create=False))
        self._lock = threading.Lock()
        self._last_refresh: float | None = None
        self._snapshot: dict[str, Any] = {}
        self.store: ObjectStore | None = None
        self.descriptor: RunDescriptor | None = None
        self.log: CommitLog | None = None
        self.totals: LogTotals | None = None
        self.next_seq = 0
        self.caught_up = False   # the log read to the tail seen at the last refresh ("finished" waits for it)
        self.error = ""
        self.epoch = 0
        self.rejected: Counter = Counter()
        self.fragments: dict[int, FragmentView] = {}
        self.commit_times: deque = deque(maxlen=4096)
        self.first_commit_at: float | None = None
        self.learners: dict[str, LearnerView] = {}
        self.syncer: dict[str, Any] = {"status": "not seen", "last_t": None, "metrics_url": None, "regions": {}}
        self.launcher: dict[str, Any] = {}
        self.eval_series = Series(config.series_points)
        self.notes: deque = deque(maxlen=MAX_NOTES)
        self._committed_early: dict[str, None] = {}   # ids a commit named before their delta event was read
        self._tails: dict[Path, Tail] = {}
        self._totals: dict[str, Any] | None = None   # LogTotals.to_dict(), recomputed after new commits
        self.accounting: dict[tuple, dict] = {}        # (role, id, life) -> its last ``accounting`` event

    # -- reading -----------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The current state as a JSON-ready dict (docs/dashboard.md), refreshed when due."""
        with self._lock:
            now = self.wall()
            if self._last_refresh is None or now - self._last_refresh >= self.cfg.refresh_s:
                self.refresh()
                self._last_refresh = now
                self._snapshot = self._build(now)
            return self._snapshot

    def refresh(self) -> None:
        """Read what is new: the events first, then the commits (a commit read before the event of
        a delta it names is remembered, so the backlog stays right in either order)."""
        self._read_events()
        if self.descriptor is None and not self._open():
            return
        try:
            self._read_commits()
            self.error = ""
        except (StoreError, FormatError) as exc:   # a store down for a moment: shown, retried next refresh
            self.error = f"reading the commit log: {exc}"

    def _open(self) -> bool:
        try:
            store = self._open_store(self.uri)
            self.descriptor = read_descriptor(store)
        except (StoreError, FormatError) as exc:
            self.error = f"no run readable at {self.uri} yet: {exc}"
            return False
        self.store, self.log = store, CommitLog(store)
        self.totals = LogTotals(fragments=self.descriptor.num_fragments, base_of=stored_base(store, self.descriptor))
        self.fragments = {p: FragmentView() for p in range(self.descriptor.num_fragments)}
        return True

    def _read_commits(self) -> None:
        tail = self.log.tail()
        self.caught_up = self.next_seq > tail
        if self.caught_up:
            return
        end = min(tail + 1, self.next_seq + self.cfg.max_commits_per_refresh)
        for rec in self.log.read_range(self.next_seq, end):
            self._add_commit(rec)
            self.next_seq = rec.seq + 1
            self._totals = None
        self.caught_up = self.next_seq > tail

    def _add_commit(self, rec: CommitRecord) -> None:
        self.totals.add(rec)
        self.epoch = max(self.epoch, rec.epoch)
        at = rec.info.get("committed_at")
        if isinstance(at, (int, float)) and rec.kind != "init":
            self.commit_times.append(float(at))
            self.first_commit_at = self.first_commit_at if self.first_commit_at is not None else float(at)
        rejected = rec.info.get("rejected")
        if isinstance(rejected, dict):
            self.rejected.update({str(k): int(v) for k, v in rejected.items() if isinstance(v, int)})
        f = self.fragments.get(rec.fragment)
        if f is not None and rec.kind in ("init", "merge"):
            f.version = max(f.version, rec.version)
            f.last_seq = rec.seq
            f.committed_at = float(at) if isinstance(at, (int, float)) else f.committed_at
        if f is not None and rec.kind == "merge":
            f.merges += 1
            f.round_size, f.inputs, f.grace_wait_s = rec.quorum, len(rec.inputs), rec.grace_wait_s
            f.input_staleness = [i.staleness for i in rec.inputs]
        for delta_id in [i.delta_id for i in rec.inputs] + [d.delta_id for d in rec.dropped]:
            self._settle(delta_id)

    def _settle(self, delta_id: str) -> None:
        lv = self.learners.get(delta_id.rsplit("/", 2)[0])
        if lv is not None and delta_id in lv.outstanding:
            lv.outstanding.discard(delta_id)
            return
        self._committed_early[delta_id] = None
        while len(self._committed_early) > 20_000:     # bounded: ids of learners without an event log
            self._committed_early.pop(next(iter(self._committed_early)))

    def _read_events(self) -> None:
        if self.events_dir is None:
            return
        try:
            paths = sorted(self.events_dir.glob("*.jsonl"))
        except OSError as exc:
            self.notes.append({"t": self.wall(), "who": "dashboard", "text": f"cannot list {self.events_dir}: {exc}"})
            return
        for path in paths:
            tail = self._tails.setdefault(path, Tail(path))
            for rec in tail.read():
                if isinstance(rec, dict):
                    self._add_event(rec)

    def _add_event(self, e: dict) -> None:
        role, ev = e.get("role"), e.get("event")
        if role == "learner" and isinstance(e.get("id"), str):
            self._learner_event(e, ev)
        elif role == "syncer":
            self._syncer_event(e, ev)
        elif ev == "run-created":
            self.launcher = {k: e.get(k) for k in ("run_id", "learners", "steps", "store", "security")}
        if ev == "accounting" and e.get("format") == ACCOUNTING_FORMAT and isinstance(e.get("stores"), dict):
            self.accounting[(role, e.get("id"), e.get("life"))] = e    # cumulative per life: the last is its total
            if role == "learner" and isinstance(e.get("id"), str) and e.get("region"):
                self._learner(e["id"]).region = str(e["region"])
        elif ev == "eval" and isinstance(e.get("loss"), (int, float)):
            self.eval_series.add(float(e.get("tokens") or 0), float(e["loss"]))
        if ev in TROUBLE:
            text = e.get("error") or e.get("detail") or e.get("what") or e.get("reason") or ""
            self.notes.append({"t": e.get("t"), "who": e.get("id", role), "text": f"{ev}: {str(text)[:200]}"})

    def _learner(self, lid: str) -> LearnerView:
        if lid not in self.learners:
            self.learners[lid] = LearnerView(lid, self.cfg.series_points)
        return self.learners[lid]

    def _learner_event(self, e: dict, ev: str) -> None:
        lv = self._learner(e["id"])
        lv.last_t = e.get("t", lv.last_t)
        if ev == "learner-start":
            lv.stopped, lv.incarnation = False, e.get("incarnation")
            lv.versions = dict(e.get("versions") or lv.versions)
        elif ev == "step":
            lv.step, lv.tokens = e.get("step", lv.step), e.get("tokens", lv.tokens)
            lv.loss, lv.step_time_s = e.get("loss"), e.get("step_time_s")
            lv.versions = dict(e.get("versions") or lv.versions)
            lv.acked, lv.spilled = e.get("acked", lv.acked), e.get("spilled", lv.spilled)
            lv.bytes_sent = e.get("bytes_sent", lv.bytes_sent)
            if lv.last_t is not None:
                lv.recent.append((lv.last_t, lv.tokens))
            if isinstance(lv.loss, (int, float)):
                lv.loss_series.add(float(lv.tokens), float(lv.loss))
        elif ev == "version-applied":
            lv.applied += 1
            lv.last_applied = {k: e.get(k) for k in ("fragment", "version", "seq", "latency_s", "t")}
            if e.get("fragment") is not None:
                lv.versions[str(e["fragment"])] = e.get("version")
        elif ev == "delta" and isinstance(e.get("delta"), str):
            lv.published += 1
            if e["delta"] in self._committed_early:
                del self._committed_early[e["delta"]]
            else:
                lv.outstanding.add(e["delta"])
        elif ev in SETTLED_BY_LEARNER and isinstance(e.get("delta"), str):
            lv.outstanding.discard(e["delta"])
        elif ev == "learner-stop":
            lv.stopped = True
            lv.step, lv.tokens = e.get("step", lv.step), e.get("tokens", lv.tokens)
            lv.bytes_received, lv.undelivered = e.get("bytes_received"), e.get("undelivered") or 0
            lv.bytes_sent = (e.get("bytes_sent") or 0) + (e.get("bytes_spilled") or 0) or lv.bytes_sent
        elif ev == "metrics-listening":
            lv.metrics_url = e.get("url")

    def _syncer_event(self, e: dict, ev: str) -> None:
        s = self.syncer
        s["last_t"] = e.get("t", s["last_t"])
        s["id"] = e.get("id", s.get("id"))
        if ev == "syncer-recovered":
            s["status"] = "running"
        elif ev == "syncer-stop":
            s["status"] = "fenced" if e.get("fenced") else "stopped"
            s["regions"] = e.get("regions") or {}
        elif ev == "syncer-fenced":
            s["status"] = "fenced"
        elif ev == "metrics-listening":
            s["metrics_url"] = e.get("url")
        elif s["status"] == "not seen":
            s["status"] = "running"

    # -- the state -----------------------------------------------------------------------------
    def _build(self, now: float) -> dict[str, Any]:
        d = self.descriptor
        versions = {p: f.version for p, f in self.fragments.items()}
        learners = [self._learner_state(lv, now, versions) for _, lv in sorted(self.learners.items())]
        if self._totals is None and self.totals is not None:
            self._totals = self.totals.to_dict()
        totals = self._totals
        # finished: every role stopped *and* the log read to its end, so the totals shown are final
        # (a long run's backlog is read max_commits_per_refresh at a time)
        done = bool(learners) and all(lv["status"] == "stopped" for lv in learners) \
            and self.syncer["status"] in ("stopped", "fenced") and self.caught_up
        return {
            "format": STATE_FORMAT, "version": STATE_VERSION, "now": round(now, 3), "error": self.error,
            "run": {"uri": self.uri, "events_dir": str(self.events_dir) if self.events_dir else None,
                    "run_id": d.run_id if d else None, "fragments": d.num_fragments if d else None,
                    "sync_every": d.schedule.sync_every if d else None, "quorum": d.policy.quorum if d else None,
                    "compression": d.codec.scheme if d else None,
                    "signed": (d.security is not None) if d else None,
                    "steps": (d.job or {}).get("steps") if d else None, "finished": done,
                    "commits_read": self.next_seq},
            "learners": learners,
            "fragments": [self._fragment_state(p, f, now) for p, f in sorted(self.fragments.items())],
            "syncer": self._syncer_state(now, learners, totals or {}),
            "totals": totals,
            "eval": self.eval_series.to_list(),
            "regions": self._regions_state(),
            "notes": list(self.notes),
        }

    def _learner_state(self, lv: LearnerView, now: float, versions: dict[int, int]) -> dict[str, Any]:
        if lv.stopped:
            status = "stopped"
        elif lv.last_t is None:
            status = "starting"
        elif now - lv.last_t > self.cfg.silent_s:
            status = "silent"
        else:
            status = "training"
        stale = {p: v - int(lv.versions[str(p)]) for p, v in versions.items()
                 if v >= 0 and isinstance(lv.versions.get(str(p)), int)}
        return {"id": lv.id, "status": status, "alive": status == "training", "incarnation": lv.incarnation,
                "step": lv.step, "tokens": lv.tokens, "loss": lv.loss, "step_time_s": lv.step_time_s,
                "tokens_per_s": _round(lv.tokens_per_s(self.cfg.rate_window_s), 1),
                "versions": lv.versions, "staleness": max(stale.values()) if stale else None,
                "last_version": lv.last_applied, "versions_applied": lv.applied,
                "deltas_published": lv.published, "awaiting_commit": len(lv.outstanding),
                "acked": lv.acked, "spilled": lv.spilled, "undelivered": lv.undelivered,
                "bytes_sent": lv.bytes_sent, "bytes_received": lv.bytes_received, "region": lv.region,
                "metrics_url": lv.metrics_url,
                "last_event_age_s": _round(now - lv.last_t, 1) if lv.last_t is not None else None,
                "loss_series": lv.loss_series.to_list()}

    def _fragment_state(self, p: int, f: FragmentView, now: float) -> dict[str, Any]:
        behind = [f.version - int(lv.versions[str(p)]) for lv in self.learners.values()
                  if not lv.stopped and isinstance(lv.versions.get(str(p)), int) and f.version >= 0]
        return {"fragment": p, "version": f.version, "merges": f.merges, "last_seq": f.last_seq,
                "last_round_size": f.round_size, "last_inputs": f.inputs, "grace_wait_s": f.grace_wait_s,
                "input_staleness": f.input_staleness, "learners_behind_max": max(behind) if behind else None,
                "committed_ago_s": _round(now - f.committed_at, 1) if f.committed_at is not None else None}

    def _syncer_state(self, now: float, learners: list[dict], t: dict[str, Any]) -> dict[str, Any]:
        times = self.commit_times
        recent = sum(1 for c in times if c >= now - self.cfg.rate_window_s)
        span = times[-1] - self.first_commit_at if times and self.first_commit_at is not None else 0.0
        s = self.syncer
        status = s["status"]
        if status == "running" and s["last_t"] is not None and now - s["last_t"] > self.cfg.silent_s \
                and not any(lv["alive"] for lv in learners):
            status = "idle"
        return {"id": s.get("id"), "status": status, "epoch": self.epoch, "last_seq": self.next_seq - 1,
                "commits": t.get("commits", 0), "commits_by_kind": t.get("commits_by_kind", {}),
                "commits_per_s": round(recent / self.cfg.rate_window_s, 3),
                "commits_per_s_run": round((len(times) - 1) / span, 3) if span > 0 else None,
                "deltas_merged": t.get("deltas_merged", 0), "deltas_dropped": t.get("deltas_dropped", 0),
                "deltas_lost": t.get("deltas_lost", 0), "drop_reasons": t.get("drop_reasons", {}),
                "rejected_at_ingest": dict(sorted(self.rejected.items())),
                "backlog": sum(lv["awaiting_commit"] for lv in learners),
                "last_commit_ago_s": _round(now - times[-1], 1) if times else None,
                "metrics_url": s["metrics_url"]}

    def _regions_state(self) -> list[dict[str, Any]]:
        """Bytes per region (docs/regions.md): from every process life's last ``accounting`` event
        (cumulative, format 1) the bytes written to and read from each region's store and the bus
        bytes of the processes placed in it; the syncer's replication into it (reported when the
        syncer stops). Empty without accounting events and without a regions section."""
        regions = self.descriptor.regions if self.descriptor is not None else None
        names = [spec.name for spec in regions.regions] if regions is not None else []
        rows: dict[str, dict[str, Any]] = {}

        def row(name: str) -> dict[str, Any]:
            return rows.setdefault(name, {"region": name, "home": regions is not None and name == regions.home,
                                          "learners": [], "store_bytes_written": 0, "store_bytes_read": 0,
                                          "store_requests": 0, "bus_bytes": 0, "replicated_bytes": None,
                                          "replicated_commits": None, "replication_delay_s_mean": None})
        for name in names:
            row(name)
        for (role, ident, _), e in sorted(self.accounting.items(), key=lambda kv: str(kv[0])):
            for name, c in e["stores"].items():
                if isinstance(c, dict):
                    r = row(str(name))
                    r["store_bytes_written"] += int(c.get("bytes_written", 0))
                    r["store_bytes_read"] += int(c.get("bytes_read", 0))
                    r["store_requests"] += sum(int(c.get(k, 0)) for k in REQUEST_KINDS)
            here = row(str(e.get("region") or "home"))
            bus = e.get("bus") if isinstance(e.get("bus"), dict) else {}
            here["bus_bytes"] += int(bus.get("sent_bytes", 0)) + int(bus.get("recv_bytes", 0))
            if role == "learner" and ident not in here["learners"]:
                here["learners"].append(ident)
        for name, rep in (self.syncer["regions"] or {}).items():
            if isinstance(rep, dict):
                r = row(str(name))
                r["replicated_bytes"], r["replicated_commits"] = rep.get("bytes"), rep.get("copied")
                r["replication_delay_s_mean"] = rep.get("delay_s_mean")
        for r in rows.values():
            r["learners"].sort()
        return [rows[n] for n in sorted(rows, key=lambda n: (n not in names, names.index(n) if n in names else 0, n))]


def _round(x: float | None, nd: int) -> float | None:
    return None if x is None else round(x, nd)
