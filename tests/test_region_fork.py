"""Issue 25, defect 5: a syncer started on a region's copy forked the log, and home's replicator
skipped the fork silently (docs/regions.md "Failover").

Now a syncer refuses any store but the home region's (told by the store's region marker or its
location in the descriptor) before writing a byte; taking over in another region is an explicit,
fenced failover that adopts what reachable regions hold and claims an epoch above every region's;
and a replicator whose region's tail is not home's bytes reports ``RegionConflict`` instead of
resuming after it. Runs over local directories as regions, no threads but the replicator's; waits
are on conditions with deadlines.
"""
from __future__ import annotations

import os
import re

import pytest
import torch

from pipeline.regions import RegionSpec, RegionsConfig
from pipeline.types import CommitRecord
from pipeline.errors import FormatError
from storage.errors import Fenced
from storage.layout import (DESCRIPTOR_KEY, REGION_MARKER_KEY, commit_key, failover_key, read_descriptor,
                            version_key)
from storage.log import CommitLog, current_epoch
from storage.regions import RegionConflict, read_marker, replicate_commit, store_region
from storage.store import open_store
from tests.test_regions import Partitioned, wait_until
from workers import cli
from workers.common.events import EventLog
from workers.launch import RunSettings, Schedule, create_run
from workers.syncer.home import HomeRegionError, pack_failover, read_failover
from workers.syncer.replicate import Replicator, ReplicatorConfig
from workers.syncer.syncer import Syncer, SyncerConfig


def make_run(tmp_path, names=("a", "b", "c")) -> dict[str, str]:
    """A run with regions ``names`` (home: the first) over local directories, seeded everywhere."""
    dirs = {n: str(tmp_path / n) for n in names}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    regions = RegionsConfig(names[0], tuple(RegionSpec(n, d) for n, d in dirs.items()))
    create_run(open_store(dirs[names[0]]), {n: p.detach().numpy().copy() for n, p in model.named_parameters()},
               RunSettings(schedule=Schedule(fragments=2, sync_every=4), regions=regions))
    return dirs


def start(store, regions=None, failover_from=None) -> Syncer:
    """A syncer's start-up (recovery, epoch claim, fence) on ``store``, without its loop."""
    syncer = Syncer(store, SyncerConfig(), regions=regions)
    try:
        syncer.recover(failover_from) if failover_from is not None else syncer.recover()
    finally:
        syncer.io.shutdown(wait=True)
    return syncer


def files(root: str) -> dict[str, int]:
    """Every file under ``root`` with its size: what a refused start must leave as it was."""
    out = {}
    for base, _, names in os.walk(root):
        for n in names:
            out[os.path.relpath(os.path.join(base, n), root)] = os.path.getsize(os.path.join(base, n))
    return out


# -- a syncer on a region's copy is refused ------------------------------------------------------------

@pytest.mark.parametrize("told_by", ["marker", "location"])
def test_a_syncer_on_a_regions_copy_is_refused_before_it_writes(tmp_path, told_by):
    """By the marker create_run wrote (reached through another path, so the location says
    nothing), or by the descriptor's location of region b (marker removed: a run from before
    markers). The refusal names home and the failover flag; b's store is untouched."""
    dirs = make_run(tmp_path)
    b = open_store(dirs["b"])
    assert read_marker(b, b.get(DESCRIPTOR_KEY)) == ("b", None)
    if told_by == "marker":
        os.symlink(dirs["b"], tmp_path / "b-link")
        uri = str(tmp_path / "b-link")
    else:
        b.delete(REGION_MARKER_KEY)
        uri = dirs["b"]
    assert store_region(open_store(uri), read_descriptor(b)).how == told_by
    before = files(dirs["b"])
    with pytest.raises(HomeRegionError, match=rf"is region b's copy of run .*the home region is a .*"
                                              rf"--failover-from-region a"):
        start(open_store(uri))
    assert files(dirs["b"]) == before and current_epoch(b) == 0     # no claim, no fence, no probe left
    # the same through `ddiloco syncer`: one error line saying what to do, exit status 1
    assert cli.main(["syncer", "--store", uri, "--insecure", "--no-bus"]) == 1
    assert files(dirs["b"]) == before
    # the home store starts as before
    assert start(open_store(dirs["a"])).epoch == 1


@pytest.mark.parametrize("store, flag, error", [
    ("b", "c", "the run's home region is a; name it to take over from it"),
    ("a", "b", "is already the home region a's store; start the syncer without the flag"),
    ("plain", "a", "has no regions section, so there is no other region to fail over from"),
])
def test_failover_flags_that_make_no_sense_are_refused(tmp_path, capsys, store, flag, error):
    dirs = make_run(tmp_path)
    if store == "plain":
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        dirs["plain"] = str(tmp_path / "plain")
        create_run(open_store(dirs["plain"]), {n: p.detach().numpy().copy() for n, p in model.named_parameters()},
                   RunSettings(schedule=Schedule(fragments=2, sync_every=4)))
    before = files(dirs[store])
    assert cli.main(["syncer", "--store", dirs[store], "--insecure", "--no-bus", "--failover-from-region", flag]) == 1
    assert error in capsys.readouterr().err
    assert files(dirs[store]) == before


# -- the explicit failover -------------------------------------------------------------------------

def test_an_explicit_failover_claims_an_epoch_above_every_regions_and_fences_the_old_home(tmp_path):
    """Home a reaches epoch 3; b's copy stops at epoch 1's fence, c's holds everything. With a
    down, b takes over: it adopts c's two extra commits (a's bytes), claims epoch 4 (above every
    region's, not b's own 0 + 1), records the failover in its fence and in failovers/4. Once a
    answers again, the new home's replicator copies the fence there, which fences a's old epoch;
    a later start on a is refused (a's own copy of the failover record says where home is)."""
    dirs = make_run(tmp_path)
    a, b, c = (open_store(dirs[n]) for n in "abc")
    for _ in range(3):
        start(a)
    tail = CommitLog(a).tail()                     # 0, 1: init; 2, 3, 4: fences of epochs 1, 2, 3
    assert [CommitLog(a).read(s).epoch for s in range(tail + 1)] == [0, 0, 1, 2, 3]
    for seq in range(2, tail + 1):
        replicate_commit(a, c, seq)
    replicate_commit(a, b, 2)
    down_a = Partitioned(open_store(dirs["a"]))
    down_a.down = True

    syncer = start(b, regions={"a": down_a, "c": c}, failover_from="a")
    assert syncer.epoch == 4
    for seq in range(tail + 1):                    # c's commits adopted with a's bytes, before the fence
        assert b.get(commit_key(seq)) == a.get(commit_key(seq))
    fence = CommitLog(b).read(tail + 1)
    assert fence.kind == "fence" and fence.epoch == 4
    moved = fence.info["failover"]
    assert (moved["from"], moved["to"], moved["adopted_from"], moved["adopted"]) == ("a", "b", "c", 2)
    assert "error" in moved["regions"]["a"] and moved["regions"]["c"] == {"tail": tail, "epoch": 3}
    for store in (a, b, c):                        # above every region's epoch: claims and records
        log = CommitLog(store)
        assert current_epoch(store) <= 4 and all(log.read(s).epoch < 4 for s in range(tail + 1))
    desc = read_descriptor(b)
    rec = read_failover(b.get(failover_key(4)), desc, 4, "failovers/4", None)
    assert (rec.source, rec.to, rec.epoch, rec.fence_seq) == ("a", "b", 4, tail + 1)

    down_a.down = False                            # a answers again: the new home replicates to it
    rep = syncer.replicator
    rep.cfg = ReplicatorConfig(retry_s=0.01, max_retry_s=0.05)
    rep.start(syncer.state.last_seq)
    try:
        wait_until(lambda: rep.lag() == {"a": 0, "c": 0}, 30, lambda: f"replication to a and c: {rep.stats()}")
    finally:
        rep.stop()
    assert a.get(commit_key(tail + 1)) == b.get(commit_key(tail + 1))
    with pytest.raises(Fenced, match="superseded by epoch 4"):
        CommitLog(a, epoch=3).check_fenced()      # the old home's syncer stops at its next check
    assert read_marker(a, a.get(DESCRIPTOR_KEY)) == ("a", None) and a.exists(failover_key(4))

    down_b, down_c = Partitioned(open_store(dirs["b"])), Partitioned(open_store(dirs["c"]))
    down_b.down = down_c.down = True
    with pytest.raises(HomeRegionError, match=r"the home region is b since the failover of epoch 4"):
        start(open_store(dirs["a"]), regions={"b": down_b, "c": down_c})
    assert CommitLog(a).tail() == tail + 1          # refused before writing
    assert start(open_store(dirs["b"])).epoch == 5                      # b is home: no flag needed
    assert start(open_store(dirs["b"]), failover_from="a").epoch == 6   # the same command line again


def test_a_failover_onto_a_forked_copy_is_refused(tmp_path):
    """Regions b and c disagree at a commit both hold: b cannot take over (which is home's log?)."""
    dirs = make_run(tmp_path)
    a, b, c = (open_store(dirs[n]) for n in "abc")
    start(a)
    replicate_commit(a, c, 2)
    b.put_if_absent(commit_key(2), CommitRecord(2, 1, "fence", info={"syncer": "rogue"}).to_bytes())
    down_a = Partitioned(open_store(dirs["a"]))
    down_a.down = True
    with pytest.raises(RegionConflict, match=r"region c's .*log/00000000000000000002 differs .* logs forked"):
        start(b, regions={"a": down_a, "c": c}, failover_from="a")
    assert current_epoch(b) == 0 and CommitLog(b).tail() == 2


def test_a_failover_record_whose_fence_is_not_a_failover_is_refused(tmp_path):
    dirs = make_run(tmp_path, ("a", "b"))
    desc = read_descriptor(open_store(dirs["a"]))
    good = CommitRecord(5, 4, "fence", info={"failover": {"from": "a", "to": "b"}}).to_bytes()
    assert read_failover(pack_failover(desc.run_id, good), desc, 4, "f", None).to == "b"
    for blob, epoch, error in [
        (pack_failover(desc.run_id, good), 3, "not a failover fence of epoch 3"),
        (pack_failover("another-run", good), 4, "not a failover record of run"),
        (pack_failover(desc.run_id, CommitRecord(5, 4, "fence", info={"failover": {"from": "a", "to": "z"}})
                       .to_bytes()), 4, "between the run's regions"),
        (pack_failover(desc.run_id, good), 4, "does not carry the syncer's signature"),
    ]:
        trusted = (lambda rec: False) if "signature" in error else None
        with pytest.raises(FormatError, match=error):
            read_failover(blob, desc, epoch, "f", trusted)


# -- the replicator compares a region's tail before resuming -------------------------------------------

def home_log(root, n: int):
    """A home store whose log holds ``n`` merge commits of fragment 0, each with its version."""
    home = open_store(str(root))
    home.put(DESCRIPTOR_KEY, b"a descriptor (copied as bytes, never parsed here)")
    for seq in range(n):
        key = version_key(0, seq, 0)
        home.put(key, f"version {seq} ".encode() * 20)
        home.put(commit_key(seq), CommitRecord(seq, 0, "merge", fragment=0, version=seq, output_key=key).to_bytes())
    return home


@pytest.mark.parametrize("home_commits, copied, forked, error", [
    (8, 4, 1, r"log/00000000000000000004 holds other bytes than .* its log forked"),   # a fork inside home's log
    (4, 4, 2, r"reaches commit 5 .* ends before it: the region holds commits home never wrote"),   # ahead of home
])
def test_a_replicator_reports_a_forked_region_instead_of_resuming(tmp_path, home_commits, copied, forked, error):
    """The region holds home's commits 0..copied-1, then ``forked`` records a syncer wrote there.
    The old replicator resumed after the region's tail (splicing home's later commits onto the
    fork, or doing nothing while the region was ahead); now the region is in conflict, reported,
    and nothing more is written to its log."""
    home = home_log(tmp_path / "home", home_commits)
    region = open_store(str(tmp_path / "r"))
    for seq in range(copied):
        replicate_commit(home, region, seq)
    for seq in range(copied, copied + forked):
        region.put_if_absent(commit_key(seq), CommitRecord(seq, 1, "fence", info={"syncer": "rogue"}).to_bytes())
    fork = {seq: region.get(commit_key(seq)) for seq in range(copied + forked)}
    events = EventLog(None, "syncer", "t")
    seen: list[dict] = []
    events.subscribe(seen.append)
    rep = Replicator(home, {"r": region}, events, ReplicatorConfig(retry_s=0.01, max_retry_s=0.05)).start()
    try:
        wait_until(lambda: rep.stats()["r"]["failures"] >= 2, 30, lambda: f"a conflict: {rep.stats()}")
    finally:
        rep.stop()
    stats = rep.stats()["r"]
    assert stats["next"] is None and stats["copied"] == 0 and rep.lag()["r"] == home_commits
    assert stats["conflict"] is not None
    assert re.search(error, stats["conflict"]), stats["conflict"]
    errors = [e for e in seen if e["event"] == "replicate-error"]
    assert errors and all(e["conflict"] for e in errors)
    assert CommitLog(region).tail() == copied + forked - 1                  # nothing spliced after the fork
    assert {seq: region.get(commit_key(seq)) for seq in range(copied + forked)} == fork


def test_a_region_whose_tail_is_homes_resumes_and_gets_its_marker(tmp_path):
    """The check passes a region whose copy ends in home's log: it catches up as before, and its
    first pass writes its region marker."""
    home = home_log(tmp_path / "home", 6)
    region = open_store(str(tmp_path / "r"))
    for seq in range(3):
        replicate_commit(home, region, seq)
    rep = Replicator(home, {"r": region}, EventLog(None, "syncer", "t"),
                     ReplicatorConfig(retry_s=0.01, max_retry_s=0.05)).start()
    try:
        wait_until(lambda: rep.lag() == {"r": 0}, 30, lambda: f"catch-up: {rep.stats()}")
    finally:
        rep.stop()
    assert rep.stats()["r"]["conflict"] is None and rep.stats()["r"]["copied"] == 3
    assert read_marker(region, home.get(DESCRIPTOR_KEY)) == ("r", None)


def test_bad_failover_settings_are_refused_naming_them(tmp_path):
    from storage.log import claim_epoch
    from workers.syncer.home import HomeConfig
    with pytest.raises(ValueError, match="epoch floor must be an int >= 1, got 0"):
        claim_epoch(open_store(str(tmp_path / "s")), "syncer", floor=0)
    with pytest.raises(ValueError, match=r"HomeConfig.survey_timeout_s must be > 0, got 0"):
        HomeConfig(survey_timeout_s=0)


def test_ddiloco_syncer_fails_over_with_the_flag(tmp_path, monkeypatch):
    """`ddiloco syncer --store B --failover-from-region a` (its loop stubbed out: the start is what
    is checked): with a still answering, b adopts a's log and claims above a's epochs (a planned
    move); the replicator then fences a, as in the test above."""
    dirs = make_run(tmp_path, ("a", "b"))
    a, b = open_store(dirs["a"]), open_store(dirs["b"])
    start(a)
    start(a)
    monkeypatch.setattr(Syncer, "run", lambda self, should_stop: 0)
    assert cli.main(["syncer", "--store", dirs["b"], "--insecure", "--no-bus", "--failover-from-region", "a"]) == 0
    fence = CommitLog(b).read(CommitLog(b).tail())
    assert fence.kind == "fence" and fence.epoch == 3 and fence.info["failover"]["adopted_from"] == "a"
    assert [b.get(commit_key(s)) for s in range(4)] == [a.get(commit_key(s)) for s in range(4)]
    assert b.exists(failover_key(3))


def test_a_region_that_hangs_is_left_out_of_the_survey(tmp_path):
    """A start never waits on a region past the survey's deadline: the hung one is unreachable."""
    import threading
    from workers.syncer.home import survey
    dirs = make_run(tmp_path, ("a", "b", "c"))
    release = threading.Event()

    class Hung(Partitioned):
        def __getattr__(self, name):
            release.wait()
            return getattr(self.inner, name)
    try:
        views = survey({"b": Hung(open_store(dirs["b"])), "c": open_store(dirs["c"])},
                       read_descriptor(open_store(dirs["a"])), True, 0.2)
    finally:
        release.set()
    assert views["b"].error == "no answer within 0.2 s"
    assert views["c"].error is None and views["c"].tail == 1
