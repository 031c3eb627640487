"""The simulation's tiny job (docs/faultsim.md): a 2-layer MLP of 212 parameters learning a
fixed random linear map, and the run it trains (descriptor, version 0, init commits) created in the
in-memory store with the real launcher code (workers/launch.py ``create_run``).

Everything is seeded: the teacher map and version 0 by the world's seed, each learner life's data
by (seed, learner, life), so a seed fixes every number the learners compute. Torch runs on one
CPU thread (its kernels are deterministic there).
"""
from __future__ import annotations

import numpy as np
import torch

from pipeline.codec import CodecConfig
from pipeline.descriptor import RunDescriptor, VersionsConfig
from pipeline.guard import NormGuardConfig
from pipeline.outer import OuterConfig
from pipeline.policy import PolicyConfig
from storage.store import ObjectStore
from workers.launch import RunSettings, Schedule, create_run

from .world import SimConfig, stable_seed

IN, HIDDEN, OUT = 8, 16, 4
BATCH = 8
TOKENS_PER_STEP = 64       # what a step reports to the syncer's token weights (a fixed batch)


class TinyMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(IN, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def build_model(seed: int) -> TinyMLP:
    """The model with weights drawn from ``seed`` (only version 0 uses them: learners load it)."""
    gen = torch.Generator().manual_seed(seed)
    model = TinyMLP()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


class Batches:
    """One learner life's data: batches of x ~ N(0, 1) and y = x A^T + noise, A fixed by the world."""

    def __init__(self, world_seed: int, learner: str, life: int):
        self.teacher = torch.from_numpy(np.random.default_rng(world_seed).normal(size=(OUT, IN)).astype(np.float32))
        self.gen = torch.Generator().manual_seed(stable_seed(world_seed, learner, life))

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn((BATCH, IN), generator=self.gen)
        y = x @ self.teacher.T + 0.05 * torch.randn((BATCH, OUT), generator=self.gen)
        return x, y


def create_sim_run(store: ObjectStore, cfg: SimConfig) -> RunDescriptor:
    """Create ``cfg``'s run in ``store`` with the real launcher: descriptor, version 0, init commits
    (its rules: the launcher's defaults, or the older ones ``cfg.marks``/``cfg.guard_version`` name)."""
    model = build_model(cfg.seed)
    init = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    versions = VersionsConfig() if cfg.marks is None else VersionsConfig(marks=cfg.marks)
    guard = NormGuardConfig() if cfg.guard_version is None else NormGuardConfig(
        cap=None if cfg.guard_version == 1 else NormGuardConfig.cap, version=cfg.guard_version)
    settings = RunSettings(schedule=Schedule(cfg.fragments, cfg.sync_every),
                           policy=PolicyConfig(quorum=cfg.quorum, overlap=cfg.overlap),
                           codec=CodecConfig("int4", block_size=32), versions=versions, guard=guard,
                           # momentum 0.9: the worlds every seed count of docs/faultsim.md was measured in
                           outer=OuterConfig(momentum=0.9), seed=cfg.seed, run_id=f"faultsim-{cfg.seed}")
    return create_run(store, init, settings, embedding_tensors=())
