"""`ddiloco export --format safetensors` (issue 17, "Weights out"): on a finished `ddiloco run`, the
safetensors file holds exactly the tensors of the torch export, its metadata names the run, the
commit and every fragment's version as the log has them, and the model loaded from it has the
held-out loss of the replayed state at that commit (and, at the tail, the run's final loss).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file
from safetensors.torch import load_file

from pipeline.errors import FormatError
from storage.log import CommitLog
from workers.tools import export
from workers.job.data import Corpus, evaluate
from workers.job.job import job_from
from workers.job.model import GPT
from workers.common.refold import rebuild
from workers.common.runs import open_run
from runhelpers import finished_demo_run

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A finished 2-learner `ddiloco run` (tiny model); returns its output directory."""
    return finished_demo_run(tmp_path_factory.mktemp("ddiloco-export"), steps=60)


def call(argv: list, capsys) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    handler = export.configure_export(parser)
    rc = handler(parser.parse_args([str(a) for a in argv]))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def eval_loss(run: Path, state: dict) -> float:
    _, desc = open_run(str(run / "store"))
    gcfg, job = job_from(desc)
    model = GPT(gcfg)
    model.load_state_dict(state, strict=True)
    return evaluate(model, Corpus(job.data_config(gcfg.block_size)))


def middle_seq(run: Path) -> int:
    store, desc = open_run(str(run / "store"))
    return (desc.num_fragments + CommitLog(store).tail()) // 2


def test_safetensors_equals_the_torch_export_and_the_replayed_state(run, tmp_path, capsys):
    store, desc = open_run(str(run / "store"))
    seq = middle_seq(run)
    assert seq > desc.num_fragments      # a point after some merges, not the initial model
    rc, out, err = call([run / "store", "--seq", seq, "--format", "safetensors", "-o", tmp_path / "m.st"], capsys)
    assert rc == 0 and f"after commit {seq}" in out and "(safetensors)" in out, err
    rc, _, err = call([run / "store", "--seq", seq, "-o", tmp_path / "m.pt"], capsys)
    assert rc == 0, err
    st = load_file(tmp_path / "m.st")
    pt = torch.load(tmp_path / "m.pt", weights_only=True)
    assert sorted(st) == sorted(pt) and len(pt) > 1     # load_state_dict(strict=True) below checks the names
    for name in pt:
        assert st[name].dtype == torch.float32 and torch.equal(st[name], pt[name]), name
    # The replayed state at that commit (the code path of `ddiloco replay`) is the same model ...
    state, _ = rebuild(store, desc, seq, use_checkpoint=False)
    replayed = {n: torch.from_numpy(np.array(v, dtype=np.float32)) for fs in state.fragments
                for n, v in fs.history[fs.version].items()}
    loss = eval_loss(run, st)
    assert loss == eval_loss(run, replayed) == eval_loss(run, pt)
    # ... and the metadata says which one: run, commit, each fragment's version and its commit.
    info = export.read_export_metadata(tmp_path / "m.st")
    assert info.run_id == desc.run_id and info.commit_seq == seq
    assert info.fragment_versions == {p: fs.version for p, fs in enumerate(state.fragments)}
    log = CommitLog(store)
    for p, c in info.fragment_commits.items():
        rec = log.read(c)
        assert c <= seq and rec.fragment == p and rec.version == info.fragment_versions[p]


def test_safetensors_of_the_tail_has_the_runs_final_loss(run, tmp_path, capsys):
    path = tmp_path / "final.safetensors"          # the suffix alone chooses the format
    rc, out, err = call([run / "store", "--latest", "-o", path], capsys)
    assert rc == 0 and "(safetensors)" in out, err
    final = json.loads((run / "summary.json").read_text())["final_eval_loss"]
    assert eval_loss(run, load_file(path)) == pytest.approx(final, rel=1e-5)
    store, _ = open_run(str(run / "store"))
    info = export.read_export_metadata(path)
    assert info.commit_seq == CommitLog(store).tail() and info.shard_seqs == (info.commit_seq,)
    # The metadata keys docs/formats.md documents, all strings (what the format allows).
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as fh:
        meta = fh.metadata()
    assert meta["format"] == "pt" and meta["ddiloco.metadata_version"] == str(export.EXPORT_METADATA_VERSION)
    assert set(meta) == {"format", "ddiloco.metadata_version", "ddiloco.run_id", "ddiloco.commit_seq",
                         "ddiloco.fragment_versions", "ddiloco.fragment_commits", "ddiloco.dtype",
                         "ddiloco.shard_seqs", "ddiloco.model_config"}
    # v3 (issue 28): the run's model config travels with the weights (the demo's GPT config here)
    _, desc = open_run(str(run / "store"))
    assert info.model_config == desc.model and info.model_config["n_layer"] == 1


def test_torch_stays_the_default_and_a_torch_file_has_no_metadata(run, tmp_path, capsys):
    rc, out, err = call([run / "store", "--latest", "-o", tmp_path / "m.pt"], capsys)
    assert rc == 0 and "(torch)" in out, err
    assert isinstance(torch.load(tmp_path / "m.pt", weights_only=True), dict)
    with pytest.raises(FormatError, match="not a readable safetensors file"):
        export.read_export_metadata(tmp_path / "m.pt")


def test_metadata_errors_are_named(tmp_path):
    save_file({"w": np.zeros(2, np.float32)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(FormatError, match="no ddiloco metadata"):
        export.read_export_metadata(tmp_path / "plain.safetensors")
    save_file({"w": np.zeros(2, np.float32)}, str(tmp_path / "newer.safetensors"),
              metadata={"ddiloco.metadata_version": "99"})
    with pytest.raises(FormatError, match="newer than this reader"):
        export.read_export_metadata(tmp_path / "newer.safetensors")
    save_file({"w": np.zeros(2, np.float32)}, str(tmp_path / "bad.safetensors"),
              metadata={"ddiloco.metadata_version": "1", "ddiloco.run_id": "r", "ddiloco.commit_seq": "x"})
    with pytest.raises(FormatError, match="malformed ddiloco metadata"):
        export.read_export_metadata(tmp_path / "bad.safetensors")


def test_metadata_v1_files_still_read_and_v2_needs_shard_seqs(tmp_path):
    """Issue 26: v1 files (before shard_seqs was always written) read as before - an unsharded
    one's point is its commit_seq, a sharded one's shard_seqs (which the v1 reader dropped) -
    and a v2 file without shard_seqs is malformed, not silently unsharded."""
    base = {"ddiloco.run_id": "r", "ddiloco.fragment_versions": '{"0": 3}', "ddiloco.fragment_commits": '{"0": 7}'}
    cases = {"v1.safetensors": ({"ddiloco.metadata_version": "1", "ddiloco.commit_seq": "7"}, (7,)),
             "v1sharded.safetensors": ({"ddiloco.metadata_version": "1", "ddiloco.commit_seq": "-1",
                                        "ddiloco.shard_seqs": "[7, 4]"}, (7, 4))}
    for name, (meta, seqs) in cases.items():
        save_file({"w": np.zeros(2, np.float32)}, str(tmp_path / name), metadata={**base, **meta})
        assert export.read_export_metadata(tmp_path / name).shard_seqs == seqs
    save_file({"w": np.zeros(2, np.float32)}, str(tmp_path / "v2.safetensors"),
              metadata={**base, "ddiloco.metadata_version": "2", "ddiloco.commit_seq": "7"})
    with pytest.raises(FormatError, match="malformed ddiloco metadata.*shard_seqs"):
        export.read_export_metadata(tmp_path / "v2.safetensors")


def test_unknown_format_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown export format"):
        export.write_export(tmp_path / "x", "onnx", {}, {})
    parser = argparse.ArgumentParser()
    export.configure_export(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["store", "--latest", "-o", "x", "--format", "onnx"])
