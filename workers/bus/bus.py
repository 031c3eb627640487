"""The ZeroMQ fast path between learners and the syncer (docs/protocol.md, SPEC §7).

Two sockets: *ingest* (syncer ROUTER <- learner DEALER: hello, delta, heartbeat up; ack down) and
*announce* (syncer PUB -> learner SUB: round, version, syncer-heartbeat). Every message is multipart:
frame 0 a sealed ``bus`` record, frame 1 an optional blob. Receivers enforce a byte limit through
``ZMQ_MAXMSGSIZE`` (libzmq drops the message before allocating it) and again when decoding.
Nothing here is needed for correctness: storage is the truth, the bus only makes things faster.
Sockets are not thread-safe: each socket object belongs to exactly one thread.

Security (docs/security.md): with ``CurveKeys`` every socket uses CURVE
(encryption + authentication). The syncer's sockets are CURVE servers and run a ZAP authenticator
(``zmq.auth.thread.ThreadAuthenticator``) that admits only client keys the ``authorize`` callback
maps to a learner id; libzmq then stamps each message with that id (``User-Id``), which becomes
``Message.peer``. Learners pin the syncer's public key. Learner-side sockets only ever receive
small records, so their size limit is the head limit.

Accounting (docs/regions.md "Request and byte accounting"): every socket adds the
messages and frame bytes it sends and receives to ``BusConfig.counters`` (a ``BusCounters``; a
private one when None), so a process can report its bus traffic per link.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from pipeline.envelope import pack_record, unpack_record
from pipeline.errors import FormatError

BUS_KIND = "bus"
# Each version names its message types, and a reader refuses a type the message's version lacks
# (issue 26: syncer-driven rounds, 488cdb7, added "round" while the version stayed 1). v1: every
# type v1 writers sent, "round" included, so peers of those versions are still read; v2: the same
# set, the first version whose types are fixed by its number - a new type is a new version.
BUS_VERSION = 2
_TYPES = ("hello", "heartbeat", "delta", "ack", "version", "syncer-heartbeat", "round")
TYPES_BY_VERSION = {1: _TYPES, 2: _TYPES}
MESSAGE_TYPES = TYPES_BY_VERSION[BUS_VERSION]
HEAD_MAX_BYTES = 64 << 10   # frame 0 is a small record; anything bigger is hostile or broken


@dataclass(frozen=True)
class Message:
    type: str
    fields: dict[str, Any] = field(default_factory=dict)
    blob: bytes | None = None
    peer: str | None = None        # the authenticated sender (CURVE + ZAP), None without CURVE

    def __post_init__(self) -> None:
        if self.type not in MESSAGE_TYPES:
            raise ValueError(f"unknown bus message type {self.type!r}")


def encode_message(msg: Message) -> list[bytes]:
    head = pack_record(BUS_KIND, BUS_VERSION, {"type": msg.type, **msg.fields})
    return [head] if msg.blob is None else [head, msg.blob]


def decode_message(frames: list[bytes], max_blob_bytes: int, peer: str | None = None) -> Message:
    """Frames -> Message, or FormatError naming what is wrong (size, structure, type)."""
    if not 1 <= len(frames) <= 2:
        raise FormatError(f"bus message: {len(frames)} frames (expected 1 or 2)")
    if len(frames[0]) > HEAD_MAX_BYTES:
        raise FormatError(f"bus message: head of {len(frames[0])} bytes exceeds {HEAD_MAX_BYTES}")
    version, d = unpack_record(frames[0], BUS_KIND, tuple(TYPES_BY_VERSION), max_bytes=HEAD_MAX_BYTES,
                               what="bus message")
    mtype = d.pop("type", None)
    if mtype not in TYPES_BY_VERSION[version]:
        raise FormatError(f"bus message: unknown type {mtype!r} for bus version {version}")
    blob = None
    if len(frames) == 2:
        blob = bytes(frames[1])
        if len(blob) > max_blob_bytes:
            raise FormatError(f"bus message: blob of {len(blob)} bytes exceeds {max_blob_bytes}")
    return Message(mtype, d, blob, peer)


@dataclass(frozen=True)
class CurveKeys:
    """CURVE key material (z85 text). ``server_public`` is what clients pin. The secret never
    appears in repr."""

    public: bytes
    secret: bytes = field(repr=False)
    server_public: bytes | None = None


class BusCounters:
    """Messages and payload bytes (every frame a peer receives; not the ROUTER's local routing id,
    nor ZMTP framing, CURVE's 16-byte boxes or TCP overhead) this process's bus sockets sent and
    received. Thread-safe: a learner's sender and receiver threads add to one object."""

    FIELDS = ("sent_msgs", "sent_bytes", "recv_msgs", "recv_bytes")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(self.FIELDS, 0)

    def sent(self, frames: list) -> None:
        self._add("sent", frames)

    def received(self, frames: list) -> None:
        self._add("recv", frames)

    def _add(self, way: str, frames: list) -> None:
        n = sum(len(f) for f in frames)
        with self._lock:
            self._counts[f"{way}_msgs"] += 1
            self._counts[f"{way}_bytes"] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


@dataclass(frozen=True)
class BusConfig:
    """Endpoints and limits. ``max_message_bytes`` bounds every received message."""

    ingest: str                       # tcp://host:port the syncer ROUTER binds / learners connect
    announce: str                     # tcp://host:port the syncer PUB binds / learners connect
    max_message_bytes: int = 64 << 20
    send_hwm: int = 64
    linger_ms: int = 0
    # Where the sockets made from this config count their traffic (None: each socket its own).
    counters: BusCounters | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("ingest", "announce"):
            ep = getattr(self, name)
            if not isinstance(ep, str) or not ep.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"bus {name} endpoint {ep!r} must start with tcp://, ipc:// or inproc://")
        if self.max_message_bytes < HEAD_MAX_BYTES:
            raise ValueError(f"max_message_bytes {self.max_message_bytes} is below {HEAD_MAX_BYTES}")


def _limit(sock: zmq.Socket, cfg: BusConfig, max_bytes: int | None = None) -> None:
    # libzmq reads a frame's size before allocating it and drops the connection past this limit.
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes if max_bytes is not None else cfg.max_message_bytes + HEAD_MAX_BYTES)
    sock.setsockopt(zmq.LINGER, cfg.linger_ms)
    sock.setsockopt(zmq.SNDHWM, cfg.send_hwm)
    sock.setsockopt(zmq.RCVHWM, cfg.send_hwm * 4)


def _curve_server(sock: zmq.Socket, keys: CurveKeys | None) -> None:
    if keys is not None:
        sock.curve_secretkey = keys.secret
        sock.curve_publickey = keys.public
        sock.curve_server = True


def _curve_client(sock: zmq.Socket, keys: CurveKeys | None) -> None:
    if keys is not None:
        if keys.server_public is None:
            raise ValueError("a CURVE client needs the server's public key")
        sock.curve_secretkey = keys.secret
        sock.curve_publickey = keys.public
        sock.curve_serverkey = keys.server_public


class _Zap(ThreadAuthenticator):
    """ZAP handler: a client key is admitted iff ``authorize`` names the learner that owns it,
    and that name becomes the User-Id libzmq attaches to the client's messages."""

    def __init__(self, ctx: zmq.Context, authorize: Callable[[str], str | None],
                 denied: Callable[[str], None] | None):
        super().__init__(ctx)
        self._ddl_authorize, self._ddl_denied = authorize, denied   # the base class owns _allowed/_denied

    def callback(self, domain: str, key: bytes) -> bool:
        ok = self._ddl_authorize(key.decode("ascii")) is not None
        if not ok and self._ddl_denied is not None:
            self._ddl_denied(key.decode("ascii"))
        return ok

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self._ddl_authorize(z85.encode(client_public_key).decode("ascii")) or ""


class SyncerBus:
    """The syncer's side: bind ROUTER (ingest) and PUB (announce). One thread uses it.

    With ``curve``, ``authorize(client_key_z85) -> learner id | None`` decides who may connect
    (required: a CURVE server without an allow list would accept any key); ``denied(key)`` hears
    every refused key. The bus then owns a private context, so its ZAP handler is its own."""

    def __init__(self, cfg: BusConfig, ctx: zmq.Context | None = None, curve: CurveKeys | None = None,
                 authorize: Callable[[str], str | None] | None = None, denied: Callable[[str], None] | None = None):
        self.cfg = cfg
        self.counters = cfg.counters if cfg.counters is not None else BusCounters()
        self.zap: _Zap | None = None
        self._own_ctx = curve is not None and ctx is None
        self.ctx = zmq.Context() if self._own_ctx else (ctx or zmq.Context.instance())
        if curve is not None:
            if authorize is None:
                raise ValueError("a CURVE syncer bus needs authorize(): the list of learner keys it accepts")
            self.zap = _Zap(self.ctx, authorize, denied)
            self.zap.start()
            self.zap.configure_curve_callback("*", credentials_provider=self.zap)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.pub = self.ctx.socket(zmq.PUB)
        for s in (self.router, self.pub):
            _limit(s, cfg)
            _curve_server(s, curve)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 0)  # an ack to a vanished learner is dropped, not an error
        # A learner that reconnects (a restart, or libzmq dropping an oversized message's connection)
        # comes back under the same routing id before the old connection is torn down: hand the id
        # over to the new connection, else its messages are taken but every ack goes nowhere. Who may
        # use an id is still decided by CURVE + ZAP, not by the id.
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.ingest_endpoint = _bind(self.router, cfg.ingest)
        self.announce_endpoint = _bind(self.pub, cfg.announce)
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)

    def recv(self, timeout_s: float) -> tuple[bytes, Message | FormatError] | None:
        """Next message as (routing id, message), or None after ``timeout_s``. A message that does
        not decode comes back as the FormatError saying why, so the caller can count and log it."""
        if not self.poller.poll(max(0, int(timeout_s * 1000))):
            return None
        frames = self.router.recv_multipart(copy=False)
        ident, body = frames[0].bytes, frames[1:]
        self.counters.received(body)       # frame 0 is the routing id libzmq adds here, not traffic
        peer = None
        if self.zap is not None:
            try:
                peer = body[0].get("User-Id") if body else None
            except zmq.ZMQError:
                peer = None
            if not peer:   # cannot happen with ZAP on; never treat an unnamed peer as anyone
                return ident, FormatError("bus message: no authenticated peer")
        try:
            return ident, decode_message([f.buffer for f in body], self.cfg.max_message_bytes, peer)
        except FormatError as exc:
            return ident, exc

    def send_to(self, ident: bytes, msg: Message) -> None:
        try:
            frames = encode_message(msg)
            self.router.send_multipart([ident, *frames], flags=zmq.NOBLOCK)
            self.counters.sent(frames)
        except zmq.Again:
            pass  # learner not reading: it will resend or spill; acks are optimisations

    def announce(self, msg: Message) -> None:
        try:
            frames = encode_message(msg)
            self.pub.send_multipart(frames, flags=zmq.NOBLOCK)
            self.counters.sent(frames)     # once, however many subscribers get a copy
        except zmq.Again:
            pass  # PUB drops past the high-water mark anyway; learners also poll storage

    def close(self) -> None:
        self.router.close(0)
        self.pub.close(0)
        if self.zap is not None:
            self.zap.stop()
        if self._own_ctx:
            self.ctx.destroy(linger=0)    # closes whatever is left, never blocks


class LearnerLink:
    """A learner's DEALER to the syncer's ingest socket. Used by the sender thread only."""

    def __init__(self, cfg: BusConfig, identity: bytes, ctx: zmq.Context | None = None,
                 curve: CurveKeys | None = None, wake_fd: int | None = None):
        self.cfg = cfg
        self.counters = cfg.counters if cfg.counters is not None else BusCounters()
        self.wake_fd = wake_fd      # a pipe the training thread writes to: recv() returns at once
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        _limit(self.sock, cfg, 2 * HEAD_MAX_BYTES)    # it only receives acks
        _curve_client(self.sock, curve)
        self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)   # do not queue for a syncer that is not connected
        self.sock.connect(cfg.ingest)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        if wake_fd is not None:
            self.poller.register(wake_fd, zmq.POLLIN)

    def send(self, msg: Message) -> bool:
        """Queue ``msg``; False when it would block (not connected or high-water mark)."""
        try:
            frames = encode_message(msg)
            self.sock.send_multipart(frames, flags=zmq.NOBLOCK)
            self.counters.sent(frames)
            return True
        except zmq.Again:
            return False

    def recv(self, timeout_s: float) -> Message | None:
        ready = dict(self.poller.poll(max(0, int(timeout_s * 1000))))
        if self.wake_fd is not None and self.wake_fd in ready:
            drain_wake(self.wake_fd)
        if self.sock not in ready:
            return None
        return _receive(self.sock, self.counters)

    def close(self, linger_s: float = 0.0) -> None:
        """``linger_s``: how long what was sent last may still go out (a leaving heartbeat)."""
        self.sock.close(int(linger_s * 1000))


class AnnounceListener:
    """A learner's SUB to the syncer's announcements. Used by the receiver thread only."""

    def __init__(self, cfg: BusConfig, ctx: zmq.Context | None = None, curve: CurveKeys | None = None):
        self.ctx = ctx or zmq.Context.instance()
        self.counters = cfg.counters if cfg.counters is not None else BusCounters()
        self.sock = self.ctx.socket(zmq.SUB)
        _limit(self.sock, cfg, 2 * HEAD_MAX_BYTES)    # it only receives announcements
        _curve_client(self.sock, curve)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(cfg.announce)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)

    def recv(self, timeout_s: float) -> Message | None:
        if not self.poller.poll(max(0, int(timeout_s * 1000))):
            return None
        return _receive(self.sock, self.counters)

    def close(self) -> None:
        self.sock.close(0)


@dataclass(frozen=True)
class Transport:
    """How the processes reach each other: what builds the syncer's bus, a learner's link and its
    announcement listener, each with the constructor signature of the ZeroMQ class it stands for.
    ``ZMQ`` (the default everywhere) is ZeroMQ; the fault simulation hands its own in-memory
    network on simulated time (infra/faultsim/simbus.py, issue 25: the bus's faults - blackhole,
    acks that never come, reordering - run there without forking the sender's or syncer's logic)."""

    syncer: Callable[..., SyncerBus] = SyncerBus
    learner: Callable[..., LearnerLink] = LearnerLink
    listener: Callable[..., AnnounceListener] = AnnounceListener


ZMQ = Transport()


def _receive(sock: zmq.Socket, counters: BusCounters) -> Message | None:
    """One ready message from a learner-side socket, counted; None if it is not a valid message
    (dropped: the syncer's side never sends one, and a learner must not stop on it)."""
    frames = sock.recv_multipart()
    counters.received(frames)
    try:
        return decode_message(frames, HEAD_MAX_BYTES)
    except FormatError:
        return None


def drain_wake(fd: int) -> None:
    """Empty a non-blocking wake-up pipe."""
    try:
        while os.read(fd, 4096):
            pass
    except (BlockingIOError, OSError):
        pass


def _bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind; a tcp endpoint with port 0 gets a free port. Returns the endpoint actually bound."""
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        host = endpoint[len("tcp://"):-2]
        port = sock.bind_to_random_port(f"tcp://{host}")
        return f"tcp://{host}:{port}"
    sock.bind(endpoint)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)
