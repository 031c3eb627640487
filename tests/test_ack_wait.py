"""The ack wait follows the acks seen (pipeline/ack_wait.py, issue 31): a syncer whose merges hold
its loop for seconds (1.1-3.5 s at 101M parameters) must not make every learner upload each
delivered delta a second time, and a fast syncer keeps the configured floor. Injected clock and a
fake link (tests/test_sender_connect.py): no timing."""
from __future__ import annotations

import numpy as np
import pytest

from pipeline.ack_wait import AckWait, AckWaitConfig
from workers.bus.bus import Message
from workers.learner.sender import SenderConfig

from test_hardening_learner_sender import header
from test_sender_connect import _sender, _spilled


def test_the_wait_is_twice_the_longest_recent_ack_within_floor_and_cap():
    w = AckWait(AckWaitConfig(floor_s=2.0, cap_s=10.0, window=3))
    assert w.wait_s() == 2.0                               # nothing seen: the floor
    w.observe(0.01)
    assert w.wait_s() == 2.0                               # fast acks: still the floor
    w.observe(3.0)
    assert w.wait_s() == 6.0 and w.longest_s == 3.0
    w.observe(9.0)
    assert w.wait_s() == 10.0                              # capped
    for _ in range(3):                                     # the slow ones age out of the window
        w.observe(0.5)
    assert w.wait_s() == 2.0
    for bad in (-1.0, float("nan"), float("inf")):         # a clock that stepped sets nothing
        w.observe(bad)
    assert w.wait_s() == 2.0


@pytest.mark.parametrize("kwargs, needle", [
    (dict(floor_s=0), "floor_s"), (dict(cap_s=1.0, floor_s=2.0), "cap_s"), (dict(factor=0.5), "factor"),
    (dict(window=0), "window"), (dict(floor_s=float("nan")), "floor_s")])
def test_bad_settings_are_refused_by_name(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        AckWaitConfig(**kwargs)


def test_the_sender_config_refuses_a_cap_below_the_floor():
    with pytest.raises(ValueError, match="max_ack_wait_s"):
        SenderConfig(ack_timeout_s=5.0, max_ack_wait_s=2.0)


def _ack(link, h) -> None:
    link.replies.append(Message("ack", {"delta_id": h.id, "status": "durable"}))


def _after_one_slow_ack(tmp_path, now: list[float]):
    """A connected sender whose first delta, sent at t = 0, was acked 1.5 s later (a merge)."""
    sender, events, link = _sender(tmp_path, now)
    link.connected = True
    first = header(0, 1)
    sender.submit(first, {"w": np.ones(8, np.float32)})
    sender.turn()
    now[0] = 1.5
    _ack(link, first)
    sender.turn()
    return sender, events, link


def test_after_slow_acks_a_delivered_delta_waits_longer_than_the_floor_instead_of_spilling(tmp_path):
    now = [0.0]
    sender, events, link = _after_one_slow_ack(tmp_path, now)
    assert sender.stats.acked == 1 and sender.stats.ack_wait_s == 3.0 and sender.stats.longest_ack_s == 1.5
    second = header(1, 2)
    sender.submit(second, {"w": np.ones(8, np.float32)})
    sender.turn()                                          # sent at t = 1.5
    now[0] = 1.5 + 2.5                                     # past the 2 s floor: a fixed deadline spilled here
    sender.turn()
    assert sender.stats.spilled == 0 and not _spilled(tmp_path, second)
    _ack(link, second)
    sender.turn()
    assert sender.stats.acked == 2 and sender.stats.spilled == 0 and not sender.pending
    sender.stop()


def test_a_delta_the_syncer_never_acks_still_spills_at_the_grown_wait(tmp_path):
    now = [0.0]
    sender, events, link = _after_one_slow_ack(tmp_path, now)
    lost = header(1, 2)
    sender.submit(lost, {"w": np.ones(8, np.float32)})
    sender.turn()                                          # sent at 1.5; its ack never comes
    now[0] = 1.5 + 2.9
    link.replies.append(Message("syncer-heartbeat", {}))   # the syncer is alive, the delta is lost
    sender.turn()
    assert sender.stats.spilled == 0
    now[0] = 1.5 + 3.0                                     # 2 x the longest ack seen
    sender.turn()
    assert sender.stats.spilled == 1 and _spilled(tmp_path, lost)
    assert [e["delta"] for e in events.named("delta-spilled")] == [lost.id]
    sender.stop()
