"""Issue 29: learners started with no bus endpoints find the syncer through the store, and follow a
restarted syncer to its new ports (workers/bus/discovery.py)."""
from __future__ import annotations

import signal

import pytest

from pipeline.errors import FormatError
from storage.layout import ENDPOINTS_KEY
from storage.store import open_store
from tests.runhelpers import TinyRun, last_step, wait_for
from workers.bus.discovery import BusTarget, advertised, publish, read
from workers.bus.keys import generate_identity
from workers.common.events import EventLog
from workers.launch import RunSettings, Schedule, create_run

import numpy as np


def _run(tmp_path, signed: bool):
    store = open_store(str(tmp_path / ("signed" if signed else "plain")))
    syncer = generate_identity("syncer") if signed else None
    desc = create_run(store, {"w": np.zeros((2, 2), np.float32)}, RunSettings(schedule=Schedule(fragments=1,
                                                                                                sync_every=4)),
                      embedding_tensors=(), syncer=syncer)
    return store, desc, syncer


def test_a_wildcard_bind_is_advertised_with_the_given_host():
    assert advertised("tcp://0.0.0.0:5555", "node7") == "tcp://node7:5555"
    assert advertised("tcp://*:6000", "h") == "tcp://h:6000"
    assert advertised("tcp://127.0.0.1:5555", "h") == "tcp://127.0.0.1:5555"   # a named address stays


def test_a_signed_record_is_checked_and_a_forged_one_ignored(tmp_path):
    store, desc, syncer = _run(tmp_path, True)
    assert read(store, desc) is None
    publish(store, desc, 2, "syncer", "tcp://a:1", "tcp://a:2", syncer.signer(), 1.0)
    assert read(store, desc).ingest == "tcp://a:1"
    publish(store, desc, 3, "syncer", "tcp://evil:1", "tcp://evil:2", generate_identity("syncer").signer(), 2.0)
    with pytest.raises(FormatError, match="not signed by run"):
        read(store, desc)
    publish(store, desc, 3, "syncer", "tcp://evil:1", "tcp://evil:2", None, 2.0)      # no signature at all
    with pytest.raises(FormatError, match="not signed by run"):
        read(store, desc)
    plain, pdesc, _ = _run(tmp_path, False)
    publish(plain, pdesc, 1, "syncer", "tcp://b:1", "tcp://b:2", None, 1.0)
    assert read(plain, pdesc).announce == "tcp://b:2"
    assert plain.list("hints/") == [ENDPOINTS_KEY] or ENDPOINTS_KEY in plain.list("hints/")


def test_the_target_moves_only_to_a_newer_syncers_new_endpoints(tmp_path):
    store, desc, _ = _run(tmp_path, False)
    events = EventLog(tmp_path / "l.jsonl", "learner", "l0")
    t = BusTarget(store, desc, events, every_s=0.0)
    assert t.refresh(force=True) is False and t.config is None and t.generation == 0
    publish(store, desc, 1, "syncer", "tcp://a:1", "tcp://a:2", None, 1.0)
    assert t.refresh() and t.generation == 1 and t.config.ingest == "tcp://a:1"
    publish(store, desc, 2, "syncer", "tcp://a:1", "tcp://a:2", None, 2.0)          # restarted, same place
    assert not t.refresh() and t.generation == 1
    publish(store, desc, 1, "syncer", "tcp://old:1", "tcp://old:2", None, 3.0)      # an older epoch: never
    assert not t.refresh() and t.config.ingest == "tcp://a:1"
    publish(store, desc, 3, "syncer", "tcp://b:7", "tcp://b:8", None, 4.0)
    assert t.refresh() and t.generation == 2 and t.config.announce == "tcp://b:8"


def _syncer(run: TinyRun):
    argv = ["syncer", "--id", "syncer", *run.key_args("syncer"), "--ingest", "tcp://127.0.0.1:0",
            "--announce", "tcp://127.0.0.1:0", "--advertise", "127.0.0.1", "--spill-poll", "0.2"]
    run.cluster.spawn("syncer", "syncer", argv)
    run.cluster.wait_ready("syncer", 120)
    ev = next(e for e in reversed(run.events("syncer")) if e.get("event") == "syncer-advertised")
    return ev["ingest"]


def test_a_learner_without_endpoints_finds_a_restarted_syncer_on_new_ports(tmp_path):
    run = TinyRun(str(tmp_path / "store"), tmp_path, env=None, steps=600)
    run.create()
    first = _syncer(run)
    try:
        run.cluster.spawn("l0", "learner", ["learner", "--id", "l0", *run.key_args("l0"), "--discover",
                                            "--pace", "0.05"])
        acked = lambda after=0.0: [e for e in run.events("l0") if e.get("event") == "delta-acked"   # noqa: E731
                                   and e["t"] > after]
        wait_for(lambda: acked() and last_step(run, "l0") >= 40, 180, "l0 to deliver over the discovered bus")
        found = [e for e in run.events("l0") if e.get("event") == "syncer-found"]
        assert found[0]["ingest"] == first
        run.cluster.kill("syncer")
        second = _syncer(run)
        assert second != first
        wait_for(lambda: any(e.get("event") == "syncer-found" and e["ingest"] == second for e in run.events("l0")),
                 120, "l0 to find the restarted syncer")
        moved = next(e for e in run.events("l0") if e.get("event") == "syncer-found" and e["ingest"] == second)
        assert moved["generation"] == 2 and moved["epoch"] > found[0]["epoch"]
        wait_for(lambda: acked(moved["t"]), 120, "an ack from the restarted syncer")
        assert run.cluster.alive("l0")
    finally:
        run.cluster.signal("l0", signal.SIGTERM)
        run.stop_all()
