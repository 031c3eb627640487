"""Syncer checkpoint v3 (issue 31): an int4 run's checkpoint stores each retained version as the
syncer holds it (oldest and newest full, int4 links between), loads back to the same state bit for
bit, continues identically, is a third of a full history's size, and refuses malformed links."""
from __future__ import annotations

import msgpack
import numpy as np
import pytest

from pipeline.checksum import tensor_digest
from pipeline.descriptor import VersionsConfig
from pipeline.envelope import seal, unseal
from pipeline.errors import FormatError
from pipeline.fold import SyncerState, initial_state
from pipeline.state import CHECKPOINT_KIND, FragmentState
from pipeline.version_history import VersionHistory
from test_fold import delta, inp, init_model, make_desc, run
from test_version_history import _chain, _grow

RETAIN = 6


def _int4_run(marks: int = 1, rounds: int = 12):
    """A fold over ``rounds`` merges per fragment of an int4 run retaining RETAIN versions."""
    desc = make_desc(versions=VersionsConfig("int4", RETAIN, marks=marks, full_every=RETAIN))
    rng = np.random.default_rng(3)
    s = initial_state(desc, init_model())
    for r in range(rounds):
        s = run(s, desc, [inp("a", 2 * r, delta(rng), base=r)]).state
        s = run(s, desc, [inp("a", 2 * r + 1, delta(rng, names=("h.1.w",)), frag=1, base=r)], frag=1).state
    return desc, s, rng


def _version(blob: bytes) -> int:
    return unseal(blob, CHECKPOINT_KIND, (1, 2, 3))[0]


def _body(blob: bytes) -> dict:
    return msgpack.unpackb(unseal(blob, CHECKPOINT_KIND, (1, 2, 3))[1], raw=False, strict_map_key=False)


def _reseal(body: dict, version: int = 3) -> bytes:
    return seal(CHECKPOINT_KIND, version, msgpack.packb(body, use_bin_type=True))


def _same_history(a: VersionHistory, b: VersionHistory) -> None:
    assert list(a) == list(b) and a.full_versions() == b.full_versions()
    for (va, xa), (vb, xb) in zip(a.items(), b.items()):
        assert va == vb and tensor_digest(xa) == tensor_digest(xb)


@pytest.mark.parametrize("marks", [1, 2])
def test_an_int4_checkpoint_is_v3_and_round_trips_bit_for_bit(marks):
    desc, s, rng = _int4_run(marks)
    assert s.fragments[0].history.full_versions() == [s.fragments[0].version - RETAIN + 1, s.fragments[0].version]
    blob = s.to_bytes()
    assert _version(blob) == 3
    t = SyncerState.from_bytes(blob, desc)
    assert t.to_bytes() == blob
    assert (t.marks is None) == (marks == 1)
    for fa, fb in zip(s.fragments, t.fragments):
        _same_history(fa.history, fb.history)
    # the loaded state folds on exactly as the live one: the same record, the same next checkpoint
    nxt = [inp("a", 99, delta(rng), base=s.fragments[0].version)]
    ra, rb = run(s, desc, nxt), run(t, desc, nxt)
    assert ra.record == rb.record and ra.state.to_bytes() == rb.state.to_bytes()
    _same_history(ra.state.fragments[0].history, rb.state.fragments[0].history)


def test_v3_holds_the_content_of_a_full_history_in_a_third_of_the_bytes():
    desc, s, _ = _int4_run()
    full = SyncerState([FragmentState(f.version, f.params, f.momentum, {v: x for v, x in f.history.items()})
                        for f in s.fragments], s.high_water, s.last_seq, s.run_id, s.marks)
    old = full.to_bytes()                      # what every checkpoint was before v3: v1, every version full
    assert _version(old) == 1
    loaded = SyncerState.from_bytes(old, desc)  # an older checkpoint still loads, with the same values
    for fa, fb in zip(s.fragments, loaded.fragments):
        assert list(fa.history) == list(fb.history)
        for (_, xa), (_, xb) in zip(fa.history.items(), fb.history.items()):
            assert tensor_digest(xa) == tensor_digest(xb)
    # bytes at a real tensor size (the fold's toy tensors are smaller than one int4 block)
    chain, links = _chain(30)
    compact = _grow(chain, links)
    zeros = {n: np.zeros_like(a) for n, a in chain[-1].items()}

    def size(h):
        return len(SyncerState([FragmentState(29, dict(chain[-1]), zeros, h)], [{}], 41, "run").to_bytes())
    values = 4 * sum(a.size for a in chain[-1].values())
    v3, v1 = size(compact), size(VersionHistory({v: chain[v] for v in compact}))
    assert v1 > (2 + 16) * values                  # params, momentum and 16 full versions
    assert v3 < (2 + 2 + 15 * 0.15) * values       # two full versions, 15 int4 links (0.5625 B / 4 B)
    assert v3 < v1 / 2.5


@pytest.mark.parametrize("dtype, marks, version", [("fp32", 1, 1), ("bf16", 1, 1), ("bf16", 2, 2), ("fp32", 2, 2)])
def test_runs_without_links_still_write_v1_and_v2(dtype, marks, version):
    desc = make_desc(versions=VersionsConfig(dtype, 3, marks=marks))
    s = initial_state(desc, init_model())
    for r in range(4):
        s = run(s, desc, [inp("a", r, delta(np.random.default_rng(r)), base=r)]).state
    blob = s.to_bytes()
    assert _version(blob) == version and SyncerState.from_bytes(blob, desc).to_bytes() == blob


def test_malformed_v3_checkpoints_are_refused_by_name():
    desc, s, _ = _int4_run()
    body = _body(s.to_bytes())
    hist = body["fragments"][0]["history"]
    middle = next(i for i, e in enumerate(hist) if e[1] is None)

    def refused(b, match, d=desc, version=3):
        with pytest.raises(FormatError, match=match):
            SyncerState.from_bytes(_reseal(b, version), d)

    b = _body(s.to_bytes())
    b["fragments"][0]["history"][middle][2]["h.0.w"] = b"\0" * 3
    refused(b, r"fragment 0 history v\d+ link tensor h.0.w: 3 bytes \(expected \d+: int4, block size")
    b = _body(s.to_bytes())
    b["fragments"][0]["history"][middle][2] = None
    refused(b, r"history v\d+ holds neither values nor a link")
    b = _body(s.to_bytes())
    h = b["fragments"][0]["history"]
    h[0][1], h[0][2] = None, h[middle][2]              # the oldest must be full: nothing to rebuild it from
    refused(b, "the oldest retained version .* must be held full")
    b = _body(s.to_bytes())
    b["fragments"][0]["history"][middle] = b["fragments"][0]["history"][middle][:2]
    refused(b, "fragment 0: bad history entry")
    refused(_body(s.to_bytes()), "an int4 link in a run whose versions are fp32", d=make_desc())
    b = _body(s.to_bytes())
    b["marks"] = []
    refused(b, "a version 3 checkpoint with merged marks, but the run's descriptor has versions.marks 1")
    b = _body(s.to_bytes())
    refused(b, "bad history entry", version=1)          # a v3 body sealed as v1
