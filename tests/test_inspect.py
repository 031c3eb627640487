"""`ddiloco log`, `ddiloco export`, `ddiloco diff` and a full `ddiloco replay` on a finished
`ddiloco run` in a local directory (issue "Replay and inspection of a run's fragment log"): the log
totals equal the run's summary.json, export of the last commit is the final model, export of any
commit equals the replayed state there, and diff's norms are those of the two exports.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.types import CommitRecord, DroppedRecord, InputRecord
from storage.layout import commit_key, published_keys
from storage.log import CommitLog
from workers.tools import export, logview, replay_cli
from workers.job.data import Corpus, evaluate
from workers.job.job import job_from
from workers.job.model import GPT
from workers.common.refold import rebuild
from workers.common.runs import open_run
from runhelpers import finished_demo_run
from workers.common.versions import VersionTracker

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A finished 2-learner `ddiloco run` (tiny model); returns its output directory."""
    return finished_demo_run(tmp_path_factory.mktemp("ddiloco-run"), steps=100)


def store_of(run: Path) -> str:
    return str(run / "store")


def summary_of(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def call(configure, argv: list, capsys) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    handler = configure(parser)
    rc = handler(parser.parse_args([str(a) for a in argv]))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def all_records(run: Path) -> list[CommitRecord]:
    store, _ = open_run(store_of(run))
    log = CommitLog(store)
    return list(log.read_range(0, log.tail() + 1))


# -- replay of the finished run -----------------------------------------------------------------

def test_replay_verifies_every_version_of_the_finished_run(run, capsys):
    recs = all_records(run)
    merges = sum(r.kind == "merge" for r in recs)
    assert merges == summary_of(run)["merge_commits"] >= 3
    assert {i.learner for r in recs for i in r.inputs} == {"l0", "l1"}
    rc, out, err = call(replay_cli.configure, [store_of(run)], capsys)
    assert rc == 0, err
    assert f"verified {len(recs) - 3} commits, {merges} versions" in out


# -- log ------------------------------------------------------------------------------------------

def test_log_totals_match_the_run_summary(run, capsys):
    rc, out, err = call(logview.configure, [store_of(run), "--json"], capsys)
    assert rc == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    commits, totals = lines[:-1], lines[-1]
    assert totals["type"] == "totals" and all(c["type"] == "commit" for c in commits)
    recs = all_records(run)
    assert [CommitRecord.from_dict({k: v for k, v in c.items() if k != "type"}) for c in commits] == recs
    summary = summary_of(run)
    assert totals["tokens_merged"] == summary["tokens_merged"] > 0
    assert totals["deltas_merged"] == summary["deltas_merged"]
    assert totals["deltas_dropped"] == summary["deltas_dropped"]
    assert totals["commits_by_kind"]["merge"] == summary["merge_commits"]
    assert {p: v for p, v in totals["versions_per_fragment"].items()} == summary["versions_per_fragment"]
    per = totals["per_learner"]
    assert sorted(per) == ["l0", "l1"]
    # each figure is rounded to 0.1 token on its own (tokens are averaged over fragments)
    assert sum(t["tokens_merged"] for t in per.values()) == pytest.approx(totals["tokens_merged"], abs=0.1 * len(per))
    assert sum(t["deltas_dropped"] for t in per.values()) == totals["deltas_dropped"]


def test_log_lines_and_filters(run, capsys):
    recs = all_records(run)
    rc, out, _ = call(logview.configure, [store_of(run)], capsys)
    assert rc == 0
    lines = out.splitlines()
    assert [ln.split()[0] for ln in lines[:len(recs)]] == [f"#{r.seq}" for r in recs]
    assert lines[len(recs)].startswith(f"totals: {len(recs)} commits")
    assert any(ln.strip().startswith("all ") for ln in lines[len(recs):])
    rc, out, _ = call(logview.configure, [store_of(run), "--fragment", 1], capsys)
    shown = [ln for ln in out.splitlines() if ln.startswith("#")]
    assert shown and len(shown) == sum(r.fragment == 1 for r in recs)
    assert all(" f1 v" in ln for ln in shown)
    rc, out, _ = call(logview.configure, [store_of(run), "--learner", "l0"], capsys)
    shown = [ln for ln in out.splitlines() if ln.startswith("#")]
    assert shown and all("l0/" in ln for ln in shown)
    table = out.split("totals:")[1]
    assert " l0 " in table and " l1 " not in table and " all " not in table


def test_commit_line_names_weights_staleness_and_drops():
    rec = CommitRecord(
        seq=42, epoch=2, kind="merge", fragment=1, version=7, quorum=2, grace_wait_s=0.125,
        inputs=(InputRecord("a/0/5", "a", 0, 5, "deltas/a", "0" * 64, base_version=5, c_steps=4, c_tokens=1024,
                            learner_step=40, weight=0.75, staleness=1),),
        dropped=(DroppedRecord("b/1/3", "b", "deltas/b", "0" * 64, "shape-mismatch: wte.weight", 512),))
    line = logview.commit_line(rec)
    for text in ("#42", "e2", "merge", "f1 v7", "quorum 2", "grace 0.125s", "a/0/5 w=0.750 tok=1024 steps=4",
                 "base=v5 stale=1", "dropped b/1/3 (shape-mismatch: wte.weight)"):
        assert text in line, (text, line)
    totals = logview.LogTotals()
    totals.add(rec)
    d = totals.to_dict()
    assert d["per_learner"]["b"]["drop_reasons"] == {"shape-mismatch": 1}
    assert (d["tokens_merged"], d["tokens_dropped"], d["versions_per_fragment"]) == (1024, 512, {"1": 7})


def test_log_of_a_log_with_a_gap_names_it(run, tmp_path, capsys):
    copy = Path(shutil.copytree(store_of(run), tmp_path / "copy"))
    (copy / commit_key(5)).unlink()
    rc, _, err = call(logview.configure, [copy], capsys)
    assert rc == 3 and "gap" in err and commit_key(5) in err


# -- export and diff ------------------------------------------------------------------------------

def test_export_of_the_last_commit_is_the_final_model(run, tmp_path, capsys):
    path = tmp_path / "model.pt"
    rc, out, err = call(export.configure_export, [store_of(run), "--latest", "-o", path], capsys)
    assert rc == 0, err
    state = torch.load(path, weights_only=True)
    store, desc = open_run(store_of(run))
    final, _ = VersionTracker(store, desc).load_all()
    assert list(state) == [t.name for t in desc.layout.tensors]
    for name, value in final.items():
        assert state[name].dtype == torch.float32
        assert np.array_equal(state[name].numpy(), value), name
    # It is the model the run evaluated at the end: same held-out loss as summary.json.
    gcfg, job = job_from(desc)
    model = GPT(gcfg)
    model.load_state_dict(state, strict=True)
    loss = evaluate(model, Corpus(job.data_config(gcfg.block_size)))
    assert loss == pytest.approx(summary_of(run)["final_eval_loss"], rel=1e-5)
    # --seq TAIL is the same file content as --latest.
    tail = CommitLog(store).tail()
    rc, _, _ = call(export.configure_export, [store_of(run), "--seq", tail, "-o", tmp_path / "tail.pt"], capsys)
    other = torch.load(tmp_path / "tail.pt", weights_only=True)
    assert rc == 0 and all(torch.equal(other[n], state[n]) for n in state)


@pytest.mark.parametrize("where", ["init", "middle", "tail"])
def test_export_at_a_commit_equals_the_replayed_state_there(run, where, tmp_path, capsys):
    store, desc = open_run(store_of(run))
    tail = CommitLog(store).tail()
    seq = {"init": desc.num_fragments - 1, "middle": (desc.num_fragments + tail) // 2, "tail": tail}[where]
    rc, out, err = call(export.configure_export, [store_of(run), "--seq", seq, "-o", tmp_path / "m.pt"], capsys)
    assert rc == 0 and f"after commit {seq}" in out, err
    got = torch.load(tmp_path / "m.pt", weights_only=True)
    state, _ = rebuild(store, desc, seq, use_checkpoint=False)
    for p, fs in enumerate(state.fragments):
        for name, value in fs.history[fs.version].items():
            assert np.array_equal(got[name].numpy(), value), (seq, p, name)


def test_export_errors(run, tmp_path, capsys):
    tail = CommitLog(open_run(store_of(run))[0]).tail()
    rc, _, err = call(export.configure_export, [store_of(run), "--seq", tail + 1, "-o", tmp_path / "x.pt"], capsys)
    assert rc == 2 and f"commits 0..{tail}" in err
    copy = Path(shutil.copytree(store_of(run), tmp_path / "copy"))
    store, desc = open_run(str(copy))
    # Every object the version is stored as: an int4 run's version may also be a full snapshot,
    # which export reads instead of the delta (ci130: only the delta was removed, export passed).
    keys = published_keys(VersionTracker(store, desc).latest()[0])
    for key in keys:
        (copy / key).unlink()
    rc, _, err = call(export.configure_export, [copy, "--latest", "-o", tmp_path / "x.pt"], capsys)
    assert rc == 3 and "missing" in err and not (tmp_path / "x.pt").exists(), err
    assert any(key in err for key in keys), (keys, err)


def test_diff_norms_are_those_of_the_two_exports(run, capsys):
    store, desc = open_run(store_of(run))
    tail = CommitLog(store).tail()
    a_seq, b_seq = desc.num_fragments + 2, tail
    rc, out, err = call(export.configure_diff, [store_of(run), a_seq, "latest", "--json"], capsys)
    assert rc == 0, err
    rows = {r["tensor"]: r for r in map(json.loads, out.splitlines())}
    a, va = export.model_at(store, desc, a_seq)
    b, vb = export.model_at(store, desc, b_seq)
    assert sorted(rows) == sorted(a)
    for name, row in rows.items():
        d = b[name].astype(np.float64) - a[name].astype(np.float64)
        assert row["norm_change"] == pytest.approx(float(np.linalg.norm(d)), rel=1e-12, abs=0)
        assert row["max_abs_change"] == float(np.max(np.abs(d)))
        assert (row["version_a"], row["version_b"]) == (va[row["fragment"]].version, vb[row["fragment"]].version)
        if row["version_a"] == row["version_b"]:
            assert row["norm_change"] == 0.0
    assert any(r["norm_change"] > 0 for r in rows.values())
    rc, out, _ = call(export.configure_diff, [store_of(run), tail, tail], capsys)
    assert rc == 0 and f"from commit {tail} to commit {tail}" in out
    assert all(float(ln.split()[4]) == 0.0 for ln in out.splitlines()[2:-1])


def test_commit_line_shows_ingest_rejections():
    from pipeline.types import CommitRecord
    from workers.tools.logview import commit_line
    rec = CommitRecord(seq=9, epoch=1, kind="drop", fragment=0, version=3,
                       info={"rejected": {"bad-signature": 2, "oversized": 1}})
    line = commit_line(rec)
    assert "rejected at ingest bad-signature x2, oversized x1" in line
    assert "rejected" not in commit_line(CommitRecord(seq=9, epoch=1, kind="drop", fragment=0, version=3))
