"""`python -m infra.lab.same_bytes SEEDS > FILE.json`: the sha256 of every object that seeded fault
simulations store (the real syncer, learners, codec and log on simulated time, infra/faultsim).

Lab (the question of every refactor: does it keep every stored object's bytes?). Run it under two
trees (``PYTHONPATH=OLD_CHECKOUT python -m infra.lab.same_bytes 0,1``) and compare: objects that
also differ between two runs of one tree carry wall-clock times or nonces (epoch claims,
incarnations, init commits); every other object must match. Used for the config tree (docs/config.md).
"""
from __future__ import annotations

import hashlib
import json
import sys

from infra.faultsim.runner import simulate
from infra.faultsim.world import draw


def object_digests(seed: int) -> dict[str, str]:
    cfg, faults = draw(seed)
    store = simulate(cfg, faults).store
    return {k: hashlib.sha256(store.peek(k)).hexdigest() for k in sorted(store.keys(""))}


if __name__ == "__main__":
    seeds = [int(s) for s in (sys.argv[1] if len(sys.argv) > 1 else "0").split(",")]
    json.dump({seed: object_digests(seed) for seed in seeds}, sys.stdout, indent=0, sort_keys=True)
