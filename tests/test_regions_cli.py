"""Issue 29: regions on real stores from the command line. Two local S3 servers stand for two regions
(`ddiloco run --region r0=s3://... --region r1=s3://...,endpoint=...,profile=r1`): the run is created in
both, each learner reads versions and spills only in its own region's store, and the run replays."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from infra.s3server import S3Server
from pipeline.regions import parse_region_spec, regions_from_specs
from storage.store import open_store


def test_a_region_flag_is_parsed_and_a_bad_one_named():
    spec = parse_region_spec("r1=s3://b/run,endpoint=http://127.0.0.1:9000,profile=eu")
    assert (spec.name, spec.uri, spec.endpoint, spec.profile) == ("r1", "s3://b/run", "http://127.0.0.1:9000", "eu")
    assert regions_from_specs(["a=/x", "b=/y"]).home == "a"
    for bad, match in (("r1", "expected NAME=URI"), ("r1=s3://b/r,colour=red", "not endpoint=URL"),
                       ("r1=s3://b/r,profile=a,profile=b", "at most once")):
        with pytest.raises(ValueError, match=match):
            parse_region_spec(bad)
    with pytest.raises(ValueError, match="at least two"):
        regions_from_specs(["a=/x"])


def test_two_s3_servers_as_two_regions_from_the_command_line(s3_server, tmp_path, monkeypatch):
    other = S3Server(tmp_path / "s3b").start()
    try:
        creds = tmp_path / "credentials"
        creds.write_text(f"[r1]\naws_access_key_id = {other.access_key}\naws_secret_access_key = {other.secret_key}\n")
        conf = tmp_path / "config"
        conf.write_text("[profile r1]\nregion = us-east-1\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "DDILOCO_"))}
        env.update(s3_server.env(), AWS_SHARED_CREDENTIALS_FILE=str(creds), AWS_CONFIG_FILE=str(conf),
                   OMP_NUM_THREADS="1")
        home, far = s3_server.uri("regions-cli/r0"), other.uri("regions-cli/r1")
        out = tmp_path / "run"
        cmd = [sys.executable, "-m", "workers.cli", "run", "--learners", "2", "--steps", "60", "--fragments", "2",
               "--sync-every", "4", "--layers", "1", "--width", "32", "--batch-size", "4", "--plain",
               "--eval-every", "1000", "--out", str(out), "--region", f"r0={home}",
               "--region", f"r1={far},endpoint={other.endpoint},profile=r1"]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        assert summary["ok"] and {lid: p["region"] for lid, p in summary["placement"].items()} == \
            {"l0": "r0", "l1": "r1"}, summary["placement"]
        # r1's own store holds the run (its copy: descriptor, versions) and l1's traffic stayed there
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))   # this process reads r1 as the roles did
        monkeypatch.setenv("AWS_CONFIG_FILE", str(conf))
        b = open_store(far, s3_endpoint=other.endpoint, profile="r1", create=False)
        assert "run.descriptor" in b.list("") and b.list("versions/")
        acc = summary["accounting"]
        for lid, region in (("l0", "r0"), ("l1", "r1")):
            assert acc["learners"][lid]["region"] == region and acc["learners"][lid]["store"]["get"] > 0
        # l1 read from r1's own store (its deltas go up to the home syncer over the bus: cross-region by
        # nature), and every version it applied is in r1's copy, where its receiver found it
        assert acc["links"]["r1->r1"]["store_bytes"] > 0 and acc["learners"]["l0"]["cross_region_bytes"] == 0
        from workers.common.events import read_events
        applied = [(e["fragment"], e["version"]) for e in read_events(out / "logs" / "l1.jsonl")
                   if e.get("event") == "version-applied"]
        held = set(b.list("versions/"))
        assert applied and all(any(k.startswith(f"versions/f{p:05d}/v{v:012d}") for k in held) for p, v in applied)
        done = subprocess.run([sys.executable, "-m", "workers.cli", "replay", str(out)], capture_output=True,
                              text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    finally:
        other.stop()


def test_launch_places_its_learners_in_the_regions_given(tmp_path):
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "launch"
    cmd = [sys.executable, "-m", "workers.cli", "launch", "--learners", "2", "--steps", "80", "--fragments", "2",
           "--sync-every", "8", "--plain", "--out", str(out), "--region", f"r0={tmp_path / 'r0'}",
           "--region", f"r1={tmp_path / 'r1'}", "--", "python", str(root / "examples" / "minimal.py")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDILOCO_")}
    done = subprocess.run(cmd, capture_output=True, text=True, env=dict(env, OMP_NUM_THREADS="1"), timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    acc = json.loads((out / "summary.json").read_text())["accounting"]
    assert {lid: acc["learners"][lid]["region"] for lid in ("l0", "l1")} == {"l0": "r0", "l1": "r1"}
    assert acc["learners"]["l1"]["store"]["get"] > 0 and (tmp_path / "r1" / "run.descriptor").exists()
    done = subprocess.run([sys.executable, "-m", "workers.cli", "replay", str(out)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
