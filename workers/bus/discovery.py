"""Finding the syncer through storage (issue 29): no hostname in a learner's job script.

A syncer started with ``--advertise HOST`` writes, once its bus is bound, where learners reach it
(``hints/syncer-endpoints``, storage/layout.py): its epoch, id, ingest and announce endpoints - a
wildcard bind (``tcp://0.0.0.0:5555``, ``tcp://*:0``) written with HOST and the port actually bound -
signed by the syncer's key in a signed run. A learner started with ``--discover``
(``DDILOCO_DISCOVER=1``) and no endpoints reads it at start and again every ``every_s`` from its
receiver thread (``BusTarget.refresh``); when a newer syncer epoch advertises other endpoints (a
restarted syncer on another host or port), its sender and receiver reconnect there at their next
turn. Until a syncer advertised, the learner works through storage alone, as with ``--no-bus``.

Record (docs/formats.md "Syncer endpoints"): envelope kind ``syncer-endpoints`` version 1, a msgpack
map ``{epoch, syncer, ingest, announce, wall, sig}``; ``sig``: hex Ed25519 signature (purpose
``endpoints``) over the canonical map without ``sig``, or None in an unsigned run. A record that
fails its checks, or an older epoch's, is ignored and reported; a learner never follows it.
"""
from __future__ import annotations

import socket
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable

from pipeline.descriptor import RunDescriptor
from pipeline.envelope import pack_record, unpack_record
from pipeline.errors import FormatError
from storage.errors import NotFound, StoreError
from storage.layout import ENDPOINTS_KEY
from storage.store import ObjectStore
from workers.bus.bus import BusConfig, BusCounters
from workers.bus.signing import Signer, canonical, verify_hex

ENDPOINTS_KIND, ENDPOINTS_VERSION = "syncer-endpoints", 1
WILDCARDS = ("0.0.0.0", "*", "", "[::]", "::")


@dataclass(frozen=True)
class Endpoints:
    epoch: int
    syncer: str
    ingest: str
    announce: str
    wall: float
    sig: str | None = None

    def body(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "sig"}


def advertised(endpoint: str, host: str) -> str:
    """``endpoint`` as others connect to it: a wildcard host replaced by ``host`` (default the FQDN)."""
    if not endpoint.startswith("tcp://") or ":" not in endpoint[len("tcp://"):]:
        return endpoint
    bound, port = endpoint[len("tcp://"):].rsplit(":", 1)
    return f"tcp://{(host or socket.getfqdn()) if bound in WILDCARDS else bound}:{port}"


def publish(store: ObjectStore, descriptor: RunDescriptor, epoch: int, syncer: str, ingest: str, announce: str,
            signer: Signer | None, wall: float) -> Endpoints:
    ep = Endpoints(epoch, syncer, ingest, announce, round(wall, 3))
    if signer is not None:
        ep = Endpoints(**ep.body(), sig=signer.sign("endpoints", descriptor.run_id, canonical(ep.body())).hex())
    store.put(ENDPOINTS_KEY, pack_record(ENDPOINTS_KIND, ENDPOINTS_VERSION, asdict(ep)))
    return ep


def read(store: ObjectStore, descriptor: RunDescriptor) -> Endpoints | None:
    """The advertised endpoints (None when no syncer advertised); ``FormatError`` for a record that
    is malformed or, in a signed run, not signed by the run's syncer."""
    try:
        blob = store.get(ENDPOINTS_KEY)
    except NotFound:
        return None
    what = f"{store.uri}/{ENDPOINTS_KEY}"
    _, rec = unpack_record(blob, ENDPOINTS_KIND, ENDPOINTS_VERSION, max_bytes=1 << 16, what=what)
    try:
        ep = Endpoints(int(rec["epoch"]), str(rec["syncer"]), str(rec["ingest"]), str(rec["announce"]),
                       float(rec["wall"]), rec.get("sig"))
    except (KeyError, TypeError, ValueError) as exc:
        raise FormatError(f"{what}: malformed endpoints record ({exc})") from None
    for e in (ep.ingest, ep.announce):
        if not e.startswith(("tcp://", "ipc://", "inproc://")):
            raise FormatError(f"{what}: {e!r} is not a ZeroMQ endpoint")
    sec = descriptor.security
    if sec is not None and not verify_hex(ep.sig, sec.syncer.sign, "endpoints", descriptor.run_id,
                                           canonical(ep.body())):
        raise FormatError(f"{what}: not signed by run {descriptor.run_id}'s syncer: ignored")
    return ep


class BusTarget:
    """A learner's view of where the syncer is, shared by its sender and receiver threads. Each
    change of endpoints bumps ``generation``; the threads reconnect when theirs is older."""

    def __init__(self, store: ObjectStore, descriptor: RunDescriptor, events, every_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        self.store, self.descriptor, self.events, self.every_s, self.clock = store, descriptor, events, every_s, clock
        self.counters = BusCounters()
        self.found: Endpoints | None = None
        self.config: BusConfig | None = None
        self.generation = 0
        self._next = 0.0
        self._lock = threading.Lock()
        self._failing = ""

    def refresh(self, force: bool = False) -> bool:
        """Re-read the record when due (or ``force``); True when the endpoints changed."""
        now = self.clock()
        if not force and now < self._next:
            return False
        self._next = now + self.every_s
        try:
            ep = read(self.store, self.descriptor)
        except (StoreError, FormatError) as exc:
            if str(exc) != self._failing:
                self.events.emit("syncer-discovery-failed", error=str(exc)[:300])
            self._failing = str(exc)
            return False
        self._failing = ""
        if ep is None:
            return False
        if self.found is not None:
            if ep.epoch < self.found.epoch:          # an older syncer's record: never followed
                return False
            if (ep.ingest, ep.announce) == (self.found.ingest, self.found.announce):
                self.found = ep                      # a restart on the same endpoints: nothing to move
                return False
        with self._lock:
            self.found = ep
            self.config = BusConfig(ep.ingest, ep.announce, counters=self.counters)
            self.generation += 1
        self.events.emit("syncer-found", epoch=ep.epoch, syncer=ep.syncer, ingest=ep.ingest, announce=ep.announce,
                         generation=self.generation)
        return True
