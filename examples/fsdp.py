"""A learner whose model is sharded with FSDP2 over the ranks of its own torchrun group (docs/running.md
"An FSDP2 learner"); every learner is one such group:

    ddiloco launch --learners 2 --nproc-per-learner 2 --out runs/fsdp -- python examples/fsdp.py

Each rank trains on its own batches; rank 0 talks to the syncer and storage; a new version reaches every
rank's shards at a step boundary. ``--digests``: every rank logs digests of the fragments it holds after
each broadcast, and rank 0 the digests of the versions it applied (tests compare them).
"""
import argparse
import os
import sys
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from minimal import TEACHER, batch  # noqa: E402 - the same task as examples/minimal.py
from workers.learner.fsdp import ShardedLearner  # noqa: E402
from workers.learner.group import DataParallelGroup, GroupConfig  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--digests", action="store_true")
    args = parser.parse_args()
    group = DataParallelGroup(GroupConfig(digests=args.digests))          # torchrun's ranks: one learner
    torch.manual_seed(os.getpid())   # any draw: every rank then holds its chunk of the run's version 0
    model = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 4)).to(group.device)
    mesh = init_device_mesh(group.device.type, (group.world_size,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    learner = ShardedLearner(model, torch.optim.AdamW(model.parameters(), lr=3e-3), group=group).start()
    for step in learner.range(int(os.environ.get("DDILOCO_STEPS", "300"))):
        x = batch(f"{learner.id}.rank{group.rank}", step).to(group.device)
        loss = learner.step(lambda: torch.nn.functional.mse_loss(model(x), TEACHER.to(group.device)(x)),
                            tokens=x.shape[0])
        if loss is not None and group.rank == 0 and step % 100 == 0:
            print(f"{learner.id} step {step} loss {loss:.4f}", flush=True)
    learner.close()


if __name__ == "__main__":
    main()
