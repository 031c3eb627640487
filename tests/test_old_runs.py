"""Every stored run stays verifiable (issue 26): a small signed run written by each earlier writer
whose formats differ (tests/fixtures/runs/<commit>/, made by tests/fixtures/make_old_runs.sh with
that commit's own ``ddiloco run``; docs/formats.md "Old runs") replays bit for bit, exports, opens
in ``ddiloco log`` and ``ddiloco dashboard --once``, and resumes: a syncer given the run's keys
recovers it and commits again, and a learner joins it and is merged - after which the whole log,
old records and new, replays.

Before issue 26 the run written by 2366547 (before syncer-driven rounds) was refused as forged:
its commit signatures were checked over a re-encoding of the parsed records, which since 488cdb7
carries a ``round`` field the stored records do not have.
"""
from __future__ import annotations

import hashlib
import math
import json
import shutil
from pathlib import Path

import pytest

from storage.layout import read_descriptor
from storage.log import CommitLog
from storage.store import open_store
from workers.cli import main as cli
from workers.cluster import ClusterConfig, LocalCluster

RUNS = Path(__file__).parent / "fixtures" / "runs"
# writer commit -> what its formats lack against the next one (docs/formats.md "Old runs")
WRITERS = {
    "2366547": "learner-driven rounds: commit records without round (commit v1), descriptor v1",
    "7340386": "the last writer of descriptor v1 (syncer-driven rounds, commit v1 with round)",
    "d31c79d": "the last writer before tensor blob format 3 (deltas and versions in format 1)",
    "6ae44ea": "the last writer before issue 25 (norm guard map v2, checkpoint v1, commit v1)",
    "9a51134": "the last writer before checkpoint v3 (int4 versions down, its checkpoints v2 with full history)",
}


def _copy(writer: str, tmp_path: Path) -> tuple[Path, Path]:
    """A scratch copy of the fixture (never the fixture itself: a resume writes to it); the secret
    keys get the 0600 their loader demands (git keeps no such mode)."""
    root = tmp_path / writer
    shutil.copytree(RUNS / writer, root)
    for key in (root / "keys").glob("*.key_secret"):
        key.chmod(0o600)
    return root / "store", root / "keys"


def _digests(store_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(store_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(store_dir.rglob("*")) if p.is_file()}


def test_every_writer_has_a_fixture_and_docs_name_it():
    assert sorted(p.name for p in RUNS.iterdir() if p.is_dir()) == sorted(WRITERS)
    formats = (Path(__file__).parent.parent / "docs" / "formats.md").read_text()
    assert all(w in formats for w in WRITERS), [w for w in WRITERS if w not in formats]


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_an_old_signed_run_replays_exports_and_opens_with_its_bytes_untouched(tmp_path, writer, capsys):
    store_dir, _ = _copy(writer, tmp_path)
    before = _digests(store_dir)
    d = read_descriptor(open_store(str(store_dir), create=False))
    assert d.security is not None                          # signed: every commit's signature is checked
    records = list(CommitLog(open_store(str(store_dir), create=False)).read_range(0))
    assert records and all("sig" in r.info for r in records if r.kind in ("init", "merge"))

    assert cli(["replay", str(store_dir)]) == 0
    out = capsys.readouterr().out
    assert "verified" in out and "FAILED" not in out, out[-2000:]

    model = tmp_path / "model.pt"
    assert cli(["export", str(store_dir), "--latest", "-o", str(model)]) == 0
    import torch
    state = torch.load(model, weights_only=True)
    assert sum(t.numel() for t in state.values()) == sum(math.prod(t.shape) for t in d.layout.tensors)
    capsys.readouterr()

    assert cli(["log", str(store_dir)]) == 0
    assert "merged" in capsys.readouterr().out
    assert cli(["dashboard", str(store_dir), "--once", "--events", str(store_dir.parent / "logs")]) == 0
    board = json.loads(capsys.readouterr().out)
    assert board["error"] == "" and board["run"]["commits_read"] == len(records)
    assert board["run"]["run_id"] == d.run_id and board["learners"]
    assert _digests(store_dir) == before                   # reading an old run writes nothing


@pytest.mark.timeout(400)
@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_syncer_resumes_an_old_signed_run_and_a_learner_joins_it(tmp_path, writer, capsys):
    store_dir, keys = _copy(writer, tmp_path)
    store = open_store(str(store_dir), create=False)
    old = list(CommitLog(store).read_range(0))
    old_epoch = max(r.epoch for r in old)
    d = read_descriptor(store)
    cluster = LocalCluster(ClusterConfig(str(store_dir), tmp_path / "resumed", keydir=keys, poll_s=0.1))
    try:
        cluster.start_syncer()
        cluster.wait_ready("syncer", 120)
        # --pace: the learner lives long enough (40 steps >= 0.8 s) for the syncer's rounds to reach it
        cluster.start_learner("l0", ["--pace", "0.02"])
        cluster.wait_for(cluster.learners_done, 300, "the joining learner to end")
        learner_ok = cluster.life("l0").how == "exit 0"
        if learner_ok:
            assert cluster.wait_drained(120).ok, cluster.drain_status()
    finally:
        cluster.stop()
    new = [r for r in CommitLog(store).read_range(0) if r.seq > old[-1].seq]
    assert new and new[0].kind == "fence" and new[0].epoch > old_epoch      # recovered: a new epoch's fence
    assert all(r.epoch == new[0].epoch for r in new)
    if d.schedule.driver == "learner":
        # Learner-driven rounds were replaced by syncer-driven ones (488cdb7): the log replays and
        # the syncer resumes, but a learner of this version refuses to train the run, saying why.
        assert not learner_ok and "created before syncer-driven rounds" in cluster.stderr("l0")
    else:
        assert learner_ok, (cluster.life("l0").how, cluster.stderr("l0"), cluster.events("l0")[-3:])
        merged = [i for r in new if r.kind == "merge" for i in r.inputs]
        assert merged and {i.learner for i in merged} == {"l0"}
        assert {i.incarnation for i in merged}.isdisjoint({i.incarnation for r in old for i in r.inputs})
    capsys.readouterr()
    assert cli(["replay", str(store_dir)]) == 0            # the whole log: old records and the new ones
    assert "FAILED" not in capsys.readouterr().out


def test_a_changed_field_encoding_is_refused_by_its_version_not_misread_or_called_forged():
    """Format discipline (issue 26): a writer that changes what a field means bumps the record's
    version; today's reader then refuses the record by naming the version - it does not misread it,
    nor report a bad signature. A writer that forgot the bump is refused by the field's check."""
    import dataclasses

    from pipeline.errors import FormatError
    from pipeline.types import CommitRecord
    from workers.bus.signing import Signer, commit_signature_ok, sign_commit

    class RoundAsText(CommitRecord):          # a scratch future writer: ``round`` as decimal text
        VERSION = 3

        def to_dict(self):
            return {**super().to_dict(), "round": str(self.round)}

    signer = Signer.generate()
    rec = sign_commit(RoundAsText(seq=4, epoch=1, kind="fence", round=12), signer, "run")
    assert commit_signature_ok(rec, signer.public, "run")           # signed over what it writes
    with pytest.raises(FormatError, match=r"commit format version 3 is not supported \(this build reads \[1, 2\]\)"):
        CommitRecord.from_bytes(rec.to_bytes())
    from pipeline.envelope import pack_record
    unbumped = pack_record("commit", CommitRecord.VERSION, rec.to_dict())
    with pytest.raises(FormatError, match="round"):
        CommitRecord.from_bytes(unbumped)
    # And v2 is strict where v1 was lenient: a v2 record without ``round`` is damaged, not old.
    body = {k: v for k, v in dataclasses.replace(rec).to_dict().items() if k != "round"}
    assert CommitRecord.from_bytes(pack_record("commit", 1, body)).round == -1
    with pytest.raises(FormatError, match=r"missing \['round'\]"):
        CommitRecord.from_bytes(pack_record("commit", 2, body))


def test_replay_log_and_export_take_a_run_output_directory(tmp_path, capsys):
    """Issue 26: `ddiloco replay OUT` - the directory `ddiloco run --out OUT` wrote - reads the run
    its summary names (``replay_uri``, an absolute path, so from any working directory)."""
    store_dir, _ = _copy("6ae44ea", tmp_path)
    out = tmp_path / "OUT"
    out.mkdir()
    (out / "summary.json").write_text(json.dumps({"run_uri": "runs/x/store", "replay_uri": str(store_dir)}))
    assert cli(["replay", str(out)]) == 0 and "verified" in capsys.readouterr().out
    assert cli(["log", str(out)]) == 0 and "merged" in capsys.readouterr().out
    assert cli(["export", str(out), "--latest", "-o", str(tmp_path / "m.pt")]) == 0
    capsys.readouterr()
    (out / "summary.json").write_text(json.dumps({"replay_uri": str(tmp_path / "gone")}))
    assert cli(["replay", str(out)]) == 2 and "no run at" in capsys.readouterr().err
