"""The initial-model proposal: how a run whose learners bring their own model gets its one version 0.

SPEC §7 "One initial model": every learner starts from the same weights. A learner started by
``ddiloco launch`` (or with ``DDILOCO_PROPOSE=1``) on a store that holds no run yet writes its own
initial weights here, create-if-absent (storage/layout.py ``PROPOSAL_KEY``): of several learners
started at once exactly one write lands, whoever it is. The creator of the run (the launcher, which
holds the syncer's key and signs version 0) reads the proposal and creates the run from it; every
learner, the proposer included, then loads version 0 from the run, never its own weights. The
proposal is kept afterwards as evidence of where version 0 came from.

Record (docs/formats.md "Initial-model proposal"): envelope kind ``initial-model`` version 1, a
msgpack map ``{"learner": id, "digest": tensor_digest, "tensors": [[name, dtype, shape, bytes], ...],
"model": {...}}`` with the tensors in name order and ``model`` the learner's model config (a plain
map, e.g. ``{"hf_config": ...}``; the run descriptor's ``model`` section, so that exports can rebuild
the model); reading checks the envelope's checksum and the digest of the decoded values, and
refuses anything but float32.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from pipeline.checksum import tensor_digest
from pipeline.envelope import pack_record, unpack_record
from pipeline.errors import FormatError
from pipeline.types import check_learner_id

import time

from .errors import AlreadyExists, NotFound
from .layout import EPOCH_PREFIX, PROPOSAL_KEY, read_descriptor
from .log import CommitLog
from .shards import shard_stores
from .store import ObjectStore

PROPOSAL_KIND, PROPOSAL_VERSION = "initial-model", 1
MAX_PROPOSAL_BYTES = 1 << 31     # the envelope's own limit: a model of up to 2 GiB of float32


def encode_proposal(learner: str, tensors: Mapping[str, np.ndarray], model: Mapping[str, Any] | None = None) -> bytes:
    """The sealed record of ``learner``'s initial weights (float32 arrays by name) and model config."""
    check_learner_id(learner)
    if not tensors:
        raise ValueError("an initial-model proposal needs at least one tensor")
    rows = []
    for name in sorted(tensors):
        a = np.asarray(tensors[name])
        a = a if a.flags.c_contiguous else a.copy(order="C")   # (ascontiguousarray makes a 0-d array 1-d)
        if a.dtype != np.float32:
            raise ValueError(f"initial model tensor {name!r} is {a.dtype}; runs train float32 models "
                             "(call model.float() before the Learner)")
        rows.append([name, str(a.dtype), list(a.shape), a.tobytes()])
    try:
        return pack_record(PROPOSAL_KIND, PROPOSAL_VERSION,
                           {"learner": learner, "digest": tensor_digest(tensors), "tensors": rows,
                            "model": dict(model or {})})
    except TypeError as exc:   # msgpack: a value that is no plain map/list/number/string
        raise ValueError(f"model_config must be a map of plain values (JSON-like), got one that is not: {exc} "
                         "(for a Hugging Face config: json.loads(config.to_json_string()))") from None


def decode_proposal(blob: bytes, what: str = PROPOSAL_KEY) -> tuple[str, dict[str, np.ndarray], dict[str, Any]]:
    """(proposing learner, tensors, model config) of a proposal; ``FormatError`` naming what is wrong."""
    _, rec = unpack_record(blob, PROPOSAL_KIND, PROPOSAL_VERSION, max_bytes=MAX_PROPOSAL_BYTES, what=what)
    try:
        learner = check_learner_id(rec["learner"])
        tensors = {}
        for name, dtype, shape, data in rec["tensors"]:
            if dtype != "float32":
                raise FormatError(f"{what}: tensor {name!r} is {dtype}, not float32")
            tensors[str(name)] = np.frombuffer(data, dtype=np.float32).reshape(tuple(shape)).copy()
        digest = str(rec["digest"])
        model = rec.get("model", {})
        if not isinstance(model, dict):
            raise TypeError(f"model is a {type(model).__name__}, not a map")
    except (KeyError, TypeError, ValueError) as exc:
        raise FormatError(f"{what}: malformed initial-model proposal ({exc.__class__.__name__}: {exc})") from None
    if tensor_digest(tensors) != digest:
        raise FormatError(f"{what}: the tensors do not match the proposal's digest")
    return learner, tensors, model


def propose(store: ObjectStore, learner: str, tensors: Mapping[str, np.ndarray],
            model: Mapping[str, Any] | None = None) -> bool:
    """Write ``learner``'s weights as the run's initial model unless someone proposed first.
    True when this write landed (ours is the initial model), False when another proposal exists."""
    try:
        store.put_if_absent(PROPOSAL_KEY, encode_proposal(learner, tensors, model))
        return True
    except AlreadyExists:
        return False


def read_proposal(store: ObjectStore) -> tuple[str, dict[str, np.ndarray], dict[str, Any]]:
    """The run's initial-model proposal (``NotFound`` when nobody proposed yet)."""
    return decode_proposal(store.get(PROPOSAL_KEY), f"{store.uri}/{PROPOSAL_KEY}")


def run_complete(store: ObjectStore, descriptor) -> bool:
    """Whether a run's creation finished: every shard's log holds its init commits (``create_run``
    writes the descriptor first, then each fragment's version 0 and init commit)."""
    return all(CommitLog(s).tail() >= descriptor.num_fragments - 1 for s in shard_stores(store, descriptor))


def syncer_started(store: ObjectStore, descriptor) -> bool:
    """Whether every syncer (shard) of the run has claimed an epoch, i.e. started recovering."""
    return all(s.list(EPOCH_PREFIX) for s in shard_stores(store, descriptor))


def wait_for_run(store: ObjectStore, timeout_s: float, clock=None, sleep=None):
    """The run's descriptor once the run is complete (``run_complete``); ``NotFound`` after
    ``timeout_s`` (a syncer started before its launcher created the run: ``ddiloco syncer --wait-for-run``)."""
    clock, sleep = clock or time.monotonic, sleep or time.sleep
    deadline = clock() + timeout_s
    while True:
        try:
            desc = read_descriptor(store)
            if run_complete(store, desc):
                return desc
        except NotFound:
            if clock() >= deadline:
                raise
        if clock() >= deadline:
            raise NotFound(f"the run at {store.uri} was not completely created within {timeout_s:g} s", uri=store.uri)
        sleep(0.1)
