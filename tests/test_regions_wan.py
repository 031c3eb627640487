"""Issue 14 acceptance over an emulated WAN, with real processes: two SeaweedFS servers (one per
region), a WanProxy on every path between the regions (S3 both ways, the learners' ZeroMQ
sockets), `ddiloco syncer` and four learner processes (two per region).

1. The region-partition chaos scenario (infra/chaos/scenarios.py): region r1 is cut off for 20 s
   mid-run. Its learners keep training (max step gap during the cut <= 2x the learner's own median
   gap: each learner is compared with itself, so a loaded machine scales both), spill into r1's
   bucket; after the heal the syncer ingests everything, the ledger balances (every produced delta
   merged exactly once or recorded as dropped), replay is bit-exact and r1's copy of the log
   matches the home log object for object.
2. `ddiloco run --regions 2 --wan SPEC --no-bus`: the bucket-only path (no ZeroMQ anywhere, so
   r1's learners reach the syncer only through r1's bucket) trains, drains and verifies r1's copy.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from infra.chaos.runner import run_scenario
from infra.chaos.scenarios import get
from infra.wan_topology import HOME, WanConfig, WanTopology, learner_region
from infra.wan_link import LinkSpec


def _check(report: dict, name: str) -> dict:
    found = [c for c in report["checks"] if c["name"] == name]
    assert found, f"check {name} missing from {[c['name'] for c in report['checks']]}"
    return found[0]


def test_region_partition_over_the_wan(tmp_path):
    sc = get("region-partition")
    assert sc.spec.storage == "wan" and sc.spec.regions == 2 and sc.spec.learners == 4
    assert [(f.action, f.target, f.duration_s) for f in sc.faults] == [("partition-region", "r1", 20.0)]
    report = run_scenario(sc, tmp_path / "chaos", say=lambda line: None)
    failed = [f"{c['name']}: {c['detail']}" for c in report["checks"] if not c["ok"]]
    assert report["ok"], failed
    marks = {m["what"]: m["t"] for m in report["timeline"] if m["who"] == "r1"}
    assert marks["heal"] - marks["partition"] >= 20.0
    # r1's learners trained through the cut and spilled into r1's bucket; some of it was merged
    kept = _check(report, "region-kept-training")["data"]["per_learner"]
    assert {k.split("@")[0] for k in kept} == {"l1", "l3"}
    for f in kept.values():   # every delta spilled during the cut was ingested after the heal
        assert f["steps"] >= 60 and f["max_gap_s"] <= 2 * f["median_gap_s"] and f["spilled"] > 0
        assert f["merged_after_heal"] + sum(f["dropped_after_heal"].values()) == f["spilled"]
    # home kept committing while r1 was cut off; nothing r1 made during the cut reached home before the heal
    logs = tmp_path / "chaos" / "logs"
    syncer = [json.loads(line) for line in (logs / "syncer.jsonl").read_text().splitlines()]
    made = {e["delta"]: e["t"] for lid in ("l1", "l3") for e in map(json.loads, (logs / f"{lid}.jsonl").read_text().splitlines())
            if e.get("event") == "delta"}
    during = [e for e in syncer if e.get("event") == "commit" and e.get("kind") == "merge"
              and marks["partition"] < e["t"] < marks["heal"]]
    assert len(during) >= 5 and any(i.split("/")[0] in ("l0", "l2") for e in during for i in e["inputs"])
    assert all(made[i] < marks["partition"] for e in during for i in e["inputs"] if i in made)
    assert any(e.get("event") == "replicate-error" for e in syncer)       # the copy to r1 failed during the cut
    assert any(e.get("event") == "replicate-recovered" for e in syncer)   # and caught up after it
    ledger = _check(report, "token-ledger")["data"]
    assert ledger["deltas"].get("merged", 0) > 0 and ledger["duplicate_copies_recorded"] >= 0
    assert sum(ledger["deltas"].values()) == ledger["produced_deltas"]
    assert _check(report, "replay-bit-exact")["data"]["commits"] >= 20
    verified = _check(report, "regions-verified")["data"]
    assert verified["regions"]["r1"]["ok"] and verified["regions"]["r1"]["tail"] == verified["home_tail"]


def test_bucket_only_run_over_the_wan(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "workers.cli", "run", "--learners", "2", "--regions", "2", "--no-bus",
           "--wan", "rtt=40ms,bw=100mbit", "--steps", "600", "--fragments", "3", "--sync-every", "12",
           "--layers", "1", "--width", "32", "--batch-size", "4", "--max-bytes", "300000", "--plain",
           "--eval-every", "1000", "--out", str(out)]
    done = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] and summary["drained"]
    wan = summary["wan"]
    assert not wan["bus_across"] and set(wan["links"]) == {"s3:r1", "s3:r0@r1"}     # no ZeroMQ link at all
    assert wan["links"]["s3:r1"]["bytes_up"] > 0 and wan["links"]["s3:r1"]["bytes_down"] > 0
    assert wan["regions_verified"]["r1"]["ok"], wan["regions_verified"]
    l1 = summary["per_learner"]["l1"]        # learner 1 lives in r1: everything it sent went through r1's bucket
    assert l1["bytes_sent"] == 0 and l1["spilled"] > 0 and l1["versions_applied"] > 0
    assert summary["deltas_merged"] > 0


def test_a_wan_run_replays_from_its_output_directory_after_its_servers_stopped(tmp_path):
    """Issue 26: the run's S3 servers stop with it, so it keeps a copy of every region's store in
    OUT/stores; `ddiloco replay OUT` (and --regions, and `ddiloco log OUT`) read those - before,
    replay said "no S3 credentials found" and --regions ended in a ProfileNotFound traceback."""
    out = tmp_path / "X"
    cmd = [sys.executable, "-m", "workers.cli", "run", "--regions", "2", "--wan", "rtt=50ms,bw=200mbit",
           "--learners", "2", "--steps", "60", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        env.pop(k, None)                 # the replay sees no server and no AWS config of the run
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"ddiloco replay {out} --regions" in done.stdout           # the summary says how
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run_uri"].startswith("s3://") and set(summary["region_stores"]) == {"r0", "r1"}
    for argv in (["replay", str(out)], ["replay", str(out), "--regions"], ["log", str(out)]):
        again = subprocess.run([sys.executable, "-m", "workers.cli", *argv], env=env, capture_output=True,
                               text=True, timeout=300)
        assert again.returncode == 0, (argv, again.stdout[-2000:], again.stderr[-2000:])
        assert "Traceback" not in again.stderr and "FAILED" not in again.stderr
    assert "verified" in again.stdout or "merged" in again.stdout


def test_each_side_reaches_its_own_region_directly_and_the_other_through_the_link(tmp_path):
    """The per-side AWS config files: a region's own bucket direct, the other across the proxy;
    the descriptor holds profiles only (no endpoint, no secret)."""
    topo = WanTopology(tmp_path, WanConfig(2, LinkSpec.parse("rtt=10ms"), prefix="t")).start()
    try:
        direct = {n: s.endpoint for n, s in topo.servers.items()}
        assert topo.endpoint(HOME, HOME) == direct[HOME] and topo.endpoint("r1", "r1") == direct["r1"]
        assert topo.endpoint(HOME, "r1") not in direct.values() and topo.endpoint("r1", HOME) not in direct.values()
        config = (tmp_path / "wan" / "config-r1").read_text()
        assert f"endpoint_url = {direct['r1']}" in config and f"endpoint_url = {direct[HOME]}" not in config
        assert all(r.endpoint is None and r.profile == r.name for r in topo.regions.regions)
        assert oct((tmp_path / "wan" / "credentials").stat().st_mode & 0o777) == "0o600"
        env = topo.env("r1", {"AWS_ENDPOINT_URL": "http://elsewhere:1", "PATH": "/bin"})
        assert "AWS_ENDPOINT_URL" not in env and env["AWS_CONFIG_FILE"].endswith("config-r1")
        assert learner_region(["--id", "l1", "--region", "r1"]) == "r1" and learner_region(["--id", "l0"]) == HOME
        with pytest.raises(ValueError, match="region must be one of"):
            topo.partition(HOME)
    finally:
        topo.close()


def test_each_region_can_have_its_own_link(tmp_path):
    """``--wan "SPEC;rK:SPEC"``: every path between home and rK gets rK's spec, the other regions the default."""
    cfg = WanConfig.parse(3, "rtt=100ms,bw=100mbit;r2:rtt=250ms,bw=50mbit")
    assert cfg.link_for("r1") == LinkSpec.parse("rtt=100ms,bw=100mbit")
    assert cfg.link_for("r2") == LinkSpec.parse("rtt=250ms,bw=50mbit")
    topo = WanTopology(tmp_path, WanConfig.parse(2, "r1:rtt=30ms", prefix="t")).start()
    try:
        topo.bus_links("tcp://127.0.0.1:1", "tcp://127.0.0.1:2")
        assert {link.name for link in topo.links} == {"s3:r1", "s3:r0@r1", "ingest:r1", "announce:r1"}
        assert all(link.proxy.up == link.proxy.down == LinkSpec.parse("rtt=30ms") for link in topo.links)
        assert topo.summary()["wan"]["per_region"] == {"r1": vars(LinkSpec.parse("rtt=30ms"))}
    finally:
        topo.close()


@pytest.mark.parametrize("regions, wan, error", [(1, "rtt=10ms", "at least 2 regions"),
                                                 (2, "bw=100mb", "ambiguous"),
                                                 (3, "r1:rtt=20ms", r"no spec for \['r2'\]"),
                                                 (2, "r0:rtt=1ms", "home r0 has no link"),
                                                 (2, "rtt=1ms;rtt=2ms", "more than one spec without a region"),
                                                 (2, "rtt=1ms;r1:bw=10mb", "field 'bw'")])
def test_bad_wan_settings_are_refused_naming_the_field(regions, wan, error):
    with pytest.raises(ValueError, match=error):
        WanConfig.parse(regions, wan)


@pytest.mark.parametrize("flags, error", [(["--wan", "rtt=1ms"], "--wan needs --regions N >= 2"),
                                          (["--regions", "2", "--wan", "bw=10mb"], "field 'bw'"),
                                          (["--regions", "2", "--wan", "rtt=1ms", "--store", "x"], "leave out --store"),
                                          (["--spill-poll", "0"], "roles.spill_poll must be > 0"),
                                          (["--pace", "0.4", "--slow", "2"], "takes no roles.slow")])
def test_ddiloco_run_refuses_wan_flags_it_cannot_honour(tmp_path, capsys, flags, error):
    from workers import cli
    assert cli.main(["run", "--out", str(tmp_path / "out"), "--plain", *flags]) == 2
    assert error in capsys.readouterr().err
    assert not (tmp_path / "out" / "wan").exists()        # refused before any server started


def test_region_blackhole_cuts_with_hold_and_heals_the_same_region():
    """The region-blackhole scenario (a run of it: docs/regions.md) cuts r1 with ``hold`` - bytes and
    new connections stall instead of failing - and heals r1 after the fault's duration."""
    from infra.chaos.runner import _Schedule, _apply
    sc = get("region-blackhole")
    (fault,) = sc.faults
    calls = []

    class Run:
        timeline = [type("Mark", (), {"t": 0.0})()]

        def partition_region(self, region, mode):
            calls.append(("partition", region, mode))

        def heal_region(self, region):
            calls.append(("heal", region))

    sched = _Schedule()
    _apply(Run(), sc, fault, sched, [], say=lambda line: None)
    assert calls == [("partition", "r1", "hold")]
    (what, heal), = sched.due(float("inf"))
    heal()
    assert what == "heal-region" and calls[-1] == ("heal", "r1")
    partition = get("region-partition").faults[0]
    _apply(Run(), get("region-partition"), partition, _Schedule(), [], say=lambda line: None)
    assert calls[-1] == ("partition", "r1", "reset")
