"""Issue 14, run topology: a descriptor with regions, learners that read and spill only in their
own region's store, a syncer that ingests every region's inbox and replicates each commit there,
and `ddiloco replay --regions` checking each copy.

The run is real (in-process syncer thread, four in-process learners, no bus, a tiny model) over two
local-directory stores as two regions. Region B's store as the *syncer* sees it can be cut off (a
wrapper that raises Unavailable: a partition between the regions), while B's learners keep their
own direct access to it. Tests wait on conditions with deadlines, never on sleeps.
"""
from __future__ import annotations

import dataclasses
import io
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from pipeline.descriptor import RunDescriptor
from pipeline.errors import FormatError
from pipeline.envelope import pack_record
from pipeline.regions import RegionSpec, RegionsConfig
from pipeline.types import delta_id
from storage.accounting import CountingStore
from storage.errors import Unavailable
from storage.layout import (DESCRIPTOR_KEY, SPILL_PREFIX, VERSION_PREFIX, commit_key, incarnation_prefix,
                            parse_spill_key, parse_version_key, read_descriptor, version_key)
from storage.log import CommitLog
from storage.regions import RegionConflict, learner_region_store, open_region, prune_versions, verify_region
from storage.store import open_store
from workers import cli
from workers.launch import RunSettings, Schedule, create_run
from workers.learner.learner import Learner, LearnerConfig
from workers.tools.replay_cli import verify_regions
from workers.tools.replay_verify import replay_run
from workers.syncer.syncer import Syncer, SyncerConfig


class Partitioned:
    """An ObjectStore whose every call raises Unavailable while ``down`` (the path to it is cut)."""

    def __init__(self, inner):
        self.inner, self.uri, self.down = inner, inner.uri, False

    def __getattr__(self, name):
        attr = getattr(self.inner, name)

        def call(*a, **kw):
            if self.down:
                raise Unavailable("partitioned (test)", uri=self.uri)
            return attr(*a, **kw)
        return call


def regions_for(a, b) -> RegionsConfig:
    return RegionsConfig("a", (RegionSpec("a", str(a)), RegionSpec("b", str(b))))


def _model(seed: int):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def wait_until(cond, timeout: float, what: str, step=None) -> None:
    """Poll ``cond`` (running ``step`` between polls: the learners train meanwhile) until true."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what() if callable(what) else what}"
        if step is not None:
            step()
        else:
            time.sleep(0.01)


# -- the descriptor ---------------------------------------------------------------------------------

def _desc(tmp_path, regions):
    init = {n: p.detach().numpy().copy() for n, p in _model(0).named_parameters()}
    return create_run(open_store(str(tmp_path / "run")), init, RunSettings(schedule=Schedule(fragments=2, sync_every=4),
                                                                           regions=regions))


def test_regions_are_a_named_feature_of_v5_and_v2_v3_documents_keep_their_meaning(tmp_path):
    """Since issue 26 a run writes v5 and names ``regions`` as a reader feature (before: document
    v3); v2 and v3 documents are read as before and re-written byte for byte."""
    plain = _desc(tmp_path / "p", None)
    assert "regions" not in plain.to_dict() and plain.features()["reader"] == []
    regional = _desc(tmp_path / "r", regions_for(tmp_path / "a", tmp_path / "b"))
    again = RunDescriptor.from_bytes(regional.to_bytes())
    assert again == regional and again.regions.home == "a" and [r.name for r in again.regions.others] == ["b"]
    assert regional.to_bytes() == pack_record(RunDescriptor.KIND, 5, {**regional.to_dict(), "features": {
        "reader": ["regions"], "writer": sorted(["regions", "syncer-rounds"])}})
    for version, d in ((2, plain), (3, regional)):
        old = pack_record(RunDescriptor.KIND, version, d.to_dict())
        assert RunDescriptor.from_bytes(old) == d and RunDescriptor.from_bytes(old).to_bytes() == old
    # regions is exactly the v2/v3 difference: neither may pass for the other
    with pytest.raises(FormatError, match="version 2 document must not have a regions section"):
        RunDescriptor.from_bytes(pack_record(RunDescriptor.KIND, 2, regional.to_dict()))
    with pytest.raises(FormatError, match="version 3 document must have a regions section"):
        RunDescriptor.from_bytes(pack_record(RunDescriptor.KIND, 3, plain.to_dict()))


@pytest.mark.parametrize("change, error", [
    (lambda d: d["regions"].update(home="c"), "home 'c' is not one of the regions"),
    (lambda d: d["regions"]["regions"][1].update(name="a"), r"names \['a'\] appear more than once"),
    (lambda d: d["regions"]["regions"][1].update(uri="s3://key:secret@bucket/run"), "carries user info"),
    (lambda d: d["regions"]["regions"][1].update(endpoint="ftp://x"), "endpoint must be http"),
    (lambda d: d["regions"]["regions"][1].update(profile="a b"), "profile must be a profile name"),
    (lambda d: d["regions"]["regions"][1].update(Name="b"), r"regions\[1\] must be a map with exactly"),
    (lambda d: d["regions"]["regions"][1].update(name="B_1"), "region name 'B_1' must match"),
])
def test_bad_regions_sections_are_refused_naming_the_field(tmp_path, change, error):
    d = _desc(tmp_path, regions_for(tmp_path / "a", tmp_path / "b")).to_dict()
    change(d)
    with pytest.raises(FormatError, match=error) as exc:
        RunDescriptor.from_dict(d)
    assert str(exc.value).startswith("descriptor regions")


def test_a_learner_finds_its_region_store_and_refuses_a_wrong_one(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    _desc_store = open_store(str(a))
    init = {n: p.detach().numpy().copy() for n, p in _model(0).named_parameters()}
    create_run(_desc_store, init, RunSettings(schedule=Schedule(fragments=2, sync_every=4),
                                              regions=regions_for(a, b)))
    with pytest.raises(ValueError, match=r"no region 'c' in this run; its regions are \['a', 'b'\]"):
        learner_region_store(_desc_store, "c")
    assert cli.main(["learner", "--store", str(a), "--id", "b0", "--region", "c", "--insecure"]) == 1
    assert "no region 'c' in this run" in capsys.readouterr().err
    assert learner_region_store(_desc_store, "a") is _desc_store
    counted = CountingStore(_desc_store)     # a wrapper: recognised by its file:// URI
    assert learner_region_store(counted, "a") is counted
    from workers.syncer.replicate import region_stores
    with pytest.raises(ValueError, match="'a' is the home region: its store is the syncer's own"):
        region_stores(_desc_store, read_descriptor(_desc_store), {"a": counted})
    with pytest.raises(ValueError, match=r"region stores \['z'\] were given, but run .* regions are \['a', 'b'\]"):
        region_stores(_desc_store, read_descriptor(_desc_store), {"z": counted})
    open_store(str(b)).put(DESCRIPTOR_KEY, b"another run")
    with pytest.raises(RegionConflict, match="holds another run descriptor"):
        learner_region_store(_desc_store, "b")
    plain = open_store(str(tmp_path / "plain"))
    create_run(plain, init, RunSettings(schedule=Schedule(fragments=2, sync_every=4)))
    with pytest.raises(ValueError, match="has no regions section: --region b needs"):
        learner_region_store(plain, "b")


def test_a_region_prunes_the_versions_home_retention_deleted_and_nothing_newer(tmp_path):
    home, b = open_store(str(tmp_path / "a")), open_store(str(tmp_path / "b"))
    for p, kept in ((0, (3, 4)), (1, (7,))):
        for v in kept:
            home.put(version_key(p, v, 1), b"x")
    for p, v in ((0, 1), (0, 2), (0, 3), (0, 4), (0, 5), (1, 6), (1, 7), (2, 0)):
        b.put(version_key(p, v, 1), b"x")      # (0, 5): copied before home listed it; (2, 0): home has none
    assert prune_versions(home, b) == 3
    left = sorted(parse_version_key(k) for k in b.list(VERSION_PREFIX))
    assert left == [(0, 3), (0, 4), (0, 5), (1, 7), (2, 0)]


# -- a two-region run -------------------------------------------------------------------------------

@dataclass
class Topology:
    """Two regions' stores as each party sees them: ``home`` (the syncer's, region a), ``b_direct``
    (b's learners', and the test's view of b), ``b_for_syncer`` (b across the link from home),
    ``a_for_b`` (the home store as handed to b's learners, counted), ``cut``/``heal`` the link."""

    home: object
    b_direct: object
    b_for_syncer: object
    a_for_b: CountingStore
    regions: RegionsConfig
    cut: Callable[[], None]
    heal: Callable[[], None]


class TwoRegions:
    """Run in regions a (home) and b, a syncer thread, learners a0 a1 (home) and b0 b1 (region b)."""

    def __init__(self, topo: Topology):
        self.topo, self.home, self.b_direct = topo, topo.home, topo.b_direct
        create_run(self.home, {n: p.detach().numpy().copy() for n, p in _model(0).named_parameters()},
                   RunSettings(schedule=Schedule(fragments=2, sync_every=4), regions=topo.regions))
        self.stop = threading.Event()
        self.syncer = Syncer(self.home, SyncerConfig(spill_poll_s=0.05, checkpoint_every=10),
                             regions={"b": topo.b_for_syncer})
        self.syncer.replicator.cfg = dataclasses.replace(self.syncer.replicator.cfg, retry_s=0.05, max_retry_s=0.2)
        self.thread = threading.Thread(target=self.syncer.run, args=(self.stop.is_set,), daemon=True)
        self.thread.start()
        wait_until(lambda: CommitLog(self.b_direct).tail() >= 1 and self.b_direct.exists(DESCRIPTOR_KEY), 60,
                   "region b to receive the run")
        # b's learners are handed the *home* store (counted) and their region: they must move to b's
        # store at start and never read the home store again.
        self.learners = {}
        for i, lid in enumerate(("a0", "a1", "b0", "b1")):
            model = _model(i + 1)
            store = self.home if lid.startswith("a") else topo.a_for_b
            learner = Learner(model, torch.optim.AdamW(model.parameters(), 1e-3), store, lid,
                              LearnerConfig(poll_s=0.05), region=None if lid.startswith("a") else "b")
            self.learners[lid] = (learner.start(), model)
        self.after_start = topo.a_for_b.snapshot()
        self.x, self.y = torch.randn(16, 8), torch.randn(16, 1)
        self.b_step_s: list[float] = []

    def step(self) -> None:
        """One step of every learner (a real learner's step takes time: the syncer's clock follows it)."""
        assert self.thread.is_alive(), "the syncer died"
        for lid, (learner, model) in self.learners.items():
            t0 = time.monotonic()
            learner.step(lambda: torch.nn.functional.mse_loss(model(self.x), self.y), tokens=16)
            if lid.startswith("b"):
                self.b_step_s.append(time.monotonic() - t0)
        time.sleep(0.004)

    def folded(self, what: str = "inputs") -> set[str]:
        """Delta ids the home log merged (``inputs``) or dropped (``dropped``)."""
        log = CommitLog(self.home)
        return {x.delta_id for r in log.read_range(0, log.tail() + 1) for x in getattr(r, what)}

    def close(self) -> None:
        for learner, _ in self.learners.values():
            learner.close()
        self.stop.set()
        self.thread.join(60)


def train_across_a_partition(run: TwoRegions, timeout: float = 120) -> None:
    """Both regions train and merge; the link to b is cut while b's learners keep stepping and
    spilling in b; after the heal every delta b spilled meanwhile is folded at home."""
    for lid in ("b0", "b1"):
        store = run.learners[lid][0].store
        assert store is not run.topo.a_for_b and store.uri == run.b_direct.uri
        assert getattr(store, "endpoint", None) == getattr(run.b_direct, "endpoint", None)
    wait_until(lambda: {d.split("/")[0] for d in run.folded()} >= {"a0", "a1", "b0", "b1"}
               and all(run.learners[b][0].applied >= 2 for b in ("b0", "b1")), timeout,
               "merges from both regions and versions applied in b", run.step)
    run.topo.cut()
    tail_at_cut = CommitLog(run.home).tail()
    steps_before = len(run.b_step_s)
    wait_until(lambda: len(run.b_direct.list(SPILL_PREFIX)) >= 4
               and CommitLog(run.home).tail() >= tail_at_cut + 4, timeout,
               lambda: f"spills in b during the partition: {len(run.b_direct.list(SPILL_PREFIX))} spilled, "
                       f"home tail {CommitLog(run.home).tail()} (cut at {tail_at_cut}), {run.syncer.summary()}",
               run.step)
    stranded = {delta_id(*parse_spill_key(k)) for k in run.b_direct.list(SPILL_PREFIX)}
    assert CommitLog(run.b_direct).tail() <= tail_at_cut + 1 < CommitLog(run.home).tail()
    assert run.syncer.replicator.lag()["b"] > 0
    cut = sorted(run.b_step_s[steps_before:])
    assert max(cut) < 1.0, f"b's learners stalled during the partition: {cut[-3:]}"
    run.topo.heal()
    wait_until(lambda: stranded <= run.folded() | run.folded("dropped"), timeout,
               "the deltas spilled in b during the partition to be folded", run.step)
    assert stranded & run.folded(), "none of b's partition-time deltas was merged"


def check_after(run: TwoRegions) -> int:
    """Replication caught up and verified, b's learners never read home after start, replay exact."""
    tail = CommitLog(run.home).tail()
    assert run.syncer.replicator.lag() == {"b": 0}
    b = run.syncer.summary()["regions"]["b"]
    assert b["next"] == tail + 1 and b["copied"] >= tail - 2
    assert 0 < b["delay_s_mean"] <= b["delay_s_max"]     # the cut shows as the longest delay
    # the syncer's cross-region traffic is counted: the copies it wrote, the spills it read in b
    assert b["requests"]["bytes_written"] >= b["bytes"] > 0 and b["requests"]["bytes_read"] > 0
    assert b["requests"]["list"] > 0 and b["requests"]["failed"] > 0      # the inbox polls; the cut
    check = verify_region(run.home, run.b_direct, "b", tail)
    assert check.ok and check.tail == tail and check.checked == tail + 1, check
    steady = run.topo.a_for_b.snapshot() - run.after_start
    assert steady.requests == 0 and steady.bytes_read == 0, steady
    assert run.after_start.get <= 2 * 2   # per b learner: the descriptor, read and compared with b's
    assert replay_run(run.home, read_descriptor(run.home)).commits >= 8
    return tail


def test_two_regions_train_replicate_survive_a_partition_and_replay(tmp_path):
    a_uri, b_uri = str(tmp_path / "a"), str(tmp_path / "b")
    b_for_syncer = Partitioned(open_store(b_uri))
    topo = Topology(open_store(a_uri), open_store(b_uri), b_for_syncer, CountingStore(open_store(a_uri)),
                    regions_for(a_uri, b_uri), lambda: setattr(b_for_syncer, "down", True),
                    lambda: setattr(b_for_syncer, "down", False))
    run = TwoRegions(topo)
    try:
        train_across_a_partition(run)
    finally:
        run.close()
    tail = check_after(run)
    assert cli.main(["replay", a_uri, "--regions", "--plain"]) == 0
    # damage in b's copy is found by name
    desc = read_descriptor(run.home)
    blob = run.b_direct.get(commit_key(tail))
    run.b_direct.delete(commit_key(tail))
    run.b_direct.put(commit_key(tail), blob[:-1] + bytes([blob[-1] ^ 1]))
    out, err = io.StringIO(), io.StringIO()
    assert not verify_regions(run.home, desc, tail, out, err)
    assert commit_key(tail) in err.getvalue() and "0 objects missing, 1 differ" in err.getvalue()


# -- the same over two SeaweedFS servers with a WAN link between the regions ---------------------------

@pytest.fixture
def two_servers(tmp_path, monkeypatch):
    """Two SeaweedFS servers (regions a and b), each with its own credentials, reached through the
    AWS profiles ``ra`` and ``rb`` of a credentials file: the descriptor names profiles, never keys."""
    from infra.s3server import S3Server
    servers = []
    try:
        for name in ("a", "b"):
            servers.append(S3Server(tmp_path / f"s3{name}").start())
        creds = tmp_path / "credentials"
        creds.write_text("".join(f"[r{n}]\naws_access_key_id = {s.access_key}\naws_secret_access_key = {s.secret_key}\n"
                                 for n, s in zip("ab", servers)))
        for var in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                    "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
        monkeypatch.setenv("AWS_REGION", "us-east-1")
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
        yield servers
    finally:
        for s in servers:
            s.stop()


def test_two_seaweedfs_regions_over_a_wan_link(two_servers):
    from infra.wan import WanProxy
    from storage.s3 import S3Store
    sa, sb = two_servers
    prefix = "run-" + uuid.uuid4().hex[:8]
    regions = RegionsConfig("a", (RegionSpec("a", sa.uri(prefix), endpoint=sa.endpoint, profile="ra"),
                                  RegionSpec("b", sb.uri(prefix), endpoint=sb.endpoint, profile="rb")))
    proxy = WanProxy("127.0.0.1", sb.port, "rtt=40ms,bw=100mbit,jitter=2ms", seed=1)
    proxy.start()
    try:
        home = open_region(regions.region("a"))
        # the syncer reaches b across the link; b's learners reach b directly
        b_for_syncer = S3Store(sb.uri(prefix), endpoint=f"http://{proxy.endpoint}", profile="rb",
                               connect_timeout=1.0, read_timeout=2.0, attempts=1)
        topo = Topology(home, open_region(regions.region("b")), b_for_syncer,
                        CountingStore(open_region(regions.region("a"))), regions,
                        lambda: proxy.partition("reset"), proxy.heal)
        run = TwoRegions(topo)
        try:
            train_across_a_partition(run, timeout=180)
        finally:
            run.close()
        check_after(run)
        stats = proxy.stats()
        assert stats.resets > 0 and stats.bytes_up > 0 and stats.bytes_down > 0
    finally:
        proxy.stop()


# -- real processes: `ddiloco syncer` and `ddiloco learner --region` with a bus ------------------------

def test_learner_processes_in_two_regions_with_a_bus(tmp_path):
    """l0 in the home region, l1 started with ``--store HOME --region b``: it moves to b's store,
    trains, applies versions from b's copy (signed run: verified with the run's keys), and the
    syncer process replicates everything to b; replay --regions verifies the copy."""
    import os
    from tests.runhelpers import TinyRun
    a_uri, b_uri = str(tmp_path / "a"), str(tmp_path / "b")
    run = TinyRun(a_uri, tmp_path, dict(os.environ, OMP_NUM_THREADS="1"), steps=120, learners=2)
    run.create(regions=regions_for(a_uri, b_uri))
    try:
        run.syncer()
        wait_until(lambda: os.path.isdir(b_uri) and CommitLog(open_store(b_uri)).tail() >= 2
                   and open_store(b_uri).exists(DESCRIPTOR_KEY), 60, "the syncer to fill region b")
        run.learner("l0")
        run.learner("l1", extra=["--region", "b"])
        for lid in ("l0", "l1"):
            assert run.wait(lid, 240) == 0, run.stderr(lid)
        assert run.wait_inbox_empty(60), "the syncer did not commit every durable delta"
    finally:
        run.stop_all()
    assert run.procs["syncer"].returncode == 0, run.stderr("syncer")
    done = {lid: [e for e in run.events(lid) if e.get("event") == "learner-done"][-1] for lid in ("l0", "l1")}
    assert done["l1"]["versions_applied"] > 0, done["l1"]
    home = open_store(a_uri)
    log = CommitLog(home)
    merged = {i.learner for r in log.read_range(0, log.tail() + 1) for i in r.inputs}
    assert merged == {"l0", "l1"}
    # each learner claimed its life in its own region's store (a write that shows where it lives)
    assert open_store(b_uri).list(incarnation_prefix("l1")) and not home.list(incarnation_prefix("l1"))
    assert home.list(incarnation_prefix("l0")) and not open_store(b_uri).list(incarnation_prefix("l0"))
    check = verify_region(home, open_store(b_uri), "b", log.tail())
    assert check.ok and check.tail == log.tail(), check
    assert cli.main(["replay", a_uri, "--regions", "--plain"]) == 0


def test_ddiloco_run_places_learners_in_regions(tmp_path):
    """`ddiloco run --regions 2`: the run is created with two regions (r1 seeded at creation), l1
    runs in r1; the run finishes, r1's copy matches the home log, and replay --regions passes."""
    import os
    import subprocess
    import sys
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "workers.cli", "run", "--learners", "2", "--regions", "2", "--steps", "60",
           "--fragments", "3", "--sync-every", "6", "--layers", "1", "--width", "32", "--batch-size", "4",
           "--max-bytes", "300000", "--plain", "--eval-every", "1000", "--out", str(out)]
    done = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    home, r1 = open_store(str(out / "store")), open_store(str(out / "regions" / "r1"))
    assert read_descriptor(home).regions.home == "r0"
    assert r1.list(incarnation_prefix("l1")) and not home.list(incarnation_prefix("l1"))
    tail = CommitLog(home).tail()
    assert verify_region(home, r1, "r1", tail).ok
    assert cli.main(["replay", str(out / "store"), "--regions", "--plain"]) == 0


def test_the_replicator_catches_a_region_up_from_the_home_log_and_restarts(tmp_path):
    """A region that fails is retried with backoff without blocking the caller; once it answers it
    gets every commit from the home log, in order; a stopped replicator starts again."""
    from workers.common.events import EventLog
    from workers.syncer.replicate import Replicator, ReplicatorConfig
    a, b = open_store(str(tmp_path / "a")), Partitioned(open_store(str(tmp_path / "b")))
    init = {n: p.detach().numpy().copy() for n, p in _model(0).named_parameters()}
    create_run(a, init, RunSettings(schedule=Schedule(fragments=2, sync_every=4)))
    b.down = True
    rep = Replicator(a, {"b": b}, EventLog(None, "syncer", "t"), ReplicatorConfig(retry_s=0.01, max_retry_s=0.05))
    t0 = time.monotonic()
    rep.start()
    rep.committed(1, 0)
    assert time.monotonic() - t0 < 0.5          # never waits on the region
    wait_until(lambda: rep.stats()["b"]["failures"] >= 3, 10, "retries while b is down")
    assert rep.lag() == {"b": 2}
    down_s = time.monotonic() - t0
    b.down = False
    wait_until(lambda: rep.lag() == {"b": 0}, 10, "b to catch up")
    assert rep.stats()["b"]["delay_s_max"] >= down_s     # commit noted -> copied, across the outage
    assert rep.stop() and verify_region(a, b.inner, "b", 1).ok
    rep.start()
    assert rep.stop(drain_s=1.0)
