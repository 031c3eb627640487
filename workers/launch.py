"""Creating a run: the one initial model, the run descriptor and version 0 of every fragment.

SPEC §7 'One initial model': version 0 is written to storage once, with the descriptor, and every
learner loads it; no learner initialises its own weights. The descriptor is written
create-if-absent, so two launchers can never create one run twice with different settings.

Security (docs/security.md): given the syncer's identity, the run is *signed*: the descriptor lists
the public keys (its ``security`` section, never a secret) and version 0 and the init commits carry
the syncer's signatures. Without it the run is unsigned for its whole life.
"""
from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from pipeline.checksum import tensor_digest
from pipeline.fold import published
from pipeline.codec import CodecConfig
from pipeline.descriptor import LearnerRules, RunDescriptor, RunSections, VersionsConfig
from pipeline.fragment import FragmentLayout, fragment_offsets, make_layout, specs_from_arrays
from pipeline.guard import NormGuardConfig
from pipeline.merge import MergeConfig, default_embedding_tensors
from pipeline.outer import OuterConfig
from pipeline.policy import PolicyConfig
from pipeline.regions import RegionsConfig
from pipeline.schedule import ScheduleConfig
from pipeline.security import RunSecurity
from pipeline.types import CommitRecord
from storage.layout import version_key, write_descriptor
from storage.log import CommitLog
from storage.regions import open_region, seed_region
from storage.shards import shard_stores
from storage.store import ObjectStore
from workers.bus.keys import Identity, PublicIdentity
from workers.bus.signing import sign_commit
from workers.common.versions import encode_version


STRATEGIES = ("balanced", "layerwise", "roundrobin")


@dataclass(frozen=True)
class Schedule:
    """``[schedule]``: P fragments, each synced every H steps (SPEC §2), cut by ``strategy``.
    ``sync_every`` none: 4 x fragments, the demo job's sweep (docs/results.md "Rounds, defaults and quality")."""

    fragments: int = 4
    sync_every: int | None = None
    strategy: str = "balanced"

    def __post_init__(self) -> None:
        if self.fragments < 1:
            raise ValueError(f"fragments must be >= 1, got {self.fragments}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.sync_every is not None and self.sync_every < self.fragments:
            raise ValueError(f"sync_every (H={self.sync_every}) must be >= fragments (P={self.fragments}): "
                             "each fragment needs its own step offset")

    @property
    def h(self) -> int:
        return self.sync_every if self.sync_every is not None else 4 * self.fragments


@dataclass(frozen=True)
class RunSettings(RunSections):
    """What ``create_run`` takes: the schedule and the descriptor's own sections, each holding its
    one set of defaults (workers/run_config.py builds it from flags or a file). ``merge``'s
    embedding tensors are filled in from the model at creation; ``guard`` off:
    ``NormGuardConfig(enabled=False)`` (always recorded, so replay knows the run's guard)."""

    schedule: Schedule = Schedule()
    guard: NormGuardConfig = NormGuardConfig()
    seed: int = 0
    run_id: str = ""
    model: dict[str, Any] = field(default_factory=dict)
    job: dict[str, Any] | None = None  # the default job's settings (workers/job/job.py JobSettings.to_dict())
    extra: dict[str, Any] = field(default_factory=dict)   # free-form notes, never read
    regions: RegionsConfig | None = None   # the run topology; None: one region, this store
    syncers: int = 1                   # syncer shards: shard i owns fragments p % syncers == i

    def __post_init__(self) -> None:
        if {"security", "norm_guard", "job"} & set(self.extra):
            raise ValueError("extra must not hold 'security', 'norm_guard' or 'job': they are sections of the "
                             "descriptor (pass the keys to create_run, guard and job to RunSettings)")
        for name, cls in (("schedule", Schedule), ("policy", PolicyConfig), ("codec", CodecConfig),
                          ("versions", VersionsConfig), ("merge", MergeConfig), ("outer", OuterConfig),
                          ("learner", LearnerRules), ("guard", NormGuardConfig)):
            if not isinstance(getattr(self, name), cls):
                raise ValueError(f"RunSettings.{name} must be a {cls.__name__}, got {getattr(self, name)!r}")

    def descriptor(self, run_id: str, specs: Sequence, embedding_tensors: Sequence[str],
                   security: RunSecurity | None = None) -> RunDescriptor:
        """The run descriptor these settings make for a model of ``specs`` (the sections as they
        are; the layout, H's offsets and the embedding tensors derived here)."""
        p, h = self.schedule.fragments, self.schedule.h
        layout = make_layout(specs, p, self.schedule.strategy)
        return RunDescriptor(
            run_id=run_id, seed=self.seed, model=dict(self.model), job=None if self.job is None else dict(self.job),
            extra=dict(self.extra), security=security, regions=self.regions, syncers=self.syncers,
            layout=FragmentLayout(tuple(specs), tuple(tuple(f) for f in layout), self.schedule.strategy),
            schedule=ScheduleConfig(h, tuple(fragment_offsets(p, h))), policy=self.policy, codec=self.codec,
            versions=self.versions, merge=MergeConfig(self.merge.method, frozenset(embedding_tensors)),
            outer=self.outer, learner=self.learner, guard=self.guard)


def check_quorum(quorum: int, learners: int) -> None:
    """Refuse a quorum K that the ``learners`` (M) a launcher starts can never meet: K
    is a minimum (SPEC §4), so with K > M no round would ever close and no learner's work would
    reach the model. ``ValueError`` naming both numbers."""
    for name, v in (("quorum K", quorum), ("learners M", learners)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if quorum > learners:
        raise ValueError(f"quorum K={quorum} exceeds the {learners} learner(s) M: K is a minimum, so no round "
                         f"could ever close (use K <= M)")


def create_run(store: ObjectStore, init: Mapping[str, np.ndarray], settings: RunSettings,
               embedding_tensors: tuple[str, ...] | None = None, *, syncer: Identity | None = None,
               learners: Sequence[PublicIdentity] = ()) -> RunDescriptor:
    """Write the descriptor, version 0 of every fragment, and one ``init`` commit per fragment;
    in a run with regions, copy them to every other region's store.

    ``syncer`` (its identity, secret included: it signs version 0) makes the run signed, listing
    ``learners``' public keys; more learners can join later (workers/bus/keys.py ``add_member``)."""
    wide = sorted(n for n, a in init.items() if str(a.dtype) in ("float64", "torch.float64"))
    if wide:   # versions and deltas travel as fp32/bf16: a float64 model would silently lose precision
        raise ValueError(f"the model has float64 tensors ({', '.join(wide[:3])}{' ...' if len(wide) > 3 else ''}); "
                         "runs train float32 models: call model.float() before create_run and the Learner")
    if syncer is None and learners:
        raise ValueError("learner keys were given without the syncer's identity: a signed run needs both")
    if syncer is not None and syncer.public.role != "syncer":
        raise ValueError(f"key {syncer.name!r} has role {syncer.public.role!r}, not 'syncer'")
    security = RunSecurity.listing(syncer.public, learners) if syncer is not None else None
    signer = syncer.signer() if syncer is not None else None
    emb = embedding_tensors if embedding_tensors is not None else tuple(sorted(default_embedding_tensors(init)))
    desc = settings.descriptor(settings.run_id or uuid.uuid4().hex[:12], specs_from_arrays(init), emb, security)
    write_descriptor(store, desc)
    values = published({n: np.asarray(a, dtype=np.float32) for n, a in init.items()}, desc.versions.dtype)
    logs = [CommitLog(s) for s in shard_stores(store, desc)]   # every shard's log starts with them (storage/shards.py)
    for p, names in enumerate(desc.layout.fragments):
        part = {n: values[n] for n in names}
        key = version_key(p, 0, 0)
        checksum = tensor_digest(part)
        store.put_if_absent(key, encode_version(desc, p, 0, p, 0, part, signer, checksum))
        rec = CommitRecord(seq=p, epoch=0, kind="init", fragment=p, version=0, output_key=key,
                           output_checksum=checksum, info={"created_at": round(time.time(), 3)})
        for log in logs:
            log.append(sign_commit(rec, signer, desc.run_id) if signer is not None else rec)
    if desc.regions is not None:   # every region holds the run before any of its learners starts
        for spec in desc.regions.others:
            seed_region(store, open_region(spec, create=True), spec.name)   # its region marker
    return desc


def create_from_proposal(store: ObjectStore, settings: RunSettings, *, syncer: Identity | None = None,
                         learners: Sequence[PublicIdentity] = ()) -> tuple[RunDescriptor, str]:
    """Create the run from the initial model a learner proposed (storage/proposal.py; ``ddiloco
    launch``: the learners bring the model, the launcher holds the settings and the syncer's key).
    ``NotFound`` when nobody proposed yet. Returns (descriptor, the proposing learner's id)."""
    from storage.proposal import read_proposal
    proposer, tensors, model = read_proposal(store)
    settings = dataclasses.replace(settings, model={**settings.model, **model},
                                   extra={**settings.extra, "initial_model_from": proposer})
    return create_run(store, tensors, settings, syncer=syncer, learners=learners), proposer
