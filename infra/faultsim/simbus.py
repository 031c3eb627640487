"""The ZeroMQ bus on simulated time (docs/faultsim.md "The bus").

A :class:`SimNet` is one run's network: the syncer's ROUTER + PUB (:class:`SimSyncerBus`), each
learner's DEALER (:class:`SimLink`) and SUB (:class:`SimListener`), built through
``workers.bus.bus.Transport`` with the ZeroMQ classes' constructor signatures, so the real sender,
ingest and receiver run unchanged on them. Messages go through the real wire format
(``encode_message`` / ``decode_message``) and arrive ``latency_s`` after they were sent, on the
receiving side's simulated clock.

What ZeroMQ does that matters here, and is kept:

* a DEALER's send fails at once (``False``) while no live syncer is bound (``ZMQ_IMMEDIATE``: it
  does not queue for a peer that is not connected), so the sender spills;
* the ROUTER routes an ack to the newest link of an identity (``ROUTER_HANDOVER``), and drops one
  for an identity that has none (``ROUTER_MANDATORY`` off);
* PUB reaches the listeners connected when it sends; nobody else hears it;
* a SIGSTOPped process keeps its connections: what is sent to it waits until it runs again; a
  killed one's sockets are gone (messages to it vanish, a DEALER's sends fail);
* a **blackhole** (the chaos proxy that drops every packet while connections stay up): sends
  succeed and nothing arrives, either way.

Each endpoint belongs to the simulated process whose thread built it; a message to it wakes the
thread that reads it (``SimNet.on_message``: the actors schedule that thread's turn), as a socket's
poll would.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

from pipeline.errors import FormatError
from workers.bus.bus import (HEAD_MAX_BYTES, BusConfig, BusCounters, Message, Transport, decode_message,
                             drain_wake, encode_message)

from .clock import Proc, Sim

LATENCY_S = 0.005      # one way, any message (a LAN round trip is ~0.1-1 ms; a region's link more)


class _Queue:
    """Messages to one endpoint, in arrival order: (arrives at, sender identity, frames)."""

    def __init__(self, sim: Sim, proc: Proc | None, kind: str, net: "SimNet"):
        self.sim, self.proc, self.kind, self.net = sim, proc, kind, net
        self.items: deque = deque()
        self.closed = False

    @property
    def live(self) -> bool:
        return not self.closed and (self.proc is None or self.proc.alive)

    def put(self, at: float, ident: bytes, frames: list[bytes]) -> None:
        if not self.live:
            return
        self.items.append((at, ident, frames))
        self.net.wake(self.proc, self.kind, at)

    def take(self) -> tuple[bytes, list[bytes]] | None:
        if self.items and self.items[0][0] <= self.sim.clock():
            _, ident, frames = self.items.popleft()
            return ident, frames
        return None


class SimNet:
    """One run's bus (module docstring). ``blackholes``: (start, end) windows of simulated time."""

    def __init__(self, sim: Sim, latency_s: float = LATENCY_S):
        if not (isinstance(latency_s, (int, float)) and 0 <= latency_s < 1):
            raise ValueError(f"latency_s must be a number of seconds in [0, 1), got {latency_s!r}")
        self.sim, self.latency_s = sim, float(latency_s)
        self.blackholes: list[tuple[float, float]] = []
        self.router: _Queue | None = None            # the bound syncer's ingest
        self.links: dict[bytes, _Queue] = {}         # identity -> its newest DEALER's inbound queue
        self.subs: list[_Queue] = []
        self._wakers: dict[tuple[int, str], Callable[[float], None]] = {}
        self.sent = self.delivered = self.dropped = 0
        self.transport = Transport(syncer=self._syncer, learner=self._learner, listener=self._listener)

    # -- the harness's side ------------------------------------------------------------------------
    def on_message(self, proc: Proc, kind: str, wake: Callable[[float], None]) -> None:
        """Call ``wake(t)`` when a message for ``proc``'s ``kind`` endpoint ("syncer", "sender",
        "receiver") arrives at ``t``: the actor turns the thread that reads it then."""
        self._wakers[(id(proc), kind)] = wake

    def wake(self, proc: Proc | None, kind: str, at: float) -> None:
        fn = self._wakers.get((id(proc), kind)) if proc is not None else None
        if fn is not None:
            fn(at)

    def blackholed(self, now: float) -> bool:
        return any(a <= now < b for a, b in self.blackholes)

    def _send(self, to: _Queue | None, ident: bytes, frames: list[bytes]) -> None:
        now = self.sim.clock()
        self.sent += 1
        if to is None or not to.live or self.blackholed(now):
            self.dropped += 1
            return
        self.delivered += 1
        to.put(now + self.latency_s, ident, frames)

    def _owner(self) -> Proc | None:
        return self.sim.current.proc if self.sim.current is not None else None

    # -- the endpoints, as Transport builds them ---------------------------------------------------
    def _syncer(self, cfg: BusConfig, curve=None, authorize=None, denied=None) -> "SimSyncerBus":
        if curve is not None:
            raise ValueError("the simulated bus has no CURVE: simulate unsigned runs")
        return SimSyncerBus(self, cfg)

    def _learner(self, cfg: BusConfig, identity: bytes, curve=None, wake_fd: int | None = None) -> "SimLink":
        return SimLink(self, cfg, identity, wake_fd)

    def _listener(self, cfg: BusConfig, curve=None) -> "SimListener":
        return SimListener(self, cfg)


def _learner_side(queue: _Queue, counters: BusCounters) -> Message | None:
    """The next due message of a learner-side endpoint, counted; None if none is due or it does not
    decode (as ``workers.bus.bus._receive``: a learner never stops on a bad message)."""
    got = queue.take()
    if got is None:
        return None
    frames = got[1]
    counters.received(frames)
    try:
        return decode_message(frames, HEAD_MAX_BYTES)
    except FormatError:
        return None


class SimSyncerBus:
    """The syncer's ROUTER (ingest) and PUB (announce): ``workers.bus.bus.SyncerBus``'s interface."""

    def __init__(self, net: SimNet, cfg: BusConfig):
        self.net, self.cfg = net, cfg
        self.counters = cfg.counters if cfg.counters is not None else BusCounters()
        self.ingest_endpoint, self.announce_endpoint = cfg.ingest, cfg.announce
        self.inbox = _Queue(net.sim, net._owner(), "syncer", net)
        net.router = self.inbox                     # a new syncer binds the endpoint; the old one is gone

    def recv(self, timeout_s: float) -> tuple[bytes, Message | FormatError] | None:
        got = self.inbox.take()
        if got is None:
            return None
        ident, frames = got
        self.counters.received(frames)
        try:
            return ident, decode_message(frames, self.cfg.max_message_bytes)
        except FormatError as exc:
            return ident, exc

    def send_to(self, ident: bytes, msg: Message) -> None:
        frames = encode_message(msg)
        self.counters.sent(frames)
        self.net._send(self.net.links.get(ident), b"", frames)

    def announce(self, msg: Message) -> None:
        frames = encode_message(msg)
        self.counters.sent(frames)
        for sub in [s for s in self.net.subs if s.live]:
            self.net._send(sub, b"", frames)
        self.net.subs = [s for s in self.net.subs if s.live]

    def close(self) -> None:
        self.inbox.closed = True
        if self.net.router is self.inbox:
            self.net.router = None


class SimLink:
    """A learner's DEALER to the syncer: ``workers.bus.bus.LearnerLink``'s interface."""

    def __init__(self, net: SimNet, cfg: BusConfig, identity: bytes, wake_fd: int | None):
        self.net, self.cfg, self.identity, self.wake_fd = net, cfg, identity, wake_fd
        self.counters = cfg.counters if cfg.counters is not None else BusCounters()
        self.acks = _Queue(net.sim, net._owner(), "sender", net)
        net.links[identity] = self.acks             # ROUTER_HANDOVER: the newest connection has the id

    def send(self, msg: Message) -> bool:
        router = self.net.router
        if router is None or not router.live:
            return False                            # ZMQ_IMMEDIATE: no connected syncer, nothing queued
        frames = encode_message(msg)
        self.counters.sent(frames)
        self.net._send(router, self.identity, frames)
        return True

    def recv(self, timeout_s: float) -> Message | None:
        if self.wake_fd is not None:
            drain_wake(self.wake_fd)                # the submit() wake-up pipe: nothing waits on it here
        return _learner_side(self.acks, self.counters)

    def close(self, linger_s: float = 0.0) -> None:
        self.acks.closed = True               # what it sent is in flight already: no linger to model
        if self.net.links.get(self.identity) is self.acks:
            del self.net.links[self.identity]


class SimListener:
    """A learner's SUB to the announcements: ``workers.bus.bus.AnnounceListener``'s interface."""

    def __init__(self, net: SimNet, cfg: BusConfig):
        self.net = net
        self.counters = cfg.counters if cfg.counters is not None else BusCounters()
        self.queue = _Queue(net.sim, net._owner(), "receiver", net)
        net.subs.append(self.queue)

    def recv(self, timeout_s: float) -> Message | None:
        return _learner_side(self.queue, self.counters)

    def close(self) -> None:
        self.queue.closed = True
