"""Issue 28/29: the same script by hand, no launcher - the syncer creates the run from the learner's
proposal (`ddiloco syncer --create LAUNCH.toml`, as on Kubernetes or SLURM), signed with its key and
listing the learners whose public keys lie beside it; the learner needs only the environment contract."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from storage.layout import read_descriptor
from storage.log import CommitLog
from storage.store import open_store
from tests.runhelpers import wait_for
from tests.test_launch import DEADLINE_S, _env
from workers.bus.keys import ensure_identities

ROOT = Path(__file__).resolve().parents[1]


def test_a_syncer_creates_the_run_from_a_hand_started_learners_proposal(tmp_path):
    keys, store = tmp_path / "keys", tmp_path / "store"
    ensure_identities(keys, ["syncer", "l0"])
    store.mkdir()
    toml = subprocess.run([sys.executable, "-m", "workers.cli", "launch", "--print-config", "--learners", "1",
                           "--fragments", "2", "--sync-every", "8"], capture_output=True, text=True, env=_env(),
                          timeout=120)
    assert toml.returncode == 0, toml.stderr
    (tmp_path / "run.toml").write_text(toml.stdout)
    syncer = subprocess.Popen([sys.executable, "-m", "workers.cli", "syncer", "--store", str(store), "--create",
                               str(tmp_path / "run.toml"), "--keys", str(keys), "--no-bus", "--spill-poll", "0.1",
                               "--log", str(tmp_path / "syncer.jsonl")], stdout=subprocess.DEVNULL,
                              stderr=open(tmp_path / "syncer.stderr", "w"), env=_env())
    try:
        env = _env(DDILOCO_STORE=str(store), DDILOCO_LEARNER_ID="l0", DDILOCO_PROPOSE="1", DDILOCO_STEPS="120",
                   DDILOCO_KEY=str(keys / "l0.key_secret"), DDILOCO_SYNCER_KEY=str(keys / "syncer.key"),
                   DDILOCO_LOG=str(tmp_path / "l0.jsonl"))
        learner = subprocess.run([sys.executable, str(ROOT / "examples" / "minimal.py")], capture_output=True,
                                 text=True, env=env, timeout=DEADLINE_S)
        assert learner.returncode == 0, learner.stderr[-3000:]
        s = open_store(str(store), create=False)
        desc = read_descriptor(s)
        assert desc.extra["initial_model_from"] == "l0" and desc.security is not None
        assert sorted(desc.security.learners) == ["l0"]
        wait_for(lambda: any(CommitLog(s).read(q).kind == "merge" for q in range(CommitLog(s).tail() + 1)), 120,
                 "a merge of the learner's deltas")
    finally:
        syncer.terminate()
        syncer.wait(timeout=60)
    assert syncer.returncode == 0, (tmp_path / "syncer.stderr").read_text()[-2000:]
    done = subprocess.run([sys.executable, "-m", "workers.cli", "replay", str(store)], capture_output=True, text=True,
                          env=_env(), timeout=DEADLINE_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def test_create_refuses_a_signed_run_without_keys(tmp_path):
    (tmp_path / "run.toml").write_text("")
    (tmp_path / "store").mkdir()
    done = subprocess.run([sys.executable, "-m", "workers.cli", "syncer", "--store", str(tmp_path / "store"),
                           "--create", str(tmp_path / "run.toml"), "--no-bus"], capture_output=True, text=True,
                          env=_env(), timeout=120)
    assert done.returncode != 0 and "--create makes a signed run" in done.stderr
