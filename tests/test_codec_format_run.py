"""The tensor blob format a run writes is the descriptor's ``codec.format`` (issue 15; docs/formats.md
"Run descriptor", docs/scale.md "The codec").

New runs (``RunSettings``, ``ddiloco run``) record format 3 and every writer of the run's blobs uses
it: the learner's sender (deltas), create_run (version 0), the syncer's committer (versions), and
recovery's republish. A descriptor written before the field existed keeps its exact bytes and means
format 1; bad values are refused naming the field. The runs here are real (in-process syncer and
learner, no bus, a tiny model), replayed bit for bit afterwards.
"""
from __future__ import annotations

import base64
import hashlib
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline import codec
from pipeline.codec import RUN_FORMAT, CodecConfig, decode, encode
from pipeline.descriptor import RunDescriptor, VersionsConfig
from pipeline.outer import OuterConfig
from pipeline.policy import PolicyConfig
from pipeline.envelope import pack_record, unpack_record, unseal
from pipeline.errors import FormatError
from pipeline.fragment import specs_from_arrays
from pipeline.guard import NormGuardConfig
from storage.layout import (DELTA_PREFIX, DESCRIPTOR_KEY, SNAPSHOT_SUFFIX, VERSION_PREFIX, parse_version_key,
                            published_keys, read_descriptor, write_descriptor)
from storage.log import CommitLog
from storage.store import open_store
from workers.launch import RunSettings, Schedule, create_run
from workers.learner.learner import Learner, LearnerConfig
from workers.syncer.syncer import Syncer, SyncerConfig
from workers.common.versions import VersionTracker
from workers.tools.replay_verify import replay_run

FIXTURES = Path(__file__).parent / "fixtures"
INIT = {"wte.weight": np.zeros((8, 4), np.float32), "h.0.w": np.ones((4, 4), np.float32),
        "h.0.b": np.zeros(4, np.float32)}


def blob_version(blob: bytes, kind: str) -> int:
    """The envelope version of a stored tensor blob (its checksum checked)."""
    return unseal(blob, kind, codec.VERSIONS, checksums=codec.CHECKSUMS)[0]


# -- the descriptor field ----------------------------------------------------------------------------

def test_new_runs_record_format_3_in_the_codec_section_without_a_new_document_version():
    assert RUN_FORMAT == 3 and RunSettings().codec.format == 3
    d = RunSettings(schedule=Schedule(fragments=2, sync_every=4)).descriptor("r", specs_from_arrays(INIT), ())
    assert d.codec == CodecConfig("int4", 64, 3, 3)
    body = d.to_dict()
    assert body["codec"] == {"scheme": "int4", "block_size": 64, "zstd_level": 3, "format": 3}
    # the section's field, not a new document version or feature (readers refuse unknown fields)
    assert unpack_record(d.to_bytes(), RunDescriptor.KIND, RunDescriptor.VERSION)[1] == {**body, "features": d.features()}
    assert RunDescriptor.from_bytes(d.to_bytes()) == d
    for fmt in (1, 2, 3):
        again = RunSettings(schedule=Schedule(fragments=2, sync_every=4),
                            codec=CodecConfig(format=fmt)).descriptor("r", specs_from_arrays(INIT), ())
        assert RunDescriptor.from_bytes(again.to_bytes()).codec.format == fmt
        assert ("format" in again.to_dict()["codec"]) == (fmt != 1)


def test_descriptors_written_before_the_field_keep_their_bytes_and_mean_format_1(tmp_path):
    """tests/fixtures/descriptor_v2_v4_pre_format.json: v2, v3 (regions) and v4 (shards) documents
    written by the code before codec.format (make_pre_format_fixtures.py), and the v1 fixtures."""
    docs = json.loads((FIXTURES / "descriptor_v2_v4_pre_format.json").read_text())["docs"]
    assert sorted(d["version"] for d in docs.values()) == [2, 3, 4]
    for name, doc in docs.items():
        blob = base64.b64decode(doc["envelope_base64"])
        assert hashlib.sha256(blob).hexdigest() == doc["sha256"] and "format" not in doc["codec"]
        d = RunDescriptor.from_bytes(blob)
        assert d.codec.format == 1 and d.codec.scheme == "int8", name
        assert d.to_bytes() == blob, name                  # re-written: the very same bytes
        store = open_store(str(tmp_path / name))
        store.put_if_absent(DESCRIPTOR_KEY, blob)
        write_descriptor(store, read_descriptor(store))    # relaunching: a no-op
        assert store.get(DESCRIPTOR_KEY) == blob
    for name in ("unsigned", "signed", "old"):
        v1 = json.loads((FIXTURES / f"descriptor_v1_{name}.json").read_text())
        d = RunDescriptor.from_bytes(base64.b64decode(v1["envelope_base64"]))
        assert d.codec.format == 1 and "format" not in d.to_dict()["codec"]
    # and a run that chooses format 1 - and the other settings of that time: the issue-11 exactly-once
    # marks, the version-2 norm guard (issue 25 made newer ones the default), outer momentum 0.9
    # (the flat settings' default then; 0.5 since issue 27, as `ddiloco run` had it) and bf16 versions
    # (int4 since issue 31) - writes exactly what
    # runs wrote before the field (the same map; since issue 26 in a v5 document naming its features)
    plain = RunSettings(schedule=Schedule(fragments=2, sync_every=4), policy=PolicyConfig(quorum=2),
                        codec=CodecConfig("int8", 32, 5, format=1), versions=VersionsConfig("bf16", marks=1),
                        outer=OuterConfig(momentum=0.9),
                        guard=NormGuardConfig(version=2), seed=3, model={"n_layer": 1}).descriptor(
        "pre-format-v2", specs_from_arrays(INIT), ("wte.weight",))
    assert plain.to_dict() == unpack_record(base64.b64decode(docs["v2"]["envelope_base64"]), RunDescriptor.KIND, 2)[1]


def _codec_map(**codec_fields) -> dict:
    d = RunSettings(schedule=Schedule(fragments=2, sync_every=4)).descriptor("r", specs_from_arrays(INIT), ()).to_dict()
    d["codec"] = {"scheme": "int4", "block_size": 64, "zstd_level": 3, **codec_fields}
    return d


@pytest.mark.parametrize("value, message", [
    (4, r"descriptor codec\.format: codec format must be a tensor blob format version, one of \(1, 2, 3\), got 4"),
    (0, r"descriptor codec\.format: .*got 0"),
    ("3", r"descriptor codec\.format must be int, got str"),
    (True, r"descriptor codec\.format must be int, got bool"),
    (1, r"descriptor codec\.format: 1 is written by leaving the field out"),
])
def test_a_bad_codec_format_is_refused_naming_the_field(value, message):
    with pytest.raises(FormatError, match=message):
        RunDescriptor.from_dict(_codec_map(format=value))
    with pytest.raises(FormatError, match=message):
        RunDescriptor.from_bytes(pack_record(RunDescriptor.KIND, 2, _codec_map(format=value)))


def test_a_bad_codec_format_is_refused_before_a_run_is_made(tmp_path, capsys):
    for bad in (4, 0, True, "3", None):
        with pytest.raises(ValueError, match=rf"codec format must be .* one of \(1, 2, 3\), got {bad!r}"):
            RunSettings(codec=CodecConfig(format=bad))
        with pytest.raises(ValueError, match=r"codec format must be"):
            CodecConfig(format=bad)
    from workers import cli
    with pytest.raises(SystemExit) as exit_:
        cli.main(["run", "--codec-format", "4", "--out", str(tmp_path / "out"), "--plain"])
    assert exit_.value.code == 2
    assert "--codec-format: invalid choice: 4 (choose from 1, 2, 3)" in capsys.readouterr().err
    assert not (tmp_path / "out" / "store").exists()


@pytest.mark.parametrize("flags, fmt", [([], 3), (["--codec-format", "2"], 2), (["--codec-format", "1"], 1)])
def test_ddiloco_run_records_its_codec_format_and_writes_version_0_in_it(tmp_path, flags, fmt):
    from workers import cli
    out = tmp_path / "out"
    assert cli.main(["run", "--create-only", "--insecure", "--fragments", "2", "--layers", "1", "--width", "16",
                     "--out", str(out), *flags]) == 0
    store = open_store(str(out / "store"))
    d = read_descriptor(store)
    assert d.codec.format == fmt
    keys = store.list(VERSION_PREFIX)
    assert len(keys) == d.num_fragments and all(blob_version(store.get(k), "version") == fmt for k in keys)


def test_encode_writes_the_configs_format_unless_told():
    x = {"w": np.random.default_rng(0).standard_normal(1000).astype(np.float32)}
    for fmt in (1, 2, 3):
        blob = encode("d", {}, x, CodecConfig(format=fmt))
        assert blob_version(blob, "d") == fmt
        assert blob == encode("d", {}, x, CodecConfig(), version=fmt)      # an explicit version wins
        assert decode(blob, "d").tensors["w"].tobytes() == decode(encode("d", {}, x, CodecConfig()),
                                                                   "d").tensors["w"].tobytes()


# -- real runs ----------------------------------------------------------------------------------------

def _run(tmp_path, commits: int, **settings) -> tuple:
    """A finished in-process run of a tiny model (syncer + one learner, no bus) with ``commits``
    commits; its store and descriptor."""
    store = open_store(str(tmp_path / "run"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    desc = create_run(store, {n: p.detach().numpy().copy() for n, p in model.named_parameters()},
                      RunSettings(schedule=Schedule(fragments=2, sync_every=4), **settings))
    stop = threading.Event()
    syncer = Syncer(store, SyncerConfig(checkpoint_every=4, spill_poll_s=0.05))
    thread = threading.Thread(target=syncer.run, args=(stop.is_set,), daemon=True)
    thread.start()
    learner = Learner(model, torch.optim.AdamW(model.parameters(), 1e-3), store, "l0", LearnerConfig(poll_s=0.05))
    learner.start()
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    deadline = time.monotonic() + 120
    try:
        while CommitLog(store).tail() < commits:
            assert time.monotonic() < deadline, "the run did not reach its commits in time"
            assert thread.is_alive(), "the syncer died"
            learner.step(lambda: torch.nn.functional.mse_loss(model(x), y), tokens=16)
            time.sleep(0.005)
    finally:
        learner.close()
        stop.set()
        thread.join(30)
    return store, desc


@pytest.mark.parametrize("settings, fmt", [({}, 3), ({"codec": CodecConfig("int8", format=1)}, 1)],
                         ids=["default-v3", "chosen-v1-int8"])
def test_a_run_writes_its_format_everywhere_and_replays_bit_for_bit(tmp_path, settings, fmt):
    store, desc = _run(tmp_path, 16, **settings)
    assert read_descriptor(store).codec.format == fmt == desc.codec.format
    deltas, versions = store.list(DELTA_PREFIX), store.list(VERSION_PREFIX)
    assert len(deltas) >= 8 and len(versions) >= 8
    assert {blob_version(store.get(k), "delta") for k in deltas} == {fmt}           # the learner's sender
    kinds = {k: "version" if k.endswith(SNAPSHOT_SUFFIX) or parse_version_key(k)[1] == 0 else "version-delta"
             for k in versions}                 # int4 versions: version 0 and snapshots full, the rest deltas
    assert {blob_version(store.get(k), kinds[k]) for k in versions} == {fmt}       # create_run and the committer
    report = replay_run(store, desc)                   # every commit recomputed, every version compared
    tail = CommitLog(store).tail()              # (the init commits 0..P-1 are the start, not replayed)
    assert (report.start, report.end, report.commits) == (desc.num_fragments, tail, tail + 1 - desc.num_fragments)
    assert report.versions >= 8 and report.checkpoints >= 1
    # a restarted syncer republishes lost newest versions from its recovered state: in the run's
    # format, byte for byte what was stored, so replay still verifies them
    newest = [k for rec in VersionTracker(store, desc).latest().values() for k in published_keys(rec)]
    before = {k: store.get(k) for k in newest}
    for k in newest:
        store.delete(k)
    Syncer(store, SyncerConfig()).recover()
    assert {k: store.get(k) for k in newest} == before
    again = replay_run(store, desc)                   # (the restart appended its own record)
    assert again.versions == report.versions and again.commits >= report.commits and not again.warnings
