"""``ddiloco syncer --create FILE``: the syncer creates its run from the first learner's proposal (issue 28/29).

Under ``ddiloco launch`` the launcher creates a new run; on a cluster (Kubernetes, SLURM) nothing
outlives the jobs but the syncer, so it does the same: it reads the run's settings from a launch file
(``ddiloco launch --print-config``; workers/launch_config.py), waits until a learner proposed its model
(storage/proposal.py), and creates the run from it - signed with its own key, listing every learner
whose public key file (``NAME.key``) lies in its key directory. An existing run is used as it is.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from pipeline.descriptor import RunDescriptor
from pipeline.regions import regions_from_specs
from storage.errors import NotFound
from storage.layout import read_descriptor
from storage.proposal import run_complete, wait_for_run
from storage.store import ObjectStore
from workers.bus.keys import SYNCER, Identity, load_public
from workers.launch import create_from_proposal

POLL_S = 0.2


def launch_settings(path: str | Path):
    """The LaunchConfig of a launch file (``SystemExit`` naming the file and key for a bad one)."""
    from workers import config
    from workers.launch_config import SKIP, LaunchConfig
    try:
        values = config.read_toml(path, LaunchConfig, SKIP)
        return config.build(LaunchConfig, values, {k: str(path) for k in values})
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--create {path}: {exc}") from None


def listed_learners(key_dir: Path | None) -> list:
    """The public identities of the learners whose ``NAME.key`` lies in ``key_dir`` (syncer's excluded)."""
    if key_dir is None:
        return []
    return [load_public(p) for p in sorted(Path(key_dir).glob("*.key")) if p.stem != SYNCER]


def create_when_proposed(store: ObjectStore, path: str | Path, syncer: Identity | None, key_dir: Path | None,
                         timeout_s: float, events=None, clock: Callable[[], float] = time.monotonic,
                         sleep: Callable[[float], None] = time.sleep) -> RunDescriptor:
    """The run's descriptor: the existing run's, or one created from the first proposal within
    ``timeout_s`` (``NotFound`` otherwise)."""
    cfg = launch_settings(path)
    # the run's regions are data in the launch file (launch.region_specs, home first), as for ddiloco launch
    regions = regions_from_specs(cfg.launch.region_specs.split(";")) if cfg.launch.region_specs else None
    learners = listed_learners(key_dir) if syncer is not None else []
    deadline = clock() + timeout_s
    while True:
        try:
            desc = read_descriptor(store)
            return desc if run_complete(store, desc) else wait_for_run(store, max(1.0, deadline - clock()))
        except NotFound:
            pass
        try:
            desc, proposer = create_from_proposal(store, cfg.settings(regions), syncer=syncer, learners=learners)
            if events is not None:
                events.emit("run-created", run_id=desc.run_id, initial_model_from=proposer, by="syncer",
                            learners_listed=len(learners))
            return desc
        except NotFound:
            pass
        if clock() >= deadline:
            raise NotFound(f"no run at {store.uri} and no learner proposed a model within {timeout_s:g} s "
                           "(start the learners with DDILOCO_PROPOSE=1)", uri=store.uri)
        sleep(POLL_S)
