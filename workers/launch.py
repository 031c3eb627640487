"""Creating a run: the one initial model, the run descriptor and version 0 of every fragment.

SPEC §7 'One initial model': version 0 is written to storage once, with the descriptor, and every
learner loads it; no learner initialises its own weights. The descriptor is written
create-if-absent, so two launchers can never create one run twice with different settings.

Security (docs/security.md): given the syncer's identity, the run is *signed*: the descriptor lists
the public keys (its ``security`` section, never a secret) and version 0 and the init commits carry
the syncer's signatures. Without it the run is unsigned for its whole life.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from pipeline.checksum import tensor_digest
from pipeline.fold import published
from pipeline.codec import RUN_FORMAT, CodecConfig
from pipeline.descriptor import LearnerRules, RunDescriptor, VersionsConfig
from pipeline.marks import MARKS_LINEAGE
from pipeline.fragment import FragmentLayout, fragment_offsets, make_layout, specs_from_arrays
from pipeline.guard import NEW_RUN_VERSION, NormGuardConfig
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


@dataclass(frozen=True)
class RunSettings:
    """What a user chooses for a run, flat (``descriptor`` maps it to the descriptor's sections, in
    one place; the sections validate it)."""

    fragments: int = 4                 # P
    sync_every: int = 8                # H (each fragment synced every H steps)
    overlap: int = 2                   # tau (the paper's main setting)
    quorum: int = 1                    # K
    compression: str = "int4"
    block_size: int = 64
    zstd_level: int = 3
    codec_format: int = RUN_FORMAT     # tensor blob format of the run's deltas and versions (docs/formats.md)
    version_dtype: str = "bf16"        # versions travel in bf16; the syncer keeps fp32 master state
    merge: str = "rda"
    strategy: str = "balanced"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    grace_gamma: float = PolicyConfig.gamma
    grace_cap_s: float = 0.0
    retain_versions: int = 16
    mixing_alpha: float = 0.0
    keep_progress: bool = False        # learners keep their steps since the answer
    seed: int = 0
    run_id: str = ""
    norm_guard: NormGuardConfig | None = None     # None: the default guard, on (pipeline/guard.py); off: enabled=False
    model: dict[str, Any] = field(default_factory=dict)
    job: dict[str, Any] | None = None  # the default job's settings (workers/job/job.py JobSettings.to_dict())
    extra: dict[str, Any] = field(default_factory=dict)   # free-form notes, never read
    regions: RegionsConfig | None = None   # the run topology; None: one region, this store
    syncers: int = 1                   # syncer shards: shard i owns fragments p % syncers == i
    marks: int = MARKS_LINEAGE         # exactly-once rule (pipeline/marks.py); 1: the issue-11 rule

    def __post_init__(self) -> None:
        if {"security", "norm_guard", "job"} & set(self.extra):
            raise ValueError("extra must not hold 'security', 'norm_guard' or 'job': they are sections of the "
                             "descriptor (pass the keys to create_run, norm_guard and job to RunSettings)")
        if self.fragments < 1:
            raise ValueError(f"fragments must be >= 1, got {self.fragments}")
        CodecConfig(self.compression, self.block_size, self.zstd_level, self.codec_format)   # refused early
        if self.sync_every < self.fragments:
            raise ValueError(f"sync_every (H={self.sync_every}) must be >= fragments (P={self.fragments}): "
                             "each fragment needs its own step offset")

    def descriptor(self, run_id: str, specs: Sequence, embedding_tensors: Sequence[str],
                   security: RunSecurity | None = None) -> RunDescriptor:
        """The run descriptor these settings make for a model of ``specs`` (the one mapping from
        settings to sections; ``ValueError`` from the section that refuses a value)."""
        layout = make_layout(specs, self.fragments, self.strategy)
        return RunDescriptor(
            run_id=run_id, seed=self.seed, model=dict(self.model), job=None if self.job is None else dict(self.job),
            extra=dict(self.extra), security=security, regions=self.regions, syncers=self.syncers,
            layout=FragmentLayout(tuple(specs), tuple(tuple(f) for f in layout), self.strategy),
            schedule=ScheduleConfig(self.sync_every, tuple(fragment_offsets(self.fragments, self.sync_every))),
            policy=PolicyConfig(self.quorum, self.overlap, self.grace_gamma, self.grace_cap_s),
            codec=CodecConfig(self.compression, self.block_size, self.zstd_level, self.codec_format),
            versions=VersionsConfig(self.version_dtype, self.retain_versions, self.marks),
            merge=MergeConfig(self.merge, frozenset(embedding_tensors)),
            outer=OuterConfig(self.outer_lr, self.outer_momentum),
            learner=LearnerRules(self.mixing_alpha, self.keep_progress),
            # Always recorded, so replay knows the run's guard (issue 11 item 2: on unless turned off).
            # (version 3: per-step norms and round agreement,old runs keep the map they wrote)
            guard=self.norm_guard if self.norm_guard is not None else NormGuardConfig(version=NEW_RUN_VERSION))


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
