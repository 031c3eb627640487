"""Prometheus metrics for the syncer and the learners: opt-in with ``--metrics-port N``.

A ``Metrics`` follows what its process already reports: it subscribes to the process's
``EventLog`` (workers/common/events.py) and turns each event into counters, gauges and histograms, so the
syncer and the learner need no code of their own for it. A few values are read when Prometheus
scrapes instead: the store's requests and bytes (the role's store wrapped in
``storage.accounting.CountingStore``) and, on the syncer, the deltas held for a round and each
fragment's version. Every ``Metrics`` has its own registry (never prometheus_client's global one),
so several in one process (tests) do not collide. The endpoint is ``http://HOST:PORT/metrics``
(HOST 127.0.0.1 unless ``--metrics-host``; PORT 0 picks a free port); the process logs a
``metrics-listening`` event with the URL. Metric names: docs/running.md "Weights out and metrics"; dashboard:
infra/grafana/ddiloco.json.

Bytes: a learner's deltas out are ``ddiloco_learner_delta_bytes_total`` (bus and spill together)
and its versions in are the store's ``ddiloco_store_bytes_total{direction="read"}``; the syncer's
store traffic is its own ``ddiloco_store_bytes_total`` (the deltas it receives over the bus are
the learners' bus bytes: the syncer reports no per-delta event to count them by).
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pipeline.fold import DropReason
from storage.accounting import CountingStore
from storage.layout import read_descriptor
from storage.store import ObjectStore
from workers.common.events import EventLog
from workers.common.health import Health, HealthServer

ROUND_SIZE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
GRACE_BUCKETS = (0.0, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
COMMIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# A learner's events that end a delta's wait to become durable, and the outcome each one counts as.
DELTA_OUTCOMES = {"delta-acked": "acked", "delta-spilled": "spilled", "delta-superseded": "superseded",
                  "delta-evicted": "evicted", "delta-dropped": "dropped", "delta-rejected": "rejected"}
ROLES = ("syncer", "learner")


class Metrics:
    """The metrics of one syncer or learner process (module docstring). ``observe`` takes one event
    record as ``EventLog`` emits it; it never raises (a failure counts in
    ``ddiloco_metrics_errors_total``), so metrics can never stop training."""

    def __init__(self, role: str, ident: str, run_id: str = ""):
        if role not in ROLES:
            raise ValueError(f"metrics role must be one of {ROLES}, got {role!r}")
        self.role, self.ident = role, ident
        self.registry = CollectorRegistry()
        self._lock = threading.Lock()
        self._server: HealthServer | None = None
        self.health = Health(role)      # /healthz and /readyz beside /metrics (workers/common/health.py)
        self.url: str | None = None
        self.port: int | None = None
        self.last_error = ""
        r = self.registry
        Gauge("ddiloco_info", "This process: role, id and run (always 1)", ["role", "id", "run_id"],
              registry=r).labels(role, ident, run_id).set(1)
        self.events = Counter("ddiloco_events", "Events this process logged, by name", ["event"], registry=r)
        self.errors = Counter("ddiloco_metrics_errors", "Events the metrics could not read", registry=r)
        self.store_errors = Counter("ddiloco_store_errors", "Store operations that failed (retried)", ["op"],
                                    registry=r)
        self._handlers: dict[str, Callable[[dict], None]] = {"store-error": self._store_error}
        if role == "syncer":
            self._syncer_metrics(r)
        else:
            self._learner_metrics(r)

    # -- syncer ----------------------------------------------------------------------------------
    def _syncer_metrics(self, r: CollectorRegistry) -> None:
        self.commits = Counter("ddiloco_syncer_commits", "Commits this syncer appended, by kind", ["kind"],
                               registry=r)
        self.merged = Counter("ddiloco_syncer_deltas_merged", "Deltas merged into a version", registry=r)
        self.dropped = Counter("ddiloco_syncer_deltas_dropped", "Deltas a commit dropped, by reason", ["reason"],
                               registry=r)
        self.rejected = Counter("ddiloco_syncer_deltas_rejected", "Deltas refused at ingest, by reason",
                                ["reason"], registry=r)
        self.evicted = Counter("ddiloco_syncer_deltas_evicted", "Pending deltas evicted to bound memory",
                               registry=r)
        self.round_size = Histogram("ddiloco_syncer_round_size", "Learners merged per merge commit",
                                    buckets=ROUND_SIZE_BUCKETS, registry=r)
        self.grace = Histogram("ddiloco_syncer_grace_wait_seconds", "Grace wait after quorum, per merge commit",
                               buckets=GRACE_BUCKETS, registry=r)
        self.commit_s = Histogram("ddiloco_syncer_commit_seconds", "Time to merge and commit one round",
                                  buckets=COMMIT_BUCKETS, registry=r)
        self.staleness = Histogram("ddiloco_syncer_input_staleness", "Versions a merged delta's base lagged "
                                   "its fragment's version, per merged delta", ["fragment"],
                                   buckets=STALENESS_BUCKETS, registry=r)
        self.last_commit = Gauge("ddiloco_syncer_last_commit_seq", "Seq of the last commit this syncer "
                                 "appended (the fence seq after a recovery)", registry=r)
        self.checkpoints = Counter("ddiloco_syncer_checkpoints", "Checkpoints written", registry=r)
        self.retained = Counter("ddiloco_syncer_retention_deleted", "Objects retention deleted", registry=r)
        self.recoveries = Counter("ddiloco_syncer_recoveries", "Epochs claimed (one fence commit each)",
                                  registry=r)
        self.fenced = Gauge("ddiloco_syncer_fenced", "1 once a newer syncer fenced this one", registry=r)
        self._handlers.update({
            "commit": self._commit, "delta-rejected": lambda e: self.rejected.labels(str(e.get("reason", "?"))).inc(),
            "delta-evicted": lambda e: self.evicted.inc(), "checkpoint": lambda e: self.checkpoints.inc(),
            "retention": lambda e: self.retained.inc(int(e.get("deleted", 0))),
            "syncer-recovered": self._recovered, "syncer-fenced": lambda e: self.fenced.set(1)})

    def _commit(self, e: dict) -> None:
        kind = str(e["kind"])
        self.commits.labels(kind).inc()
        self.last_commit.set(int(e["seq"]))
        self.merged.inc(len(e.get("inputs", ())))
        for _delta, reason in e.get("dropped", ()):
            self.dropped.labels(DropReason.parse(str(reason)).category).inc()
        for s in e.get("staleness", ()):
            self.staleness.labels(str(e["fragment"])).observe(s)
        if kind == "merge":
            self.round_size.observe(int(e.get("quorum", 0)))
            self.grace.observe(float(e.get("grace_s") or 0.0))
        if e.get("sync_s") is not None:
            self.commit_s.observe(float(e["sync_s"]))

    def _recovered(self, e: dict) -> None:
        self.recoveries.inc()
        if e.get("fence_seq") is not None:
            self.last_commit.set(int(e["fence_seq"]))

    # -- learner ---------------------------------------------------------------------------------
    def _learner_metrics(self, r: CollectorRegistry) -> None:
        self.steps = Counter("ddiloco_learner_steps", "Inner steps trained", registry=r)
        self.tokens = Counter("ddiloco_learner_tokens", "Tokens trained", registry=r)
        self.tokens_per_s = Gauge("ddiloco_learner_tokens_per_second", "Tokens per second between the last "
                                  "two progress events", registry=r)
        self.step_s = Gauge("ddiloco_learner_step_seconds", "Typical recent step time", registry=r)
        self.loss = Gauge("ddiloco_learner_loss", "Training loss of the last logged step", registry=r)
        self.version = Gauge("ddiloco_learner_fragment_version", "Version of each fragment the learner "
                             "trains on (staleness: the syncer's version minus this)", ["fragment"], registry=r)
        self.applied = Counter("ddiloco_learner_versions_applied", "New versions applied", registry=r)
        self.latency = Histogram("ddiloco_learner_version_latency_seconds", "Commit to applied, per version",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.deltas = Counter("ddiloco_learner_deltas", "Deltas handed to the sender (submitted) and how each "
                              "ended (acked, spilled, superseded, evicted, dropped, rejected)", ["outcome"],
                              registry=r)
        self.backlog = Gauge("ddiloco_learner_undelivered_deltas", "Deltas not yet durable (sent and unacked, "
                             "or waiting to spill)", registry=r)
        self.delta_bytes = Counter("ddiloco_learner_delta_bytes", "Delta bytes sent (bus) or spilled", registry=r)
        self.spill_bytes = Counter("ddiloco_learner_spilled_bytes", "Delta bytes spilled to the store", registry=r)
        self.spill_failures = Counter("ddiloco_learner_spill_failures", "Failed spill attempts (each retried)",
                                      registry=r)
        self.nonfinite = Counter("ddiloco_learner_nonfinite_steps", "Steps skipped for a non-finite loss",
                                 registry=r)
        self.receiver_errors = Counter("ddiloco_learner_receiver_errors", "Failures to fetch or apply a "
                                       "version (refused versions included)", registry=r)
        self._undelivered: set[str] = set()
        self._last_step: dict[str, float] | None = None
        self._spill_streak = 0
        self._handlers.update({
            "learner-start": self._learner_start, "step": self._step, "version-applied": self._version_applied,
            "delta": self._delta, "spill-failed": self._spill_failed, "spill-recovered": self._spill_recovered,
            "nonfinite-step": lambda e: self.nonfinite.inc(), "receiver-error": lambda e: self.receiver_errors.inc(),
            "version-refused": lambda e: self.receiver_errors.inc(),
            **{name: self._delta_done for name in DELTA_OUTCOMES}})

    def _set_versions(self, versions: dict) -> None:
        for p, v in (versions or {}).items():
            self.version.labels(str(p)).set(int(v))

    def _learner_start(self, e: dict) -> None:
        self._set_versions(e.get("versions", {}))
        self._last_step = None      # a new life: its counters start again from zero

    def _step(self, e: dict) -> None:
        last = self._last_step or {"step": 0, "tokens": 0, "bytes": 0, "t": None}
        step, tokens, sent = int(e["step"]), int(e["tokens"]), int(e.get("bytes_sent", 0))
        self.steps.inc(max(0, step - last["step"]))
        self.tokens.inc(max(0, tokens - last["tokens"]))
        self.delta_bytes.inc(max(0, sent - last["bytes"]))
        if last["t"] is not None and e["t"] > last["t"]:
            self.tokens_per_s.set((tokens - last["tokens"]) / (e["t"] - last["t"]))
        if e.get("step_time_s") is not None:
            self.step_s.set(float(e["step_time_s"]))
        if e.get("loss") is not None:
            self.loss.set(float(e["loss"]))
        self._set_versions(e.get("versions", {}))
        self._last_step = {"step": step, "tokens": tokens, "bytes": sent, "t": e["t"]}

    def _version_applied(self, e: dict) -> None:
        self.applied.inc()
        self.version.labels(str(e["fragment"])).set(int(e["version"]))
        if e.get("latency_s") is not None:
            self.latency.observe(max(0.0, float(e["latency_s"])))

    def _delta(self, e: dict) -> None:
        self.deltas.labels("submitted").inc()
        self._undelivered.add(str(e["delta"]))
        self.backlog.set(len(self._undelivered))

    def _delta_done(self, e: dict) -> None:
        self.deltas.labels(DELTA_OUTCOMES[e["event"]]).inc()
        if e["event"] == "delta-spilled":
            self.spill_bytes.inc(int(e.get("bytes", 0)))
        self._undelivered.discard(str(e.get("delta")))
        self.backlog.set(len(self._undelivered))

    def _spill_failed(self, e: dict) -> None:
        # The sender reports the 1st, 2nd, 4th, 8th ... failure of a streak: count what lies between.
        n = int(e.get("consecutive", self._spill_streak + 1))
        self.spill_failures.inc(max(1, n - self._spill_streak))
        self._spill_streak = max(self._spill_streak, n)

    def _spill_recovered(self, e: dict) -> None:
        self.spill_failures.inc(max(0, int(e.get("after_failures", 0)) - self._spill_streak))
        self._spill_streak = 0

    # -- both ------------------------------------------------------------------------------------
    def _store_error(self, e: dict) -> None:
        self.store_errors.labels(str(e.get("op", "?"))).inc()

    def observe(self, rec: dict) -> None:
        """Count one event (an ``EventLog`` listener)."""
        name = str(rec.get("event", "?"))
        try:
            with self._lock:
                self.health.observe(rec)
                self.events.labels(name).inc()
                handler = self._handlers.get(name)
                if handler is not None:
                    handler(rec)
        except Exception as exc:   # noqa: BLE001 - a malformed event must never reach the training loop
            self.errors.inc()
            self.last_error = f"{name}: {exc.__class__.__name__}: {exc}"

    def watch_store(self, store: CountingStore) -> None:
        """Report ``store``'s request and byte counts at every scrape."""
        self.registry.register(_Polled(lambda: _store_families(store)))

    def watch_syncer(self, syncer: Any) -> None:
        """Report the syncer's held deltas and fragment versions at every scrape (read, never changed)."""
        self.registry.register(_Polled(lambda: _syncer_families(syncer)))

    # -- the endpoint ----------------------------------------------------------------------------
    def serve(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve ``/metrics`` (and ``/healthz``, ``/readyz``) on ``host:port`` (0: a free port) from a
        daemon thread; returns the metrics URL."""
        if not 0 <= port <= 65535:
            raise ValueError(f"--metrics-port must be 0..65535, got {port}")
        try:
            self._server = HealthServer(self.registry, self.health, host, port)
        except OSError as exc:
            raise OSError(f"metrics: cannot listen on {host}:{port} ({exc.strerror or exc}): pick another "
                          "--metrics-port (0: any free port) or --metrics-host") from None
        self.port = self._server.port
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{self.port}/metrics"
        return self.url

    def close(self) -> None:
        """Stop serving (the counters stay readable in ``registry``)."""
        if self._server is not None:
            self._server.close()
            self._server = None


class _Polled:
    """A collector whose families are computed at scrape time; a failure yields nothing, never a 500."""

    def __init__(self, families: Callable[[], Iterable]):
        self._families = families

    def collect(self):
        try:
            return list(self._families())
        except Exception:   # noqa: BLE001 - e.g. a syncer still recovering: skip this scrape's values
            return []


def _store_families(store: CountingStore) -> Iterable:
    c = store.snapshot()
    requests = CounterMetricFamily("ddiloco_store_requests", "Store requests by kind (S3-billed kinds)",
                                   labels=["kind"])
    for kind in ("put", "put_if_absent", "multipart_puts", "get", "head", "list", "delete"):
        requests.add_metric([kind], getattr(c, kind))
    moved = CounterMetricFamily("ddiloco_store_bytes", "Bytes read from and written to the store",
                                labels=["direction"])
    moved.add_metric(["read"], c.bytes_read)
    moved.add_metric(["written"], c.bytes_written)
    failed = CounterMetricFamily("ddiloco_store_failed_requests", "Store calls that raised", value=c.failed)
    return [requests, moved, failed]


def _syncer_families(syncer: Any) -> Iterable:
    pending = GaugeMetricFamily("ddiloco_syncer_pending_deltas", "Deltas held for a fragment's next round "
                                "(from the bus or the spill inbox)", labels=["fragment"])
    for p, held in enumerate(list(syncer.pending)):
        pending.add_metric([str(p)], len(held))
    out = [pending]
    state = getattr(syncer, "state", None)
    if state is not None:
        version = GaugeMetricFamily("ddiloco_syncer_fragment_version", "Each fragment's committed version",
                                    labels=["fragment"])
        for p, f in enumerate(state.fragments):
            version.add_metric([str(p)], f.version)
        out += [version, GaugeMetricFamily("ddiloco_syncer_last_seq", "The log's last commit seq",
                                           value=state.last_seq)]
    return out


def add_metrics_args(parser) -> None:
    """``--metrics-port`` and ``--metrics-host`` (``ddiloco syncer`` and ``ddiloco learner``)."""
    parser.add_argument("--metrics-port", type=int, default=None, metavar="N",
                        help="serve Prometheus metrics at http://HOST:N/metrics (0: any free port; the "
                             "metrics-listening event names it); off unless given")
    parser.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                        help="address the metrics endpoint binds (default 127.0.0.1: this host only; "
                             "0.0.0.0 for a Prometheus elsewhere)")


def start_metrics(args, events: EventLog, role: str, ident: str, store: ObjectStore,
                  run_id: str | None = None) -> tuple[ObjectStore, Metrics | None]:
    """With ``--metrics-port``: a serving ``Metrics`` subscribed to ``events``, and ``store``
    wrapped so its traffic is counted (use the returned store); otherwise ``(store, None)``.
    ``run_id``: the run's, when the caller has read its descriptor already."""
    if getattr(args, "metrics_port", None) is None:
        return store, None
    metrics = Metrics(role, ident, run_id if run_id is not None else read_descriptor(store).run_id)
    counted = CountingStore(store)
    metrics.watch_store(counted)
    url = metrics.serve(args.metrics_host, args.metrics_port)
    events.subscribe(metrics.observe)
    events.emit("metrics-listening", url=url, host=args.metrics_host, port=metrics.port)
    return counted, metrics
