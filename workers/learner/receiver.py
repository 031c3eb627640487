"""The learner's background receiver (SPEC §3, §7): new fragment versions, from storage.

It listens to the syncer's announcements and polls the commit log every ``poll_s``. Either way it
only loads versions named by a commit (checked against the commit's digest), and only versions
newer than the newest it has handed over. The training thread collects them with ``take()``,
which never blocks. The newest version per fragment wins: an older unapplied one is replaced.

Rounds (SPEC §3-4): the syncer's ``round`` announcements say which round of which fragment is
open; the training thread reads them with ``opened()`` and answers at its next step boundary.
When no announcement was heard for a while (no bus, or the bus is down) the openings are computed
from the round clock the syncer keeps in storage (pipeline/schedule.py), so a learner keeps
answering rounds whatever happens to the fast path. A round so computed is a guess: it replaces
the opening held only when it is newer, while an announcement (or a newer clock record) of the
same syncer epoch replaces a guess even when it names a lower round - the syncer's own clock is
the truth (issue 25: when the highest (epoch, round) ever heard was kept, one round extrapolated
from a bogus clock, 30288 where the syncer was at 3600, silenced every real one).
In a signed run a version whose commit or blob lacks the syncer's valid signature is refused
(``VersionTracker.load``): logged as ``version-refused`` with the reason, counted, never applied.

Health: a commit whose version could not be loaded (storage failing) is
retried until it loads or a newer commit supersedes it, never skipped; a failure that lasts
(``FAIL_AFTER`` polls), a refused version or a crash of this thread shows in ``failed`` (and the
learner's stats) and as a ``receiver-stuck`` event, so versions never silently stop arriving.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable
import numpy as np

from pipeline.errors import FormatError
from pipeline.types import CommitRecord
from pipeline.schedule import ClockRecord
from storage.errors import NotFound, StoreError
from storage.layout import CLOCK_KEY
from workers.bus.bus import ZMQ, BusConfig, Message, Transport
from workers.common.aggregate import RunningMean
from workers.common.events import EventLog
from workers.common.versions import VersionTracker


@dataclass(frozen=True)
class Arrival:
    fragment: int
    version: int
    seq: int
    values: dict[str, np.ndarray]
    found_by: str          # "announce" or "poll"
    committed_at: float    # syncer wall time of the commit (from the record), for latency figures
    epoch: int = -1        # the committing syncer's epoch
    round: int = -1        # the round the commit closed (-1: none)


FAIL_AFTER = 3            # failed polls in a row before the receiver reports itself failed
FETCH_THREADS = 8         # parallel GETs of commits and versions
# Round announcements heard this recently make the storage clock unnecessary. 1 s, not 3:
# with the bus blackholed a learner heard no round for 3 s, answered nothing, and one that reached
# the end of its budget meanwhile lost its last 152 steps (fault campaign, seed 0 schedule 2). Runs
# whose rounds are rarer than this read the clock once per poll (one GET), which agrees with the bus.
BUS_ROUNDS_FRESH_S = 1.0
COPY_WAIT_MIN_S = 0.05     # first re-read of an announced commit the store does not hold yet (a region's copy)
COPY_EST_ALPHA = 0.5       # weight of the latest copy time in the smoothed one


class Receiver:
    def __init__(self, tracker: VersionTracker, known: dict[int, int], events: EventLog,
                 bus: BusConfig | None, poll_s: float = 0.5, curve=None, fetch_threads: int = FETCH_THREADS,
                 on_news: Callable[[], None] | None = None, clock: Callable[[], float] | None = None,
                 wall: Callable[[], float] | None = None, threads: bool = True, transport: Transport = ZMQ,
                 target=None):
        if not isinstance(fetch_threads, int) or isinstance(fetch_threads, bool) or not 1 <= fetch_threads <= 64:
            raise ValueError(f"fetch_threads must be an int in 1..64, got {fetch_threads!r}")
        self.tracker, self.events, self.bus_cfg, self.poll_s, self.curve = tracker, events, bus, poll_s, curve
        self.fetch_threads = fetch_threads
        self._target = target   # a discovered syncer (workers/bus/discovery.py): re-read here, followed
        # Injected time (None: the time module's, read at each call), and ``threads=False``: no
        # thread, the caller drives ``turn`` (the fault simulation on simulated time, issue 25).
        self._clock, self._wall, self.threads = clock, wall, threads
        self.transport = transport       # what builds the announcement listener (ZeroMQ; the simulation's own)
        self._listener = None            # without a thread: the listener ``turn`` reads
        self._next_poll = 0.0            # without a thread: when ``turn`` polls storage next
        # called (on this thread) when take() or opened() has something new: the learner's sync
        # agent (workers/learner/agent_main.py) waits on it instead of polling
        self.on_news = on_news or (lambda: None)
        self.known = dict(known)                 # fragment -> newest version handed over
        self._ready: dict[int, Arrival] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._supervise, name="receiver", daemon=True)
        self.errors = 0
        self.refused = 0           # versions that failed their checks (signature, digest, size)
        self.last_error = ""
        self.syncer_epoch = -1
        self._retry: dict[int, CommitRecord] = {}           # fragment -> commit whose version failed to load
        self._failing: dict[str, tuple[int, str]] = {}      # what -> (failures in a row, last error)
        self._bytes_at_start = tracker.bytes_loaded          # the start-up load is not steady-state traffic
        self._opened: dict[int, tuple[int, int]] = {}   # fragment -> newest (epoch, round) heard open
        self._guessed: set[int] = set()                  # fragments whose opening came from the storage clock
        self._bus_round_at = -1e9                        # when a round announcement was last heard
        self._map = map                                  # the fetch pool's map while the thread runs
        self._announced = -1                             # newest commit seq an announcement named
        # An announcement can overtake the copy in a learner's region (issue 14: the replicator
        # writes it there a few round trips after the commit): then the receiver waits for the
        # copy with a bounded backoff instead of re-reading on every announcement.
        self.awaited = 0            # announced commits the store did not hold yet at the first read
        self.copy_misses = 0        # reads that found an announced commit missing
        self._awaiting_since = -1.0  # when the current wait began (-1: not waiting)
        self._last_miss = -1.0       # when the current wait's latest read missed
        self._copy_est = -1.0        # smoothed announce -> copy time (-1: none yet): where a wait starts
        self._backoff = 0.0         # the current wait's next pause
        self._copy_wait = RunningMean()   # announce -> found, seconds, of the commits waited for

    def start(self) -> None:
        if self.threads:
            self._thread.start()
        elif self.bus_cfg is not None:
            self._listener = self.transport.listener(self.bus_cfg, curve=self.curve)

    def stop(self) -> None:
        self._stop.set()
        if self.threads:
            self._thread.join(timeout=10)
        elif self._listener is not None:
            self._listener.close()
            self._listener = None

    def turn(self) -> float:
        """One turn without a thread (``threads=False``): what the announcement listener holds,
        then, when due (or an announcement names a new version), a poll of the log and of the round
        clock in storage - the thread's loop, on the caller's time. Returns the seconds until the
        next poll is due (a message arriving meanwhile is the caller's cue to turn sooner)."""
        found_by = "poll"
        while self._listener is not None:
            msg = self._listener.recv(0)
            if msg is None:
                break
            if self._hear(msg):
                found_by, self._next_poll = "announce", 0.0
        if self._mono() >= self._next_poll:
            self._poll(found_by)
            self._poll_clock()
            self._next_poll = self._mono() + self._after_poll()
        return max(0.0, self._next_poll - self._mono())

    def _is_new(self, msg: Message) -> bool:
        v, p = msg.fields.get("version"), msg.fields.get("fragment")
        return isinstance(p, int) and isinstance(v, int) and v > self.known.get(p, -1)

    def _hear(self, msg: Message) -> bool:
        """One announcement: a new version (True: poll now, unless a region's copy is being waited
        for, where the backoff decides), a round opening, or the syncer's heartbeat."""
        if msg.type == "version":
            if self._is_new(msg):
                seq = msg.fields.get("seq")
                if isinstance(seq, int) and not isinstance(seq, bool):
                    self._announced = max(self._announced, seq)
                return self._awaiting_since < 0
        elif msg.type == "round":
            self._bus_round_at = self._mono()
            self._open(msg.fields.get("epoch"), msg.fields.get("fragment"), msg.fields.get("round"))
        elif msg.type == "syncer-heartbeat":
            self.syncer_epoch = msg.fields.get("epoch", -1)
        return False

    def _mono(self) -> float:
        return self._clock() if self._clock is not None else time.monotonic()

    def _now_wall(self) -> float:
        return self._wall() if self._wall is not None else time.time()

    def take(self) -> list[Arrival]:
        with self._lock:
            out = sorted(self._ready.values(), key=lambda a: a.fragment)
            self._ready.clear()
        return out

    def opened(self) -> dict[int, tuple[int, int]]:
        """The newest open round of every fragment heard of, as (syncer epoch, round id)."""
        with self._lock:
            return dict(self._opened)

    def _open(self, epoch, fragment, rnd, guess: bool = False) -> None:
        """Fragment ``fragment``'s round ``rnd`` of syncer ``epoch`` is open: announced, or (``guess``)
        computed from the clock record in storage. It replaces the opening held when it is newer,
        or when the held one is a guess of the same epoch (module docstring)."""
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (epoch, fragment, rnd)):
            return
        if fragment not in self.known or rnd < 0:
            return
        with self._lock:
            held = self._opened.get(fragment, (-1, -1))
            new = (epoch, rnd) != held and ((epoch, rnd) > held or (fragment in self._guessed and epoch == held[0]))
            if new:
                self._opened[fragment] = (epoch, rnd)
                (self._guessed.add if guess else self._guessed.discard)(fragment)
        if new:
            self.on_news()

    def _poll_clock(self) -> None:
        """Rounds from the syncer's clock in storage, when no announcement was heard lately."""
        if self._mono() - self._bus_round_at < BUS_ROUNDS_FRESH_S:
            return
        try:
            clock = ClockRecord.from_bytes(self.tracker.store.get(CLOCK_KEY), CLOCK_KEY)
        except NotFound:
            return
        except (StoreError, FormatError) as exc:
            self._error(f"round clock: {exc}")
            return
        now = self._now_wall()
        for p in self.known:
            if p < len(clock.offsets):
                self._open(clock.epoch, p, clock.round_at(p, now), guess=True)

    def _run(self) -> None:
        gen = 0
        if self._target is not None:
            gen, self.bus_cfg = self._target.generation, self._target.config
        listener = self.transport.listener(self.bus_cfg, curve=self.curve) if self.bus_cfg is not None else None
        # GETs of commits and versions run on this pool: one round trip for many objects
        pool = ThreadPoolExecutor(self.fetch_threads, thread_name_prefix="receiver-fetch")
        self._map = pool.map
        next_poll = 0.0
        try:
            while not self._stop.is_set():
                if self._target is not None and (self._target.refresh() or self._target.generation != gen):
                    gen, self.bus_cfg = self._target.generation, self._target.config   # the syncer moved
                    if listener is not None:
                        listener.close()
                    listener = self.transport.listener(self.bus_cfg, curve=self.curve)
                found_by = "poll"
                # Wake for the next poll on time: a re-read for a region's copy is due sooner than
                # 0.2 s (it used to wait for the next message, up to 0.2 s late, a step boundary missed).
                wait = max(0.0, min(self.poll_s, 0.2, next_poll - self._mono()))
                if listener is not None:
                    msg = listener.recv(wait)
                    if msg is not None and msg.type == "version" and self._is_new(msg):
                        found_by = "announce"
                    if msg is not None and self._hear(msg):
                        next_poll = 0.0
                else:
                    self._stop.wait(wait)
                if self._mono() >= next_poll:
                    self._poll(found_by)
                    self._poll_clock()
                    next_poll = self._mono() + self._after_poll()
        finally:
            pool.shutdown(wait=True)
            self._map = map
            if listener is not None:
                listener.close()

    def _poll(self, found_by: str) -> None:
        """Read the commits after the cursor and load the newest version of each fragment they
        name. A version that could not be loaded because storage failed is *not* passed by: its
        commit is kept and retried every poll until it loads or a newer commit of the fragment
        supersedes it. One that fails its checks is refused (never applied)
        and the fragment is reported failed until a newer version loads. Finding the commits costs
        one GET when nothing is new (``VersionTracker.poll_fast``); new commits and their versions
        are fetched in parallel on the receiver's pool."""
        try:
            # While waiting for a copy, one GET of the next commit per try (not a window up to the
            # announced seq, which would be all 404s).
            at_least = -1 if self._awaiting_since >= 0 else self._announced
            records = self.tracker.poll_fast(at_least=at_least, map_fn=self._map)
            self._healthy("log")
            self._healthy("thread")
        except (StoreError, FormatError) as exc:
            self._failing_now("log", f"log poll: {exc}")
            records = []
        newest: dict[int, CommitRecord] = dict(self._retry)
        for rec in records:
            if rec.kind in ("init", "merge") and rec.version > self.known.get(rec.fragment, -1):
                newest[rec.fragment] = rec
        for p, rec in list(newest.items()):
            if rec.version <= self.known.get(p, -1):
                self._retry.pop(p, None)
                del newest[p]
        loaded = dict(zip(newest, self._map(self._load, newest.values())))
        for p, rec in newest.items():
            try:
                values = loaded[p]
                if isinstance(values, Exception):
                    raise values
            except FormatError as exc:
                # A version that fails its checks is never applied; a later genuine one will be.
                self._retry.pop(p, None)
                self.refused += 1
                self.events.emit("version-refused", fragment=p, version=rec.version, seq=rec.seq, reason=str(exc))
                self._failing_now(f"fragment {p}", f"version {rec.version} ({rec.output_key}) refused: {exc}",
                                  definite=True)
                continue
            except StoreError as exc:
                self._retry[p] = rec
                self._failing_now(f"fragment {p}", f"version {rec.version} ({rec.output_key}): {exc}")
                continue
            self._retry.pop(p, None)
            self._healthy(f"fragment {p}")
            self.known[p] = rec.version
            with self._lock:
                self._ready[p] = Arrival(p, rec.version, rec.seq, values, found_by,
                                         float(rec.info.get("committed_at", 0.0)), rec.epoch, rec.round)
            self.on_news()

    def _after_poll(self) -> float:
        """Seconds to the next poll: ``poll_s``, or while an announced commit is not in the store
        yet, first the smoothed copy time (>= COPY_WAIT_MIN_S), then pauses from COPY_WAIT_MIN_S
        doubling, at most ``poll_s``. Counts the commits waited for and the reads that missed."""
        now = self._mono()
        if self._announced <= self.tracker.cursor:
            if self._awaiting_since >= 0:
                # The copy landed between the last miss and now: the midpoint, not ``now``. Found
                # times alone only ratchet up (a wait starts at their mean, so none is shorter than
                # it): at 0.4 s steps the wait grew to ~poll_s and versions missed a step boundary.
                waited = (self._last_miss + now) / 2 - self._awaiting_since
                self._copy_wait.append(waited)
                # recent copies decide the next wait's start (a run's early slow copies must not)
                self._copy_est = waited if self._copy_est < 0 else self._copy_est + COPY_EST_ALPHA * (waited - self._copy_est)
            self._awaiting_since, self._backoff = -1.0, 0.0
            return self.poll_s
        self.copy_misses += 1
        self._last_miss = now
        if self._awaiting_since < 0:
            self.awaited += 1
            self._awaiting_since = now
            # First re-read when a copy usually lands, then probes 0.05, 0.1, 0.2 ... s apart (a
            # copy just after the estimate is found soon; a region that is down costs one GET a poll_s).
            self._backoff = COPY_WAIT_MIN_S / 2
            return min(max(COPY_WAIT_MIN_S, self._copy_est), self.poll_s)
        self._backoff *= 2
        return min(self._backoff, self.poll_s)

    @property
    def copy_wait_s(self) -> float:
        """Mean seconds from an announcement to the commit being in the store, over the waits."""
        return self._copy_wait.mean if self._copy_wait else 0.0

    def _load(self, rec: CommitRecord) -> dict[str, np.ndarray] | Exception:
        """One version (on a pool thread): its values, or the error ``_poll`` handles."""
        try:
            return self.tracker.load(rec)
        except (FormatError, StoreError) as exc:
            return exc

    @property
    def bytes_received(self) -> int:
        """Bytes of version objects downloaded since start (the versions-down half of bandwidth)."""
        return self.tracker.bytes_loaded - self._bytes_at_start

    def _error(self, text: str) -> None:
        self.errors += 1
        self.last_error = text
        self.events.emit("receiver-error", error=text)

    # -- health: a learner must never silently stop getting versions ------------
    @property
    def failed(self) -> str | None:
        """Why versions are not arriving, once a failure has lasted ``FAIL_AFTER`` polls in a row
        (or at once for a refused version, or a crash of this thread); None while healthy."""
        with self._lock:
            bad = [f"{key}: {text}" for key, (n, text) in sorted(self._failing.items()) if n >= FAIL_AFTER]
        return "; ".join(bad) or None

    def _failing_now(self, key: str, text: str, definite: bool = False) -> None:
        """Count a failure of ``key`` ("log", "fragment P", "thread"); report the 1st, 2nd, 4th...
        in a row, and ``receiver-stuck`` when it crosses ``FAIL_AFTER``."""
        self.errors += 1
        self.last_error = text
        with self._lock:
            n = self._failing.get(key, (0, ""))[0] + (FAIL_AFTER if definite else 1)
            self._failing[key] = (n, text)
        if n & (n - 1) == 0 or definite:
            self.events.emit("receiver-error", error=text, what=key, consecutive=n)
        if n >= FAIL_AFTER and n - (FAIL_AFTER if definite else 1) < FAIL_AFTER:
            self.events.emit("receiver-stuck", what=key, error=text)

    def _healthy(self, key: str) -> None:
        with self._lock:
            was = self._failing.pop(key, None)
        if was is not None and was[0] >= FAIL_AFTER:
            self.events.emit("receiver-recovered", what=key, after=was[0])

    def _supervise(self) -> None:
        """The thread's body: ``_run``, restarted after an unexpected error (reported, and shown
        in ``failed`` until the next successful poll) - the receiver never dies silently."""
        while not self._stop.is_set():
            try:
                self._run()
                return
            except Exception as exc:   # noqa: BLE001 - anything: a dead receiver means no more versions
                self._failing_now("thread", f"receiver crashed, restarting: {exc.__class__.__name__}: {exc}",
                                  definite=True)
                self._stop.wait(1.0)
