"""Issue 29: `ddiloco k8s render` writes manifests that the Kubernetes API schemas accept (validated
offline with kubernetes-validate) and that have the properties that matter: one syncer, independent
learners, no secret values in the YAML, probes that point at endpoints the roles really serve."""
from __future__ import annotations

import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from infra.k8s.render import HEALTH_PATHS, KEYS_MOUNT, METRICS_PORT, SYNCER, render
from workers.common.metrics import Metrics
from workers.syncer.create import launch_settings

K8S_VERSION = "1.37.0"
SECRETISH = ("SECRET", "PASSWORD", "TOKEN", "ACCESS_KEY")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    out = tmp_path_factory.mktemp("k8s")
    toml = subprocess.run([sys.executable, "-m", "workers.cli", "launch", "--print-config", "--learners", "3",
                           "--quorum", "2"], capture_output=True, text=True, timeout=120).stdout
    files = render(out, 3, "s3://ddiloco/run1", "registry.example/ddiloco:0.1", ["python", "train.py", "--lr", "3e-4"],
                   nproc=2, max_restarts=4, launch_toml=toml)
    docs = {p.relative_to(out).as_posix(): [d for d in yaml.safe_load_all(p.read_text()) if d]
            for p in files if p.suffix == ".yaml"}
    return out, docs


def _resources(docs):
    return [d for name, ds in docs.items() if not name.endswith("kustomization.yaml") for d in ds]


def test_every_manifest_is_valid_against_the_kubernetes_schemas(rendered):
    out, docs = rendered
    resources = _resources(docs)
    assert {d["kind"] for d in resources} >= {"StatefulSet", "Service", "PodDisruptionBudget", "Job", "ConfigMap",
                                               "Deployment"}
    for d in resources:
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)
    for name, (kust,) in ((n, ds) for n, ds in docs.items() if n.endswith("kustomization.yaml")):
        for res in kust["resources"]:         # every resource a kustomization names exists
            assert (out / Path(name).parent / res).exists(), (name, res)


def test_a_broken_manifest_is_refused_by_the_same_check():
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"},
                                      "spec": {"backoffLimit": "many", "template": {}}}, K8S_VERSION, strict=True)


def test_one_syncer_and_learners_that_restart_alone(rendered):
    _, docs = rendered
    resources = _resources(docs)
    sets = [d for d in resources if d["kind"] == "StatefulSet"]
    assert len(sets) == 1 and sets[0]["spec"]["replicas"] == 1 and sets[0]["metadata"]["name"] == SYNCER
    pdb = next(d for d in resources if d["kind"] == "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"] == sets[0]["spec"]["template"]["metadata"]["labels"]
    jobs = [d for d in resources if d["kind"] == "Job"]
    ids = []
    for job in jobs:
        spec = job["spec"]["template"]["spec"]
        assert spec["restartPolicy"] == "OnFailure" and job["spec"]["backoffLimit"] == 4
        env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
        ids.append(env["DDILOCO_LEARNER_ID"])
        # it reaches the syncer's stable pod name on the syncer's own ports
        cmd = sets[0]["spec"]["template"]["spec"]["containers"][0]["command"]
        port = cmd[cmd.index("--ingest") + 1].rsplit(":", 1)[1]
        assert env["DDILOCO_INGEST"] == f"tcp://{SYNCER}-0.{sets[0]['spec']['serviceName']}:{port}"
        # each pod holds only its own secret key and the syncer's public key
        items = [i["key"] for v in spec["volumes"] if v["name"] == "keys" for i in v["secret"]["items"]]
        assert sorted(items) == sorted([f"{env['DDILOCO_LEARNER_ID']}.key_secret", "syncer.key"])
        # two ranks: torchrun (on loopback) inside the pod, the script's own flags kept
        assert spec["containers"][0]["command"][:5] == ["python", "-m", "workers.learner.localrun",
                                                        "--nproc-per-node", "2"]
        assert spec["containers"][0]["command"][-3:] == ["train.py", "--lr", "3e-4"][-3:]
    assert sorted(ids) == ["l0", "l1", "l2"] and len(jobs) == 3


def test_no_secret_value_appears_in_any_manifest(rendered):
    _, docs = rendered
    for d in _resources(docs):
        assert d["kind"] != "Secret"          # Secrets are created from files (README), never rendered
        for c in [c for t in _pod_specs(d) for c in t["containers"]]:
            for e in c.get("env", []):
                if any(word in e["name"] for word in SECRETISH) or e["name"] in ("DDILOCO_KEY",):
                    assert "value" not in e or e["value"].startswith(KEYS_MOUNT + "/"), e   # a path, never a key


def _pod_specs(d):
    if d["kind"] in ("StatefulSet", "Deployment", "Job"):
        return [d["spec"]["template"]["spec"]]
    return []


def test_the_probes_point_at_endpoints_the_syncer_serves(rendered):
    _, docs = rendered
    sset = next(d for d in _resources(docs) if d["kind"] == "StatefulSet")
    pod = sset["spec"]["template"]
    c = pod["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert c["command"][c["command"].index("--metrics-port") + 1] == str(ports["metrics"]) == str(METRICS_PORT)
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(METRICS_PORT)
    paths = {c[k]["httpGet"]["path"] for k in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert paths == set(HEALTH_PATHS) and all(c[k]["httpGet"]["port"] == "metrics"
                                              for k in ("livenessProbe", "readinessProbe"))
    m = Metrics("syncer", "syncer", "r")
    base = m.serve("127.0.0.1", 0).rsplit("/", 1)[0]
    try:
        for path in [*paths, pod["metadata"]["annotations"]["prometheus.io/path"]]:
            try:
                code = urllib.request.urlopen(base + path, timeout=10).status
            except urllib.error.HTTPError as exc:
                code = exc.code
            assert code in (200, 503), (path, code)   # served (503: not ready yet), never 404
    finally:
        m.close()


def test_the_run_settings_in_the_config_map_are_what_the_syncer_reads(rendered, tmp_path):
    _, docs = rendered
    cm = next(d for d in _resources(docs) if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "ddiloco-run")
    (tmp_path / "launch.toml").write_text(cm["data"]["launch.toml"])
    cfg = launch_settings(tmp_path / "launch.toml")
    assert cfg.launch.learners == 3 and cfg.policy.quorum == 2


def test_render_refuses_a_missing_command(tmp_path):
    done = subprocess.run([sys.executable, "-m", "workers.cli", "k8s", "render", "--store", "s3://b/r", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "give the learners' command after --" in done.stderr


REGIONS = ["home=s3://bucket-a/run", "eu=s3://bucket-b/run,endpoint=http://s3.eu.example:9000,profile=eu"]


@pytest.fixture(scope="module")
def regional(tmp_path_factory):
    from infra.k8s.render import launch_file
    out = tmp_path_factory.mktemp("k8s-regions")
    learners, toml, regions = launch_file(None, 3, REGIONS)
    files = render(out, learners, None, "registry.example/ddiloco:0.1", ["python", "train.py"], launch_toml=toml,
                   regions=regions)
    return {p.relative_to(out).as_posix(): [d for d in yaml.safe_load_all(p.read_text()) if d]
            for p in files if p.suffix == ".yaml"}, (out / "README.md").read_text()


def test_regions_reach_the_syncers_launch_file_and_each_learner_names_its_own(regional, tmp_path):
    from workers.learner.env import LearnerEnv
    docs, readme = regional
    resources = _resources(docs)
    for d in resources:
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)
    cm = next(d for d in resources if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "ddiloco-run")
    (tmp_path / "launch.toml").write_text(cm["data"]["launch.toml"])
    cfg = launch_settings(tmp_path / "launch.toml")          # what the syncer's --create builds the run with
    assert cfg.launch.region_specs == ";".join(REGIONS) and cfg.launch.learners == 3
    syncer = next(d for d in resources if d["kind"] == "StatefulSet")["spec"]["template"]["spec"]["containers"][0]
    assert syncer["command"][syncer["command"].index("--store") + 1] == "s3://bucket-a/run"   # the home region's
    where = {}
    for job in (d for d in resources if d["kind"] == "Job"):
        pod = job["spec"]["template"]
        env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"] if "value" in e}
        contract = LearnerEnv.from_environ(env)              # what the learner's process reads
        assert contract.store == "s3://bucket-a/run" and contract.region == pod["metadata"]["labels"]["ddiloco/region"]
        assert job["metadata"]["labels"]["ddiloco/region"] == contract.region
        where[contract.learner_id] = contract.region
        # a region names a credentials profile: the AWS files come from an optional Secret, by path
        aws = next(v for v in pod["spec"]["volumes"] if v["name"] == "aws")
        assert aws["secret"]["optional"] and env["AWS_CONFIG_FILE"].startswith("/aws/")
    assert where == {"l0": "home", "l1": "eu", "l2": "home"}          # learner m in region m mod N
    assert "- `eu`: l1" in readme and "ddiloco-aws" in readme


def test_regions_without_a_profile_mount_no_aws_files(tmp_path):
    from infra.k8s.render import launch_file
    learners, toml, regions = launch_file(None, 2, ["home=s3://a/run", "r1=s3://b/run"])
    files = render(tmp_path, learners, None, "img", ["python", "train.py"], launch_toml=toml, regions=regions)
    text = "".join(p.read_text() for p in files if p.suffix == ".yaml")
    assert "DDILOCO_REGION" in text and "AWS_CONFIG_FILE" not in text and "ddiloco-aws" not in text


def test_render_refuses_a_store_beside_regions_and_a_flag_that_contradicts_the_file(tmp_path):
    base = [sys.executable, "-m", "workers.cli", "k8s", "render", "--out", str(tmp_path / "o")]
    done = subprocess.run([*base, "--store", "s3://b/r", "--region", REGIONS[0], "--region", REGIONS[1], "--",
                           "python", "t.py"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "not both" in done.stderr, done.stderr[-500:]
    (tmp_path / "run.toml").write_text("[launch]\nlearners = 4\n")
    done = subprocess.run([*base, "--config", str(tmp_path / "run.toml"), "--learners", "3", "--store", "s3://b/r",
                           "--", "python", "t.py"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "launch.learners is 4 in" in done.stderr, done.stderr[-500:]
    done = subprocess.run([*base, "--region", REGIONS[0], "--", "python", "t.py"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0 and "needs at least two" in done.stderr, done.stderr[-500:]
    assert not (tmp_path / "o").exists()       # nothing written for a refused command
