"""`ddiloco slurm submit`: a run as SLURM jobs - one syncer job, one job per learner, one stop job (issue 29).

    ddiloco slurm submit --learners 4 --out /shared/runs/r1 --partition gpu -- python train.py

1. ``OUT`` (on a filesystem every node mounts) gets the run's settings (``OUT/launch.toml``, the
   same file as ``ddiloco launch --print-config``), keys for the syncer and every learner
   (``OUT/keys``, unless ``--insecure``) and the batch scripts (``OUT/slurm/*.sbatch``,
   infra/slurm/scripts.py). The store is ``--store`` (S3 across sites) or ``OUT/store``; with
   ``--region NAME=URI,...`` (home first) the home region's, and learner m runs in region m mod N.
2. The syncer's job: ``ddiloco syncer --create OUT/launch.toml --advertise HOST`` on any free port
   - it creates the run from the first learner's proposed model and writes where it listens into
   the store (workers/bus/discovery.py), so no job script holds a hostname; requeued when it fails,
   it recovers from the log and advertises its new endpoints, which the learners follow.
3. One job per learner, each running the command with the environment contract
   (workers/learner/env.py: ``DDILOCO_DISCOVER=1``, ``DDILOCO_PROPOSE=1``, its key files). Its job
   alone is requeued when its process or node fails and resumes from its record; ``scancel`` of it
   stops that learner and nobody else. ``--nodes-per-learner N`` makes it a torchrun group across N
   nodes (``srun``), ``--nproc-per-learner G`` ranks per node.
4. With ``--eval``, an evaluator job: the command once more with ``DDILOCO_ROLE=evaluator`` (as
   ``ddiloco launch --eval``), following the global model and logging its held-out loss.
5. A stop job after every learner's (``afterany``): it waits until the syncer has committed every
   learner's durable deltas (infra/slurm/drain.py), SIGTERMs the syncer, then the evaluator (its last evaluation is of the final model), and writes
   ``OUT/summary.json`` and ``OUT/report.png`` (``ddiloco slurm summary OUT``).

Without a command the learners are the built-in demo learner (``ddiloco learner``) on a run that
exists already (``ddiloco run --create-only --store URI``); it starts a new life at step 0 when requeued.
``OUT/slurm/jobs.json`` records the job ids (``ddiloco slurm status OUT`` reads it).
"""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from storage.errors import NotFound
from storage.layout import read_descriptor
from storage.store import open_store
from workers import config
from workers.bus.keys import SYNCER, ensure_identities, key_paths
from pipeline.regions import regions_from_specs
from workers.common.placement import Placement, learner_names
from workers.launch_config import SKIP, LaunchConfig
from workers.launcher import learner_command
from workers.learner.env import LearnerEnv

from .scripts import ROLE_SBATCH, STOP_SBATCH

JOBS_FILE = "slurm/jobs.json"
EVALUATOR = "evaluator"
ROLES = (SYNCER, EVALUATOR, "stop")   # the jobs that are not learners
JOBS_VERSION = 1


@dataclass(frozen=True)
class SlurmOptions:
    """What ``ddiloco slurm submit`` asks of SLURM (the run's own settings are the LaunchConfig)."""

    partition: str | None = None
    account: str | None = None
    time_limit: str | None = None            # sbatch --time, e.g. 2-00:00:00
    nodes_per_learner: int = 1
    syncer_restarts: int = 20
    bind: str = "0.0.0.0"                    # the syncer's bus binds here, on free ports
    advertise: str = ""                      # what learners connect to ('' : the syncer node's name)
    sbatch_args: tuple[str, ...] = ()        # more sbatch options for every job, e.g. --qos=high
    python: str = sys.executable

    def __post_init__(self) -> None:
        if self.nodes_per_learner < 1:
            raise ValueError(f"--nodes-per-learner must be >= 1, got {self.nodes_per_learner}")
        if self.syncer_restarts < 0:
            raise ValueError(f"--syncer-restarts must be >= 0, got {self.syncer_restarts}")
        for a in self.sbatch_args:
            if not a.startswith("-"):
                raise ValueError(f"--sbatch-arg takes one sbatch option such as --qos=high, got {a!r}")


@dataclass
class Job:
    """One ``sbatch`` call: its options, the script, the command it runs and the variables it adds."""

    role: str
    options: list[str]
    script: Path
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    after: list[str] = field(default_factory=list)   # roles whose jobs must have ended (afterany)

    def argv(self, ids: dict[str, str]) -> list[str]:
        dep = [f"--dependency=afterany:{':'.join(ids[r] for r in self.after)}"] if self.after else []
        return ["sbatch", "--parsable", *self.options, *dep, str(self.script), *self.command]


def run_store(out: Path, lc) -> tuple[str, str | None]:
    """The run's store and S3 endpoint: the home region's with --region, else --store or OUT/store."""
    if lc.region_specs:
        regions = regions_from_specs(lc.region_specs.split(";"))
        home = regions.region(regions.home)
        return home.uri, home.endpoint or lc.s3_endpoint
    return lc.store or str(Path(out).resolve() / "store"), lc.s3_endpoint


def plan(cfg: LaunchConfig, opts: SlurmOptions, out: Path, command: list[str]) -> list[Job]:
    """The jobs of a run, in submission order (writes OUT's settings, keys and scripts)."""
    lc = cfg.launch
    if lc.syncers > 1:
        raise ValueError("--syncers > 1: learners find only an unsharded syncer through the store so far; "
                         "run one syncer on SLURM")
    if not lc.bus:
        raise ValueError("--no-bus: the SLURM jobs find the syncer's bus through the store; drop --no-bus")
    out = out.resolve()
    (out / "slurm").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    # regions (--region NAME=URI[,endpoint=URL][,profile=NAME], home first): the syncer works on the
    # home region's store, learner m in region m mod N names its region (DDILOCO_REGION), as ddiloco launch
    regions = regions_from_specs(lc.region_specs.split(";")) if lc.region_specs else None
    store_uri, s3_endpoint = run_store(out, lc)
    store = open_store(store_uri, s3_endpoint=s3_endpoint)
    names = learner_names(lc.learners)
    placement = Placement.round_robin(names, [r.name for r in regions.regions] if regions is not None else [])
    keydir = None if lc.insecure else Path(lc.keys or out / "keys").resolve()
    if keydir is not None:
        ensure_identities(keydir, [SYNCER, *names])
    builtin = not command
    if builtin:
        try:
            read_descriptor(store)
        except NotFound:
            raise ValueError(f"no training command and no run at {store_uri}: give the command after -- (e.g. "
                             f"-- python train.py), or create a demo run first (ddiloco run --create-only --store "
                             f"{store_uri} --learners {lc.learners}) for the built-in learner") from None
    launch_toml = out / "launch.toml"
    launch_toml.write_text(config.to_toml(cfg, SKIP, header="the settings of this SLURM run (ddiloco slurm submit)"))
    role_script, stop_script = out / "slurm" / "role.sbatch", out / "slurm" / "stop.sbatch"
    role_script.write_text(ROLE_SBATCH)
    stop_script.write_text(STOP_SBATCH)
    common = [*(["--partition", opts.partition] if opts.partition else []),
              *(["--account", opts.account] if opts.account else []),
              *(["--time", opts.time_limit] if opts.time_limit else []), *opts.sbatch_args]
    py = opts.python

    def options(role: str, *more: str) -> list[str]:
        return [f"--job-name=ddiloco-{role}", f"--output={out / 'slurm' / f'{role}-%j.out'}", *common, *more]

    signed = [] if keydir is None else ["--keys", str(keydir)]
    syncer_cmd = [py, "-m", "workers.cli", "syncer", "--store", store_uri, "--id", SYNCER,
                  "--ingest", f"tcp://{opts.bind}:0", "--announce", f"tcp://{opts.bind}:0",
                  "--advertise", opts.advertise, "--log", str(out / "logs" / "syncer.jsonl"),
                  *(["--s3-endpoint", s3_endpoint] if s3_endpoint else []),
                  *(signed or ["--insecure"]), *([] if builtin else ["--create", str(launch_toml)])]
    jobs = [Job(SYNCER, options(SYNCER, "--ntasks=1"), role_script, syncer_cmd,
                {"DDILOCO_SLURM_ROLE": SYNCER, "DDILOCO_SLURM_MAX_RESTARTS": str(opts.syncer_restarts)})]
    nproc = lc.nproc_per_learner
    for lid in names:
        env = {"DDILOCO_SLURM_ROLE": lid, "DDILOCO_SLURM_MAX_RESTARTS": str(lc.max_restarts),
               "DDILOCO_SLURM_NODES": str(opts.nodes_per_learner), "DDILOCO_SLURM_NPROC": str(nproc),
               "DDILOCO_SLURM_PYTHON": py}
        log = str(out / "logs" / f"{lid}.jsonl")
        if builtin:
            cmd = [py, "-m", "workers.cli", "learner", "--store", store_uri, "--id", lid, "--discover", "--log", log,
                   *(["--s3-endpoint", s3_endpoint] if s3_endpoint else []), *(signed or ["--insecure"]),
                   *(["--region", placement.region(lid)] if placement.region(lid) else []),
                   "--state-every", str(lc.state_every),           # a requeued life resumes its count
                   *(["--steps", str(lc.steps)] if lc.steps else [])]
        else:
            # one node: this interpreter, under workers.learner.localrun for G > 1 ranks (as ddiloco launch);
            # several nodes: role.sbatch wraps the command in srun + torchrun itself
            cmd = learner_command(command, nproc if opts.nodes_per_learner == 1 else 1)
            contract = LearnerEnv(
                store=store_uri, learner_id=lid, s3_endpoint=s3_endpoint, region=placement.region(lid), log=log,
                propose=True, discover=True,
                key=str(key_paths(keydir, lid)[1]) if keydir else None,
                syncer_key=str(key_paths(keydir, SYNCER)[0]) if keydir else None,
                propose_wait_s=lc.propose_wait, state_every_s=lc.state_every, steps=lc.steps,
                optimizer_every=lc.save_optimizer_every)
            env.update(contract.to_environ())
        per_node = nproc if opts.nodes_per_learner > 1 else 1
        jobs.append(Job(lid, options(lid, f"--nodes={opts.nodes_per_learner}", f"--ntasks-per-node=1",
                                     f"--cpus-per-task={per_node}"), role_script, cmd, env))
    if lc.eval or lc.eval_command:   # the command once more as the run's evaluator (as ddiloco launch --eval)
        if builtin:
            raise ValueError("--eval runs the training command as the evaluator: give the command after --")
        eval_cmd = learner_command(shlex.split(lc.eval_command) if lc.eval_command else command, 1)
        contract = LearnerEnv(store=store_uri, learner_id=EVALUATOR, s3_endpoint=s3_endpoint, role="evaluator",
                              log=str(out / "logs" / f"{EVALUATOR}.jsonl"), propose_wait_s=lc.propose_wait,
                              steps=lc.steps)
        jobs.append(Job(EVALUATOR, options(EVALUATOR, "--ntasks=1"), role_script, eval_cmd,
                        {"DDILOCO_SLURM_ROLE": EVALUATOR, "DDILOCO_SLURM_MAX_RESTARTS": str(lc.max_restarts),
                         **contract.to_environ()}))
    jobs.append(Job("stop", options("stop", "--ntasks=1"), stop_script, [],
                    {"DDILOCO_SLURM_OUT": str(out), "DDILOCO_SLURM_PYTHON": py}, after=list(names)))
    return jobs


def submit(jobs: list[Job], out: Path, environ: dict[str, str], runner=subprocess.run) -> dict[str, str]:
    """``sbatch`` each job in order (the stop job learns the syncer's id); returns role -> job id and
    writes ``OUT/slurm/jobs.json``. A refused sbatch cancels what was submitted before it."""
    ids: dict[str, str] = {}
    for job in jobs:
        env = {**environ, **job.env}
        if job.role == "stop":
            env["DDILOCO_SLURM_SYNCER_JOB"] = ids[SYNCER]
            env["DDILOCO_SLURM_EVAL_JOB"] = ids.get(EVALUATOR, "")
        done = runner(job.argv(ids), capture_output=True, text=True, env=env, timeout=120)
        if done.returncode != 0:
            if ids:
                runner(["scancel", *ids.values()], capture_output=True, text=True, env=environ, timeout=120)
            raise RuntimeError(f"sbatch refused the {job.role} job ({done.returncode}): {done.stderr.strip()[-800:]}"
                               + (f"; cancelled jobs {', '.join(ids.values())}" if ids else ""))
        ids[job.role] = done.stdout.strip().split(";")[0]
    record = {"version": JOBS_VERSION, "submitted": time.time(), "syncer": ids[SYNCER], "stop": ids["stop"],
              "evaluator": ids.get(EVALUATOR), "learners": {j.role: ids[j.role] for j in jobs if j.role not in ROLES}}
    (out.resolve() / JOBS_FILE).write_text(json.dumps(record, indent=2))
    return ids


def read_jobs(out: Path) -> dict:
    """``OUT/slurm/jobs.json`` (ValueError naming the file when it is missing or not ours)."""
    path = Path(out) / JOBS_FILE
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a `ddiloco slurm submit` output directory ({exc})") from None
    if record.get("version") != JOBS_VERSION:
        raise ValueError(f"{path}: version {record.get('version')!r}, this ddiloco reads {JOBS_VERSION}")
    return record


def describe(jobs: list[Job]) -> str:
    """The sbatch calls as a shell would run them (``--dry-run``)."""
    lines = []
    for job in jobs:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(job.env.items()))
        dep = [f"--dependency=afterany:<{'>:<'.join(job.after)}>"] if job.after else []
        argv = ["sbatch", *job.options, *dep, str(job.script), *job.command]
        lines.append(f"# {job.role}\n{env} {shlex.join(argv)}")
    return "\n".join(lines)
