"""Issue 28, the pieces under `ddiloco launch`: the environment contract, the initial-model proposal
(one model for learners started at once with different seeds), the resume record."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from pipeline.errors import FormatError
from storage.errors import NotFound
from pipeline.fold import published
from storage.layout import PROPOSAL_KEY
from storage.log import claim_epoch
from storage.learner_state import LearnerState, read_state, write_state
from storage.proposal import decode_proposal, encode_proposal, propose, read_proposal
from storage.store import open_store
from workers.launch import RunSettings, Schedule, create_from_proposal
from workers.learner.env import LearnerEnv
from workers.learner.learner import Learner, LearnerConfig


def test_the_environment_contract_round_trips_and_names_a_wrong_variable():
    env = LearnerEnv(store="/runs/x", learner_id="l3", ingest="tcp://h:1", announce="tcp://h:2", key="/k/l3.key_secret",
                     syncer_key="/k/syncer.key", log="/o/l3.jsonl", propose=True, steps=500)
    assert LearnerEnv.from_environ(env.to_environ()) == env
    assert LearnerEnv.from_environ({}) is None          # no launcher: the caller must pass store and id
    with pytest.raises(ValueError, match="DDILOCO_LEARNER_ID"):
        LearnerEnv.from_environ({"DDILOCO_STORE": "/runs/x"})
    with pytest.raises(ValueError, match="DDILOCO_INGEST and DDILOCO_ANNOUNCE"):
        LearnerEnv.from_environ({"DDILOCO_STORE": "/r", "DDILOCO_LEARNER_ID": "l0", "DDILOCO_INGEST": "tcp://h:1"})
    with pytest.raises(ValueError, match="DDILOCO_STEPS must be an int"):
        LearnerEnv.from_environ({"DDILOCO_STORE": "/r", "DDILOCO_LEARNER_ID": "l0", "DDILOCO_STEPS": "many"})
    with pytest.raises(ValueError, match="DDILOCO_LEARNER_ID"):
        LearnerEnv.from_environ({"DDILOCO_STORE": "/r", "DDILOCO_LEARNER_ID": "no/slash"})


def test_a_learner_without_store_or_environment_says_what_it_needs(monkeypatch):
    monkeypatch.delenv("DDILOCO_STORE", raising=False)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="DDILOCO_STORE"):
        Learner(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_a_learner_takes_its_run_and_id_from_the_environment(tmp_path, monkeypatch):
    store = open_store(str(tmp_path / "run"))
    model = torch.nn.Linear(3, 2)
    create_from_proposal_ready(store, model)
    monkeypatch.setenv("DDILOCO_STORE", str(tmp_path / "run"))
    monkeypatch.setenv("DDILOCO_LEARNER_ID", "l7")
    learner = Learner(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert learner.id == "l7" and learner.bus is None and learner.cfg.state_every_s == 5.0
    learner.start()
    learner.close()


def create_from_proposal_ready(store, model) -> None:
    propose(store, "l0", {n: p.detach().numpy().copy() for n, p in model.named_parameters()})
    create_from_proposal(store, RunSettings(schedule=Schedule(fragments=1, sync_every=4)))


def test_a_proposal_is_checked_against_its_digest_and_its_envelope():
    blob = encode_proposal("l1", {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "s": np.float32(2.0).reshape(())})
    learner, tensors, model = decode_proposal(blob)
    assert tensors["s"].shape == () and tensors["s"] == 2.0      # a scalar parameter stays 0-d
    assert learner == "l1" and tensors["w"].shape == (2, 3) and tensors["w"][1, 2] == 5 and model == {}
    assert decode_proposal(encode_proposal("l1", {"w": np.zeros(1, np.float32)}, {"hf_config": {"a": 1}}))[2] == \
        {"hf_config": {"a": 1}}
    damaged = bytearray(blob)
    damaged[-40] ^= 0x01
    with pytest.raises(FormatError):
        decode_proposal(bytes(damaged))
    with pytest.raises(ValueError, match="float32"):
        encode_proposal("l1", {"w": np.zeros(2, dtype=np.float64)})


def test_only_the_first_proposal_lands(tmp_path):
    store = open_store(str(tmp_path / "run"))
    with pytest.raises(NotFound):
        read_proposal(store)
    assert propose(store, "l0", {"w": np.zeros(2, np.float32)}) is True
    assert propose(store, "l1", {"w": np.ones(2, np.float32)}) is False
    learner, tensors, _ = read_proposal(store)
    assert learner == "l0" and not tensors["w"].any()
    assert store.list("proposals/") == [PROPOSAL_KEY]


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def test_learners_started_at_once_with_different_seeds_all_begin_from_one_model(tmp_path):
    """Three learners, three seeds, no run yet: one proposal lands, the run is created from it, and
    every learner (the proposer too) holds exactly version 0 after start - never its own draw."""
    uri = str(tmp_path / "run")
    store = open_store(uri)
    models = {f"l{i}": _model(seed) for i, seed in enumerate((11, 22, 33))}
    own = {lid: {n: p.detach().clone() for n, p in m.named_parameters()} for lid, m in models.items()}
    assert not torch.equal(own["l0"]["0.weight"], own["l1"]["0.weight"])
    learners = {lid: Learner(m, torch.optim.AdamW(m.parameters()), open_store(uri, create=False), lid,
                             LearnerConfig(propose=True, propose_wait_s=60, poll_s=0.05))
                for lid, m in models.items()}
    errors: list[BaseException] = []

    def start(learner):
        try:
            learner.start()
        except BaseException as exc:   # noqa: BLE001 - reported by the assertion below
            errors.append(exc)
    threads = [threading.Thread(target=start, args=(lr,)) for lr in learners.values()]
    for t in threads:
        t.start()
    # the launcher's part: wait for a proposal, create the run from it
    desc = proposer = None
    for _ in range(600):
        try:
            desc, proposer = create_from_proposal(store, RunSettings(schedule=Schedule(fragments=2, sync_every=4)))
            claim_epoch(store, "syncer")   # a syncer started: proposers wait for it (bootstrap.find_run)
            break
        except NotFound:
            threading.Event().wait(0.05)
    assert desc is not None, "no learner proposed its model"
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert desc.extra["initial_model_from"] == proposer
    version0 = published({n: t.numpy() for n, t in own[proposer].items()}, desc.versions.dtype)
    for lid, m in models.items():
        for n, p in m.named_parameters():   # version 0 is the proposer's draw as the run publishes it (bf16)
            assert np.array_equal(p.detach().numpy(), version0[n]), f"{lid} {n} is not {proposer}'s initial weights"
    others = [lid for lid in models if lid != proposer]
    assert all(not torch.equal(models[lid][0].weight.detach(), own[lid]["0.weight"]) for lid in others)
    for lr in learners.values():
        lr.close()


def test_a_learner_without_propose_still_refuses_a_missing_run_at_once(tmp_path):
    model = _model(0)
    learner = Learner(model, torch.optim.SGD(model.parameters(), lr=0.1), open_store(str(tmp_path / "run")), "l0")
    with pytest.raises(NotFound, match="no run at"):
        learner.start()
    assert open_store(str(tmp_path / "run")).list("proposals/") == []


def test_a_new_life_resumes_its_step_count_from_the_record(tmp_path):
    uri = str(tmp_path / "run")
    store = open_store(uri)
    model = _model(1)
    create_from_proposal_ready(store, model)
    cfg = LearnerConfig(state_every_s=1000.0)   # only the record written at close counts here
    first = Learner(model, torch.optim.SGD(model.parameters(), lr=0.01), open_store(uri, create=False), "l0", cfg)
    first.start()
    x = torch.randn(4, 8)
    for _ in first.range(7):
        first.step(lambda: model(x).square().mean(), tokens=4)
    first.close()
    state = read_state(store, "l0")
    assert (state.step, state.tokens, state.incarnation) == (7, 28, first.incarnation)
    second = Learner(model, torch.optim.SGD(model.parameters(), lr=0.01), open_store(uri, create=False), "l0", cfg)
    second.start()
    assert second.step_count == 7 and second.tokens == 28 and second.resumed == state
    assert next(second.range(10)) == 7          # the loop goes on from where the last life stood
    second.close()
    # a learner without resume records starts at 0, as before
    plain = Learner(model, torch.optim.SGD(model.parameters(), lr=0.01), open_store(uri, create=False), "l0")
    plain.start()
    assert plain.step_count == 0
    plain.close()


def test_a_resume_record_is_checked(tmp_path):
    store = open_store(str(tmp_path / "run"))
    write_state(store, LearnerState("l2", 3, 40, 400, 1.5))
    assert read_state(store, "l2") == LearnerState("l2", 3, 40, 400, 1.5)
    assert read_state(store, "l3") is None
    store.put("learner-state/l3", LearnerState("l2", 3, 40, 400, 1.5).to_bytes())
    with pytest.raises(FormatError, match="names learner 'l2'"):
        read_state(store, "l3")
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        LearnerState("l2", 0, -1, 0, 0.0)


def test_a_kept_optimizer_state_comes_back_in_the_next_life(tmp_path):
    """--save-optimizer-every: AdamW's moments and step count survive a restart (plain data, no pickle);
    without it, or for another optimizer, the next life starts a fresh one."""
    uri = str(tmp_path / "run")
    store = open_store(uri)
    model = _model(2)
    create_from_proposal_ready(store, model)
    cfg = LearnerConfig(state_every_s=1000.0, optimizer_every=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    first = Learner(model, opt, open_store(uri, create=False), "l0", cfg).start()
    x = torch.randn(4, 8)
    for _ in first.range(5):
        first.step(lambda: model(x).square().mean(), tokens=4)
    first.close()                         # the last snapshot, at step 5
    before = opt.state_dict()
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    second = Learner(model, fresh, open_store(uri, create=False), "l0", cfg).start()
    after = fresh.state_dict()
    assert after["param_groups"][0]["betas"] == (0.8, 0.95)
    for i, st in before["state"].items():
        for name, v in st.items():
            assert torch.equal(after["state"][i][name], v), (i, name)
    second.close()
    # another optimizer's shape: refused, reported, fresh
    other = torch.optim.AdamW([model[0].weight], lr=1e-2)
    third = Learner(model, other, open_store(uri, create=False), "l0", cfg).start()
    assert other.state_dict()["state"] == {}
    third.close()
    with pytest.raises(ValueError, match="needs state_every_s"):
        LearnerConfig(optimizer_every=10)
