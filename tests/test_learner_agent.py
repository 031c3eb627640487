"""The learner's sync agent (issue 15, workers/learner/agent.py): sender and receiver in a child
process give the same stored bytes and the same applied versions as the threads; its wire refuses
damaged frames; an agent that keeps dying stops the learner loudly (one that dies once is replaced:
tests/test_agent_faults.py).

Tiny unsigned runs in a temp directory, no syncer, no bus (deltas spill; versions are appended by
hand), so both modes see the same inputs and every figure compared is deterministic."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

from pipeline.errors import FormatError
from storage.layout import read_descriptor, spill_prefix
from storage.store import open_store
from workers.launch import Schedule
from workers.learner.agent_board import Board, BoardArrival
from workers.learner.agent_wire import WIRE_VERSION, Slots, fragment_offsets, pack, unpack

from test_hardening_learner import append_version, make_run, start_learner, tiny_model, train_until


def _spills(store) -> dict[str, bytes]:
    return {k: store.get(k) for k in store.list(spill_prefix("l0", 1))}


def _run(tmp_path, sync_process: bool):
    """Version 1 of fragment 1 is applied before the first step (waited for without stepping), then
    six steps on fixed data and a flush: the same inputs in both modes."""
    store = open_store(str(tmp_path / ("agent" if sync_process else "threads")))
    model = tiny_model()
    desc = make_run(store, model)
    learner, _ = start_learner(store, model, sync_process=sync_process)
    try:
        values = {t.name: np.full(t.shape, 0.25, np.float32) for t in desc.layout.tensors}
        append_version(store, desc, 1, 1, values)
        deadline = time.monotonic() + 20
        while learner.apply_arrivals() == 0:
            assert time.monotonic() < deadline, "version 1 never arrived"
            time.sleep(0.01)
        applied = {n: p.detach().numpy().copy() for n, p in model.named_parameters() if n in desc.layout.fragments[1]}
        torch.manual_seed(1)
        train_until(learner, lambda: learner.step_count >= 6, "six steps")
    finally:
        drained = learner.close(flush=True)      # one delta per trained fragment, spilled (no bus)
    return store, learner, applied, drained


def test_agent_stores_the_same_bytes_and_applies_the_same_versions(tmp_path):
    s_thr, l_thr, applied_thr, ok_thr = _run(tmp_path, False)
    s_ag, l_ag, applied_ag, ok_ag = _run(tmp_path, True)
    assert ok_thr and ok_ag
    for n, v in applied_ag.items():
        assert np.array_equal(v, np.full(v.shape, 0.25, np.float32)), n
        assert np.array_equal(v, applied_thr[n]), n
    assert l_ag.stats()["spilled"] == l_thr.stats()["spilled"] == 2
    assert l_ag.stats()["versions_applied"] == l_thr.stats()["versions_applied"] == 1
    spills_thr, spills_ag = _spills(s_thr), _spills(s_ag)
    assert len(spills_thr) == 2 and spills_ag == spills_thr


def test_agent_wire_refuses_damaged_or_foreign_frames():
    frame = pack("delta", slot=3, header={"a": 1})
    assert unpack(frame) == {"v": WIRE_VERSION, "type": "delta", "slot": 3, "header": {"a": 1}}
    bad = bytearray(frame)
    bad[-1] ^= 1
    with pytest.raises(FormatError, match="checksum"):
        unpack(bytes(bad))
    import zlib
    import msgpack
    body = msgpack.packb({"v": WIRE_VERSION + 1, "type": "delta"})
    with pytest.raises(FormatError, match="version"):
        unpack(zlib.crc32(body).to_bytes(4, "big") + body)


def test_the_board_carries_rounds_arrivals_and_slots_between_two_mappings():
    ours = Board(3, 4)
    theirs = Board(3, 4, fd=ours.fd)          # what the child maps from the inherited fd
    assert ours.opened() == {} and ours.arrival(0) is None and ours.generation() == 0
    assert ours.consumed(2) == 0 and ours.done(3) == 0          # never written: zeros
    theirs.write_opened({0: (1, 4), 2: (1, 5)})
    assert ours.generation() == 1 and ours.opened() == {0: (1, 4), 2: (1, 5)}
    theirs.write_opened({2: (2, 7)})                            # round 4 closed, a new epoch
    assert ours.opened() == {2: (2, 7)}
    a = BoardArrival(1, theirs.version_slot(1, 1), 9, 33, 2, 7, 1.7e9 + 0.25, "announce")
    theirs.write_arrival(1, a)
    assert ours.arrival(1) == a and ours.generation() == 3
    assert theirs.version_slot(1, 1) != theirs.version_slot(1, 2) == theirs.version_slot(1, 0)
    ours.set_consumed(1, 1)
    theirs.set_done(3, 5)
    assert theirs.consumed(1) == 1 and ours.done(3) == 5
    theirs.close(close_fd=False)
    ours.close()


def test_the_learner_rereads_only_the_rounds_that_changed_and_keeps_the_same_rounds_object():
    """``write_opened(before=...)`` rewrites only the fragments whose round changed; the learner's
    view (SyncAgent.opened) checks one seq word per fragment and hands out the same dict object
    until a round changes, which is how ``Learner.answer_rounds`` skips a step with nothing new."""
    from types import SimpleNamespace
    from workers.learner.agent import SyncAgent
    ours = Board(3, 4)
    theirs = Board(3, 4, fd=ours.fd)
    view = SimpleNamespace(board=ours, d=SimpleNamespace(num_fragments=3), _opened=(-1, {}), _opened_seqs=[-1] * 3)
    first = {0: (1, 4), 2: (1, 5)}
    theirs.write_opened(first)
    rounds = SyncAgent.opened(view)
    assert rounds == first and SyncAgent.opened(view) is rounds            # no news: the same object
    seqs = [ours.opened_seq(p) for p in range(3)]
    theirs.write_opened(first, before=first)                             # nothing changed: no record written
    assert [ours.opened_seq(p) for p in range(3)] == seqs and SyncAgent.opened(view) is rounds
    theirs.write_opened({0: (1, 4), 2: (1, 6)}, before=first)            # only fragment 2's round moved
    assert [ours.opened_seq(p) for p in range(3)] == [seqs[0], seqs[1], seqs[2] + 2]
    newer = SyncAgent.opened(view)
    assert newer is not rounds and newer == {0: (1, 4), 2: (1, 6)} and rounds == first   # handed-out dict kept
    theirs.write_opened({2: (1, 6)}, before={0: (1, 4), 2: (1, 6)})      # fragment 0's round closed
    assert SyncAgent.opened(view) == {2: (1, 6)}
    theirs.close(close_fd=False)
    ours.close()


def test_the_board_refuses_a_damaged_record_or_a_foreign_header():
    ours = Board(2, 4)
    ours.write_opened({1: (1, 2)})
    ours.words[ours._opened_at + 5 + 2] ^= 1                   # fragment 1's round word
    with pytest.raises(FormatError, match="checksum"):
        ours.opened()
    with pytest.raises(FormatError, match="header"):
        Board(3, 4, fd=ours.fd)                                 # the child computed another shape
    ours.words[ours._opened_at + 5 + 2] ^= 1
    assert ours.opened() == {1: (1, 2)}
    ours.close()


def test_a_record_held_mid_write_is_waited_for_and_a_dead_writers_is_refused():
    """Issue 25: a writer that loses the GIL or the CPU mid-write holds a record's seq odd for
    milliseconds; a reader that spun a fixed count judged it damaged and the learner died of it."""
    import threading
    ours = Board(2, 4)
    theirs = Board(2, 4, fd=ours.fd)
    theirs.set_done(1, 5)
    at = theirs._done_at + 1 * 3
    seq = int(theirs.words[at])
    theirs.words[at] = seq + 1                   # odd: the writer is "descheduled" mid-write
    def finish_write():
        theirs.words[at] = seq                   # as it was, then the write the writer was doing
        theirs.set_done(1, 6)
    finish = threading.Timer(0.3, finish_write)
    finish.start()
    t0 = time.monotonic()
    assert ours.done(1) == 6                     # waited for the write to end, 0.3 s later
    assert time.monotonic() - t0 >= 0.25
    finish.join()
    theirs.words[at] = int(theirs.words[at]) + 1  # mid-write again, and its writer dies
    ours.writer_alive = lambda: False
    t0 = time.monotonic()
    with pytest.raises(FormatError, match="mid-write"):
        ours.done(1)
    assert time.monotonic() - t0 < 2.0           # at once, not after WRITER_STALL_S
    ours.close()


def test_a_version_slot_is_never_rewritten_before_the_learner_copied_it_out(tmp_path):
    """The agent's publish and the learner's take, on one board and one set of slots (the two
    processes' halves, without the processes): the newest version wins, a slot is written again
    only once the generation it held was copied out, and a held version goes out once it was."""
    from types import SimpleNamespace
    from workers.learner.agent import SyncAgent
    from workers.learner.agent_main import Agent
    from workers.learner.receiver import Arrival
    store = open_store(str(tmp_path / "run"))
    make_run(store, tiny_model())
    d = read_descriptor(store)
    board, slots = Board(d.num_fragments, 4), Slots(d, 4 + 2 * d.num_fragments)
    agent = SimpleNamespace(board=board, slots=slots, gen=[0] * d.num_fragments, pending={})
    learner = SimpleNamespace(board=board, slots=slots, d=d, consumed=[0] * d.num_fragments, queued={},
                              _arrivals_gen=-1, _arrival_seqs=[-1] * d.num_fragments)

    def version(v):
        vals = {name: np.full(shape, float(v), np.float32) for name, shape, _ in fragment_offsets(d, 1)}
        return Arrival(1, v, 10 + v, vals, "announce", 1.0e9 + v, 1, v)

    for v in (1, 2):                 # two generations: one per slot, the learner not looking yet
        agent.pending[1] = version(v)
        Agent.publish(agent)
    agent.pending[1] = version(3)    # generation 3 would reuse generation 1's slot: not copied out
    Agent.publish(agent)
    assert 1 in agent.pending and board.arrival(1).version == 2
    got = SyncAgent.take(learner)    # the newest (2) is copied out; 1 was never read
    assert [(a.fragment, a.version, a.round) for a in got] == [(1, 2, 2)]
    assert all(np.all(x == 2.0) for x in got[0].values.values())
    assert SyncAgent.take(learner) == []                         # nothing new
    Agent.publish(agent)             # consumed 2 >= 3 - 2: generation 3 goes out now
    assert not agent.pending
    (a,) = SyncAgent.take(learner)
    assert (a.version, a.seq, a.found_by, a.committed_at) == (3, 13, "announce", 1.0e9 + 3)
    assert all(np.all(x == 3.0) for x in a.values.values())
    slots.close()
    board.close()


def test_slots_share_values_between_two_mappings(tmp_path):
    store = open_store(str(tmp_path / "run"))
    make_run(store, tiny_model())
    d = read_descriptor(store)
    ours = Slots(d, 3)
    theirs = Slots(d, 3, fd=ours.fd)          # what the child maps from the inherited fd
    names = d.layout.fragments[1]
    shapes = {t.name: tuple(t.shape) for t in d.layout.tensors}
    values = {n: np.random.default_rng(0).standard_normal(shapes[n]).astype(np.float32) for n in names}
    ours.write(2, 1, values)
    got = theirs.read(2, 1)
    assert set(got) == set(names) and all(np.array_equal(got[n], values[n]) for n in names)
    with pytest.raises(FormatError):
        theirs.views(3, 1)
    theirs.close(close_fd=False)
    ours.close()


def test_an_agent_that_keeps_dying_stops_the_learner_loudly(tmp_path):
    """A killed agent is replaced (issue 25: tests/test_agent_faults.py); one that dies
    RESPAWN_LIMIT + 1 times in a row without making a delta durable is not: the learner stops loudly."""
    from workers.learner.agent import RESPAWN_LIMIT
    store = open_store(str(tmp_path / "run"))
    model = tiny_model()
    make_run(store, model)
    learner, _ = start_learner(store, model, sync_process=True)
    try:
        train_until(learner, lambda: learner.step_count >= 2, "two steps")
        agent = learner.sender.agent
        for _ in range(RESPAWN_LIMIT + 1):
            proc = agent.proc
            proc.kill()
            deadline = time.monotonic() + 60
            while agent.proc is proc and agent.failed is None:   # replaced (once ready), or given up
                assert time.monotonic() < deadline, "the agent was neither replaced nor given up"
                time.sleep(0.02)
        assert agent.failed and "not started again" in agent.failed, agent.failed
        with pytest.raises(RuntimeError, match="sync agent"):
            train_until(learner, lambda: False, "the learner to stop", timeout=10)
    finally:
        learner.close(flush=False)


def test_agent_cpus_pin_the_agent_and_bad_sets_are_refused(tmp_path):
    from workers.common.cpus import parse_cpus
    from workers.learner.learner import LearnerConfig
    assert parse_cpus("1-3,0") == (0, 1, 2, 3) and parse_cpus("") is None
    for bad in ("3-1", "a", "-1", "1,,2"):
        with pytest.raises(ValueError, match="cpus"):
            parse_cpus(bad)
    with pytest.raises(ValueError, match="needs sync_process"):
        LearnerConfig(agent_cpus=(0,))
    with pytest.raises(ValueError, match="agent_cpus"):
        LearnerConfig(sync_process=True, agent_cpus=())
    store = open_store(str(tmp_path / "run"))
    model = tiny_model()
    make_run(store, model)
    core = max(os.sched_getaffinity(0))
    learner, _ = start_learner(store, model, sync_process=True, agent_cpus=(core,))
    try:
        train_until(learner, lambda: learner.step_count >= 2, "two steps")
        pid = learner.sender.agent.proc.pid
        tasks = os.listdir(f"/proc/{pid}/task")
        assert len(tasks) > 1                      # its sender and receiver threads are up: all of them pinned
        assert all(os.sched_getaffinity(int(t)) == {core} for t in tasks)
    finally:
        learner.close(flush=False)
    with pytest.raises(RuntimeError, match=r"did not start: ValueError: agent_cpus \[4096\]"):
        start_learner(store, model, sync_process=True, agent_cpus=(4096,))   # no such core: refused at start


@pytest.mark.timeout(180)
def test_a_signed_run_with_the_bus_trains_through_the_agent(tmp_path):
    """``ddiloco learner --sync-process`` against a real syncer: CURVE, signed deltas and versions,
    acks over the bus; every delta is committed (merged or recorded) and versions come back."""
    from storage.log import CommitLog
    from workers.cluster import ClusterConfig, LocalCluster, create_job_run
    from workers.job.job import JobSettings
    from workers.launch import RunSettings
    from runhelpers import TINY
    uri = str(tmp_path / "store")
    job = JobSettings(steps=150, batch_size=4, lr=3e-3, max_bytes=300_000, shards=1)
    settings = RunSettings(schedule=Schedule(fragments=2, sync_every=4), model=TINY.to_dict(), job=job.to_dict())
    create_job_run(open_store(uri), settings, TINY, 0, tmp_path / "keys", ["l0"])
    with LocalCluster(ClusterConfig(uri, tmp_path, keydir=tmp_path / "keys")) as cluster:
        cluster.start_syncers()
        cluster.wait_ready("syncer", timeout_s=60)
        cluster.start_learner("l0", ["--sync-process", "--slow", "4"])   # rounds need a few steps of pace
        cluster.wait_for(cluster.learners_done, 120, "the learner to finish")
        assert cluster.wait_drained(60).ok
        events = cluster.events("l0")
    start = next(e for e in events if e.get("event") == "learner-start")
    stop = next(e for e in events if e.get("event") == "learner-stop")
    assert start.get("sync_process") is True
    assert stop["drained"] and stop["step"] == 150 and stop["acked"] >= 1 and stop["versions_applied"] >= 1, stop
    assert stop["acked"] + stop["spilled"] + stop["superseded"] == stop["deltas"], stop
    assert stop["receiver_failed"] is None and stop["undelivered"] == 0
    made = [e["delta"] for e in events if e.get("event") == "delta"]
    # each delta logged once (by the agent, as it takes it from its slot: not by the learner as well)
    assert len(made) == len(set(made)) == stop["deltas"], (len(made), len(set(made)), stop["deltas"])
    produced = set(made)
    # a delta replaced before it was sent by a newer one of its lineage carries nothing of its own
    superseded = {e["delta"] for e in events if e.get("event") == "delta-superseded"}
    committed = set()
    for rec in CommitLog(open_store(uri, create=False)).read_range(0):
        committed |= {i.delta_id for i in rec.inputs} | {d.delta_id for d in getattr(rec, "dropped", ())}
    assert produced and produced - superseded <= committed, (produced - superseded - committed, superseded)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("syncers", [1, 2])
def test_ddiloco_run_sync_process_starts_every_learner_with_its_agent(tmp_path, syncers):
    """``ddiloco run --sync-process``: every learner trains through its agent, the run drains and
    accounts for each delta. With ``--syncers 2`` each agent sends fragment p's deltas to shard p % 2
    and hears both shards' versions (before, a sharded run was refused).

    ``--pace 0.05``: a learner of this 31k-parameter model otherwise runs its 60 steps in ~0.5 s,
    less than the syncer's clock (0.1 s a step until it has measured the learners) takes to open a
    round of each fragment; on a slow machine a learner then heard rounds of one fragment only (a
    learner that finishes its budget sends no last answers, workers/job/job.py) and the test failed
    for want of time, not of a defect. Padded, the learners live >= 3 s: every fragment's rounds."""
    import json
    import subprocess
    import sys
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "workers.cli", "run", "--learners", "2", "--steps", "60", "--fragments", "2",
           "--sync-every", "8", "--layers", "1", "--width", "32", "--batch-size", "4", "--eval-every", "1000",
           "--plain", "--sync-process", "--syncers", str(syncers), "--pace", "0.05", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    events = [json.loads(line) for f in sorted((out / "logs").glob("l*.jsonl")) for line in f.read_text().splitlines()
              if line.strip()]
    starts = [e for e in events if e.get("event") == "learner-start"]
    assert len(starts) == 2 and all(e.get("sync_process") is True for e in starts)
    made = [e for e in events if e.get("event") == "delta"]
    assert len(made) >= 4 and {e["fragment"] for e in made} == {0, 1}, \
        [(e["id"], e["fragment"], e.get("round"), e.get("step")) for e in made]
    applied = {e["fragment"] for e in events if e.get("event") == "version-applied" and e["version"] >= 1}
    assert applied == {0, 1}, applied        # versions from every shard reached both learners
    summary = json.loads((out / "summary.json").read_text())
    assert summary.get("drained") is not False


def test_a_draining_learner_asks_for_the_counters_and_the_agent_reports_at_once():
    """Counters come at most every STATS_EVERY_S (1 s: each frame wakes the learner mid-step), so a
    draining learner asks for them (``report``) and the agent answers with its latest at once."""
    from types import SimpleNamespace
    from workers.learner.agent import AgentSender
    from workers.learner.agent_main import Agent
    sent = []
    fake = SimpleNamespace(live_stats={}, undelivered=lambda: 1, failed=None, queued={},
                           flush_queued=lambda: None, send=lambda kind, **f: sent.append(kind))
    assert AgentSender(fake).drain(0.25) is False          # never idle: it keeps asking until the deadline
    assert sent and set(sent) == {"report"} and len(sent) >= 2
    calls = []
    agent = SimpleNamespace(report=lambda final=False: calls.append(final))
    assert Agent.handle(agent, {"type": "report"}) is True and calls == [True]   # forced: past the cadence


def test_the_learners_listeners_see_what_its_agent_logs(tmp_path):
    """A learner whose log has listeners (its ``--metrics-port`` metrics) gets the agent's event
    records in the agent's ``stats`` frames: the delta it took and the spill it made reach the
    listener once each, and the log file still holds each line once (the agent wrote it)."""
    from workers.common.events import EventLog, read_events
    from workers.learner.learner import Learner, LearnerConfig
    store = open_store(str(tmp_path / "run"))
    model = tiny_model()
    make_run(store, model)
    heard: list[dict] = []
    events = EventLog(tmp_path / "l0.jsonl", "learner", "l0")
    events.subscribe(heard.append)
    learner = Learner(model, torch.optim.AdamW(model.parameters(), lr=1e-3), store, "l0",
                      LearnerConfig(poll_s=0.02, drain_s=5, sync_process=True), events=events).start()
    try:
        torch.manual_seed(1)
        train_until(learner, lambda: learner.step_count >= 3, "three steps")
    finally:
        assert learner.close(flush=True)             # one delta per fragment, spilled by the agent (no bus)
        events.close()
    written = read_events(tmp_path / "l0.jsonl")
    for name in ("delta", "delta-spilled"):
        in_file = [e["delta"] for e in written if e["event"] == name]
        to_listener = [e["delta"] for e in heard if e["event"] == name]
        assert in_file and sorted(to_listener) == sorted(in_file) and len(set(in_file)) == len(in_file), name
    assert all(e["id"] == "l0" and e["role"] == "learner" for e in heard)
