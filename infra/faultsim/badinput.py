"""Bad input for the simulation (docs/faultsim.md): objects planted in the spill inbox that
no honest learner wrote. Each must be refused at ingest (a ``delta-rejected`` event naming its key)
and never merged; the syncer must keep committing the learners' deltas after it.

Variants (``Fault.param`` of a ``bad-input`` fault):

0. garbage bytes under a fresh spill key of the target learner;
1. a genuine delta of the target (the newest in the inbox) under a key that names another delta;
2. that delta cut in half, under a fresh key.

Keys are fresh (seq ``PLANT_SEQ`` and up, the target's newest incarnation): a planted object never
replaces an honest one. Without a genuine delta in the inbox, variants 1 and 2 plant garbage.
"""
from __future__ import annotations

import numpy as np

from storage.layout import SPILL_PREFIX, parse_spill_key, spill_key

from .faults import Fault
from .memstore import MemoryStore
from .world import stable_seed

PLANT_SEQ = 900_000


def plant_bad_input(store: MemoryStore, fault: Fault, trace: list[dict]) -> tuple[str, str]:
    """Plant ``fault``'s object; returns (its key, what it is)."""
    learner = fault.target
    lives = [int(e.get("incarnation", 1)) for e in trace if e.get("event") == "learner-start" and e["id"] == learner]
    incarnation = lives[-1] if lives else 1
    taken = sum(1 for k in store.keys(SPILL_PREFIX) if parse_spill_key(k)[2] >= PLANT_SEQ)
    key = spill_key(learner, incarnation, PLANT_SEQ + taken)
    genuine = [k for k in store.keys(SPILL_PREFIX) if parse_spill_key(k)[0] == learner
               and parse_spill_key(k)[2] < PLANT_SEQ]
    variant = int(fault.param)
    if variant == 0 or not genuine:
        rng = np.random.default_rng(stable_seed("bad-input", fault.at, learner))
        store.plant(key, rng.integers(0, 256, 200, dtype=np.uint8).tobytes())
        return key, "garbage bytes"
    blob = store.peek(genuine[-1])
    if variant == 1:
        store.plant(key, blob)
        return key, f"the bytes of {genuine[-1]} under another delta's key"
    store.plant(key, blob[: len(blob) // 2])
    return key, f"{genuine[-1]} truncated to {len(blob) // 2} bytes"
