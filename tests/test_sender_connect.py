"""A delta handed to a sender whose bus link is still connecting is sent once it connects, not
spilled at once (issue 25: a respawned sync agent spilled the first delta it was handed 7 ms
after it came up on a busy machine, and the syncer never saw it on the bus). A link that never
connects spills ``connect_s`` (0.5 s) after it was opened; one that was heard from and then refuses
(down, high-water mark) spills at once, as before. An injected clock and a fake link: no timing."""
from __future__ import annotations

import numpy as np

from pipeline.codec import CodecConfig
from storage.layout import spill_key
from storage.store import open_store
from workers.bus.bus import BusConfig, Message, Transport
from workers.learner.sender import Sender, SenderConfig

from runhelpers import Recorder
from test_hardening_learner_sender import header


class _Link:
    """A learner link that refuses every send until ``connected`` (ZeroMQ's IMMEDIATE), then takes
    them; ``replies`` are what the syncer says back."""
    made: list["_Link"] = []

    def __init__(self, *args, **kwargs):
        self.connected = False
        self.sent: list[Message] = []
        self.replies: list[Message] = []
        _Link.made.append(self)

    def send(self, msg: Message) -> bool:
        if self.connected:
            self.sent.append(msg)
        return self.connected

    def recv(self, timeout_s: float):
        return self.replies.pop(0) if self.replies else None

    def close(self, linger_s: float = 0.0) -> None:
        pass

    def kinds(self) -> list[str]:
        return [m.type for m in self.sent]


def _sender(tmp_path, now: list[float]) -> tuple[Sender, Recorder, _Link]:
    _Link.made = []
    events = Recorder()
    sender = Sender(open_store(str(tmp_path / "run")), CodecConfig(scheme="fp32"), SenderConfig(ack_timeout_s=2.0),
                    events, bus=BusConfig("tcp://127.0.0.1:1", "tcp://127.0.0.1:2"), identity=b"l0",
                    heartbeat=dict, clock=lambda: now[0], sleep=lambda s: None, threads=False,
                    transport=Transport(learner=_Link))
    sender.start()
    (link,) = _Link.made
    return sender, events, link


def _spilled(tmp_path, h) -> bool:
    return open_store(str(tmp_path / "run")).exists(spill_key(h.learner, h.incarnation, h.seq))


def test_a_delta_waits_for_a_connecting_link_and_goes_out_on_it(tmp_path):
    now = [0.0]
    sender, events, link = _sender(tmp_path, now)
    h = header(0, 1)
    sender.submit(h, {"w": np.ones(8, np.float32)})
    for _ in range(4):                      # 0.4 s of turns while the connect is under way
        sender.turn()
        now[0] += 0.1
    assert sender.stats.spilled == 0 and not events.named("delta-spilled") and not _spilled(tmp_path, h)
    link.connected = True
    sender.turn()
    assert link.kinds() == ["heartbeat", "delta"]       # the heartbeat refused at first went out too
    assert link.sent[1].fields["header"]["seq"] == h.seq and sender.stats.bytes_sent > 0
    link.replies.append(Message("ack", {"delta_id": h.id, "status": "durable"}))
    sender.turn()
    assert sender.stats.acked == 1 and sender.stats.spilled == 0 and not sender.pending
    sender.stop()


def test_a_link_that_never_connects_spills_after_the_connect_grace(tmp_path):
    now = [0.0]
    sender, events, link = _sender(tmp_path, now)
    h = header(0, 1)
    sender.submit(h, {"w": np.ones(8, np.float32)})
    sender.turn()
    now[0] = 0.49
    sender.turn()
    assert sender.stats.spilled == 0
    now[0] = 0.5                            # connect_s after the link was opened: it is down
    sender.turn()
    assert sender.stats.spilled == 1 and _spilled(tmp_path, h) and sender.stats.bytes_sent == 0
    assert [e["delta"] for e in events.named("delta-spilled")] == [h.id]
    sender.stop()


def test_a_link_heard_from_that_refuses_spills_at_once(tmp_path):
    now = [0.0]
    sender, events, link = _sender(tmp_path, now)
    link.connected = True
    link.replies.append(Message("ack", {"delta_id": "none", "status": "durable"}))   # a hello answered
    sender.turn()
    link.connected = False                  # the syncer went away: the fast path is down
    h = header(1, 1)
    sender.submit(h, {"w": np.ones(8, np.float32)})
    sender.turn()
    assert sender.stats.spilled == 1 and _spilled(tmp_path, h)
    sender.stop()
