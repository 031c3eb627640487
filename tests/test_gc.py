"""Issue 11 item 7: the store does not grow without bound. The syncer applies retention after each
checkpoint; `ddiloco gc` lists (dry run) or deletes what retention may remove; after either, a
replay from a kept checkpoint still verifies bit for bit and the syncer and learners restart.

The runs are real (in-process syncer and learner, no bus, a tiny model); tests wait on conditions
with deadlines, never on sleeps."""
from __future__ import annotations

import re
import threading
import time

import pytest
import torch

from pipeline.descriptor import VersionsConfig
from storage.checkpoints import list_checkpoints
from storage.errors import NotFound
from storage.layout import CHECKPOINT_PREFIX, DELTA_PREFIX, VERSION_PREFIX, read_descriptor
from storage.log import CommitLog
from storage.retention import plan_retention
from storage.store import open_store
from workers import cli
from workers.common.events import EventLog, read_events
from workers.syncer.gc import RetentionConfig
from workers.launch import RunSettings, Schedule, create_run
from workers.learner.learner import Learner, LearnerConfig
from workers.tools.replay_verify import replay_run
from workers.syncer.syncer import Syncer, SyncerConfig
from workers.common.versions import VersionTracker

COMMITS = 45


def make_run(tmp_path, retention: RetentionConfig):
    """A finished run of about ``COMMITS`` commits, a checkpoint every 5; returns (uri, syncer log)."""
    uri = str(tmp_path / "run")
    store = open_store(uri)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    create_run(store, {n: p.detach().numpy().copy() for n, p in model.named_parameters()},
               RunSettings(schedule=Schedule(fragments=2, sync_every=4), versions=VersionsConfig(retain=4)))
    stop = threading.Event()
    log = tmp_path / "syncer.jsonl"
    syncer = Syncer(store, SyncerConfig(checkpoint_every=5, spill_poll_s=0.05, retention=retention),
                    events=EventLog(log, "syncer", "syncer"))
    thread = threading.Thread(target=syncer.run, args=(stop.is_set,), daemon=True)
    thread.start()
    learner = Learner(model, torch.optim.AdamW(model.parameters(), 1e-3), store, "l0", LearnerConfig(poll_s=0.05))
    learner.start()
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    deadline = time.monotonic() + 120
    try:
        while CommitLog(store).tail() < COMMITS:
            assert time.monotonic() < deadline, "the run did not reach its commits in time"
            assert thread.is_alive(), "the syncer died"
            learner.step(lambda: torch.nn.functional.mse_loss(model(x), y), tokens=16)
            time.sleep(0.005)    # a real learner's step takes time; the syncer's clock follows it
    finally:
        learner.close()
        stop.set()
        thread.join(30)
    return uri, read_events(log)


def count(store, prefix: str) -> int:
    return len(store.list(prefix))


def test_the_syncer_applies_retention_after_checkpoints(tmp_path):
    """Old code: plan_retention/apply_retention were never called; every delta, version and
    checkpoint stayed (31 checkpoints, 266 versions per fragment after 1500 steps)."""
    uri, events = make_run(tmp_path, RetentionConfig(keep_commits=0))
    store = open_store(uri)
    passes = [e for e in events if e["event"] == "retention"]
    assert passes and all(e["deleted"] > 0 for e in passes)
    checkpoints = list_checkpoints(store)
    made = [e["seq"] for e in events if e["event"] == "checkpoint"]
    assert len(made) >= 6 and len(checkpoints) <= 3, (made, checkpoints)
    desc = read_descriptor(store)
    tail = CommitLog(store).tail()
    merges = sum(1 for s in range(tail + 1) if CommitLog(store).read(s).kind == "merge")
    assert count(store, VERSION_PREFIX) < merges, "old versions were removed"
    stop = next(e for e in events if e["event"] == "syncer-stop")
    assert stop["retention_deleted"] == sum(e["deleted"] for e in passes)
    # what is left: replay from the oldest kept checkpoint verifies, the syncer restarts, a learner starts
    report = replay_run(store, desc, start=min(checkpoints[0] + 1, tail))
    assert report.from_checkpoint in checkpoints and report.commits > 0
    Syncer(store, SyncerConfig()).recover()
    VersionTracker(store, desc).load_all()


def run_cli(argv, capsys):
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_gc_lists_by_default_deletes_with_a_flag_and_replay_still_verifies(tmp_path, capsys):
    uri, _ = make_run(tmp_path, RetentionConfig(enabled=False))
    store = open_store(uri)
    before = {p: count(store, p) for p in (CHECKPOINT_PREFIX, DELTA_PREFIX, VERSION_PREFIX)}
    assert before[CHECKPOINT_PREFIX] >= 6, "no retention in the syncer: every checkpoint is still there"

    rc, out, err = run_cli(["gc", uri], capsys)
    assert rc == 0, err
    listed = [ln for ln in out.splitlines() if ln.startswith("would delete ") and "dry run" not in ln]
    assert listed and all("(" in ln for ln in listed), out       # every key with its reason
    assert "dry run: add --delete" in out
    assert {p: count(store, p) for p in before} == before, "a dry run deletes nothing"

    rc, out, err = run_cli(["gc", uri, "--delete"], capsys)
    assert rc == 0, err
    after = {p: count(store, p) for p in before}
    assert after[CHECKPOINT_PREFIX] == 2 and after[DELTA_PREFIX] < before[DELTA_PREFIX]
    assert after[VERSION_PREFIX] < before[VERSION_PREFIX]
    assert f"deleted {len(listed)} objects" in out, out.splitlines()[-2:]

    # the command it prints verifies what is left, bit for bit
    replay = re.search(r"`ddiloco (replay .*)`", out).group(1).split()
    rc, rout, rerr = run_cli(replay, capsys)
    assert rc == 0 and "verified" in rout, rerr
    desc = read_descriptor(store)
    kept, tail = list_checkpoints(store), CommitLog(store).tail()
    if kept[-1] < tail:    # from the newest checkpoint (when commits follow it; else from the one before)
        assert replay_run(store, desc, start=kept[-1] + 1).from_checkpoint == kept[-1]
    else:
        assert replay_run(store, desc, start=tail).from_checkpoint == kept[-2]
    with pytest.raises(NotFound):          # a full replay needs the deleted deltas (docs/storage.md)
        replay_run(store, desc, start=0)
    assert replay_run(store, desc).start == kept[0] + 1     # by default: after the horizon gc wrote (issue 26)
    Syncer(store, SyncerConfig()).recover()
    VersionTracker(store, desc).load_all()

    rc, out, _ = run_cli(["gc", uri], capsys)       # idempotent: nothing more to remove
    assert rc == 0 and "would delete 0" in out


def test_incremental_plan_finds_what_a_full_plan_finds(tmp_path):
    uri, _ = make_run(tmp_path, RetentionConfig(enabled=False))
    store = open_store(uri)
    full = plan_retention(store, 2, 4)
    horizon = full.horizon
    assert horizon > 0
    part = plan_retention(store, 2, 4, scan_from=horizon - 10)
    assert set(part.keys()) <= set(full.keys())
    for key in set(full.keys()) - set(part.keys()):
        assert key.startswith(DELTA_PREFIX), key          # only deltas named before scan_from are left for gc
    with pytest.raises(ValueError, match="scan_from"):
        plan_retention(store, 2, 4, scan_from=-1)


class Now:
    """An executor that runs at once (the syncer's is a thread pool)."""

    def submit(self, fn, *args):
        fn(*args)


def test_without_a_byte_budget_the_newest_commits_keep_everything(tmp_path):
    """The commit rule alone (keep_bytes None) keeps whatever the newest 1000 commits name: a run
    shorter than that replays from its first commit; a longer one keeps the newest checkpoint old
    enough, and after it."""
    from workers.syncer.gc import SyncerRetention
    uri, _ = make_run(tmp_path, RetentionConfig(enabled=False))
    store = open_store(uri)
    desc = read_descriptor(store)
    tail = CommitLog(store).tail()
    before = sorted(store.list(""))
    events = []
    log = EventLog(None, "syncer", "s")
    log.emit = lambda event, **f: events.append((event, f))
    SyncerRetention(store, RetentionConfig(keep_bytes=None), log, Now()).after_checkpoint(tail)
    assert sorted(store.list("")) == before and not events
    assert replay_run(store, desc).commits > 0              # the full history still replays
    checkpoints = list_checkpoints(store)
    SyncerRetention(store, RetentionConfig(keep_commits=tail - checkpoints[2], keep_bytes=None), log,
                    Now()).after_checkpoint(tail)
    assert list_checkpoints(store) == checkpoints[2:]       # the newest one at least keep_commits old, and later
    (event, fields), = events
    assert event == "retention" and fields["horizon"] == checkpoints[2]
    replay_run(store, desc, start=checkpoints[2] + 1)
    with pytest.raises(ValueError, match="keep_commits"):
        RetentionConfig(keep_commits=-1)
    with pytest.raises(ValueError, match="keep_bytes must be 'auto', None or an int >= 0, got -5"):
        RetentionConfig(keep_bytes=-5)


def _footprint(store, horizon: int) -> int:
    """What a replay from checkpoint ``horizon`` and a restart read: that checkpoint and the newest
    two, and the deltas and versions the commits after it name (measured here from the objects,
    not from retention's code)."""
    keys = {f"checkpoints/{c:020d}" for c in [horizon, *list_checkpoints(store)[-2:]]}
    for r in CommitLog(store).read_range(horizon + 1):
        keys |= {i.key for i in r.inputs} | {d.key for d in r.dropped if d.key} | ({r.output_key} - {""})
    return sum(store.head(k).size for k in keys if store.exists(k))


def test_a_byte_budget_moves_the_horizon_and_replay_then_starts_after_it(tmp_path, capsys):
    """Issue 26: the byte budget limits the store even while the commit rule would keep everything:
    the horizon moves to the oldest checkpoint whose footprint fits; ``ddiloco replay`` then starts
    after the horizon retention wrote, says so, and verifies; from the start is asked for with --from 0
    (and then stops for want of the deleted deltas: exit 2, no damage of the run, and it says why)."""
    from workers.syncer.gc import SyncerRetention
    uri, _ = make_run(tmp_path, RetentionConfig(enabled=False))
    store = open_store(uri)
    tail = CommitLog(store).tail()
    checkpoints = list_checkpoints(store)
    assert len(checkpoints) >= 5
    target = checkpoints[-3]                           # a budget that fits from here on but not from before
    budget = (_footprint(store, target) + _footprint(store, checkpoints[-4])) // 2
    assert _footprint(store, checkpoints[-4]) > budget >= _footprint(store, target)
    events = []
    log = EventLog(None, "syncer", "s")
    log.emit = lambda event, **f: events.append((event, f))
    SyncerRetention(store, RetentionConfig(keep_bytes=budget, min_commits=0), log, Now()).after_checkpoint(tail)
    (event, fields), = events
    assert event == "retention" and fields["horizon"] == target, fields
    assert list_checkpoints(store) == [c for c in checkpoints if c >= target]
    rc, out, err = run_cli(["replay", uri], capsys)
    assert rc == 0, err
    assert f"from checkpoint {target}" in out and f"commits {target + 1}..{tail}" in out, out
    rc, out, err = run_cli(["replay", uri, "--from", "0"], capsys)
    assert rc == 2 and "retention removed" in err and "FAILED" not in err, err


def test_the_default_budget_keeps_a_long_run_no_bigger_than_a_few_model_sizes(tmp_path):
    """The syncer's default ("auto": 8 fp32 model sizes + 2 newest checkpoints, never into the newest
    100 commits): a short run keeps everything; past the floor, what a replay from the horizon reads
    fits the budget (or only the two checkpoints a restart needs are left) and the run replays."""
    from storage.retention import default_keep_bytes
    from workers.syncer.gc import SyncerRetention, model_bytes
    uri, _ = make_run(tmp_path, RetentionConfig(enabled=False))
    store = open_store(uri)
    tail = CommitLog(store).tail()
    budget = default_keep_bytes(store, model_bytes(store))
    assert budget == 8 * model_bytes(store) + 2 * store.head(f"checkpoints/{list_checkpoints(store)[-1]:020d}").size
    before, objects = list_checkpoints(store), sorted(store.list(""))
    SyncerRetention(store, RetentionConfig(), EventLog(None, "syncer", "s"), Now()).after_checkpoint(tail)
    assert sorted(store.list("")) == objects       # 45 commits < min_commits (100): a short run keeps it all
    SyncerRetention(store, RetentionConfig(min_commits=0), EventLog(None, "syncer", "s"), Now()).after_checkpoint(tail)
    kept = list_checkpoints(store)
    assert kept != before and kept[-2:] == before[-2:] and len(kept) <= 3   # the horizon, and the newest two
    assert _footprint(store, kept[0]) <= budget or len(kept) == 2   # it fits, or only the two a restart needs are left
    replay_run(store, read_descriptor(store), start=kept[0] + 1)


def test_an_age_limit_lets_go_what_only_older_commits_name(tmp_path):
    """Issue 26: ``keep_age_s`` (``ddiloco syncer --retain-age 7d``): the horizon moves to the newest
    checkpoint whose commit is at least that old (merge commits record ``committed_at``); with the
    commit rule and no budget, nothing would go in a run this short."""
    from storage.retention import parse_duration
    from workers.syncer.gc import SyncerRetention
    uri, _ = make_run(tmp_path, RetentionConfig(enabled=False))
    store = open_store(uri)
    tail = CommitLog(store).tail()
    checkpoints = list_checkpoints(store)
    target = checkpoints[-3]
    made = {r.seq: r.info.get("committed_at") for r in CommitLog(store).read_range(0)}
    at = max(t for s, t in made.items() if s <= target and t is not None)
    events = []
    log = EventLog(None, "syncer", "s")
    log.emit = lambda event, **f: events.append((event, f))
    now = at + 3600.0                       # one hour after the target's commit ...
    SyncerRetention(store, RetentionConfig(keep_bytes=None, min_commits=0, keep_age_s=3600.0), log, Now(),
                    wall=lambda: now).after_checkpoint(tail)
    (event, fields), = events
    assert event == "retention" and fields["horizon"] >= target, fields      # ... lets go what is older
    h = fields["horizon"]
    assert max(t for s, t in made.items() if s <= h and t is not None) <= at    # the horizon's commit is that old
    assert list_checkpoints(store) == [c for c in checkpoints if c >= h]
    replay_run(store, read_descriptor(store))
    assert parse_duration("7d") == 7 * 86400 and parse_duration("90s") == 90
    with pytest.raises(ValueError, match="not a duration: '7 days'"):
        parse_duration("7 days")
    with pytest.raises(ValueError, match="keep_age_s must be > 0"):
        RetentionConfig(keep_age_s=0)


def test_a_retention_pass_pauses_between_requests_to_work_at_most_its_duty():
    """A pass of 100-200 requests beside the syncer's loop crowded the loop out on a busy machine
    (fragments 36-60 global steps without a merge): ``Paced`` sleeps after each request for the work
    since its last pause times (1 - duty) / duty."""
    from workers.syncer.gc import Paced
    t = [0.0]
    slept = []

    class Slow:
        uri = "mem://slow"

        def get(self, key):
            t[0] += 0.1                           # each request takes 0.1 s
            return b"x"

    def sleep(s):
        slept.append(round(s, 9))
        t[0] += s
    paced = Paced(Slow(), 0.25, sleep, clock=lambda: t[0])
    assert paced.uri == "mem://slow"
    t[0] += 0.2                                   # the pass's own work before its first request counts too
    assert paced.get("a") == b"x" and paced.get("b") == b"x"
    assert slept == [0.9, 0.3] and abs(t[0] - 1.6) < 1e-9     # 0.4 s of work in 1.6 s: a quarter
    Paced(Slow(), 1.0, sleep, clock=lambda: t[0]).get("c")
    assert len(slept) == 2                                    # duty 1: no pauses
    with pytest.raises(ValueError, match="duty"):
        RetentionConfig(duty=0.0)
