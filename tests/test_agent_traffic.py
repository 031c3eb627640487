"""The sync agent's store requests and bus bytes are in its learner's ``accounting`` events
(issue 15; workers/learner/agent_main.py counts them, workers/common/traffic.py adds them).

Before, the child's own store and bus sockets were counted nowhere: an agent-mode learner's final
report held its start-up reads only - no spill, no version read, a bus of zeros. Tiny unsigned
runs in temp directories, as in tests/test_learner_agent.py."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from storage.accounting import StoreCounters
from storage.layout import DESCRIPTOR_KEY, spill_prefix
from storage.store import open_store
from workers.bus.bus import BusConfig, BusCounters
from workers.common.traffic import TrafficMeter, counted
from workers.launch import RunSettings, Schedule, create_run
from workers.learner.learner import Learner, LearnerConfig

from runhelpers import Recorder, free_port, syncer_thread
from test_hardening_learner import tiny_model, train_until
from test_learner_agent import _run

# Fields whose counts do not depend on timing in _run's scenario (no syncer, no bus): the claim and
# the spills (writes), the start-up look-ups. GETs are not: the receiver polls every poll_s.
STEADY = ("put", "put_if_absent", "multipart_puts", "head", "list", "delete", "bytes_written")


def _final(learner) -> dict:
    reports = learner.events.named("accounting")
    assert reports and reports[-1]["final"], reports
    return reports[-1]


def _spilled_bytes(store, learner_id: str = "l0", incarnation: int = 1) -> int:
    return sum(len(store.get(k)) for k in store.list(spill_prefix(learner_id, incarnation)))


def test_an_agent_learners_final_report_counts_its_spills_and_version_reads(tmp_path):
    s_thr, l_thr, _, ok_thr = _run(tmp_path, False)
    s_ag, l_ag, _, ok_ag = _run(tmp_path, True)
    assert ok_thr and ok_ag and l_ag.stats()["spilled"] == l_thr.stats()["spilled"] >= 2
    thr, ag = _final(l_thr)["stores"], _final(l_ag)["stores"]
    assert set(thr) == set(ag) == {"home"} and _final(l_ag)["bus"] is None
    thr, ag = thr["home"], ag["home"]
    for name in STEADY:
        assert ag[name] == thr[name], (name, ag, thr)
    # the spills' bodies (the old code counted none of them: written by the child)
    assert ag["bytes_written"] >= _spilled_bytes(s_ag) > 0 and _spilled_bytes(s_ag) == _spilled_bytes(s_thr)
    # reads that succeeded: the same objects (version 1's commit and blob among them); the child
    # reads no descriptor (wire v5: the learner hands it over, so a replacement starts while the
    # store is down, issue 25)
    assert ag["bytes_read"] == thr["bytes_read"], (ag, thr)
    assert ag["get"] - ag["failed"] == thr["get"] - thr["failed"], (ag, thr)
    # the final report is the learner's counters plus the child's last (after its sender and
    # receiver stopped): nothing the child counted is missing
    child = l_ag.receiver.agent.stats["traffic"]["store"]
    own = l_ag.store.snapshot()
    assert ag == (own + StoreCounters(**child)).as_dict()
    assert child["put_if_absent"] == l_ag.stats()["spilled"]      # the child's writes are the spills;
    assert own.put_if_absent == 1                                  # the learner's own is its claim


def test_an_agent_learners_bus_bytes_are_counted_against_the_syncers(tmp_path):
    store = open_store(str(tmp_path / "run"))
    model = tiny_model()
    create_run(store, {n: p.detach().numpy().copy() for n, p in model.named_parameters()},
               RunSettings(schedule=Schedule(fragments=2, sync_every=4)))
    ours, theirs = BusCounters(), BusCounters()
    ports = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    stop = threading.Event()
    syncer, thread = syncer_thread(store, bus=BusConfig(*ports, counters=theirs), until=lambda s: stop.is_set(),
                                   timeout=60)
    events = Recorder()
    learner = Learner(model, torch.optim.AdamW(model.parameters(), lr=1e-3), store, "l0",
                      LearnerConfig(poll_s=0.05, drain_s=10, sync_process=True), bus=BusConfig(*ports, counters=ours),
                      events=events).start()
    try:
        def merged_twice():
            time.sleep(0.005)       # a step's time: the syncer's round clock follows the learner's pace
            return learner.applied >= 2
        train_until(learner, merged_twice, "two versions merged from its deltas", timeout=40)
    finally:
        learner.close()
        stop.set()
        thread.join(30)
    stats, bus = learner.stats(), _final(learner)["bus"]
    assert stats["acked"] >= 1 and stats["bytes_sent"] > 0
    assert ours.snapshot() == dict.fromkeys(BusCounters.FIELDS, 0)    # the learner itself opened no socket
    # the child's sockets: deltas (and heartbeats) up, acks and announcements down
    assert bus["peer"] == "home" and bus["sent_bytes"] >= stats["bytes_sent"] and bus["recv_msgs"] >= stats["acked"]
    # one learner: the syncer received at most what it sent and sent at least what it received
    got = theirs.snapshot()
    assert 0 < got["recv_msgs"] <= bus["sent_msgs"] and 0 < got["recv_bytes"] <= bus["sent_bytes"]
    assert 0 < bus["recv_bytes"] <= got["sent_bytes"]


def test_a_region_learners_agent_counts_under_its_region(tmp_path):
    from pipeline.regions import RegionSpec, RegionsConfig
    a, b = tmp_path / "a", tmp_path / "b"
    model = tiny_model()
    create_run(open_store(str(a)), {n: p.detach().numpy().copy() for n, p in model.named_parameters()},
               RunSettings(schedule=Schedule(fragments=2, sync_every=4),
                           regions=RegionsConfig("a", (RegionSpec("a", str(a)), RegionSpec("b", str(b))))))
    assert open_store(str(b)).exists(DESCRIPTOR_KEY)     # create_run seeds every region's store
    events = Recorder()
    learner = Learner(model, torch.optim.AdamW(model.parameters(), lr=1e-3), open_store(str(a)), "b0",
                      LearnerConfig(poll_s=0.05, drain_s=5, sync_process=True), events=events, region="b").start()
    try:
        train_until(learner, lambda: learner.step_count >= 6, "six steps")
    finally:
        learner.close(flush=True)          # one delta per trained fragment, spilled into b's inbox
    final = _final(learner)
    assert (final["region"], final["home"], set(final["stores"])) == ("b", "a", {"b"})
    spilled = _spilled_bytes(open_store(str(b)), "b0")
    assert spilled > 0 and _spilled_bytes(open_store(str(a)), "b0") == 0
    assert final["stores"]["b"]["bytes_written"] >= spilled
    assert final["stores"]["b"]["put_if_absent"] >= learner.stats()["spilled"] + 1   # + its claim


def test_the_meter_adds_extra_counters_and_refuses_bad_ones(tmp_path):
    store = counted(open_store(str(tmp_path / "s")))
    store.put("k", b"123")
    events = Recorder()
    child = {"stores": {"r1": {"get": 2, "bytes_read": 10}, "r2": {"put": 1}},
             "bus": {"sent_msgs": 1, "sent_bytes": 7, "recv_msgs": 0, "recv_bytes": 0}}
    meter = TrafficMeter(events, "r1", "r0", {"r1": store}, None, extra=lambda: child)
    snap = meter.snapshot()
    assert snap["stores"]["r1"] == {**StoreCounters().as_dict(), "put": 1, "get": 2, "bytes_written": 3,
                                    "bytes_read": 10}
    assert snap["stores"]["r2"]["put"] == 1 and list(snap["stores"]) == ["r1", "r2"]
    assert snap["bus"] == {"peer": "r0", "sent_msgs": 1, "sent_bytes": 7, "recv_msgs": 0, "recv_bytes": 0}
    child["bus"] = None
    assert meter.snapshot()["bus"] is None                  # no bus anywhere: null, as before
    for bad, match in (({"stores": {"r1": {"gets": 1}}}, "unknown store counters"),
                       ({"stores": {"r1": {"get": -1}}}, "int >= 0"),
                       ({"bus": {"sent_msgs": "1"}}, "int >= 0")):
        meter.extra = lambda bad=bad: bad
        with pytest.raises(ValueError, match=match):
            meter.report(1)
