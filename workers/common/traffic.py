"""Traffic accounting in the event logs: ``accounting`` events, format 1 (issue 14; docs/regions.md
"Accounting events").

A ``TrafficMeter`` reads one process's counters - every store it uses (a
``storage.accounting.CountingStore``, named by the region the store is in) and its bus sockets
(``workers.bus.bus.BusCounters``, whose other end is the syncer, in the home region) - and writes
them into the process's event log as one ``accounting`` event. The counts are cumulative since the
meter started, so the last event of a life is that life's total and two consecutive events give
an interval; a process killed without a final event still leaves its last report.

When: a learner reports at the end of every outer step (every H = ``schedule.sync_every`` inner
steps, in which each fragment is synced once: SPEC §2) and when it closes; the syncer after every
P merge commits (one outer step of every fragment), at least every ``every_s`` seconds while it
commits, and when it stops. ``workers/tools/accounting.py`` sums them per region, link, learner
and outer step.

Event fields besides ``EventLog``'s (t, role, id, event):

- ``format``: 1; ``life``: the learner's incarnation or the syncer's epoch; ``final``: the last
  report of that life;
- ``region``, ``home``: the region the process runs in and the run's home region (both
  ``"home"`` in a run without regions);
- learners: ``step`` (inner steps done), ``outer_step`` (``step // H``); the syncer: ``commits``;
- ``elapsed_s``: seconds since the meter started (monotonic);
- ``stores``: region -> ``StoreCounters.as_dict()`` of the requests this process made to that
  region's store;
- ``bus``: ``{"peer": home, "sent_msgs", "sent_bytes", "recv_msgs", "recv_bytes"}`` or null (no bus).

A learner whose sender and receiver run in its sync agent (workers/learner/agent.py, issue 15)
counts the agent's store and bus too: the child process sends its counters with its ``stats``
frames and the meter adds them (``extra``) to the learner's own, region by region, so the events
have the same shape and cover both processes.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Mapping

from pipeline.descriptor import RunDescriptor
from storage.accounting import CountingStore, StoreCounters
from storage.store import ObjectStore
from workers.bus.bus import BusCounters
from workers.common.events import EventLog

ACCOUNTING_EVENT = "accounting"
ACCOUNTING_FORMAT = 1
SINGLE_REGION = "home"       # the one region of a run without a regions section


def counted(store: ObjectStore) -> CountingStore:
    """``store`` counted (itself when it already is a ``CountingStore``: never counted twice)."""
    return store if isinstance(store, CountingStore) else CountingStore(store)


def region_names(desc: RunDescriptor, store: ObjectStore, region: str | None) -> tuple[str, str]:
    """(this process's region, the home region). ``region`` None: the region whose store URI is
    ``store``'s (a learner placed by its store alone), else the home region."""
    if desc.regions is None:
        return SINGLE_REGION, SINGLE_REGION
    home = desc.regions.home
    if region is not None:
        return region, home
    mine = _place(store.uri)
    return next((spec.name for spec in desc.regions.regions if _place(spec.uri) == mine), home), home


def _place(uri: str) -> str:
    """A URI compared by place: a local path made absolute, any other URI without a trailing /."""
    path = uri[len("file://"):] if uri.startswith("file://") else uri
    return path.rstrip("/") if "://" in path else os.path.abspath(os.path.expanduser(path))


class TrafficMeter:
    """Writes ``accounting`` events for one process (module docstring). ``stores``: region name ->
    the ``CountingStore`` this process uses there; ``bus``: its sockets' counters (None: no bus);
    ``extra``: counters counted elsewhere that this process answers for (its sync agent's), read at
    each report: ``{"stores": {region: StoreCounters.as_dict()}, "bus": BusCounters.snapshot() or
    None}``, added to its own (may be set after construction)."""

    def __init__(self, events: EventLog, region: str, home: str, stores: Mapping[str, CountingStore],
                 bus: BusCounters | None = None, clock: Callable[[], float] = time.monotonic,
                 extra: Callable[[], Mapping[str, Any]] | None = None):
        for name, s in stores.items():
            if not isinstance(s, CountingStore):
                raise TypeError(f"TrafficMeter: the store of region {name!r} is not a CountingStore")
        self.events, self.region, self.home = events, region, home
        self.stores = dict(stores)
        self.bus = bus
        self.clock = clock
        self.extra = extra
        self.started = clock()

    def snapshot(self) -> dict[str, Any]:
        """The counters now, in the event's shape (``stores``, ``bus``): this process's plus ``extra``'s."""
        stores = {name: s.snapshot() for name, s in self.stores.items()}
        bus = None if self.bus is None else self.bus.snapshot()
        if self.extra is not None:
            more = self.extra()
            for name, counts in (more.get("stores") or {}).items():
                stores[name] = stores.get(name, StoreCounters()) + _store_counters(name, counts)
            if more.get("bus") is not None:
                bus = {f: (bus or {}).get(f, 0) + _count(more["bus"], f, "bus") for f in BusCounters.FIELDS}
        return {"stores": {name: c.as_dict() for name, c in sorted(stores.items())},
                "bus": None if bus is None else {"peer": self.home, **bus}}

    def report(self, life: int, final: bool = False, **fields: Any) -> None:
        """Emit one ``accounting`` event (``fields``: ``step``/``outer_step`` or ``commits``)."""
        self.events.emit(ACCOUNTING_EVENT, format=ACCOUNTING_FORMAT, life=life, final=final, region=self.region,
                         home=self.home, **fields, elapsed_s=round(self.clock() - self.started, 3),
                         **self.snapshot())


def _store_counters(region: str, counts: Mapping[str, Any]) -> StoreCounters:
    """``StoreCounters`` from an ``extra`` source's dict, refused when a field is unknown or not a count."""
    unknown = set(counts) - set(StoreCounters.__dataclass_fields__)
    if unknown:
        raise ValueError(f"TrafficMeter extra: unknown store counters {sorted(unknown)} for region {region!r}")
    return StoreCounters(**{f: _count(counts, f, f"store {region!r}") for f in counts})


def _count(counts: Mapping[str, Any], name: str, what: str) -> int:
    n = counts.get(name, 0)
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"TrafficMeter extra: {what} counter {name!r} must be an int >= 0, got {n!r}")
    return n


class SyncerTraffic:
    """An ``EventLog`` listener that makes the syncer's reports from its own events: after every
    ``fragments`` merge commits or ``every_s`` seconds (checked at each commit), and once on
    ``syncer-stop`` (final). ``state()`` gives the fields of the moment (``life``, ``commits``)."""

    def __init__(self, meter: TrafficMeter, fragments: int, state: Callable[[], dict], every_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        if not isinstance(fragments, int) or fragments < 1 or not every_s > 0:
            raise ValueError(f"need fragments >= 1 and every_s > 0, got {fragments!r}, {every_s!r}")
        self.meter, self.fragments, self.state, self.every_s, self.clock = meter, fragments, state, every_s, clock
        self._merges = 0
        self._last = clock()
        self.failures = 0
        self.last_error = ""

    def __call__(self, rec: dict) -> None:
        name = rec.get("event")
        try:
            if name == "syncer-stop":
                self.meter.report(final=True, **self.state())
            elif name == "commit":
                self._merges += rec.get("kind") == "merge"
                if self._merges >= self.fragments or self.clock() - self._last >= self.every_s:
                    self._merges, self._last = 0, self.clock()
                    self.meter.report(**self.state())
        except Exception as exc:   # noqa: BLE001 - accounting must never stop the syncer's loop
            self.failures += 1
            self.last_error = f"{exc.__class__.__name__}: {exc}"
