"""The smallest training script that runs as decoupled learners (README "Train your own model"):

    ddiloco launch --learners 2 --eval --out runs/minimal -- python examples/minimal.py

A plain PyTorch loop; the lines marked ``ddiloco`` are the whole integration. The launcher hands the run,
this learner's id and the bus over in the environment (docs/running.md "The environment contract").
"""
import os
import zlib

import torch
from workers.evaluator import Evaluator
from workers.learner.learner import Learner

torch.manual_seed(1234)   # the task: every learner fits the same fixed teacher network
TEACHER = torch.nn.Sequential(torch.nn.Linear(16, 128), torch.nn.Tanh(), torch.nn.Linear(128, 4)).requires_grad_(False)


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.GELU(), torch.nn.Linear(256, 4))


def batch(learner_id: str, step: int) -> torch.Tensor:
    """Batch ``step`` of this learner's data: its position is its step count (a resumed life goes on)."""
    return torch.randn(256, 16, generator=torch.Generator().manual_seed(zlib.crc32(f"{learner_id}/{step}".encode())))


if __name__ == "__main__":
    torch.manual_seed(os.getpid())   # each learner draws its own init: the run starts from one of them (version 0)
    model = make_model()
    if os.environ.get("DDILOCO_ROLE") == "evaluator":    # ddiloco: --eval runs this copy as the evaluator
        x = batch("held-out", 0)
        raise SystemExit(Evaluator(model).follow(lambda m: torch.nn.functional.mse_loss(m(x), TEACHER(x))) == 0)
    learner = Learner(model, torch.optim.AdamW(model.parameters(), lr=3e-3)).start()   # ddiloco: joins the run
    for step in learner.range(int(os.environ.get("DDILOCO_STEPS", "400"))):            # ddiloco: ends on Ctrl-C
        x = batch(learner.id, step)
        loss = learner.step(lambda: torch.nn.functional.mse_loss(model(x), TEACHER(x)), tokens=x.shape[0])  # ddiloco
        if step % 100 == 0:
            print(f"{learner.id} step {step} loss {loss:.4f}", flush=True)
    learner.close()                                      # ddiloco: drains its deltas, records where it stands
