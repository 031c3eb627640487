"""A TCP relay between learners and the syncer's sockets that can be blackholed (chaos, SPEC §7).

Learners connect to the relay's port; the relay connects to the syncer and copies bytes both
ways. It works at the byte level, so the CURVE handshake and the encrypted ZeroMQ stream pass
through untouched (the relay never sees a key or a message).

``blackhole()`` stops every byte in both directions and holds new connections unanswered, the way
a network partition does: ZeroMQ connections stay open, the learners' sends fill the TCP buffers
and their high-water marks, acks stop arriving, and the learners spill to storage. ``restore()``
lets the held bytes flow again (nothing is dropped or reordered: TCP retransmission would deliver
them after a real partition too), so the syncer also sees late copies of deltas it already got
through the inbox. ``retarget(port)`` points new connections at another syncer (a second syncer
that takes over), while existing ones end when their upstream closes.

One thread accepts; each connection has two copying threads. A thread copies a chunk only while
the gate is open, so at most one in-flight chunk per direction passes after ``blackhole()``.
"""
from __future__ import annotations

import socket
import threading
from dataclasses import dataclass

HOST = "127.0.0.1"
CHUNK = 64 << 10


@dataclass
class RelayStats:
    connections: int = 0
    refused: int = 0           # upstream not listening (syncer down): the client is closed
    bytes_up: int = 0          # learner -> syncer
    bytes_down: int = 0        # syncer -> learner


class Relay:
    """Listen on ``HOST:listen_port`` (0: any free port) and relay to ``HOST:target_port``."""

    def __init__(self, target_port: int, listen_port: int = 0, name: str = "relay"):
        if not 0 < target_port < 65536:
            raise ValueError(f"target port must be in 1..65535, got {target_port}")
        self.name = name
        self.target_port = target_port
        self.stats = RelayStats()
        self._open = threading.Event()
        self._open.set()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((HOST, listen_port))
        self._listener.listen(64)
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept_loop, name=f"{name}-accept", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"tcp://{HOST}:{self.port}"

    @property
    def blackholed(self) -> bool:
        return not self._open.is_set()

    def start(self) -> "Relay":
        self._thread.start()
        return self

    def blackhole(self) -> None:
        self._open.clear()

    def restore(self) -> None:
        self._open.set()

    def retarget(self, target_port: int) -> None:
        """New connections go to ``target_port``; existing ones are cut so that clients reconnect."""
        self.target_port = target_port
        self._cut_all()

    def stop(self) -> None:
        self._stop.set()
        self._open.set()
        self._cut_all()
        try:
            self._listener.close()
        except OSError:
            pass
        if self._thread.is_alive():
            self._thread.join(timeout=2)

    # -- internals -------------------------------------------------------------------------------
    def _cut_all(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            _close(s)

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            threading.Thread(target=self._connect, args=(client,), name=f"{self.name}-conn", daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        # A partition also holds new connections: wait for the gate before reaching the syncer.
        while not self._open.wait(0.2):
            if self._stop.is_set():
                _close(client)
                return
        try:
            upstream = socket.create_connection((HOST, self.target_port), timeout=2.0)
        except OSError:
            self.stats.refused += 1
            _close(client)
            return
        upstream.settimeout(None)
        client.settimeout(None)
        with self._lock:
            self._conns += [client, upstream]
        self.stats.connections += 1
        threading.Thread(target=self._pipe, args=(client, upstream, "up"), daemon=True).start()
        threading.Thread(target=self._pipe, args=(upstream, client, "down"), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        try:
            while not self._stop.is_set():
                data = src.recv(CHUNK)
                if not data:
                    break
                while not self._open.wait(0.2):     # blackholed: hold the bytes, as a partition does
                    if self._stop.is_set():
                        return
                dst.sendall(data)
                if direction == "up":
                    self.stats.bytes_up += len(data)
                else:
                    self.stats.bytes_down += len(data)
        except OSError:
            pass
        finally:
            _close(src)
            _close(dst)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass
