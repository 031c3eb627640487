"""`ddiloco k8s render`: Kubernetes manifests for a run - a kustomize base and two overlays (issue 29).

    ddiloco k8s render --learners 4 --store s3://ddiloco/run1 --image REGISTRY/ddiloco:0.1 --out k8s/ \
        -- python train.py

writes ``k8s/base`` (the run), ``k8s/overlays/dev-minio`` (plus a MinIO for a dev cluster) and
``k8s/overlays/cluster`` (the base against a real S3), and ``k8s/README.md`` with the commands that
create the Secrets. What matters in them (tests/test_k8s.py checks each):

- **One syncer**: a StatefulSet of one replica behind a headless Service (stable DNS
  ``ddiloco-syncer-0.ddiloco-syncer``, so learners need no hostname of a pod), a PodDisruptionBudget
  that keeps a voluntary eviction from taking it down, probes on ``/healthz`` and ``/readyz`` at its
  metrics port (workers/common/health.py), Prometheus scrape annotations. It creates the run from the
  first learner's proposed model (``ddiloco syncer --create``, workers/syncer/create.py) with the
  settings in the ConfigMap ``ddiloco-run``.
- **Independent learners**: one Job per learner (``restartPolicy: OnFailure``, ``backoffLimit`` =
  ``--max-restarts``): a failed learner's pod restarts alone, nobody else does (a JobSet's default
  failure policy restarts every job of the set). Several ranks: the command under
  ``workers.learner.localrun`` (torchrun inside the pod).
- **No secret values in YAML**: S3 credentials come from the Secret ``ddiloco-s3`` (``secretKeyRef``),
  keys from the Secret ``ddiloco-keys`` mounted read-only, each pod only its own secret key and the
  public keys it needs; the README says how to create both with kubectl from files.
- **Regions as data** (``--region NAME=URI[,endpoint=URL][,profile=NAME]``, home first, as for
  ``ddiloco launch``): the launch file in the ConfigMap carries them, so the syncer creates the run
  with them on the home region's store; learner m is in region m mod N (``DDILOCO_REGION`` and the
  label ``ddiloco/region``, for an overlay that adds a nodeSelector per region or for selecting one
  region's learners with ``kubectl apply -k ... -l ddiloco/region=NAME``). A region that names a
  credentials profile needs the AWS files:
  every pod then mounts the optional Secret ``ddiloco-aws`` (``config``, ``credentials``).
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import yaml

from pipeline.regions import RegionsConfig, regions_from_specs
from workers.common.placement import Placement, learner_names

APP = "ddiloco"
SYNCER = "ddiloco-syncer"
INGEST_PORT, ANNOUNCE_PORT, METRICS_PORT = 5555, 5556, 9400
HEALTH_PATHS = ("/healthz", "/readyz")   # what workers/common/health.py serves (tests/test_k8s.py asks it)
KEYS_MOUNT, CONFIG_MOUNT = "/keys", "/config"
S3_SECRET, KEYS_SECRET, RUN_CONFIG, S3_ENDPOINT_CONFIG = "ddiloco-s3", "ddiloco-keys", "ddiloco-run", "ddiloco-s3-endpoint"
AWS_SECRET, AWS_MOUNT = "ddiloco-aws", "/aws"   # the AWS config/credentials files, when a region names a profile


def _labels(component: str, **more: str) -> dict:
    return {"app.kubernetes.io/name": APP, "app.kubernetes.io/component": component, **more}


def _s3_env() -> list[dict]:
    """Credentials by reference only; the endpoint from an optional ConfigMap (an overlay's MinIO)."""
    return [{"name": k, "valueFrom": {"secretKeyRef": {"name": S3_SECRET, "key": k, "optional": True}}}
            for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")]


def _env_from() -> list[dict]:
    return [{"configMapRef": {"name": S3_ENDPOINT_CONFIG, "optional": True}}]


def _aws_files(volumes: list[dict], mounts: list[dict], env: list[dict]) -> None:
    """Mount the optional Secret with the AWS config and credentials files and point boto3 at them
    (a region opened with ``profile=NAME`` reads that profile from these files)."""
    volumes.append({"name": "aws", "secret": {"secretName": AWS_SECRET, "optional": True, "defaultMode": 0o400}})
    mounts.append({"name": "aws", "mountPath": AWS_MOUNT, "readOnly": True})
    env += [{"name": "AWS_CONFIG_FILE", "value": f"{AWS_MOUNT}/config"},
            {"name": "AWS_SHARED_CREDENTIALS_FILE", "value": f"{AWS_MOUNT}/credentials"}]


def _keys_volume(items: list[str]) -> dict:
    return {"name": "keys", "secret": {"secretName": KEYS_SECRET, "defaultMode": 0o400,
                                       "items": [{"key": k, "path": k} for k in items]}}


def syncer_manifests(store: str, image: str, learners: list[str], signed: bool, aws_files: bool = False,
                     endpoint: str | None = None) -> list[dict]:
    cmd = ["ddiloco", "syncer", "--store", store, *(["--s3-endpoint", endpoint] if endpoint else []),
           "--id", "syncer", "--create", f"{CONFIG_MOUNT}/launch.toml",
           "--ingest", f"tcp://0.0.0.0:{INGEST_PORT}", "--announce", f"tcp://0.0.0.0:{ANNOUNCE_PORT}",
           "--metrics-port", str(METRICS_PORT), "--metrics-host", "0.0.0.0", "--log", "/logs/syncer.jsonl",
           *(["--keys", KEYS_MOUNT] if signed else ["--insecure"])]
    probe = lambda path, period: {"httpGet": {"path": path, "port": "metrics"}, "periodSeconds": period,   # noqa: E731
                                  "failureThreshold": 6}
    volumes = [{"name": "config", "configMap": {"name": RUN_CONFIG}}, {"name": "logs", "emptyDir": {}}]
    mounts = [{"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True}, {"name": "logs", "mountPath": "/logs"}]
    if signed:   # its own secret, and every learner's public key (it lists them in the run it creates)
        volumes.append(_keys_volume(["syncer.key_secret", "syncer.key", *(f"{n}.key" for n in learners)]))
        mounts.append({"name": "keys", "mountPath": KEYS_MOUNT, "readOnly": True})
    env = _s3_env()
    if aws_files:
        _aws_files(volumes, mounts, env)
    pod = {"metadata": {"labels": _labels("syncer"),
                        "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS_PORT),
                                        "prometheus.io/path": "/metrics"}},
           "spec": {"containers": [{
               "name": "syncer", "image": image, "command": cmd, "env": env, "envFrom": _env_from(),
               "ports": [{"name": "ingest", "containerPort": INGEST_PORT}, {"name": "announce",
                                                                            "containerPort": ANNOUNCE_PORT},
                         {"name": "metrics", "containerPort": METRICS_PORT}],
               "startupProbe": {**probe(HEALTH_PATHS[0], 5), "failureThreshold": 60},
               "livenessProbe": probe(HEALTH_PATHS[0], 10), "readinessProbe": probe(HEALTH_PATHS[1], 5),
               "volumeMounts": mounts}], "volumes": volumes, "terminationGracePeriodSeconds": 60}}
    return [
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": SYNCER, "labels": _labels("syncer")},
         "spec": {"clusterIP": "None", "selector": _labels("syncer"), "publishNotReadyAddresses": True,
                  "ports": [{"name": "ingest", "port": INGEST_PORT}, {"name": "announce", "port": ANNOUNCE_PORT},
                            {"name": "metrics", "port": METRICS_PORT}]}},
        {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": SYNCER, "labels": _labels("syncer")},
         "spec": {"serviceName": SYNCER, "replicas": 1, "selector": {"matchLabels": _labels("syncer")},
                  "podManagementPolicy": "OrderedReady", "template": pod}},
        {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": SYNCER},
         "spec": {"maxUnavailable": 0, "selector": {"matchLabels": _labels("syncer")}}},
    ]


def learner_manifest(lid: str, store: str, image: str, command: list[str], nproc: int, max_restarts: int,
                     signed: bool, region: str | None = None, aws_files: bool = False,
                     endpoint: str | None = None) -> dict:
    """One Job per learner: its pod restarts alone (OnFailure), up to ``max_restarts`` times; with
    ``region`` it finds the run at ``store`` (the home region's) and then works in its region's."""
    host = f"{SYNCER}-0.{SYNCER}"
    env = [{"name": "DDILOCO_STORE", "value": store}, {"name": "DDILOCO_LEARNER_ID", "value": lid},
           {"name": "DDILOCO_INGEST", "value": f"tcp://{host}:{INGEST_PORT}"},
           {"name": "DDILOCO_ANNOUNCE", "value": f"tcp://{host}:{ANNOUNCE_PORT}"},
           {"name": "DDILOCO_PROPOSE", "value": "1"}, {"name": "DDILOCO_LOG", "value": f"/logs/{lid}.jsonl"},
           *_s3_env()]
    volumes, mounts = [{"name": "logs", "emptyDir": {}}], [{"name": "logs", "mountPath": "/logs"}]
    if signed:   # its own secret key and the syncer's public key, nothing else
        env += [{"name": "DDILOCO_KEY", "value": f"{KEYS_MOUNT}/{lid}.key_secret"},
                {"name": "DDILOCO_SYNCER_KEY", "value": f"{KEYS_MOUNT}/syncer.key"}]
        volumes.append(_keys_volume([f"{lid}.key_secret", "syncer.key"]))
        mounts.append({"name": "keys", "mountPath": KEYS_MOUNT, "readOnly": True})
    if region is not None:
        env.append({"name": "DDILOCO_REGION", "value": region})
    if endpoint is not None:       # the home region's own endpoint (every other region's is in the run)
        env.append({"name": "DDILOCO_S3_ENDPOINT", "value": endpoint})
    if aws_files:
        _aws_files(volumes, mounts, env)
    labels = _labels("learner", **{"ddiloco/learner": lid}, **({"ddiloco/region": region} if region else {}))
    cmd = list(command)
    if nproc > 1:   # torchrun inside the pod, every listener on 127.0.0.1
        cmd = ["python", "-m", "workers.learner.localrun", "--nproc-per-node", str(nproc), *cmd[1:]] \
            if cmd[0] in ("python", "python3") else cmd
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": f"ddiloco-learner-{lid}", "labels": labels},
            "spec": {"backoffLimit": max_restarts, "completions": 1, "parallelism": 1,
                     "template": {"metadata": {"labels": labels},
                                  "spec": {"restartPolicy": "OnFailure", "terminationGracePeriodSeconds": 60,
                                           "containers": [{"name": "learner", "image": image, "command": cmd,
                                                           "env": env, "envFrom": _env_from(),
                                                           "volumeMounts": mounts}],
                                           "volumes": volumes}}}}


def minio_manifests() -> list[dict]:
    """A single MinIO for a dev cluster, its root user from the same ``ddiloco-s3`` Secret."""
    env = [{"name": "MINIO_ROOT_USER", "valueFrom": {"secretKeyRef": {"name": S3_SECRET, "key": "AWS_ACCESS_KEY_ID"}}},
           {"name": "MINIO_ROOT_PASSWORD", "valueFrom": {"secretKeyRef": {"name": S3_SECRET,
                                                                          "key": "AWS_SECRET_ACCESS_KEY"}}}]
    labels = _labels("minio")
    return [
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "minio", "labels": labels},
         "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "template": {
             "metadata": {"labels": labels},
             "spec": {"containers": [{"name": "minio", "image": "minio/minio:RELEASE.2025-04-22T22-12-26Z",
                                      "command": ["minio", "server", "/data"], "env": env,
                                      "ports": [{"name": "s3", "containerPort": 9000}],
                                      "readinessProbe": {"httpGet": {"path": "/minio/health/ready", "port": "s3"}},
                                      "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
                      "volumes": [{"name": "data", "emptyDir": {}}]}}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "minio", "labels": labels},
         "spec": {"selector": labels, "ports": [{"name": "s3", "port": 9000}]}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": S3_ENDPOINT_CONFIG},
         "data": {"AWS_ENDPOINT_URL": "http://minio:9000"}},
    ]


def render(out: Path, learners: int, store: str | None, image: str, command: list[str], nproc: int = 1,
           max_restarts: int = 6, signed: bool = True, launch_toml: str = "", namespace: str = "ddiloco",
           regions: RegionsConfig | None = None) -> list[Path]:
    """Write the base and the overlays under ``out``; returns the files written. ``regions``: the
    run's regions (the ones ``launch_toml`` names), in place of ``store``."""
    if learners < 1 or nproc < 1 or max_restarts < 0:
        raise ValueError(f"learners and nproc must be >= 1 and max_restarts >= 0, got {learners}, {nproc}, "
                         f"{max_restarts}")
    if not command:
        raise ValueError("give the learners' command after --, e.g. -- python train.py")
    if (store is None) == (regions is None):
        raise ValueError("give the run's --store, or its regions (--region, home first, or "
                         "launch.region_specs), not both")
    names = learner_names(learners)
    placement = Placement.round_robin(names, [r.name for r in regions.regions] if regions is not None else [])
    home = regions.region(regions.home) if regions is not None else None
    store, endpoint = (home.uri, home.endpoint) if home is not None else (store, None)
    aws = regions is not None and any(r.profile for r in regions.regions)
    files: dict[str, list[dict]] = {
        "base/syncer.yaml": syncer_manifests(store, image, names, signed, aws, endpoint),
        "base/run-config.yaml": [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": RUN_CONFIG},
                                  "data": {"launch.toml": launch_toml}}],
        **{f"base/learner-{n}.yaml": [learner_manifest(n, store, image, command, nproc, max_restarts, signed,
                                                       placement.region(n), aws, endpoint)] for n in names},
        "overlays/dev-minio/minio.yaml": minio_manifests(),
    }
    resources = sorted(Path(k).name for k in files if k.startswith("base/"))
    kustomizations = {
        "base/kustomization.yaml": {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                                    "namespace": namespace, "labels": [{"pairs": {"ddiloco/run": namespace}}],
                                    "resources": resources},
        "overlays/dev-minio/kustomization.yaml": {"apiVersion": "kustomize.config.k8s.io/v1beta1",
                                                  "kind": "Kustomization", "resources": ["../../base", "minio.yaml"]},
        "overlays/cluster/kustomization.yaml": {"apiVersion": "kustomize.config.k8s.io/v1beta1",
                                                "kind": "Kustomization", "resources": ["../../base"]},
    }
    written = []
    for rel, docs in files.items():
        written.append(_write(out / rel, yaml.safe_dump_all(docs, sort_keys=False)))
    for rel, doc in kustomizations.items():
        written.append(_write(out / rel, yaml.safe_dump(doc, sort_keys=False)))
    written.append(_write(out / "README.md", _readme(names, signed, namespace, placement, aws)))
    return written


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _readme(names: list[str], signed: bool, namespace: str, placement: Placement, aws: bool) -> str:
    keys = " ".join(["syncer", *names])
    regions = sorted({placement.region(n) for n in names} - {None})
    per_region = "".join(f"\n- `{r}`: {', '.join(placement.in_region(r))}" for r in regions)
    region_text = f"""
Regions: the launch file names them; learner m is in region m mod N (`DDILOCO_REGION`, and the
label `ddiloco/region` on its Job and pod, for an overlay that patches in a nodeSelector per
region or for `kubectl apply -k overlays/cluster -l ddiloco/region=NAME`):{per_region}
""" if regions else ""
    aws_text = f"""kubectl -n {namespace} create secret generic {AWS_SECRET} \\
    --from-file=config=$HOME/.aws/config --from-file=credentials=$HOME/.aws/credentials   # the regions' profiles
""" if aws else ""
    return f"""# A decoupled-diloco run on Kubernetes (written by `ddiloco k8s render`)

```
kubectl create namespace {namespace}
kubectl -n {namespace} create secret generic {S3_SECRET} \\
    --from-literal=AWS_ACCESS_KEY_ID=... --from-literal=AWS_SECRET_ACCESS_KEY=...   # or --from-env-file
""" + aws_text + (f"""ddiloco keys keys/ {keys}                        # key pairs; secrets never leave these files
kubectl -n {namespace} create secret generic {KEYS_SECRET} --from-file=keys/
""" if signed else "") + f"""kubectl apply -k overlays/cluster       # or overlays/dev-minio: the same run against an in-cluster MinIO
kubectl -n {namespace} get pods -w
```

The syncer (StatefulSet `{SYNCER}`, one replica) creates the run from the first learner's model with
the settings in `base/run-config.yaml`; each learner is its own Job and restarts alone. Health:
`/healthz` and `/readyz` on the syncer's port {METRICS_PORT}, which Prometheus scrapes (`/metrics`).
""" + region_text


def launch_file(path: str | None, learners: int | None, region_flags: list[str] | None):
    """(learners, the launch file's text, its regions) for the ConfigMap the syncer creates the run
    from: the ``--config`` file's settings (or the defaults), with ``--learners`` and ``--region``
    set on them; a flag that contradicts the file is refused rather than silently winning."""
    from workers import config
    from workers.launch_config import SKIP, LaunchConfig
    values = config.read_toml(path, LaunchConfig, SKIP) if path else {}
    for key, flag in (("launch.learners", learners), ("launch.region_specs", ";".join(region_flags or []) or None)):
        if flag is not None and values.get(key, flag) != flag:
            raise ValueError(f"{key} is {values[key]!r} in {path} but {flag!r} on the command line: give it once")
        if flag is not None:
            values[key] = flag
    values.setdefault("launch.learners", 2)
    cfg = config.build(LaunchConfig, values, {k: str(path) for k in values} if path else None)
    specs = cfg.launch.region_specs
    regions = regions_from_specs(specs.split(";")) if specs else None
    text = config.to_toml(cfg, SKIP, header="the run's settings (k8s render); ddiloco syncer --create reads them")
    return cfg.launch.learners, text, regions


def configure(parser: argparse.ArgumentParser):
    """Kubernetes manifests for a run: ddiloco k8s render --learners M --store URI -- CMD."""
    sub = parser.add_subparsers(dest="k8s_command", required=True)
    r = sub.add_parser("render", help="write a kustomize base and overlays for a run")
    r.add_argument("--learners", type=int, default=None, help="learners (default: the --config file's, else 2)")
    r.add_argument("--store", default=None, help="the run's location: s3://bucket/prefix (or --region)")
    r.add_argument("--region", action="append", default=None, metavar="NAME=URI[,endpoint=URL][,profile=NAME]",
                   help="a region of the run on its own store (once per region, home first; launch.region_specs)")
    r.add_argument("--image", default="ddiloco:latest", help="the container image with decoupled-diloco and the script")
    r.add_argument("--nproc-per-learner", type=int, default=1)
    r.add_argument("--max-restarts", type=int, default=6)
    r.add_argument("--namespace", default="ddiloco")
    r.add_argument("--insecure", action="store_true", help="an unsigned run (no keys Secret)")
    r.add_argument("--config", default=None, metavar="LAUNCH.toml",
                   help="the run's settings (ddiloco launch --print-config; default: the defaults for --learners)")
    r.add_argument("--out", default="k8s", help="output directory")
    r.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD ARGS")

    def handler(args) -> int:
        cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
        try:
            learners, toml, regions = launch_file(args.config, args.learners, args.region)
            files = render(Path(args.out), learners, args.store, args.image, cmd, args.nproc_per_learner,
                           args.max_restarts, not args.insecure, toml, args.namespace, regions)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"ddiloco k8s render: {exc}") from None
        print(f"wrote {len(files)} files under {args.out}: kubectl apply -k {args.out}/overlays/cluster "
              f"(first the Secrets: {args.out}/README.md); the command each learner runs: {shlex.join(cmd)}",
              file=sys.stdout)
        return 0
    return handler
