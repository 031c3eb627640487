"""Issue 11, learner side: the sender's memory stays bounded when storage is slow or down (item 4),
a delta with non-finite values is dropped with an event instead of killing the sender (item 2),
and persistent spill failures are reported (item 11). No bus: every delta goes to the spill.
Tests wait on conditions with deadlines, never on sleeps."""
from __future__ import annotations

import threading

import numpy as np

from pipeline.codec import CodecConfig
from pipeline.types import DeltaHeader
from storage.errors import Unavailable
from storage.layout import SPILL_PREFIX
from storage.store import open_store
from workers.learner.sender import Sender, SenderConfig

from runhelpers import Recorder, wait_for

MB_FLOATS = (1 << 20) // 4          # one MiB of float32


class BlockingStore:
    """Every spill write blocks until released (a store that hangs), or fails (a store that is down)."""

    def __init__(self, inner, mode: str = "block"):
        self.inner, self.uri, self.mode = inner, inner.uri, mode
        self.release = threading.Event()
        self.entered = threading.Event()
        self.attempts = 0

    def put_if_absent(self, key, data):
        self.attempts += 1
        self.entered.set()
        if self.mode == "fail":
            raise Unavailable("No space left on device", uri=self.uri, key=key)
        self.release.wait(30)
        return self.inner.put_if_absent(key, data)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def make_sender(store, **cfg):
    events = Recorder()
    sender = Sender(store, CodecConfig(scheme="fp32"), SenderConfig(retry_s=0.05, max_retry_s=0.2, **cfg), events,
                    bus=None, identity=b"l0", heartbeat=dict)
    sender.start()
    return sender, events


def header(seq, fragment, base=0, tokens=100):
    return DeltaHeader("l0", 1, seq, fragment, base, c_steps=seq + 1, c_tokens=tokens * (seq + 1), learner_step=seq)


def test_send_queue_stays_bounded_while_a_spill_hangs(tmp_path):
    """Old code: 38 x 1 MB queued in 3 s and growing (an unbounded queue.Queue; superseding ran only
    after the blocking spill). Now submit supersedes (same fragment and base) and caps count and bytes."""
    store = BlockingStore(open_store(str(tmp_path / "run")))
    sender, events = make_sender(store, max_pending=6, max_held_bytes=8 << 20)
    try:
        sender.submit(header(0, 0), {"w": np.ones(MB_FLOATS, np.float32)})
        wait_for(store.entered.is_set, what="the first spill to start (and hang)", poll_s=0.01)
        peak = (0, 0)
        for seq in range(1, 200):       # 4 fragments, the base changes every 10 deltas: many lineages
            sender.submit(header(seq, seq % 4, base=seq // 10), {"w": np.full(MB_FLOATS, seq, np.float32)})
            held = sender.held()
            peak = (max(peak[0], held[0]), max(peak[1], held[1]))
        assert peak[0] <= 6 + 1 and peak[1] <= (8 << 20) + (2 << 20), peak
        s = sender.stats
        assert s.superseded > 0 and s.evicted > 0
        assert s.superseded + s.evicted + sender.held()[0] == s.submitted
        assert events.named("delta-evicted") and events.named("delta-superseded")
        # the newest delta is never the one evicted
        queued = [p.header.seq for p in sender.queue.values()] + [p.header.seq for p in sender.pending.values()]
        assert 199 in queued
    finally:
        store.release.set()
    assert sender.drain(20), "once storage answers, everything still held becomes durable"
    sender.stop()
    assert len(store.inner.list(SPILL_PREFIX)) == sender.stats.spilled == sender.stats.submitted - \
        sender.stats.superseded - sender.stats.evicted


def test_superseding_keeps_deltas_of_another_base():
    """A delta on another base holds progress no newer delta has: it is never superseded."""
    sender = Sender(None, CodecConfig(scheme="fp32"), SenderConfig(), Recorder(), bus=None, identity=b"l0",
                    heartbeat=dict)   # not started: submit alone must decide
    sender.submit(header(0, 1, base=3), {"w": np.ones(4, np.float32)})
    sender.submit(header(1, 1, base=3), {"w": np.ones(4, np.float32)})
    sender.submit(header(2, 1, base=4), {"w": np.ones(4, np.float32)})
    assert sorted(p.header.seq for p in sender.queue.values()) == [1, 2]
    assert sender.stats.superseded == 1 and sender.stats.superseded_tokens == 100


def test_non_finite_delta_is_dropped_not_fatal(tmp_path):
    """Old code: encode raised in the sender thread, which died ("sender thread failed: ...
    non-finite values") and the learner stopped. Now that delta is dropped with an event."""
    store = open_store(str(tmp_path / "run"))
    sender, events = make_sender(store)
    bad = np.ones(16, np.float32)
    bad[3] = np.nan
    sender.submit(header(0, 0), {"w": bad})
    sender.submit(header(1, 1), {"w": np.ones(16, np.float32)})
    assert sender.drain(20)
    sender.stop()
    assert sender.failed is None
    assert sender.stats.nonfinite == 1 and sender.stats.spilled == 1
    (drop,) = events.named("delta-dropped")
    assert drop["reason"] == "non-finite" and drop["delta"] == header(0, 0).id
    assert len(store.list(SPILL_PREFIX)) == 1


def test_persistent_spill_failure_is_reported(tmp_path):
    """Old code: spill_errors/last_error were counted but never reported and no event was written."""
    store = BlockingStore(open_store(str(tmp_path / "run")), mode="fail")
    sender, events = make_sender(store)
    for seq in range(3):
        sender.submit(header(seq, seq), {"w": np.ones(16, np.float32)})
    wait_for(lambda: len(events.named("spill-failed")) >= 3, what="three spill-failed events", poll_s=0.01)
    assert not sender.drain(0.2)
    sender.stop()
    s = sender.stats
    assert s.spill_errors >= 3 and "No space left on device" in s.last_error
    first = events.named("spill-failed")[0]
    # the sender wakes on each submit, so the first failure may come before the third delta is queued
    assert first["consecutive"] == 1 and "No space left" in first["error"] and 1 <= first["undelivered"] <= 3
    assert max(e["undelivered"] for e in events.named("spill-failed")) == 3
    counts = [e["consecutive"] for e in events.named("spill-failed")]
    assert counts == sorted(counts) and all(n & (n - 1) == 0 for n in counts), "thinned: 1st, 2nd, 4th..."
    assert sender.undelivered() == 3


def test_stop_releases_the_wake_pipe(tmp_path):
    import os
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        sender, _ = make_sender(open_store(str(tmp_path / "run")))
        sender.stop()
        sender.submit(header(0, 0), {"w": np.ones(4, np.float32)})     # after stop: harmless
    assert len(os.listdir("/proc/self/fd")) <= before + 2


def test_a_newer_delta_supersedes_one_that_was_sent_but_never_made_durable(tmp_path):
    """Issue 25: while the store was down nothing was acked, the held sent deltas filled the bound
    and every new answer was evicted (lost), although each one carried the progress of the older
    ones of its lineage. A sent, not yet durable delta is superseded like a never-sent one, so a long
    outage costs no work (tests/mutants/evict-unacked.patch puts the old rule back: this fails)."""
    store = BlockingStore(open_store(str(tmp_path / "run")), mode="fail")
    now = [0.0]
    events = Recorder()
    sender = Sender(store, CodecConfig(scheme="fp32"), SenderConfig(max_pending=4), events, bus=None, identity=b"l0",
                    heartbeat=dict, clock=lambda: now[0], sleep=lambda s: None, threads=False)
    sender.start()
    for seq in range(12):                       # one lineage (fragment 1, base 0), a turn after each answer
        sender.submit(header(seq, 1), {"w": np.full(16, seq, np.float32)})
        sender.turn()
        now[0] += 1.0
        assert all(p.sent_at is not None for p in sender.pending.values())   # each was sent (a spill tried)
    assert store.attempts >= 1
    assert [p.header.seq for p in sender.pending.values()] == [11]
    assert sender.stats.superseded == 11 and sender.stats.evicted == 0
    assert not events.named("delta-evicted")
    sender.stop()


def test_a_clean_stop_sends_a_leaving_heartbeat_and_the_round_book_drops_the_learner(tmp_path):
    """A learner that stops cleanly says so; the syncer stops counting it live at once (its rounds
    closed after a grace window for an answer that never came: the last learner's utilisation fell
    from 0.84 to 0.71 in a real-process campaign run)."""
    from runhelpers import free_port
    from workers.bus.bus import BusConfig, SyncerBus
    cfg = BusConfig(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
    bus = SyncerBus(cfg)
    try:
        sender = Sender(None, CodecConfig(scheme="fp32"), SenderConfig(heartbeat_s=0.05), Recorder(), bus=cfg,
                        identity=b"l0", heartbeat=lambda: {"learner": "l0", "incarnation": 1, "step": 3,
                                                           "step_time_s": 0.1})
        sender.start()
        beats: list[dict] = []
        wait_for(lambda: _heard(bus, beats) and beats, 30, "a heartbeat")
        assert not any(b.get("leaving") for b in beats)
        sender.stop()
        wait_for(lambda: _heard(bus, beats) and beats[-1].get("leaving") is True, 30, "the leaving heartbeat")
    finally:
        bus.close()
    book = _book()                                       # the syncer's side of it
    book.heartbeat("l0", 0.1, 10.0)
    book.heartbeat("l1", 0.1, 10.0)
    assert book.live(10.5) == ["l0", "l1"]
    book.left("l0")
    assert book.live(10.5) == ["l1"]
    book.heartbeat("l0", 0.1, 11.0)                      # a new life of it
    assert book.live(11.5) == ["l0", "l1"]


def _heard(bus, beats: list[dict]) -> bool:
    got = bus.recv(0.05)
    while got is not None:
        if not isinstance(got[1], Exception) and got[1].type == "heartbeat":
            beats.append(dict(got[1].fields))
        got = bus.recv(0)
    return True


def _book():
    from pipeline.fragment import FragmentLayout
    from pipeline.schedule import ScheduleConfig
    from pipeline.descriptor import RunDescriptor
    from pipeline.types import TensorSpec
    from workers.syncer.rounds import RoundBook
    desc = RunDescriptor(run_id="r", layout=FragmentLayout((TensorSpec("a", (2,)),), (("a",),)),
                         schedule=ScheduleConfig(4, (0,)))
    return RoundBook(desc, live_timeout_s=5.0, initial_step_s=1.0)


class _SilentLink:
    """A bus link into a blackhole: every send is taken, no ack ever comes."""
    def __init__(self, *args, **kwargs):
        self.sent: list = []

    def send(self, msg) -> bool:
        self.sent.append(msg)
        return True

    def recv(self, timeout_s: float):
        return None

    def close(self, linger_s: float = 0.0) -> None:
        pass


def test_answers_superseding_each_other_faster_than_the_ack_timeout_still_spill(tmp_path):
    """Issue 25 (chaos bus-blackhole, 4.05 s without a commit on a busy machine): with the bus
    blackholed a learner answered each fragment every 0.5 s, faster than its 1 s ack timeout, and
    each new answer superseded the sent, unacked one and restarted its wait; nothing spilled until
    the syncer was given up for dead (3 x ack_timeout_s). The newest answer keeps the lineage's
    first deadline: it spills ack_timeout_s after the first unacked send."""
    from workers.bus.bus import BusConfig, Transport
    store = open_store(str(tmp_path / "run"))
    now = [0.0]
    events = Recorder()
    sender = Sender(store, CodecConfig(scheme="fp32"), SenderConfig(ack_timeout_s=1.0), events,
                    bus=BusConfig("tcp://127.0.0.1:1", "tcp://127.0.0.1:2"), identity=b"l0", heartbeat=dict,
                    clock=lambda: now[0], sleep=lambda s: None, threads=False,
                    transport=Transport(learner=_SilentLink))
    sender.start()
    sender._last_heard = 0.0            # an ack was heard at t=0: the syncer counts as alive for 3 s
    for seq in range(5):                # one lineage, a new answer every 0.4 s
        sender.submit(header(seq, 1), {"w": np.full(16, seq, np.float32)})
        sender.turn()
        if sender.stats.spilled:
            break
        now[0] += 0.4
    assert sender.stats.spilled == 1, f"nothing spilled by t={now[0]:.1f} s"
    assert now[0] <= 1.2 + 1e-9, f"the first spill came at t={now[0]:.1f} s, not ~1 s after the first send"
    assert sender.stats.superseded == 3 and [e["delta"] for e in events.named("delta-spilled")] == \
        [header(3, 1).id]
    # a new lineage (a new base version: something was committed) starts its own wait
    sender.submit(header(9, 1, base=1), {"w": np.ones(16, np.float32)})
    sender.turn()
    assert sender.stats.spilled == 1 and list(sender.pending.values())[0].spill_after == now[0] + 1.0
    sender.stop()
