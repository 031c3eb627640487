"""The learner's sync agent through faults (issue 25, defects 6 and 7; workers/learner/agent.py).

6. A SIGKILLed agent used to take its learner with it (the next step raised: exit 1, optimizer
   state lost), and an agent whose learner died exited without making what it held durable.
   Now the learner starts a new agent and trains on, and an orphaned agent drains first.
7. A delta held back while every slot was in flight and replaced by a newer one of its lineage
   was counted as never durable: a clean close reported "1 delta(s) were never made durable" and
   exited 4. Now it is logged as made and superseded, as a threaded Sender logs it.

Tiny unsigned runs in temp directories (tests/test_learner_agent.py); an in-process syncer where
deltas must be merged, a bare ZeroMQ ROUTER where they must stay unacknowledged. Every wait is on a
condition with a generous deadline."""
from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from infra.chaos.invariants import Observation, token_ledger
from pipeline.types import delta_id
from storage.layout import spill_key
from storage.log import CommitLog
from storage.store import open_store
from workers.bus.bus import BusConfig, Message, SyncerBus
from workers.common.events import EventLog, read_events
from workers.learner.agent import DELTA_SLOTS, SyncAgent, _add_counters
from workers.learner.learner import Learner, LearnerConfig

from runhelpers import free_port, syncer_thread
from test_hardening_learner import make_run, tiny_model, train_until

REPO = Path(__file__).resolve().parents[1]


def _agent_learner(store, model, log: Path, bus: BusConfig | None = None, drain_s: float = 20.0) -> Learner:
    events = EventLog(log, "learner", "l0")       # a file: the agent's own events land there too
    return Learner(model, torch.optim.AdamW(model.parameters(), lr=1e-3), store, "l0",
                   LearnerConfig(poll_s=0.05, drain_s=drain_s, sync_process=True), bus=bus, events=events).start()


def _named(events: list[dict], name: str) -> list[dict]:
    return [e for e in events if e.get("event") == name]


class _QuietSyncer(threading.Thread):
    """A bare ROUTER standing in for the syncer: it answers every hello and heartbeat (so the
    agent's Sender counts it alive and waits for acks instead of spilling) and records every delta
    it is sent, acking them ``durable`` only once ``ack`` is set."""

    def __init__(self):
        super().__init__(daemon=True)
        self.ports = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        self.deltas: list[dict] = []          # the headers, in arrival order
        self.heard = 0                        # hellos and heartbeats answered
        self.ack, self.stop, self.up = threading.Event(), threading.Event(), threading.Event()

    def run(self) -> None:
        bus = SyncerBus(BusConfig(*self.ports))
        self.up.set()
        owed: dict[bytes, list[str]] = {}
        try:
            while not self.stop.is_set():
                got = bus.recv(0.05)
                if got is not None and not isinstance(got[1], Exception):
                    ident, m = got
                    if m.type == "delta":
                        self.deltas.append(m.fields["header"])
                        owed.setdefault(ident, []).append(delta_id(*(m.fields["header"][k] for k in
                                                                     ("learner", "incarnation", "seq"))))
                    elif m.type in ("hello", "heartbeat"):
                        bus.send_to(ident, Message("ack", {"delta_id": "none", "status": "durable"}))
                        self.heard += 1
                if self.ack.is_set():
                    for ident, ids in owed.items():
                        for did in ids:
                            bus.send_to(ident, Message("ack", {"delta_id": did, "status": "durable"}))
                    owed = {}
        finally:
            bus.close()

    def ids(self) -> list[str]:
        return [delta_id(h["learner"], h["incarnation"], h["seq"]) for h in list(self.deltas)]


def _state(pid: int) -> str:
    """The process's state letter (R, S, T stopped, Z ...); "" when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return ""


def _wait_heard(syncer: _QuietSyncer, proc: subprocess.Popen) -> None:
    """Until the bus answered the agent twice (its hello, then a heartbeat a second later): its
    Sender read the first answer by then, so it counts the syncer alive and waits for acks."""
    deadline = time.monotonic() + 60
    while syncer.heard < 2:
        assert time.monotonic() < deadline and proc.poll() is None, "the agent never reached the bus"
        time.sleep(0.02)


def _gone(pid: int) -> bool:
    """Exited (a zombie nobody reaped counts as exited: it runs nothing)."""
    return _state(pid) in ("", "Z")


def _stop(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until it is stopped: from then on it copies nothing out."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while _state(pid) not in ("T", "t"):
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        time.sleep(0.01)


@pytest.mark.timeout(300)
def test_a_killed_agent_is_replaced_and_the_learner_trains_on(tmp_path):
    """SIGKILL the agent of a learner that trains against a real syncer: no step raises, the same
    optimizer keeps its state, a new agent comes up, and deltas made after the kill are merged.
    Every delta of the run is accounted for by the chaos ledger (none left in flight)."""
    store = open_store(str(tmp_path / "run"))
    model = tiny_model()
    make_run(store, model)
    ports = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    stop = threading.Event()
    syncer, thread = syncer_thread(store, bus=BusConfig(*ports), until=lambda s: stop.is_set(), timeout=240)
    log = tmp_path / "l0.jsonl"
    learner = _agent_learner(store, model, log, bus=BusConfig(*ports))
    optimizer = learner.optimizer
    try:
        def paced(cond):
            def check():
                time.sleep(0.005)      # a step's time: the syncer's round clock follows the learner's pace
                return cond()
            return check
        train_until(learner, paced(lambda: learner.applied >= 1), "a first merged version", timeout=90)
        agent = learner.sender.agent
        first = agent.proc
        first.kill()
        after = learner.seq            # deltas from this seq on were made after the kill

        def merged_after_kill() -> bool:
            if agent.proc is first or learner.step_count % 10:
                return False
            made = {delta_id("l0", learner.incarnation, s) for s in range(after, learner.seq)}
            return any(i.delta_id in made for rec in CommitLog(store).read_range(0) for i in rec.inputs)
        train_until(learner, paced(merged_after_kill), "a delta made after the kill merged", timeout=150)
    finally:
        drained = learner.close()
        learner.events.close()
        stop.set()
        thread.join(60)
    assert drained and agent.respawns >= 1 and agent.proc is not first
    assert learner.optimizer is optimizer
    assert all(int(s["step"]) == learner.step_count for s in optimizer.state.values())   # AdamW kept counting
    events = read_events(log)
    assert len(_named(events, "learner-start")) == 1 and len(_named(events, "sync-agent-respawned")) >= 1
    assert _named(events, "sync-agent-lost")[0]["exit_code"] == -signal.SIGKILL
    stop_event = _named(events, "learner-stop")[-1]
    assert stop_event["drained"] and stop_event["undelivered"] == 0, stop_event
    obs = Observation(list(CommitLog(store).read_range(0)), {"l0": events}, {}, {}, [], drained=False)
    ledger = token_ledger(obs)
    assert ledger.ok, ledger.detail
    assert ledger.data["deltas"].get("in-flight-at-shutdown", 0) == 0, ledger.data["deltas"]


def test_a_replaced_held_delta_is_superseded_and_a_clean_close_drains(tmp_path):
    """Stop the agent (SIGSTOP) so that every delta slot stays in flight, answer fragment 0 more
    often than there are slots: the last two are held, the newer replacing the older. Resumed, the
    learner drains cleanly (exit status 0, nothing "never made durable") and the replaced delta is
    logged as made and superseded, as with a threaded Sender."""
    from workers.commands import learner_exit
    store = open_store(str(tmp_path / "run"))
    model = tiny_model()
    make_run(store, model)
    log = tmp_path / "l0.jsonl"
    learner = _agent_learner(store, model, log)
    try:
        train_until(learner, lambda: learner.step_count >= 2, "two steps")
        agent = learner.sender.agent
        _stop(agent.proc.pid)
        try:
            for _ in range(DELTA_SLOTS + 1):      # every free slot, then one held back
                learner._emit_delta(0, 0)
                if agent.queued:
                    break
            ((replaced, _),) = agent.queued.values()
            learner._emit_delta(0, 0)             # the same lineage: replaces the held one
            assert len(agent.queued) == 1 and agent.own["superseded"] == 1
        finally:
            os.kill(agent.proc.pid, signal.SIGCONT)
    finally:
        drained = learner.close(flush=False)
        learner.events.close()
    events = read_events(log)
    stop_event = _named(events, "learner-stop")[-1]
    err = io.StringIO()
    assert drained and learner_exit("l0", str(store.uri), stop_event, err) == 0 and err.getvalue() == ""
    made = [e["delta"] for e in _named(events, "delta")]
    superseded = {e["delta"] for e in _named(events, "delta-superseded")}
    spilled = {e["delta"] for e in _named(events, "delta-spilled")}
    assert len(made) == len(set(made)) == learner.seq >= 2
    assert set(made) == spilled | superseded and not spilled & superseded
    assert replaced.id in superseded and replaced.id not in spilled
    assert stop_event["superseded"] == len(superseded) and stop_event["spilled"] == len(spilled)
    assert stop_event["undelivered"] == 0 and stop_event["deltas"] == len(made)


ORPHAN_LEARNER = r"""
import sys, time
import numpy as np
from pipeline.types import DeltaHeader
from storage.layout import read_descriptor
from storage.log import CommitLog
from storage.store import open_store
from workers.bus.bus import BusConfig
from workers.common.events import EventLog
from workers.learner.agent import AgentSetup, SyncAgent
from workers.learner.sender import SenderConfig

uri, log, ingest, announce = sys.argv[1:5]
store = open_store(uri, create=False)
d = read_descriptor(store)
beat = {"learner": "l0", "incarnation": 1, "step": 3, "step_time_s": 0.01, "tokens_per_s": 1600.0, "loss": 1.0}
setup = AgentSetup(uri, None, "l0", log, BusConfig(ingest, announce), SenderConfig(ack_timeout_s=10.0), 0.05,
                   CommitLog(store).tail(), {p: 0 for p in range(d.num_fragments)}, beat, drain_s=60.0)
agent = SyncAgent(d, setup, lambda: beat, EventLog(log, "learner", "l0"))
agent.start()
print(agent.proc.pid, flush=True)
sys.stdin.readline()       # the test's go: the agent's Sender has heard from the bus (it waits for acks)
shapes = {t.name: tuple(t.shape) for t in d.layout.tensors}
agent.submit(DeltaHeader("l0", 1, 0, 0, 0, 3, 48, 2, 0), {n: np.full(shapes[n], 0.5, np.float32)
                                                          for n in d.layout.fragments[0]})
time.sleep(600)
"""


@pytest.mark.timeout(180)
def test_an_orphaned_agent_spills_the_delta_it_holds_before_it_exits(tmp_path):
    """A learner process (a SyncAgent, no model) hands its agent one delta and is SIGKILLed while
    the delta waits for an ack that never comes. The agent sees EOF, makes the delta durable
    (spilled, after the Sender's ack timeout) and exits. Before, it exited at once: delta lost."""
    store = open_store(str(tmp_path / "run"))
    make_run(store, tiny_model())
    syncer = _QuietSyncer()
    syncer.start()
    assert syncer.up.wait(30)
    log = tmp_path / "l0.jsonl"
    proc = subprocess.Popen([sys.executable, "-c", ORPHAN_LEARNER, str(tmp_path / "run"), str(log), *syncer.ports],
                            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    agent_pid = None
    try:
        agent_pid = int(proc.stdout.readline())
        _wait_heard(syncer, proc)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        deadline = time.monotonic() + 60
        while not syncer.deltas:              # sent: now the agent holds it, unacked
            assert time.monotonic() < deadline and proc.poll() is None, "the delta never reached the bus"
            time.sleep(0.02)
        proc.kill()                           # the learner dies; its agent sees EOF
        proc.wait(30)
        deadline = time.monotonic() + 120
        while not _gone(agent_pid):
            assert time.monotonic() < deadline, "the orphaned agent did not exit"
            time.sleep(0.05)
    finally:
        syncer.stop.set()
        syncer.join(30)
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        if agent_pid is not None and not _gone(agent_pid):
            os.kill(agent_pid, signal.SIGKILL)
    assert syncer.ids() == ["l0/1/0"] and store.exists(spill_key("l0", 1, 0))
    events = read_events(log)
    assert _named(events, "sync-agent-orphaned")[0]["held"] == 1
    (drained,) = _named(events, "sync-agent-drained")
    assert drained["drained"] and drained["spilled"] == 1 and drained["undelivered"] == 0
    assert [e["delta"] for e in _named(events, "delta-spilled")] == ["l0/1/0"]


@pytest.mark.timeout(240)
def test_a_dead_agents_unsent_deltas_are_resent_and_its_unacked_ones_answered_again(tmp_path):
    """Delta A is sent and waits for its ack in the agent; the agent is then stopped with delta B
    still in its slot, and killed. The new agent gets B from the old slot (same id, same bytes'
    fragment) and the learner answers A's round again from its parameters (same fragment and
    base, at least A's steps): A is logged superseded, nothing is left in flight."""
    store = open_store(str(tmp_path / "run"))
    model = tiny_model()
    make_run(store, model)
    syncer = _QuietSyncer()
    syncer.start()
    assert syncer.up.wait(30)
    log = tmp_path / "l0.jsonl"
    learner = _agent_learner(store, model, log, bus=BusConfig(*syncer.ports))
    try:
        train_until(learner, lambda: learner.step_count >= 3 and syncer.heard >= 2, "the agent on the bus", 60)
        agent = learner.sender.agent
        first = agent.proc
        a = delta_id("l0", learner.incarnation, learner.seq)
        learner._emit_delta(0, 0)
        train_until(learner, lambda: a in syncer.ids(), "delta A on the bus", timeout=60)
        _stop(first.pid)                      # B stays in its slot: the agent never copies it out
        b = delta_id("l0", learner.incarnation, learner.seq)
        learner._emit_delta(1, 0)
        first.kill()
        lost = {"event": "delta-superseded", "delta": a}

        def recovered() -> bool:
            seen = read_events(log)
            return b in syncer.ids() and any(all(e.get(k) == v for k, v in lost.items()) for e in seen)
        train_until(learner, recovered, "B resent and A answered again", timeout=120)
        syncer.ack.set()                      # from now on every delta is acked: the close drains
    finally:
        drained = learner.close(flush=False)
        learner.events.close()
        syncer.stop.set()
        syncer.join(30)
    assert drained and agent.respawns == 1
    events = read_events(log)
    (superseded,) = [e for e in _named(events, "delta-superseded") if e["delta"] == a]
    assert superseded["reason"] == "sync agent died"
    sent = {delta_id(h["learner"], h["incarnation"], h["seq"]): h for h in syncer.deltas}
    a_header = sent[a]
    again = [h for h in sent.values() if h["seq"] > a_header["seq"] and h["fragment"] == 0
             and h["base_version"] == a_header["base_version"]]
    assert again and max(h["c_steps"] for h in again) >= a_header["c_steps"]
    assert syncer.ids().count(b) == 1 and sent[b]["fragment"] == 1       # B: from the new agent only
    made = [e["delta"] for e in _named(events, "delta")]
    assert b in made and made.count(b) == 1 and learner.seq == len(set(made))
    ledger = token_ledger(Observation([], {"l0": events}, {}, {}, [], drained=False))
    assert ledger.ok, ledger.detail
    assert ledger.data["deltas"].get("in-flight-at-shutdown", 0) == 0, ledger.data["deltas"]


def test_the_dead_childrens_counters_are_added_to_the_live_ones():
    """A learner's counters cover every agent it had: counts add up, peaks take the larger, the
    last error and the mean copy wait are the newest child's, and a failure is the live child's only."""
    dead = {"sender": {"spilled": 2, "peak_held": 5, "last_error": "disk full"},
            "receiver": {"errors": 1, "copy_wait_s": 0.5, "failed": "stuck"},
            "traffic": {"store": {"put_if_absent": 2, "get": 7}, "bus": None}}
    live = {"sender": {"spilled": 1, "peak_held": 3, "last_error": ""},
            "receiver": {"errors": 0, "copy_wait_s": 0.25, "failed": None},
            "traffic": {"store": {"put_if_absent": 1, "get": 2}, "bus": {"sent_msgs": 4}}}
    got = _add_counters(dead, live)
    assert got["sender"] == {"spilled": 3, "peak_held": 5, "last_error": "disk full"}
    assert got["receiver"] == {"errors": 1, "copy_wait_s": 0.25, "failed": None}
    assert got["traffic"] == {"store": {"put_if_absent": 3, "get": 9}, "bus": {"sent_msgs": 4}}
    assert _add_counters({}, {})["traffic"] == {"store": None, "bus": None}


def test_a_replacement_resumes_from_the_oldest_version_the_learner_holds(tmp_path):
    """The new child's log cursor (per syncer shard) is the oldest commit among the versions the
    learner took, or the start cursor for a fragment it took none of, so no newer version is missed."""
    from types import SimpleNamespace
    view = SimpleNamespace(setup=SimpleNamespace(cursor=7), held={0: (3, 12), 1: (2, 9), 2: (0, None)})
    assert SyncAgent._resume_point(view) == (7, {0: 3, 1: 2, 2: 0})
    view.held[2] = (1, 15)
    assert SyncAgent._resume_point(view) == (9, {0: 3, 1: 2, 2: 1})
    sharded = SimpleNamespace(setup=SimpleNamespace(cursor=[4, 5]), held={0: (3, 12), 1: (2, 9), 2: (1, 8),
                                                                              3: (0, None)})
    assert SyncAgent._resume_point(sharded) == ([8, 5], {0: 3, 1: 2, 2: 1, 3: 0})   # shard p % 2
