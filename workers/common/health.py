"""Health endpoints beside ``/metrics`` (issue 29): what Kubernetes probes and SLURM scripts ask.

- ``/healthz``: 200 while the process serves at all (liveness: it is not wedged);
- ``/readyz``: 200 when the role does its job, else 503 with the reason as the body -
  a syncer once it recovered (``syncer-recovered``) until it stops or is fenced; a learner once it
  loaded the global model (``learner-start``) until it stops;
- ``/metrics``: the role's Prometheus registry (workers/common/metrics.py).

``Health`` follows the role's own events (an EventLog listener), like the metrics: nothing in the
role calls it. ``HealthServer`` is the standard library's threading HTTP server on the metrics
address (127.0.0.1 unless ``--metrics-host``).
"""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


class Health:
    """Readiness of one role from its events (module docstring)."""

    def __init__(self, role: str):
        self.role = role
        self.reason = "starting" if role == "learner" else "recovering"
        self.ready = False

    def observe(self, rec: dict) -> None:
        ev = rec.get("event")
        if self.role == "syncer":
            if ev == "syncer-recovered":
                self.ready, self.reason = True, "committing"
            elif ev in ("syncer-fenced", "syncer-stop"):
                self.ready, self.reason = False, "fenced" if ev == "syncer-fenced" else "stopped"
        elif ev == "learner-start":
            self.ready, self.reason = True, "training"
        elif ev == "learner-stop":
            self.ready, self.reason = False, "stopped"


class HealthServer:
    """``/metrics``, ``/healthz`` and ``/readyz`` on ``host:port`` from a daemon thread."""

    def __init__(self, registry: CollectorRegistry, health: Health, host: str, port: int):
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:   # noqa: N802 - the stdlib's name
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    self._send(200, b"ok\n")
                elif path == "/readyz":
                    self._send(200 if health.ready else 503, f"{health.reason}\n".encode())
                else:
                    self._send(404, b"not found: /metrics, /healthz, /readyz\n")

            def _send(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:   # probes every few seconds: no stderr line each
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, name="metrics-http", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)
