"""`ddiloco replay` (issue "Replay and inspection of a run's fragment log").

One real 2-learner run on the S3 server, whose syncer (checkpointing every 4 commits) is SIGKILLed
mid-run and restarted, is made once per module and mirrored to a local directory with an ordinary
S3 client: the log verifies bit for bit on S3 and on the mirror, the restarted syncer's recovery
went through the same replay path, --from/--to start at a checkpoint, and every kind of damage
(on private copies of the mirror) is detected, named, and never repaired. tests/test_inspect.py
replays a finished `ddiloco run` in a local directory.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import io
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from infra.chaos.faulty_syncer import EXIT_CODE
from pipeline.codec import decode, encode
from pipeline.envelope import digest, pack_record
from pipeline.types import CommitRecord
from pipeline.version_chain import is_chained
from storage.checkpoints import KIND as CHECKPOINT_KIND, VERSION as CHECKPOINT_VERSION, list_checkpoints
from storage.layout import checkpoint_key, commit_key
from storage.log import CommitLog
from storage.store import open_store
from workers.tools import replay_cli
from workers.bus.keys import SYNCER
from workers.common.refold import rebuild
from workers.tools.replay_verify import replay_run
from workers.common.runs import open_run
from workers.common.versions import (VERSION_DELTA_KIND, VERSION_KIND, delta_codec, encode_version,
                                     max_fragment_bytes)

from conftest import use_s3_env
from runhelpers import TinyRun

pytestmark = pytest.mark.timeout(240)


# -- helpers ------------------------------------------------------------------------------------

def call(configure, argv: list[str], capsys) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    handler = configure(parser)
    rc = handler(parser.parse_args([str(a) for a in argv]))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def records(store_dir) -> list[CommitRecord]:
    log = CommitLog(open_store(str(store_dir)))
    return list(log.read_range(0, log.tail() + 1))


def snapshot(root: Path) -> dict[str, str]:
    """Every object file (not the store's hidden temp dir) and its sha256."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.relative_to(root).parts[0].startswith(".")}


# -- verification of whole runs ---------------------------------------------------------------

@dataclass(frozen=True)
class S3Run:
    uri: str
    mirror: Path          # a local copy made with an ordinary S3 client
    keys: Path | None     # the run's key directory (None: an unsigned run)
    killed_at: int        # the last commit of the first syncer
    recovered: dict       # the restarted syncer's recovery event


@pytest.fixture(scope="module")
def s3run(s3_server, tmp_path_factory) -> S3Run:
    """A run on the S3 server whose syncer (checkpointing every 4 commits) dies like a SIGKILL
    mid-run and is restarted; then mirrored to a local directory the way `aws s3 sync` would."""
    base = tmp_path_factory.mktemp("s3run")
    with pytest.MonkeyPatch.context() as mp:
        use_s3_env(mp, s3_server)
        uri = s3_server.uri(f"replay-{time.time_ns()}")
        tr = TinyRun(uri, base / "tiny", dict(os.environ, OMP_NUM_THREADS="1"), steps=120, learners=2)
        tr.create()

        checkpoints = ["--checkpoint-every", "4"]
        try:
            # The first life dies like a SIGKILL (exit 137, no clean-up) on its 8th merge, after
            # that merge's data is stored and before its commit is appended (the chaos hook,
            # infra/chaos/faulty_syncer.py). A SIGKILL at a chance moment could land inside a
            # commit's PUT, and clean-clone run ci120 once found an empty object at the commit key
            # then: a lost commit, which recovery passes over, but no longer the clean run these
            # replay tests need. Killed between commits, the log is whole and the kill is the same
            # on every run.
            tr.cluster.start_syncer("syncer", ["--crash-before-commit", "8", *checkpoints],
                                    module="infra.chaos.faulty_syncer")
            for m in range(2):   # paced (9.6 s of steps): unpaced on a loaded machine the learners
                tr.learner(f"l{m}", extra=["--pace", "0.08"])   # could end before the new syncer opened a round
            assert tr.wait("syncer", 120) == EXIT_CODE, tr.stderr("syncer")
            injected = [e for e in tr.events("syncer") if e.get("event") == "fault-injected"]
            assert injected, tr.stderr("syncer")
            log = CommitLog(tr.store)
            killed_at = log.tail()
            assert killed_at == injected[0]["seq"] - 1, (killed_at, injected)
            tr.cluster.start_syncer("syncer2", checkpoints)
            for m in range(2):
                assert tr.wait(f"l{m}", 180) == 0, tr.stderr(f"l{m}")
            assert tr.wait_inbox_empty(60), ("the restarted syncer did not commit every durable delta",
                                             tr.store.list("spill/")[:5], tr.stderr("syncer2"))
        finally:
            tr.stop_all()
        recovered = [e for e in tr.events("syncer2") if e.get("event") == "syncer-recovered"]
        assert recovered, tr.stderr("syncer2")
        mirror = base / "mirror"
        _download_prefix(uri, mirror)
    return S3Run(uri, mirror, tr.keydir if tr.secure else None, killed_at, recovered[0])


def test_replay_after_syncer_restart_on_s3_and_its_local_mirror(s3run, s3_env, capsys):
    """The restarted syncer's recovery replayed the log (the same path); the finished log verifies
    on S3 and on the local mirror."""
    rec = s3run.recovered
    assert rec["fence_seq"] == s3run.killed_at + 1
    cp = rec["from_checkpoint"]
    # 0 when the kill landed right after a checkpoint: recovery then starts from it
    assert rec["replayed"] == s3run.killed_at - (cp if cp is not None else 2) >= 0
    recs = records(s3run.mirror)
    assert [r.epoch for r in recs if r.kind == "fence"] == [1, 2]
    assert any(r.kind == "merge" and r.epoch == 2 for r in recs), "the restarted syncer merged nothing"
    merges = sum(r.kind == "merge" for r in recs)
    expected = f"verified {len(recs) - 3} commits, {merges} versions"
    cps = len(list_checkpoints(open_store(str(s3run.mirror))))
    for where in (s3run.uri, s3run.mirror):
        rc, out, err = call(replay_cli.configure, [where], capsys)
        assert rc == 0 and expected in out and f"checkpoints matched: {cps}" in out, (where, err)


def test_replay_from_to_starts_at_the_nearest_checkpoint(s3run, capsys):
    store = open_store(str(s3run.mirror))
    cps = list_checkpoints(store)
    tail = CommitLog(store).tail()
    assert cps and cps[0] + 3 <= tail, (cps, tail)
    cp = cps[0]
    start, end = cp + 3, min(cp + 6, tail)
    rc, out, err = call(replay_cli.configure, [s3run.mirror, "--from", start, "--to", end], capsys)
    assert rc == 0, err
    assert f"started from checkpoint {cp}, caught up over {start - 1 - cp} commits" in out
    assert f"verified {end - start + 1} commits" in out
    report = replay_run(store, open_run(str(s3run.mirror))[1], start, end)
    assert (report.from_checkpoint, report.caught_up, report.commits) == (cp, start - 1 - cp, end - start + 1)


def _download_prefix(uri: str, dest: Path) -> None:
    """What `aws s3 sync s3://bucket/prefix dest` does: every object to dest/<key>."""
    import boto3
    from botocore.config import Config
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], config=Config(s3={"addressing_style": "path"}))
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for obj in page.get("Contents", []):
            path = dest / obj["Key"][len(prefix) + 1:]
            path.parent.mkdir(parents=True, exist_ok=True)
            client.download_file(bucket, obj["Key"], str(path))


def test_replay_writes_nothing_and_prints_progress_lines(s3run, capsys):
    before = snapshot(s3run.mirror)
    rc, out, err = call(replay_cli.configure, [s3run.mirror], capsys)
    assert rc == 0, err
    assert "started from the init commits" in out
    assert "  verify: " in out                         # plain progress lines (not a terminal)
    assert snapshot(s3run.mirror) == before             # replay never writes


def test_replay_argument_errors(s3run, capsys, tmp_path):
    tail = CommitLog(open_store(str(s3run.mirror))).tail()
    rc, _, err = call(replay_cli.configure, [s3run.mirror, "--to", tail + 5], capsys)
    assert rc == 2 and f"the last commit is {tail}" in err
    rc, _, err = call(replay_cli.configure, [s3run.mirror, "--from", 20, "--to", 10], capsys)
    assert rc == 2 and "after --to" in err
    rc, _, err = call(replay_cli.configure, [tmp_path / "nothing-here"], capsys)
    assert rc == 2 and "no run at" in err and not (tmp_path / "nothing-here").exists()
    rc, _, err = call(replay_cli.configure, [tmp_path], capsys)
    assert rc == 2 and "no run at" in err


def test_bar_progress_on_a_terminal(s3run):
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True
    out, err = Tty(), io.StringIO()
    args = argparse.Namespace(run_uri=str(s3run.mirror), s3_endpoint=None, start=None, end=None, plain=False)
    assert replay_cli.replay_command(args, out, err) == 0, err.getvalue()
    text = out.getvalue()
    assert "verify" in text and "━" in text and "verified " in text
    assert "  verify: " not in text                   # no plain lines on a terminal


# -- damage -----------------------------------------------------------------------------------

@pytest.fixture
def damaged(s3run, tmp_path) -> Path:
    """A private copy of the S3 run's local mirror (it has checkpoints), to damage."""
    return Path(shutil.copytree(s3run.mirror, tmp_path / "copy"))


def _target(store_dir) -> CommitRecord:
    """A merge commit with two inputs, after the first few."""
    recs = records(store_dir)
    return next(r for r in recs[8:] if r.kind == "merge" and len(r.inputs) >= 2)


def _reseal(store_dir: Path, seq: int, keys: Path | None, **changes) -> None:
    """Rewrite commit ``seq`` as a valid record with some fields changed, signed with the syncer's
    key if ``keys`` is given (a forgery by someone holding the key, or a syncer bug)."""
    path = store_dir / commit_key(seq)
    rec = dataclasses.replace(CommitRecord.from_bytes(path.read_bytes()), **changes)
    if keys is not None:
        from workers.bus.keys import key_paths, load_identity
        from workers.bus.signing import sign_commit
        signer = load_identity(key_paths(keys, SYNCER)[1]).signer()
        rec = sign_commit(rec, signer, open_run(str(store_dir))[1].run_id)
    path.write_bytes(rec.to_bytes())


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def _alter_version(store_dir: Path, rec: CommitRecord) -> str:
    """Re-encode a stored version, validly, with one tensor nudged; returns that tensor's name."""
    s, d = open_run(str(store_dir))
    chained = is_chained(d.versions.dtype)      # an int4 run stores the version as a delta: alter that
    kind = VERSION_DELTA_KIND if chained else VERSION_KIND
    dec = decode((store_dir / rec.output_key).read_bytes(), kind, max_bytes=max_fragment_bytes(d))
    values = {n: np.asarray(a, dtype=np.float32).copy() for n, a in dec.tensors.items()}
    name = sorted(values)[0]
    values[name].flat[0] += np.float32(0.25)
    m = dec.meta
    if chained:
        blob = encode(VERSION_DELTA_KIND, {k: v for k, v in m.items() if k != "sig"}, values, delta_codec(d))
    else:
        blob = encode_version(d, m["fragment"], m["version"], m["seq"], m["epoch"], values)
    (store_dir / rec.output_key).write_bytes(blob)
    return name


DAMAGE = ["missing-delta", "truncated-delta", "altered-delta", "forged-input-checksum", "forged-weight",
          "forged-output-checksum", "unsigned-forgery", "missing-version", "truncated-version", "altered-version",
          "flipped-commit", "log-gap"]


@pytest.mark.parametrize("kind", DAMAGE)
def test_each_kind_of_damage_is_detected_and_named(kind, damaged, s3run, capsys):
    rec = _target(damaged)
    inp = rec.inputs[1]
    delta = damaged / inp.key
    expect_rc, expect = 3, []
    if kind == "missing-delta":
        delta.unlink()
        expect = [inp.key, "missing", f"commit {rec.seq}"]
    elif kind in ("truncated-delta", "altered-delta"):
        (_truncate if kind == "truncated-delta" else _flip)(delta)
        expect = [inp.key, "checksum", f"commit {rec.seq}", inp.delta_id, "altered or replaced"]
    elif kind == "forged-input-checksum":
        forged = dataclasses.replace(inp, checksum="0" * 64)
        _reseal(damaged, rec.seq, s3run.keys, inputs=(rec.inputs[0], forged, *rec.inputs[2:]))
        expect = [inp.key, "does not match", f"commit {rec.seq}"]
    elif kind == "forged-weight":
        forged = dataclasses.replace(inp, weight=inp.weight + 0.01)
        _reseal(damaged, rec.seq, s3run.keys, inputs=(rec.inputs[0], forged, *rec.inputs[2:]))
        expect_rc, expect = 1, [f"DIVERGED at commit {rec.seq}", f"fragment:      {rec.fragment}",
                                f"input 1 ({inp.delta_id}): weight recorded {inp.weight + 0.01!r}",
                                f"recomputed {inp.weight!r}", "max abs diff"]
    elif kind == "forged-output-checksum":
        _reseal(damaged, rec.seq, s3run.keys, output_checksum="f" * 64)
        expect_rc, expect = 1, [f"DIVERGED at commit {rec.seq}", "recorded output_checksum ffffffffffffffff",
                                rec.output_key, "the commit record was altered"]
    elif kind == "unsigned-forgery":
        if s3run.keys is None:
            pytest.skip("an unsigned run: covered by the forged-* cases")
        _reseal(damaged, rec.seq, None, quorum=rec.quorum + 1)
        expect = [f"commit {rec.seq}", "signature"]
    elif kind in ("missing-version", "truncated-version"):
        path = damaged / rec.output_key
        path.unlink() if kind == "missing-version" else _truncate(path)
        expect = [rec.output_key, f"commit {rec.seq}"] + (["missing"] if kind == "missing-version" else [])
    elif kind == "altered-version":
        tensor = _alter_version(damaged, rec)
        expect_rc, expect = 1, [f"DIVERGED at commit {rec.seq}", f"tensor:        {tensor}",
                                # +0.25, as the (int4 delta) version blob can hold it: about 0.25
                                "max abs diff:  0.2", rec.output_key, "altered or replaced"]
    elif kind == "flipped-commit":
        _flip(damaged / commit_key(rec.seq))
        expect = [commit_key(rec.seq)]
    elif kind == "log-gap":
        (damaged / commit_key(rec.seq)).unlink()
        expect = ["gap", commit_key(rec.seq), "missing"]
    before = snapshot(damaged)
    rc, out, err = call(replay_cli.configure, [damaged, "--to", rec.seq + 2], capsys)
    assert rc == expect_rc, (out, err)
    for text in expect:
        assert text in err, (text, err)
    assert "verified" not in out
    assert snapshot(damaged) == before, "replay must never repair or write anything"


def test_damage_before_a_checkpoint_is_named_and_from_after_it_still_verifies(damaged, capsys):
    """Retention may delete deltas below a checkpoint: a full replay names the missing object and
    suggests --from; a replay from after the checkpoint does not need it."""
    store = open_store(str(damaged))
    recs = records(damaged)
    rec = next(r for r in recs[3:] if r.kind == "merge")
    cp = min(c for c in list_checkpoints(store) if c >= rec.seq)
    assert cp < len(recs) - 1, "the test needs a checkpoint before the end of the log"
    (damaged / rec.inputs[0].key).unlink()
    rc, _, err = call(replay_cli.configure, [damaged], capsys)
    assert rc == 3 and rec.inputs[0].key in err and f"named by commit {rec.seq}" in err, err
    assert f"--from {cp + 1}" in err
    rc, out, err = call(replay_cli.configure, [damaged, "--from", cp + 1], capsys)
    assert rc == 0 and f"started from checkpoint {cp}," in out, err


def _wrong_checkpoint(store_dir: Path, seq: int, fragment: int, keys: Path | None) -> str:
    """Replace checkpoint ``seq`` by a validly sealed (and signed, if ``keys``) state with one
    outer-momentum value of ``fragment`` off by 1; returns that tensor's name."""
    s, d = open_run(str(store_dir))
    state, _ = rebuild(s, d, seq, use_checkpoint=False)
    fs = state.fragments[fragment]
    name = sorted(fs.momentum)[0]
    bad = fs.momentum[name].copy()
    bad.flat[0] += np.float32(1.0)
    fs.momentum[name] = bad
    payload = state.to_bytes()
    if keys is not None:
        from workers.bus.keys import key_paths, load_identity
        from workers.bus.signing import seal_checkpoint
        payload = seal_checkpoint(payload, seq, load_identity(key_paths(keys, SYNCER)[1]).signer(), d.run_id)
    commit = (store_dir / commit_key(seq)).read_bytes()
    (store_dir / checkpoint_key(seq)).write_bytes(pack_record(CHECKPOINT_KIND, CHECKPOINT_VERSION, {
        "seq": seq, "commit_sha256": digest(commit), "payload": payload}))
    return name


def test_a_wrong_checkpoint_is_detected_by_full_and_partial_replay(damaged, s3run, capsys):
    store = open_store(str(damaged))
    cp = list_checkpoints(store)[0]
    later = next(r for r in records(damaged)[cp + 1:] if r.kind == "merge")
    name = _wrong_checkpoint(damaged, cp, later.fragment, s3run.keys)
    rc, _, err = call(replay_cli.configure, [damaged], capsys)
    assert rc == 1, err
    for text in (f"DIVERGED at commit {cp}", f"checkpoint {cp} differs", "outer momentum differ",
                 f"fragment:      {later.fragment}", f"tensor:        {name}", "max abs diff:  1"):
        assert text in err, (text, err)
    # Starting from it, the next merge of that fragment does not reproduce its commit.
    rc, _, err = call(replay_cli.configure, [damaged, "--from", cp + 1], capsys)
    assert rc == 1 and f"DIVERGED at commit {later.seq}" in err and "output checksum" in err, err
    assert "tensor:" in err and "max abs diff:" in err


def test_a_damaged_checkpoint_is_named(damaged, capsys):
    cp = list_checkpoints(open_store(str(damaged)))[0]
    _flip(damaged / checkpoint_key(cp))
    rc, _, err = call(replay_cli.configure, [damaged], capsys)
    assert rc == 3 and f"checkpoint {cp} is damaged" in err and checkpoint_key(cp) in err, err


def test_replay_through_the_ddiloco_command(s3run):
    from importlib import metadata
    if "replay" not in {ep.name for ep in metadata.entry_points(group="ddiloco.commands")}:
        pytest.skip("the replay entry point is not registered in this installation yet")
    done = subprocess.run([sys.executable, "-m", "workers.cli", "replay", str(s3run.mirror), "--to", "10"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "verified 8 commits" in done.stdout, done.stderr
