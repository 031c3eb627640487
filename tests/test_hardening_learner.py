"""Issue 11, learner side: a learner whose model turns non-finite keeps training (item 2), its
per-step figures are bounded (item 6), a float64 model is refused clearly (item 15), and the
receiver never silently passes a commit whose version it could not load (item 12).

The run is a tiny unsigned one in a temp directory; commits are appended by hand (no syncer, no
bus), so every test is deterministic. Tests wait on conditions with deadlines, never on sleeps."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from pipeline.checksum import tensor_digest
from pipeline.fold import published
from pipeline.descriptor import VersionsConfig
from pipeline.types import CommitRecord
from storage.errors import StoreError
from storage.layout import commit_key, version_key
from storage.log import CommitLog
from storage.store import open_store
from workers.launch import RunSettings, Schedule, create_run
from workers.learner.learner import Learner, LearnerConfig
from workers.common.versions import VersionTracker, encode_version

from runhelpers import Recorder


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def make_run(store, model):
    """A run for hand-appended versions (``append_version``): bf16 versions, whose values a test
    chooses exactly (an int4 run's version is its previous one plus a quantised delta,
    tests/test_version_chain.py)."""
    init = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    return create_run(store, init, RunSettings(schedule=Schedule(fragments=2, sync_every=4),
                                               versions=VersionsConfig("bf16")))


def append_version(store, desc, fragment: int, version: int, values: dict[str, np.ndarray]) -> CommitRecord:
    """A merge commit of ``fragment`` naming a version blob with ``values`` (what a syncer writes)."""
    log = CommitLog(store)
    seq = log.tail() + 1
    part = published({n: values[n] for n in desc.layout.fragments[fragment]}, desc.versions.dtype)
    key = version_key(fragment, version, 0)
    checksum = tensor_digest(part)
    store.put_if_absent(key, encode_version(desc, fragment, version, seq, 0, part, None, checksum))
    rec = CommitRecord(seq=seq, epoch=0, kind="merge", fragment=fragment, version=version, output_key=key,
                       output_checksum=checksum, info={"committed_at": time.time()})
    log.append(rec)
    return rec


def train_until(learner, cond, what: str, timeout: float = 20.0, losses: list | None = None):
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        loss = learner.step(lambda: torch.nn.functional.mse_loss(learner.model(x), y), tokens=16)
        if losses is not None:
            losses.append(loss)
        if cond():
            return
    raise AssertionError(f"timed out waiting for {what}")


def start_learner(store, model, **cfg):
    events = Recorder()
    learner = Learner(model, torch.optim.AdamW(model.parameters(), lr=1e-3), store, "l0",
                      LearnerConfig(poll_s=0.02, drain_s=5, **cfg), events=events)
    return learner.start(), events


def params_finite(model) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def bomb(desc, value=1e30) -> dict[str, np.ndarray]:
    return {t.name: np.full(t.shape, value, np.float32) for t in desc.layout.tensors}


# -- item 2: non-finite models ---------------------------------------------------------------------

def test_a_version_that_makes_the_model_explode_is_reverted(tmp_path):
    """Old code: the learner applied the bomb, every later loss and parameter was NaN, and its
    next delta killed the sender ("non-finite values"). Now the step is skipped, reported, and
    the fragment goes back to its last good version; training goes on."""
    store = open_store(str(tmp_path / "run"))
    model = tiny_model()
    desc = make_run(store, model)
    learner, events = start_learner(store, model)
    try:
        train_until(learner, lambda: learner.step_count >= 3, "three good steps")
        good = {n: p.detach().clone() for n, p in model.named_parameters() if n in desc.layout.fragments[0]}
        append_version(store, desc, 0, 1, bomb(desc))
        train_until(learner, lambda: events.named("nonfinite-step"), "the bomb to be applied and caught")
        (ev,) = events.named("nonfinite-step")
        assert ev["action"] == "reload-last-good" and ev["reloaded"] == {"0": 0}, ev
        assert learner.base_version[0] == 0 and learner.c_steps[0] == 0
        for n, p in model.named_parameters():
            if n in desc.layout.fragments[0]:    # its version-0 values (AdamW moved them a little since: not equal)
                assert torch.equal(p.detach(), torch.from_numpy(learner.base[0][n])), n
        assert not all(torch.equal(good[n], torch.from_numpy(learner.base[0][n])) for n in good)
        losses = []
        steps = learner.step_count
        train_until(learner, lambda: learner.step_count >= steps + 5, "five more steps", losses=losses)
        assert all(np.isfinite(losses[-5:])) and params_finite(model)
        assert learner.stats()["nonfinite_steps"] == 1 and learner.stats()["fragments_reloaded"] == 1
    finally:
        learner.close()


def test_own_divergence_skips_then_resets_to_the_current_versions(tmp_path):
    store = open_store(str(tmp_path / "run"))
    model = tiny_model()
    make_run(store, model)
    learner, events = start_learner(store, model)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    ok = lambda: torch.nn.functional.mse_loss(model(x), y)          # noqa: E731
    nan = lambda: torch.nn.functional.mse_loss(model(x), y) * float("nan")   # noqa: E731
    try:
        learner.step(ok, tokens=4)
        before = (learner.step_count, learner.tokens, list(learner.c_steps))
        learner.step(nan, tokens=4)     # one bad batch: skipped, nothing counted
        assert (learner.step_count, learner.tokens, list(learner.c_steps)) == before
        assert events.named("nonfinite-step")[-1]["action"] == "skip" and params_finite(model)
        learner.step(nan, tokens=4)
        learner.step(nan, tokens=4)     # third in a row: the learner's own training diverged
        ev = events.named("nonfinite-step")[-1]
        assert ev["action"] == "reset-to-current" and ev["reloaded"] == {"0": 0, "1": 0}, ev
        assert learner.step(ok, tokens=4) == pytest.approx(learner.loss_ewma)
    finally:
        learner.close()


def test_a_learner_that_starts_from_a_bad_version_steps_back_through_storage(tmp_path):
    """Nothing good in memory: after a reset does not help, older versions come from storage."""
    store = open_store(str(tmp_path / "run"))
    model = tiny_model()
    desc = make_run(store, model)
    append_version(store, desc, 1, 1, bomb(desc))
    learner, events = start_learner(store, model)
    try:
        assert learner.base_version == {0: 0, 1: 1}
        losses = []
        train_until(learner, lambda: any(e["action"] == "step-back" for e in events.named("nonfinite-step")),
                    "a step back to an older version", losses=losses)
        back = [e for e in events.named("nonfinite-step") if e["action"] == "step-back"][0]
        assert back["reloaded"] == {"1": 0}        # fragment 0 has nothing older than v0: left as it is
        assert learner.base_version == {0: 0, 1: 0}
        train_until(learner, lambda: learner.step_count >= 3, "good steps after stepping back", losses=losses)
        assert np.isfinite(losses[-1]) and params_finite(model)
    finally:
        learner.close()


# -- item 15: a float64 model ----------------------------------------------------------------------

def test_a_float64_model_is_refused_with_the_fix(tmp_path):
    store = open_store(str(tmp_path / "run"))
    make_run(store, tiny_model())
    model = tiny_model().double()
    learner = Learner(model, torch.optim.AdamW(model.parameters()), store, "l0")
    with pytest.raises(ValueError, match=r"float64 parameters .*model\.float\(\)"):
        learner.start()
    with pytest.raises(ValueError, match=r"float64.*model\.float\(\)"):
        create_run(open_store(str(tmp_path / "other")), {n: p.detach().numpy() for n, p in model.named_parameters()},
                   RunSettings(schedule=Schedule(fragments=2, sync_every=4)))


# -- item 6: bounded per-step figures --------------------------------------------------------------

def test_per_step_figures_are_bounded_windows(tmp_path):
    store = open_store(str(tmp_path / "run"))
    model = tiny_model()
    make_run(store, model)
    learner, _ = start_learner(store, model, stats_window=32)
    try:
        train_until(learner, lambda: learner.step_count >= 100, "100 steps")
        assert len(learner.step_times) == 32 and len(learner.gaps) == 32
        s = learner.stats()
        assert s["max_gap_s"] >= max(learner.gaps) and s["mean_step_s"] > 0 and s["median_step_s"] > 0
    finally:
        learner.close()


# -- item 12: the receiver never passes a version it could not load --------------------------------

def test_a_version_that_failed_to_load_is_retried_not_skipped(tmp_path, flaky):
    """Old code: the poll cursor moved past the commit; the version was never applied (until some
    later commit of the fragment), and nothing said so."""
    inner = open_store(str(tmp_path / "run"))
    model = tiny_model()
    desc = make_run(inner, model)
    store = flaky(inner)
    learner, events = start_learner(store, model)
    try:
        values = {t.name: np.full(t.shape, 0.01, np.float32) for t in desc.layout.tensors}
        store.fail("get", times=5, prefix=version_key(0, 1, 0))
        append_version(inner, desc, 0, 1, values)
        train_until(learner, lambda: learner.base_version[0] == 1, "version 1 to be applied after the failures")
        stuck = events.named("receiver-stuck")
        assert stuck and stuck[0]["what"] == "fragment 0", events.named("receiver-error")
        assert events.named("receiver-recovered")
        assert learner.receiver.failed is None and learner.stats()["receiver_failed"] is None
        assert learner.stats()["bytes_received"] > 0
    finally:
        learner.close()


def test_failed_flag_is_set_while_versions_cannot_load(tmp_path, flaky):
    inner = open_store(str(tmp_path / "run"))
    model = tiny_model()
    desc = make_run(inner, model)
    store = flaky(inner)
    learner, events = start_learner(store, model)
    try:
        store.fail("get", times=10**6, prefix=version_key(1, 1, 0))
        append_version(inner, desc, 1, 1, {t.name: np.zeros(t.shape, np.float32) for t in desc.layout.tensors})
        train_until(learner, lambda: learner.stats()["receiver_failed"], "the receiver to report itself failed")
        assert "fragment 1" in learner.stats()["receiver_failed"]
        assert "injected failure" in learner.stats()["receiver_failed"]
    finally:
        learner.close()


def test_tracker_poll_keeps_the_commits_it_read_before_a_failure(tmp_path, flaky):
    """Old code: the cursor had moved past the commits read before the failing read, and the
    exception threw them away: those versions were silently never applied."""
    inner = open_store(str(tmp_path / "run"))
    model = tiny_model()
    desc = make_run(inner, model)
    store = flaky(inner)
    tracker = VersionTracker(store, desc)
    tracker.latest()
    a = append_version(inner, desc, 0, 1, bomb(desc, 0.5))
    b = append_version(inner, desc, 1, 1, bomb(desc, 0.5))
    store.fail("get", times=1, prefix=commit_key(b.seq), error=StoreError)   # not retried by the log
    assert [r.seq for r in tracker.poll()] == [a.seq]
    assert [r.seq for r in tracker.poll()] == [b.seq]


def test_a_crashed_receiver_thread_restarts_and_says_so(tmp_path, monkeypatch):
    store = open_store(str(tmp_path / "run"))
    model = tiny_model()
    desc = make_run(store, model)
    learner, events = start_learner(store, model)
    try:
        real = learner.receiver._poll
        calls = {"n": 0}

        def boom(found_by):
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("bug in the receiver")
            return real(found_by)
        monkeypatch.setattr(learner.receiver, "_poll", boom)
        train_until(learner, lambda: any(e.get("what") == "thread" for e in events.named("receiver-error")),
                    "the crash to be reported")
        append_version(store, desc, 0, 1, bomb(desc, 0.25))
        train_until(learner, lambda: learner.base_version[0] == 1, "versions to keep arriving after the restart")
        assert learner.receiver.failed is None
    finally:
        learner.close()


def test_syncer_stats_are_running_aggregates_not_lists():
    """Old code: SyncerStats.grace_waits and round_sizes were lists with one entry per commit."""
    import pickle
    from workers.syncer.syncer import SyncerStats
    s = SyncerStats()
    for i in range(20_000):
        s.round_sizes.append(1 + i % 3)
        s.grace_waits.append(0.5)
    assert s.round_sizes.mean == pytest.approx(2.0, abs=1e-3) and s.grace_waits.mean == 0.5
    assert len(pickle.dumps(s.round_sizes)) < 300 and len(pickle.dumps(s.grace_waits)) < 300


def test_a_finite_loss_with_non_finite_gradients_is_skipped(tmp_path):
    store = open_store(str(tmp_path / "run"))
    model = tiny_model()
    make_run(store, model)
    learner, events = start_learner(store, model)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    try:
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        loss = learner.step(lambda: torch.nn.functional.mse_loss(model(x), y)
                            + (model[0].bias * 0).abs().sqrt().sum(), tokens=4)   # d sqrt(|0|) = inf
        assert np.isfinite(loss) and learner.step_count == 0
        assert events.named("nonfinite-step")[-1]["where"] == "gradient"
        assert all(torch.equal(before[n], p.detach()) for n, p in model.named_parameters())
    finally:
        learner.close()
