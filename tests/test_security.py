"""Issue "Security": CURVE on the bus, signed deltas / versions / commits / checkpoints, hostile input.

Most tests drive a real Syncer in a thread over a tiny two-tensor run in a temp directory; the
oversized-message test runs the syncer as its own process to measure its memory.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import stat
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import zmq
import zmq.auth

from pipeline.codec import CodecConfig, decode, encode
from pipeline.checksum import tensor_digest
from pipeline.envelope import digest, pack_record, seal, unpack_record, unseal
from pipeline.errors import FormatError
from pipeline.guard import NormGuardConfig, verdict
from pipeline.types import CommitRecord, DeltaHeader
from pipeline.version_chain import apply_delta
from storage.checkpoints import write_checkpoint
from storage.layout import spill_key
from storage.log import CommitLog
from storage.store import open_store
from workers.bus.bus import BusConfig, LearnerLink, Message
from workers.common.events import EventLog, read_events
from workers.bus.keys import (KeyRing, Roster, add_member, configure as keys_configure, ensure_identities,
                          generate_identity, key_paths, load_identity, write_identity)
from workers.launch import RunSettings, Schedule, create_run
from workers.learner.learner import Learner, LearnerConfig
from workers.learner.receiver import Receiver
from workers.common.refold import rebuild
from workers.bus.signing import seal_delta
from workers.syncer.syncer import Syncer
from workers.common.versions import (VERSION_DELTA_KIND, VersionTracker, decode_version, decode_version_delta,
                                     delta_codec, version_codec)

from runhelpers import free_port, syncer_thread

pytestmark = pytest.mark.timeout(60)
LEARNERS = ("l0", "l1")


# -- fixtures and helpers ------------------------------------------------------------------------

def _init():
    rng = np.random.default_rng(0)
    return {"a.weight": rng.normal(size=(8, 4)).astype(np.float32), "b.weight": rng.normal(size=(16,)).astype(np.float32)}


@pytest.fixture
def signed(tmp_path):
    """A signed one-fragment run: (store, descriptor, bus config, identities by name)."""
    store = open_store(str(tmp_path / "store"))
    ids = ensure_identities(tmp_path / "keys", ["syncer", *LEARNERS])
    desc = create_run(store, _init(), RunSettings(schedule=Schedule(fragments=1, sync_every=1)), embedding_tensors=(),
                      syncer=ids["syncer"], learners=[ids[n].public for n in LEARNERS])
    bus = BusConfig(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
    return store, desc, bus, ids


def _blob(desc, learner: str, seq: int, scale: float = 0.01, inc: int = 1, base: int = 0):
    h = DeltaHeader(learner, inc, seq, 0, base, 4, 400, seq)
    tensors = {t.name: np.full(t.shape, scale * (seq + 1), np.float32) for t in desc.layout.tensors}
    return h, encode("delta", h.to_dict(), tensors, CodecConfig(scheme="int8", format=1))   # _altered edits format 1


def _signed(desc, ident, learner: str, seq: int, **kw):
    h, blob = _blob(desc, learner, seq, **kw)
    return h, seal_delta(blob, learner, ident.signer(), desc.run_id)


def _syncer(store, ids, bus=None, until=lambda s: False, timeout=20.0, **cfg):
    keys = KeyRing(ids["syncer"], ids["syncer"].public) if ids else None
    return syncer_thread(store, bus=bus, keys=keys, until=until, timeout=timeout, **cfg)


def _commits(store) -> list[CommitRecord]:
    return list(CommitLog(store).read_range(0))


def _link(bus, ident, syncer_pub, name: str | None = None) -> LearnerLink:
    return LearnerLink(bus, (name or ident.name).encode(), curve=ident.curve_keys(server=syncer_pub))


def _send(link, desc, h, blob, connect_s: float = 15.0) -> Message | None:
    """Send a delta once the link is connected (the DEALER refuses to queue before); its reply or None.
    Generous waits: a CURVE handshake on a loaded 2-core CI machine can take seconds."""
    if not _push(link, Message("delta", {"header": h.to_dict(), "checksum": digest(blob)}, blob), connect_s):
        return None
    return link.recv(10.0)


def _push(link, msg: Message, connect_s: float = 15.0) -> bool:
    deadline = time.time() + connect_s
    while not link.send(msg):
        if time.time() > deadline:
            return False
        time.sleep(0.05)
    return True


# -- key files -----------------------------------------------------------------------------------

def test_keys_command_writes_zeromq_certificates_with_private_secrets(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    handler = keys_configure(parser)
    assert handler(parser.parse_args([str(tmp_path / "k"), "syncer", "l0"])) == 0
    printed = capsys.readouterr().out
    pub, sec = key_paths(tmp_path / "k", "l0")
    assert stat.S_IMODE(sec.stat().st_mode) == 0o600 and stat.S_IMODE(pub.stat().st_mode) == 0o644
    ident = load_identity(sec)
    assert zmq.auth.load_certificate(sec) == (ident.public.curve.encode(), ident.curve_secret.encode())
    assert zmq.auth.load_certificate(pub) == (ident.public.curve.encode(), None)
    assert json.loads(printed)["l0"]["sign"] == ident.public.sign
    for secret in (ident.curve_secret, ident.sign_secret.hex()):
        assert secret not in printed and secret not in repr(ident) and secret not in pub.read_text()
    # Running it again keeps the keys; writing over them is refused; a readable secret is refused.
    handler(parser.parse_args([str(tmp_path / "k"), "l0"]))
    assert load_identity(sec).public == ident.public
    with pytest.raises(FileExistsError):
        write_identity(tmp_path / "k", generate_identity("l0"))
    os.chmod(sec, 0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        load_identity(sec)
    with pytest.raises(ValueError, match="no secret"):
        load_identity(pub)


# -- transport -----------------------------------------------------------------------------------

def test_unknown_key_cannot_connect_and_nothing_it_sends_is_merged(signed):
    store, desc, bus, ids = signed
    syncer_pub = ids["syncer"].public
    mallory = generate_identity("l0")                 # claims a listed name, but its key is not listed
    syncer, t = _syncer(store, ids, bus, until=lambda s: s.stats.commits >= 1)
    try:
        evil = _link(bus, mallory, syncer_pub)
        h, blob = _signed(desc, mallory, "l0", 0)
        assert _send(evil, desc, h, blob, connect_s=3.0) is None     # the CURVE handshake never completes: no reply
        evil.close()
        assert syncer.stats.from_bus == 0 and syncer.stats.commits == 0
        # A listed learner that sends as another one is refused too.
        l1 = _link(bus, ids["l1"], syncer_pub)
        h, blob = _signed(desc, ids["l1"], "l0", 1)
        assert _send(l1, desc, h, blob).fields["status"] == "rejected"
        l1.close()
        # The genuine learner gets through, and only its delta is merged.
        l0 = _link(bus, ids["l0"], syncer_pub)
        h, blob = _signed(desc, ids["l0"], "l0", 2)
        assert _send(l0, desc, h, blob).fields["status"] == "durable"
        l0.close()
    finally:
        t.join()
    merged = [i.delta_id for r in _commits(store) if r.kind == "merge" for i in r.inputs]
    assert merged == [h.id]
    summary = syncer.summary()
    assert summary["rejections"]["unknown-key"] >= 1 and summary["rejections"]["peer-mismatch"] == 1


# -- signed data at rest -------------------------------------------------------------------------

def _altered(blob: bytes) -> bytes:
    """Change the delta inside a signed wrapper and re-seal both envelopes: every checksum is
    right, the learner's signature is not."""
    _, body = unpack_record(blob, "signed-delta", 1)
    _, raw = unseal(body["delta"], "delta", 1)
    raw = bytearray(raw)
    raw[-3] ^= 0x01            # inside the payload, the body's last field
    body["delta"] = seal("delta", 1, bytes(raw))
    return pack_record("signed-delta", 1, body)


def test_forged_altered_and_unsigned_spilled_deltas_are_rejected_and_recorded(signed, tmp_path):
    store, desc, bus, ids = signed
    attacker = generate_identity("l1")
    good_h, good = _signed(desc, ids["l0"], "l0", 0)
    alt_h, alt = _signed(desc, ids["l0"], "l0", 1)
    forged_h, forged = _signed(desc, attacker, "l1", 0)             # l1's name, another key
    plain_h, plain = _blob(desc, "l1", 1)                           # no signature at all
    stranger_h, stranger = _signed(desc, generate_identity("m9"), "m9", 0)
    for h, b in ((good_h, good), (alt_h, _altered(alt)), (forged_h, forged), (plain_h, plain),
                 (stranger_h, stranger)):
        store.put_if_absent(spill_key(h.learner, h.incarnation, h.seq), b)
    syncer, t = _syncer(store, ids, until=lambda s: s.stats.merged >= 1 and s.stats.dropped >= 3)
    t.join()
    records = _commits(store)
    merged = [i.delta_id for r in records for i in r.inputs]
    dropped = {d.delta_id: d for r in records for d in r.dropped}
    assert merged == [good_h.id]
    assert {k: d.reason for k, d in dropped.items()} == {alt_h.id: "bad-signature", forged_h.id: "bad-signature",
                                                        plain_h.id: "unsigned"}
    assert all(d.key.startswith("quarantine/") and store.exists(d.key) for d in dropped.values())
    # The unlisted learner's object was refused at ingest, counted in a commit, and kept as evidence.
    assert syncer.stats.rejections["unknown-learner"] == 1
    assert any(r.info.get("rejected", {}).get("unknown-learner") for r in records)
    assert store.exists(spill_key("m9", 1, 0))
    # Replay reaches the same decisions from the stored bytes alone, and verifies every signature.
    _, stats = rebuild(store, desc, records[-1].seq, use_checkpoint=False)
    assert stats.signatures == sum(r.kind in ("merge", "drop", "fence") for r in records) >= 1
    # The real l1/1/0 is not blocked by the forgery that claimed its id.
    syncer, t = _syncer(store, ids, bus, until=lambda s: s.stats.merged >= 1)
    h, blob = _signed(desc, ids["l1"], "l1", 0)
    link = _link(bus, ids["l1"], ids["syncer"].public)
    assert _send(link, desc, h, blob).fields["status"] == "durable"
    link.close()
    t.join()
    assert h.id in [i.delta_id for r in _commits(store) for i in r.inputs]


def test_tampered_version_is_refused_by_learners_and_flagged_by_replay(signed):
    store, desc, bus, ids = signed
    h, blob = _signed(desc, ids["l0"], "l0", 0)
    store.put_if_absent(spill_key(h.learner, h.incarnation, h.seq), blob)
    syncer, t = _syncer(store, ids, until=lambda s: s.stats.merged >= 1, checkpoint_every=1)
    t.join()
    rec = [r for r in _commits(store) if r.kind == "merge"][-1]
    base = VersionTracker(store, desc).load(max((r for r in _commits(store) if r.seq < rec.seq and r.fragment == 0
                                                 and r.kind in ("init", "merge")), key=lambda r: r.seq))
    tracker = VersionTracker(store, desc)
    good = tracker.load(rec)
    genuine = decode(store.get(rec.output_key), VERSION_DELTA_KIND).tensors     # the syncer's delta, decoded
    # The bucket's writer replaces the version (an int4 run's: the delta against the version before),
    # and the commit's checksum to match: the syncer's signatures no longer verify.
    meta = {"fragment": 0, "version": rec.version, "seq": rec.seq, "epoch": rec.epoch,
            "base_version": rec.version - 1}
    nudge = {n: np.full(a.shape, 0.5, np.float32) for n, a in good.items()}
    store.put(rec.output_key, encode(VERSION_DELTA_KIND, meta, nudge, delta_codec(desc)))
    evil = apply_delta(base, decode(store.get(rec.output_key), VERSION_DELTA_KIND).tensors)
    forged = dataclasses.replace(rec, output_checksum=tensor_digest(evil))
    store.put(f"log/{rec.seq:020d}", forged.to_bytes())
    with pytest.raises(FormatError, match="signature"):
        tracker.load(CommitLog(store).read(rec.seq))
    receiver = Receiver(VersionTracker(store, desc), {0: rec.version - 1}, EventLog(None, "learner", "l0"), None)
    receiver._poll("poll")
    assert receiver.take() == [] and receiver.refused == 1
    assert VersionTracker(store, desc).latest()[0].seq < rec.seq      # a fresh learner starts from a genuine one
    with pytest.raises(FormatError, match="signature"):
        rebuild(store, desc, rec.seq, use_checkpoint=False, verify_outputs=True)
    # A version blob whose own signature is forged is refused even under its genuine commit.
    store.put(f"log/{rec.seq:020d}", rec.to_bytes())
    store.put(rec.output_key, encode(VERSION_DELTA_KIND, {**meta, "sig": "00" * 64}, genuine, delta_codec(desc)))
    assert tensor_digest(apply_delta(base, genuine)) == rec.output_checksum   # the genuine values ...
    with pytest.raises(FormatError, match="signature"):                       # ... under a forged signature
        decode_version_delta(store.get(rec.output_key), desc, rec, base)


def test_forged_checkpoint_is_ignored(signed):
    store, desc, bus, ids = signed
    for seq in range(2):
        h, blob = _signed(desc, ids["l0"], "l0", seq)
        store.put_if_absent(spill_key(h.learner, h.incarnation, h.seq), blob)
    syncer, t = _syncer(store, ids, until=lambda s: s.stats.merged + s.stats.dropped >= 2)
    t.join()
    tail = CommitLog(store).tail()
    state, _ = rebuild(store, desc, tail, use_checkpoint=False)
    poisoned = state.to_bytes()      # an unsigned state (what a bucket writer could plant)
    write_checkpoint(store, tail, poisoned)
    again, stats = rebuild(store, desc, tail)
    assert stats.from_checkpoint is None and stats.rejected_checkpoints and "checkpoint" in stats.rejected_checkpoints[0]
    assert again.fragments[0].version == state.fragments[0].version


# -- hostile input -------------------------------------------------------------------------------

def _vm_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(field)


def test_oversized_message_is_dropped_without_a_memory_spike(signed, tmp_path):
    store, desc, bus, ids = signed
    log = tmp_path / "syncer.jsonl"
    cmd = [sys.executable, "-m", "workers.cli", "syncer", "--store", store.uri.replace("file://", ""),
           "--ingest", bus.ingest, "--announce", bus.announce, "--log", str(log),
           "--key", str(key_paths(tmp_path / "keys", "syncer")[1])]
    proc = subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL,
                            stderr=open(tmp_path / "syncer.stderr", "w"), start_new_session=True)
    try:
        deadline = time.time() + 30
        while not any(e.get("event") == "syncer-bus" for e in read_events(log)):
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "syncer.stderr").read_text()
            time.sleep(0.1)
        before = _vm_kib(proc.pid, "VmHWM")
        link = _link(bus, ids["l0"], ids["syncer"].public)
        huge = bytes(200 << 20)
        assert _push(link, Message("delta", {"header": {}, "checksum": ""}, huge))
        del huge
        time.sleep(3.0)
        grew_mib = (_vm_kib(proc.pid, "VmHWM") - before) / 1024
        print(f"syncer peak memory growth for a 200 MiB message: {grew_mib:.1f} MiB")
        assert grew_mib < 40, f"syncer peak memory grew by {grew_mib:.0f} MiB for a 200 MiB message"
        link.close()
        link = _link(bus, ids["l0"], ids["syncer"].public)   # libzmq dropped the connection; a new one works
        h, blob = _signed(desc, ids["l0"], "l0", 0)
        reply = _send(link, desc, h, blob) or link.recv(5.0)
        assert reply is not None and reply.fields["status"] == "durable"
        link.close()
        deadline = time.time() + 20
        while not any(r.kind == "merge" for r in _commits(store)):
            assert time.time() < deadline, "the syncer stopped merging"
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
    assert proc.returncode == 0
    # Secrets never reach the log, the descriptor or the summary.
    text = log.read_text() + store.get("run.descriptor").hex() + store.get("run.descriptor").decode("latin-1")
    for ident in ids.values():
        assert ident.curve_secret not in text and ident.sign_secret.hex() not in text


def test_norm_guard_drops_outliers_and_replay_agrees(tmp_path):
    cfg = NormGuardConfig(factor=4.0, window=4, min_history=2)
    assert verdict(100.0, [1.0], cfg) == ""                    # not enough history yet
    assert verdict(100.0, [1.0, 2.0, 1.5], cfg) == "norm-outlier"
    assert verdict(5.0, [1.0, 2.0, 1.5], cfg) == ""
    assert verdict(float("nan"), [1.0, 2.0], cfg) == ""        # the fold says non-finite
    with pytest.raises(ValueError, match="factor"):
        NormGuardConfig(factor=1.0)
    store = open_store(str(tmp_path / "store"))
    ids = ensure_identities(tmp_path / "keys", ["syncer", "l0"])
    desc = create_run(store, _init(), RunSettings(schedule=Schedule(fragments=1, sync_every=1), guard=cfg),
                      embedding_tensors=(),
                      syncer=ids["syncer"], learners=[ids["l0"].public])
    scales = [0.01, 0.012, 0.011, 5.0, 0.01]     # the fourth is ~400x the others
    for seq, scale in enumerate(scales):
        h, blob = _signed(desc, ids["l0"], "l0", seq, scale=scale / (seq + 1), base=0)
        store.put_if_absent(spill_key(h.learner, h.incarnation, h.seq), blob)
        syncer, t = _syncer(store, ids, until=lambda s: s.stats.commits >= 1)
        t.join()
    records = [r for r in _commits(store) if r.kind in ("merge", "drop")]
    assert [d.reason for r in records for d in r.dropped] == ["norm-outlier"]
    assert [r.kind for r in records] == ["merge", "merge", "merge", "drop", "merge"]
    assert all(len(r.info["norms"]) == 1 for r in records if r.kind == "merge")
    _, stats = rebuild(store, desc, CommitLog(store).tail(), use_checkpoint=False)
    assert stats.commits == len(_commits(store)) - 1


# -- a run's mode is fixed ------------------------------------------------------------------------

class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 8, bias=False)
        self.b = torch.nn.Module()
        self.b.weight = torch.nn.Parameter(torch.zeros(16))


def _learner(store, keys=None, lid="l0") -> Learner:
    model = _Tiny()
    return Learner(model, torch.optim.SGD(model.parameters(), lr=0.1), store, lid, LearnerConfig(keys=keys))


def test_unsigned_and_signed_runs_cannot_be_mixed(signed, tmp_path):
    store, desc, bus, ids = signed
    plain = open_store(str(tmp_path / "plain"))
    plain_desc = create_run(plain, _init(), RunSettings(schedule=Schedule(fragments=1, sync_every=1)),
                            embedding_tensors=())
    ring = KeyRing(ids["l0"], ids["syncer"].public)
    with pytest.raises(ValueError, match="is signed"):
        _learner(store).start()
    with pytest.raises(ValueError, match="unsigned"):
        _learner(plain, ring).start()
    with pytest.raises(ValueError, match="pinned syncer key"):
        _learner(store, KeyRing(ids["l0"], ids["l1"].public)).start()
    with pytest.raises(ValueError, match="not listed"):
        _learner(store, KeyRing(generate_identity("l7"), ids["syncer"].public), lid="l7").start()
    with pytest.raises(ValueError, match="is signed"):
        Syncer(store)
    with pytest.raises(ValueError, match="unsigned"):
        Syncer(plain, keys=KeyRing(ids["syncer"], ids["syncer"].public))
    with pytest.raises(ValueError, match="not the syncer key"):
        Syncer(store, keys=KeyRing(ids["l0"], ids["syncer"].public))
    # A signed delta in the unsigned run is never merged; an unsigned one in the signed run is recorded.
    h, blob = _signed(desc, ids["l0"], "l0", 0)
    plain.put_if_absent(spill_key("l0", 1, 0), blob)
    syncer, t = _syncer(plain, None, until=lambda s: s.stats.rejected >= 1, timeout=5)
    t.join()
    assert syncer.stats.rejections["undecodable"] == 1 and CommitLog(plain).tail() == plain_desc.num_fragments
    # A commit copied over from another run does not verify here.
    other = CommitLog(plain).read(0)
    with pytest.raises(FormatError, match="signature"):
        decode_version(plain.get(other.output_key), desc, other)


def test_a_learner_listed_later_is_accepted_after_the_membership_record(signed):
    store, desc, bus, ids = signed
    late = generate_identity("l9")
    h, blob = _signed(desc, late, "l9", 0)
    store.put_if_absent(spill_key("l9", 1, 0), blob)
    syncer, t = _syncer(store, ids, until=lambda s: s.stats.merged >= 1, members_poll_s=0.2)
    time.sleep(0.5)
    assert syncer.stats.merged == 0 and syncer.stats.rejections["unknown-learner"] == 1
    with pytest.raises(ValueError, match="syncer key"):
        add_member(store, desc, ids["l0"], late.public)           # only the syncer's key may list members
    add_member(store, desc, ids["syncer"], late.public)
    t.join()
    assert [i.delta_id for r in _commits(store) for i in r.inputs] == [h.id]
    roster = Roster.for_run(desc)
    assert roster.sign_key("l9") is None and roster.refresh(store) == ["l9"] and roster.sign_key("l9") == late.public.sign
    rebuild(store, desc, CommitLog(store).tail(), use_checkpoint=False)
