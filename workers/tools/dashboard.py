"""`ddiloco dashboard RUN_URI`: a live page for a running or finished run.

One static page (workers/tools/dashboard.html: HTML, CSS and a little vanilla JS, nothing fetched
from any other host) polls ``/api/state``, the JSON of ``workers.tools.dashboard_state.RunView``:
learners (alive, step, tokens/s, loss, last version applied), fragments (version, staleness, last
round size, grace wait), the syncer (commits/s, merges, drops with reasons, backlog), the held-out
loss of the global model over tokens and bytes per region. The view reads only the run's commit log
and its processes' event logs, incrementally and at most once per ``--refresh`` seconds however
many pages are open, so watching a run never slows it (docs/dashboard.md).

The server is the standard library's ``ThreadingHTTPServer`` on 127.0.0.1 by default (``--host``
to serve elsewhere: the page shows learner ids, losses and store paths to whoever can reach it).
``/api/state`` carries its format name and version in the body and a SHA-256 of the body in the
standard ``Digest`` header. Event logs: ``--events DIR`` (the ``*.jsonl`` files of the syncer,
learners and launcher), by default ``OUT/logs`` beside a local store ``OUT/store`` - where
``ddiloco run`` and ``workers.cluster.LocalCluster`` write them.
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import TextIO

from workers.tools.dashboard_state import RunView, ViewConfig

DEFAULT_PORT = 8470
PAGE = "dashboard.html"
# The page needs nothing but itself and /api/state: no other origin, no framing.
CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
       "img-src 'self' data:; frame-ancestors 'none'")


def default_events_dir(uri: str) -> Path | None:
    """``OUT/logs`` for a local store at ``OUT/store`` (None for S3). It may not exist yet: a
    dashboard started before ``ddiloco run`` shows the learners once their logs appear."""
    local = uri[len("file://"):] if uri.startswith("file://") else None if "://" in uri else uri
    if local is None:
        return None
    return Path(local).expanduser().resolve().parent / "logs"


def page_bytes() -> bytes:
    """The static page, shipped as package data (setup.cfg ``package_data``)."""
    return resources.files("workers.tools").joinpath(PAGE).read_bytes()


def state_body(state: dict) -> tuple[bytes, str]:
    """The JSON body of ``/api/state`` and its ``Digest`` header value (RFC 3230, SHA-256)."""
    body = json.dumps(state, separators=(",", ":"), allow_nan=False, default=str).encode()
    return body, "sha-256=" + base64.b64encode(hashlib.sha256(body).digest()).decode()


class DashboardServer:
    """The HTTP server of one ``RunView``: ``/`` the page, ``/api/state`` the state. ``port`` 0
    takes a free port (``url`` tells which). ``start`` serves on a daemon thread; ``close`` stops."""

    def __init__(self, view: RunView, host: str = "127.0.0.1", port: int = DEFAULT_PORT, page: bytes | None = None):
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in 0..65535, got {port!r}")
        self.view, self.page = view, page if page is not None else page_bytes()
        self.httpd = ThreadingHTTPServer((host, port), self._handler())
        self.httpd.daemon_threads = True
        self.host, self.port = host, self.httpd.server_address[1]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "ddiloco-dashboard"

            def do_GET(self) -> None:   # noqa: N802 - the http.server API
                path = self.path.split("?", 1)[0]
                if path in ("/", "/index.html"):
                    self._send(200, "text/html; charset=utf-8", server.page, {"Content-Security-Policy": CSP})
                elif path == "/api/state":
                    try:
                        body, digest = state_body(server.view.state())
                    except Exception as exc:   # noqa: BLE001 - a broken view answers 500, the server lives on
                        self._send(500, "text/plain; charset=utf-8", f"state failed: {exc}".encode())
                        return
                    self._send(200, "application/json", body, {"Digest": digest})
                else:
                    self._send(404, "text/plain; charset=utf-8", b"not found: / and /api/state only\n")

            def _send(self, code: int, ctype: str, body: bytes, headers: dict | None = None) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.send_header("X-Content-Type-Options", "nosniff")
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt: str, *args) -> None:   # quiet: a page polls every second
                pass

        return Handler

    def start(self) -> "DashboardServer":
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="dashboard", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def close(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join(timeout=5)
        self.httpd.server_close()


def configure(parser: argparse.ArgumentParser):
    """Serve a live dashboard of a running or finished run (learners, fragments, syncer, loss) on loopback."""
    parser.add_argument("run_uri", metavar="RUN_URI", help="the run: a directory, file:///path or s3://bucket/prefix")
    parser.add_argument("--events", default=None, metavar="DIR",
                        help="directory of the run's JSONL event logs (default: OUT/logs beside a local OUT/store)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1: this host only)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: any free)")
    parser.add_argument("--s3-endpoint", default=None, help="S3 endpoint URL (default: AWS_ENDPOINT_URL or AWS)")
    parser.add_argument("--refresh", type=float, default=ViewConfig.refresh_s, metavar="S",
                        help="read the store and the logs at most once per S seconds")
    parser.add_argument("--silent-after", type=float, default=ViewConfig.silent_s, metavar="S",
                        help="a learner with no event for S seconds is shown as silent, not alive")
    parser.add_argument("--once", action="store_true", help="print the state JSON once and exit (no server)")
    return lambda args: dashboard_command(args, sys.stdout, sys.stderr)


def dashboard_command(args, out: TextIO, err: TextIO) -> int:
    try:
        cfg = ViewConfig(refresh_s=args.refresh, silent_s=args.silent_after)
        events = Path(args.events) if args.events else default_events_dir(args.run_uri)
        if args.events and not events.is_dir():
            raise ValueError(f"--events {events}: no such directory")
        view = RunView(args.run_uri, events, s3_endpoint=args.s3_endpoint, config=cfg)
        if args.once:
            print(json.dumps(view.state(), indent=2, default=str), file=out)
            return 0
        server = DashboardServer(view, args.host, args.port)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=err)
        return 2
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: serving on {args.host}: anyone who can reach it sees the run's state", file=err)
    where = (f"events from {events}" + ("" if events.is_dir() else ", once it exists") if events
             else "no event logs (--events DIR): the commit log only")
    print(f"dashboard of {args.run_uri} at {server.url} ({where}); Ctrl-C stops it", file=out, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.httpd.server_close()
    return 0
