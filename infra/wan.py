"""A userspace WAN shaper: a byte-transparent TCP proxy with delay, jitter, a bandwidth cap, loss
and partitions (no netem on these machines). docs/regions.md says what it models; the
link description (``LinkSpec``) and its parser live in infra/wan_link.py.

``WanProxy(target_host, target_port, up, down)`` listens on 127.0.0.1 only and forwards every
connection to the target; ``up`` shapes client -> target, ``down`` target -> client (one
``LinkSpec`` each, ``down`` defaults to ``up``). It copies bytes and never parses them, so S3
over HTTP and ZeroMQ (also CURVE-encrypted) pass through alike. Per direction:

- **pipelined delay**: each chunk read at time t is released at t + one-way delay (+ jitter), in
  stream order; many chunks are in flight at once, so a long link still carries its bandwidth
  (not one chunk per round trip). The proxy buffers at most ``LinkSpec.buffer_bytes`` per
  direction (default 2x the bandwidth-delay product, at least 1 MiB); beyond that it stops
  reading and TCP pushes back on the sender, as a full link does.
- **bandwidth cap**: a token bucket (rate ``bw`` bytes/s, ``burst`` bytes, default 0: a plain
  link of that rate) decides when a chunk has left; the delay is added after that. All
  connections through one proxy share its bucket (per direction), as flows share a link.
- **loss**: a lost 1448-byte segment does not lose bytes on TCP, it stalls the stream by one
  retransmission timeout (head-of-line blocking), so ``loss`` is a per-segment probability of
  such a stall (``stall``, default max(200 ms, 2 x delay + 4 x jitter), Linux's RTO floor).
  ``reset`` is a per-segment probability that the connection is reset instead (RST both ways).
- **connection setup** costs one round trip (up delay + down delay) before bytes flow, as a TCP
  handshake does; TLS handshakes are not modelled.
- **partition/heal**: ``partition("hold")`` (the default) stalls every byte in both directions
  and holds new connections unanswered until ``heal()``, then lets the held bytes flow (nothing
  is dropped or reordered: TCP retransmission delivers them after a real partition shorter than
  its give-up time). ``partition("reset")`` resets every open connection and accepts-then-resets
  new ones until ``heal()`` (a broken path that the peers notice at once).

The proxy runs its own asyncio loop in a daemon thread: ``port = proxy.start()``, then
``partition()``, ``heal()``, ``stats()``, ``stop()`` from any thread. Randomness (jitter, loss,
resets) comes from one ``random.Random`` (``rng=`` or ``seed=``), so a run is reproducible up to
the chunk boundaries that TCP happens to deliver.
"""
from __future__ import annotations

import asyncio
import math
import random
import socket
import struct
import threading
from dataclasses import dataclass, fields

from .wan_link import (MAX_CHUNK, MIN_BUFFER, MIN_RTO_S, MSS, UNSHAPED_BUFFER,  # noqa: F401 (re-exported)
                       LinkSpec, as_spec)

HOST = "127.0.0.1"
PARTITION_MODES = ("hold", "reset")


# -- the schedule of one direction (pure: no sockets, no clock) -----------------------------------

@dataclass(frozen=True)
class Release:
    """When a chunk may be delivered, and what the loss model did to it."""

    at: float              # loop time
    stalled: bool = False
    reset: bool = False


class TokenBucket:
    """The bandwidth cap of one direction of a link, shared by every connection on it.

    A token bucket written as GCRA: the "theoretical arrival time" ``tat`` advances by n/rate per
    chunk; a chunk departs once ``tat - burst/rate`` has passed (burst 0: when its last byte has
    been sent at the link's rate). Connections share it first come, first served, as packets
    share a bottleneck's queue."""

    def __init__(self, spec: LinkSpec) -> None:
        self.spec = spec
        self._tat = -math.inf

    def depart(self, size: int, now: float) -> float:
        """When a chunk of ``size`` bytes offered at ``now`` has left (``now`` if unlimited)."""
        rate = self.spec.bandwidth
        if rate is None:
            return now
        self._tat = max(self._tat, now) + size / rate
        return max(now, self._tat - self.spec.burst / rate)


class Schedule:
    """When each chunk of one direction of one connection is delivered.

    Departure from the (shared) token bucket, then delay and jitter, then the loss model's
    stall. Releases never go backwards in time, because TCP delivers in order (a late chunk
    holds up those behind it)."""

    def __init__(self, spec: LinkSpec, rng: random.Random, bucket: TokenBucket | None = None) -> None:
        self.spec = spec
        self.rng = rng
        self.bucket = bucket if bucket is not None else TokenBucket(spec)
        self._last = -math.inf

    def next(self, size: int, now: float) -> Release:
        spec = self.spec
        delay = spec.delay_s
        if spec.jitter_s:
            delay = max(0.0, delay + self.rng.uniform(-spec.jitter_s, spec.jitter_s))
        at = self.bucket.depart(size, now) + delay
        segments = max(1, math.ceil(size / MSS))
        stalled = spec.loss > 0 and self._hit(spec.loss, segments)
        if stalled:
            at += spec.stall_seconds
        reset = spec.reset > 0 and self._hit(spec.reset, segments)
        at = max(at, self._last)
        self._last = at
        return Release(at=at, stalled=stalled, reset=reset)

    def _hit(self, p: float, segments: int) -> bool:
        """Whether any of ``segments`` independent segments is hit with probability ``p``."""
        return self.rng.random() < 1.0 - (1.0 - p) ** segments


# -- the proxy --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class WanStats:
    """Counters since ``start()`` (a snapshot)."""

    connections: int = 0    # forwarded to the target
    refused: int = 0        # target unreachable, or turned away by a partition in "reset" mode
    resets: int = 0         # connections reset by the loss model or a "reset" partition
    stalls: int = 0         # chunks held back one retransmission timeout by the loss model
    bytes_up: int = 0       # released towards the target (client -> target)
    bytes_down: int = 0     # released towards the client (target -> client)
    open: int = 0           # connections open now


class _Reset(Exception):
    """The loss model reset this connection."""


class WanProxy:
    """A shaped TCP proxy from 127.0.0.1:``listen_port`` (0: any free port) to the target."""

    def __init__(self, target_host: str, target_port: int, up: LinkSpec | str = "rtt=0ms",
                 down: LinkSpec | str | None = None, *, listen_port: int = 0, rng: random.Random | None = None,
                 seed: int = 0, connect_timeout_s: float = 5.0, name: str = "wan") -> None:
        if not isinstance(target_host, str) or not target_host:
            raise ValueError(f"target_host must be a non-empty host name, got {target_host!r}")
        for what, port, low in (("target_port", target_port, 1), ("listen_port", listen_port, 0)):
            if isinstance(port, bool) or not isinstance(port, int) or not low <= port <= 65535:
                raise ValueError(f"{what} must be an int in {low}..65535, got {port!r}")
        if not (isinstance(connect_timeout_s, (int, float)) and connect_timeout_s > 0):
            raise ValueError(f"connect_timeout_s must be a positive number, got {connect_timeout_s!r}")
        self.target = (target_host, target_port)
        self.up = as_spec(up)
        self.down = self.up if down is None else as_spec(down)
        # One bucket per direction for all connections: they share the link's bandwidth.
        self._up_bucket, self._down_bucket = TokenBucket(self.up), TokenBucket(self.down)
        self.name = name
        self.port = 0
        self._listen_port = listen_port
        self._connect_timeout_s = float(connect_timeout_s)
        self._rng = rng if rng is not None else random.Random(seed)
        self._lock = threading.Lock()
        self._counts = {f.name: 0 for f in fields(WanStats) if f.name != "open"}
        self._mode: str | None = None       # None: healed; else the partition mode
        self._conns: set[_Connection] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None
        self._gate: asyncio.Event | None = None   # set while healed
        self._tasks: set[asyncio.Task] = set()
        self._stopping = False

    # -- public (any thread) -------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """``127.0.0.1:PORT`` once started (prefix ``http://`` or ``tcp://`` as the client needs)."""
        return f"{HOST}:{self.port}"

    @property
    def partitioned(self) -> bool:
        return self._mode is not None

    def start(self) -> int:
        """Listen and serve in a background thread; returns the bound port."""
        if self._thread is not None:
            raise RuntimeError(f"{self.name}: already started")
        ready = threading.Event()
        failure: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, args=(ready, failure), name=f"{self.name}-loop",
                                        daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self._thread.join()
            raise failure[0]
        return self.port

    def stop(self) -> None:
        """Close the listener and every connection (RST), then end the thread. Idempotent."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)

    def partition(self, mode: str = "hold") -> None:
        """Cut the link (see the module docstring for ``hold`` and ``reset``); returns once in effect."""
        if mode not in PARTITION_MODES:
            raise ValueError(f"partition mode must be one of {PARTITION_MODES}, got {mode!r}")
        self._call(self._set_partition, mode)

    def heal(self) -> None:
        """Restore the link: held bytes and held connections proceed."""
        self._call(self._set_partition, None)

    def stats(self) -> WanStats:
        with self._lock:
            return WanStats(open=len(self._conns), **self._counts)

    def __enter__(self) -> "WanProxy":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the loop thread -------------------------------------------------------------------------

    def _call(self, fn, *args) -> None:
        if self._loop is None or self._thread is None or not self._thread.is_alive():
            raise RuntimeError(f"{self.name}: not running (call start() first)")

        async def apply() -> None:
            fn(*args)
        asyncio.run_coroutine_threadsafe(apply(), self._loop).result(timeout=10)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def _run(self, ready: threading.Event, failure: list[BaseException]) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._listen())
        except BaseException as exc:   # e.g. the port is taken: start() re-raises it
            failure.append(exc)
            loop.close()
            ready.set()
            return
        ready.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _listen(self) -> None:
        self._gate = asyncio.Event()
        self._gate.set()
        self._server = await asyncio.start_server(self._serve, HOST, self._listen_port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _shutdown(self) -> None:
        # Turn connections away (in _serve) for a moment before closing the listener: in Python
        # 3.11 a connection accepted just before Server.close() never reaches _serve and its socket
        # stays open, unanswered, until garbage collection. Those still queued get an RST on close.
        self._stopping = True
        await asyncio.sleep(0.05)
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns):
            conn.abort()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _ in range(3):      # aborted transports close their sockets (send the RST) one iteration later
            await asyncio.sleep(0)

    def _set_partition(self, mode: str | None) -> None:
        assert self._gate is not None
        self._mode = mode
        if mode is None:
            self._gate.set()
            return
        self._gate.clear()
        if mode == "reset":
            for conn in list(self._conns):
                conn.abort()
                self._count("resets")

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None and self._gate is not None
        self._tasks.add(task)
        try:
            if self._stopping or self._mode == "reset":
                _abort(client_w)
                self._count("refused")
                return
            await self._gate.wait()            # a "hold" partition holds new connections too
            try:
                target_r, target_w = await asyncio.wait_for(asyncio.open_connection(*self.target),
                                                            self._connect_timeout_s)
            except (OSError, asyncio.TimeoutError):
                _abort(client_w)
                self._count("refused")
                return
            # A real TCP handshake costs one round trip before the first byte can follow it.
            await asyncio.sleep(self.up.delay_s + self.down.delay_s)
            conn = _Connection(self, client_r, client_w, target_r, target_w)
            self._conns.add(conn)
            self._count("connections")
            try:
                await conn.run()
            finally:
                self._conns.discard(conn)
        except asyncio.CancelledError:
            # stop(): end quietly (a cancelled connection callback makes asyncio's streams log noise)
            _abort(client_w)
        finally:
            self._tasks.discard(task)


class _Connection:
    """One proxied connection: two shaped directions, torn down together on a reset or an error."""

    def __init__(self, proxy: WanProxy, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter,
                 target_r: asyncio.StreamReader, target_w: asyncio.StreamWriter) -> None:
        self.proxy = proxy
        self.writers = (client_w, target_w)
        self.directions = ((client_r, target_w, Schedule(proxy.up, proxy._rng, proxy._up_bucket), "bytes_up"),
                           (target_r, client_w, Schedule(proxy.down, proxy._rng, proxy._down_bucket), "bytes_down"))

    async def run(self) -> None:
        pumps = [asyncio.create_task(self._pump(*d)) for d in self.directions]
        try:
            done, pending = await asyncio.wait(pumps, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for pump in pumps:
                pump.cancel()
        errors = [t.exception() for t in done if not t.cancelled() and t.exception() is not None]
        if any(isinstance(e, _Reset) for e in errors):
            self.proxy._count("resets")
        if errors or pending:      # one direction broke: the connection goes down as a whole
            self.abort()
            await asyncio.gather(*pending, return_exceptions=True)
        else:
            for writer in self.writers:
                writer.close()

    def abort(self) -> None:
        for writer in self.writers:
            _abort(writer)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, schedule: Schedule,
                    counter: str) -> None:
        """Read chunks as fast as the buffer allows and release each at its scheduled time."""
        loop = asyncio.get_running_loop()
        spec = schedule.spec
        queue: asyncio.Queue[tuple[Release, bytes] | Exception | None] = asyncio.Queue()
        state = {"buffered": 0}
        space = asyncio.Event()

        async def read() -> None:
            try:
                while True:
                    while state["buffered"] >= spec.buffer_bytes:   # the link is full: TCP pushes back
                        space.clear()
                        await space.wait()
                    data = await src.read(spec.read_size)
                    if not data:
                        queue.put_nowait(None)
                        return
                    release = schedule.next(len(data), loop.time())
                    if release.stalled:
                        self.proxy._count("stalls")
                    state["buffered"] += len(data)
                    queue.put_nowait((release, data))
            except OSError as exc:        # the sender reset: pass it on after the bytes before it
                queue.put_nowait(exc)

        reader = asyncio.create_task(read())
        try:
            while True:
                item = await queue.get()
                if item is None:
                    if dst.can_write_eof():
                        dst.write_eof()            # half-close, after every byte before it
                    await reader
                    return
                if isinstance(item, Exception):
                    raise item
                release, data = item
                wait = release.at - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                await self.proxy._gate.wait()      # a "hold" partition stalls the bytes here
                if release.reset:
                    raise _Reset()
                self.proxy._count(counter, len(data))   # before the write: a peer never sees uncounted bytes
                dst.write(data)
                await dst.drain()
                state["buffered"] -= len(data)
                space.set()
        finally:
            reader.cancel()


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with RST (linger 0), so that the peer sees a reset, not an orderly end."""
    sock = writer.get_extra_info("socket")
    try:
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    writer.transport.abort()
