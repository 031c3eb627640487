"""Run descriptor format v2 (docs/formats.md "Run descriptor"): typed sections, validated once.

The v1 fixtures in tests/fixtures were written by ``create_run`` before v2 existed (see
make_v1_fixtures.py there): they must still load, migrate to the same typed values, and a signed
v1 run must still replay and verify, its stored bytes untouched.
"""
from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from pipeline.codec import SCHEMES, CodecConfig
from pipeline.descriptor import LearnerRules, RunDescriptor, VersionsConfig, migrate_v1
from pipeline.envelope import pack_record, unpack_record
from pipeline.errors import FormatError
from pipeline.guard import NormGuardConfig, guard_config
from pipeline.merge import MergeConfig
from pipeline.outer import OuterConfig
from pipeline.policy import PolicyConfig
from storage.errors import AlreadyExists
from storage.layout import DESCRIPTOR_KEY, read_descriptor, write_descriptor
from storage.store import open_store
from workers.job.job import JobSettings, job_from
from workers.bus.keys import Roster, ensure_identities
from workers.launch import RunSettings, Schedule, create_run
from workers.tools.replay_verify import replay_run

FIXTURES = Path(__file__).parent / "fixtures"


def fixture(name: str) -> tuple[bytes, dict]:
    doc = json.loads((FIXTURES / f"descriptor_v1_{name}.json").read_text())
    blob = base64.b64decode(doc["envelope_base64"])
    assert hashlib.sha256(blob).hexdigest() == doc["sha256"]
    return blob, doc["body"]


def v2_map() -> dict:
    blob, _ = fixture("unsigned")
    return RunDescriptor.from_bytes(blob).to_dict()


# -- v1 documents still load, migrated to the same typed values ---------------------------------------

def test_a_v1_descriptor_with_every_setting_changed_migrates_to_the_same_values():
    blob, body = fixture("unsigned")
    assert unpack_record(blob, "run-descriptor", 1)[0] == 1
    d = RunDescriptor.from_bytes(blob)
    assert d.run_id == "v1-unsigned" and d.seed == 7 and d.num_fragments == 2
    assert [list(f) for f in d.layout.fragments] == body["fragments"] and d.layout.strategy == "balanced"
    assert [t.to_dict() for t in d.layout.tensors] == body["tensors"]
    assert (d.schedule.sync_every, list(d.schedule.offsets), d.schedule.driver) == (4, body["offsets"], "syncer")
    assert d.policy == PolicyConfig(quorum=2, overlap=2, gamma=0.25, cap_s=1.5)
    assert d.codec == CodecConfig("int8", 32, 5, format=1)
    assert d.versions == VersionsConfig("bf16", 8, marks=1)
    assert d.merge == MergeConfig("mean", frozenset({"wte.weight"}))
    assert d.outer == OuterConfig(0.5, 0.8)
    assert d.learner == LearnerRules(0.1, True)
    assert d.guard == NormGuardConfig(version=2) and guard_config(d) == NormGuardConfig(version=2)
    assert d.security is None and d.job == body["extra"]["job"] and d.extra == {"note": "kept"}
    assert d.model == {"n_layer": 1, "n_embd": 4}
    assert JobSettings.from_dict(d.job) == JobSettings(**body["extra"]["job"])


def test_a_pre_rounds_v1_descriptor_is_learner_driven_with_a_version_1_guard():
    d = RunDescriptor.from_bytes(fixture("old")[0])
    assert d.schedule.driver == "learner"
    assert d.guard == NormGuardConfig(5.0, 16, 4, cap=None, version=1)
    assert "norm_guard" not in d.extra and "job" not in d.extra


def test_a_signed_v1_run_still_replays_and_verifies_with_its_bytes_untouched(tmp_path):
    blob, body = fixture("signed")
    store_dir = tmp_path / "run"
    shutil.copytree(FIXTURES / "run_v1_signed", store_dir)
    store = open_store(str(store_dir))
    assert store.get(DESCRIPTOR_KEY) == blob
    d = read_descriptor(store)
    assert d.security is not None and d.security.to_dict() == body["extra"]["security"]
    assert sorted(d.security.learners) == ["l0", "l1"] and Roster.for_run(d) is not None
    report = replay_run(store, d)
    assert report.commits == 6 and report.versions == 5 and report.checkpoints == 1
    write_descriptor(store, d)                       # relaunching the same run: a no-op, nothing rewritten
    assert store.get(DESCRIPTOR_KEY) == blob
    with pytest.raises(AlreadyExists, match="different run"):
        write_descriptor(store, dataclasses.replace(d, run_id="someone-else"))


def test_migration_is_one_function_of_the_v1_map():
    _, body = fixture("unsigned")
    via_map = RunDescriptor.from_dict(migrate_v1(body))
    assert via_map == RunDescriptor.from_bytes(fixture("unsigned")[0])
    minimal = {k: body[k] for k in ("run_id", "tensors", "fragments", "offsets", "sync_every")}
    d = RunDescriptor.from_dict(migrate_v1(minimal))    # v1 fields added later take their v1 defaults
    # v1 runs were created with the defaults of their time (gamma 0.5, tau 1, momentum 0.9, fp32 versions,
    # format 1 blobs, one high-water mark): they keep them
    assert d.policy == PolicyConfig(overlap=1, gamma=0.5) and d.codec == CodecConfig(format=1)
    assert d.outer == OuterConfig(0.7, 0.9) and d.versions == VersionsConfig("fp32", 16, marks=1)
    assert d.guard is None and d.job is None
    assert d.schedule.driver == "learner"
    with pytest.raises(FormatError, match=r"descriptor \(v1\): unknown fields \['surprise'\]"):
        migrate_v1({**body, "surprise": 1})
    with pytest.raises(FormatError, match=r"missing fields \['sync_every'\]"):
        migrate_v1({k: v for k, v in body.items() if k != "sync_every"})


# -- v2 round trips --------------------------------------------------------------------------------

def test_create_run_writes_v5_and_it_round_trips(tmp_path):
    ids = ensure_identities(tmp_path / "keys", ["syncer", "l0"])
    store = open_store(str(tmp_path / "store"))
    job = JobSettings(steps=3, batch_size=2)
    init = {"a.weight": np.zeros((4, 2), np.float32), "b.bias": np.ones(3, np.float32)}
    d = create_run(store, init, RunSettings(schedule=Schedule(fragments=2, sync_every=2),
                                            policy=PolicyConfig(quorum=2), codec=CodecConfig(scheme="bf16"),
                                            job=job.to_dict(), model={"n_layer": 1}), embedding_tensors=(),
                   syncer=ids["syncer"], learners=[ids["l0"].public])
    blob = store.get(DESCRIPTOR_KEY)
    version, body = unpack_record(blob, "run-descriptor", (1, 2, 5))
    assert version == 5 and body == {**d.to_dict(), "features": {"reader": [], "writer": ["syncer-rounds"]}}
    assert list(body) == ["run_id", "seed", "layout", "schedule", "policy", "codec", "versions", "merge", "outer",
                          "learner", "guard", "security", "job", "model", "extra", "features"]
    assert RunDescriptor.from_bytes(blob) == d and d.to_bytes() == blob
    assert d.policy.quorum == 2 and d.codec.scheme == "bf16" and d.security.learners["l0"] == ids["l0"].public
    assert job_from(d)[1] == job


def test_every_scheme_comes_from_the_codec():
    for scheme in SCHEMES:
        m = v2_map()
        m["codec"]["scheme"] = scheme
        assert RunDescriptor.from_dict(m).codec.scheme == scheme


# -- each validation error names its field ----------------------------------------------------------

def _set(path: str, value):
    def edit(m: dict) -> None:
        *parents, last = path.split(".")
        for p in parents:
            m = m[p]
        m[last] = value
    return edit


BAD = [
    (_set("policy.quorum", 0), r"descriptor policy\.quorum: policy quorum must be an int >= 1, got 0"),
    (_set("policy.quorum", True), r"descriptor policy\.quorum must be int, got bool"),
    (_set("policy.gamma", "fast"), r"descriptor policy\.gamma must be float"),
    (_set("codec.scheme", "int3"), r"descriptor codec\.scheme: codec scheme 'int3' not one of"),
    (_set("codec.block_size", 3), r"descriptor codec\.block_size"),
    (_set("versions.dtype", "fp16"), r"descriptor versions\.dtype"),
    (_set("versions.retain", 0), r"descriptor versions\.retain"),
    (_set("merge.method", "max"), r"descriptor merge\.method"),
    (_set("merge.embedding_tensors", [1]), r"descriptor merge\.embedding_tensors\[0\] must be str"),
    (_set("outer.momentum", 1.0), r"descriptor outer\.momentum"),
    (_set("learner.mixing_alpha", 1.0), r"descriptor learner\.mixing_alpha"),
    (_set("guard.window", 0), r"descriptor guard\.window"),
    (_set("guard.min_history", 64), r"descriptor guard\.min_history: norm guard min_history 64 exceeds window 32"),
    (_set("schedule.sync_every", 0), r"descriptor schedule\.sync_every"),
    (_set("schedule.offsets", [0, 9]), r"descriptor schedule\.offsets"),
    (_set("schedule.driver", "me"), r"descriptor schedule\.driver"),
    (_set("layout.fragments", [["wte.weight"]]), r"descriptor layout: fragments must place every tensor"),
    (_set("layout.tensors", [{"name": "x"}]), r"descriptor layout\.tensors\[0\]"),
    (_set("security", {"mode": "open"}), r"descriptor security: expected mode 'signed'"),
    (_set("job", [1]), r"descriptor job must be dict"),
    (_set("extra", {"job": {}}), r"extra must not hold \['job'\]"),
    (_set("model", {1: 2}), r"descriptor model has a non-string key"),
    (_set("run_id", ""), r"run_id must be a non-empty string"),
    (_set("policy.surprise", 1), r"descriptor policy: unknown fields \['surprise'\]"),
    (_set("topology", {}), r"descriptor: unknown fields \['topology'\]"),
    (lambda m: m["outer"].pop("lr"), r"descriptor outer: missing fields \['lr'\]"),
    (lambda m: m.pop("guard"), r"descriptor: missing fields \['guard'\]"),
]


@pytest.mark.parametrize("edit,message", BAD, ids=[m[:40] for _, m in BAD])
def test_each_validation_error_names_its_field(edit, message):
    m = v2_map()
    edit(m)
    with pytest.raises(FormatError, match=message):
        RunDescriptor.from_dict(m)


def test_stored_errors_name_the_object_and_a_v3_without_regions_or_a_v4_is_refused():
    m = v2_map()
    m["policy"]["quorum"] = 0
    with pytest.raises(FormatError, match=r"store/run.descriptor: descriptor policy\.quorum"):
        RunDescriptor.from_bytes(pack_record("run-descriptor", 2, m), what="store/run.descriptor")
    # v3 is v2 plus regions (issue 14, tests/test_regions.py): without them it is no v3 document
    with pytest.raises(FormatError, match="a version 3 document must have a regions section"):
        RunDescriptor.from_bytes(pack_record("run-descriptor", 3, v2_map()))
    with pytest.raises(FormatError, match="version"):
        RunDescriptor.from_bytes(pack_record("run-descriptor", 4, v2_map()))


def test_v5_names_its_features_and_a_reader_refuses_what_it_lacks_by_name():
    """Issue 26: the optional parts v3 and v4 made document versions of are named features in v5;
    a reader refuses a run whose reader features it lacks, naming them; a run with a writer feature
    it lacks is read (replay, log, export) but no syncer or learner of this build writes to it."""
    d = RunDescriptor.from_dict(v2_map())
    body = {**d.to_dict(), "features": d.features()}
    assert RunDescriptor.from_bytes(pack_record("run-descriptor", 5, body)) == d
    future = {**body, "features": {"reader": ["sparse-fragments"], "writer": ["syncer-rounds"]}}
    with pytest.raises(FormatError, match=r"lacks the reader features \['sparse-fragments'\]"):
        RunDescriptor.from_bytes(pack_record("run-descriptor", 5, future))
    newer = {**body, "features": {"reader": [], "writer": ["syncer-rounds", "tiered-rounds"]}}
    read = RunDescriptor.from_bytes(pack_record("run-descriptor", 5, newer))
    assert read == d and read.unknown_writer_features == ("tiered-rounds",)
    with pytest.raises(FormatError, match=r"a syncer of this version lacks the writer features \['tiered-rounds'\]"):
        read.check_writable("syncer")
    d.check_writable("learner")                          # nothing unknown: fine
    lying = {**body, "features": {"reader": ["regions"], "writer": ["regions", "syncer-rounds"]}}
    with pytest.raises(FormatError, match="do not match the sections"):
        RunDescriptor.from_bytes(pack_record("run-descriptor", 5, lying))
    with pytest.raises(FormatError, match="missing features"):
        RunDescriptor.from_bytes(pack_record("run-descriptor", 5, d.to_dict()))


def test_optional_sections_are_null_and_absent_guard_means_no_guard():
    m = v2_map()
    m.update(guard=None, job=None, security=None)
    d = RunDescriptor.from_dict(m)
    assert d.guard is None and guard_config(d) is None and d.job is None and d.security is None
    m["guard"] = {**dataclasses.asdict(NormGuardConfig()), "enabled": False}
    assert guard_config(RunDescriptor.from_dict(m)) is None
