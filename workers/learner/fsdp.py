"""A learner whose model is sharded with FSDP2 across the N ranks of one torchrun job (issue 28; SPEC §2:
"inside it may itself be a data-parallel job"). ``fully_shard`` gives every parameter as a DTensor
whose dim 0 is split over the ranks (``Shard(0)``: torch.chunk of dim 0, rank r holds chunk r).

How it works (docs/running.md "An FSDP2 learner"):

- **Rank 0 is the learner** the rest of the system sees. It runs a ``Learner`` over a *host copy* of
  the full model (float32 CPU tensors under the model's own names), never over the shards; the other
  ranks never touch the network or storage.
- **A delta is formed on rank 0 from the gathered fragment.** At each step boundary rank 0 reads its
  receiver once (open rounds, arrived versions) and names the fragments that boundary reads
  (``Learner.fragments_read``); every rank all-gathers those fragments (``DTensor.full_tensor``, one
  collective per tensor on the model's device) into rank 0's host copy; rank 0 then answers and applies
  exactly as a one-process learner (``Learner.boundary`` with that same snapshot).
- **A version reaches every rank's shards at the same boundary**: rank 0 broadcasts a header naming the
  fragments whose version changed (workers/learner/group.py's format), then each as one float32
  buffer; every rank copies its own dim-0 chunk into its local shard.
- Then every rank takes its inner step on its shards with FSDP2's own collectives; rank 0 counts it.

No step waits on the network: every collective is inside the group, like FSDP's own, and rank 0
decides from what its receiver already holds. With ``GroupConfig.digests`` every rank logs, after each
broadcast, a sha256 of each changed fragment as all its ranks now hold it (gathered) and rank 0 logs
the digest of the version it applied (``fsdp-apply`` events: what tests compare).

Memory: the device holds the shards (as FSDP2 does) and, during an answer, one gathered fragment; rank
0's host holds the host copy (4 B/param) besides the Learner's bases (4 B/param). A step whose loss or
gradient is non-finite on any rank is skipped by every rank (each checks its own gradient shard; the
group sums the verdicts) and not counted; the one-process learner's repair of non-finite *weights*
(workers/learner/nonfinite.py) does not run here. Not supported (refused at start): ``keep_progress``,
``sync_process``.
"""
from __future__ import annotations

import hashlib
import math
import os
from types import SimpleNamespace
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from pipeline.descriptor import RunDescriptor
from workers.common.events import EventLog
from workers.learner.bootstrap import stop_requested
from workers.learner.env import LearnerEnv
from workers.learner.group import RANK_ROLE, DataParallelGroup, decode_header, encode_header, rank_log_path
from workers.learner.learner import Learner, LearnerConfig
from workers.learner.nonfinite import grads_finite


def host_module(shapes: dict[str, tuple[int, ...]]) -> torch.nn.Module:
    """A module with float32 CPU parameters of these shapes under these dotted names (what a
    Learner reads and writes as the full model)."""
    root = torch.nn.Module()
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape, dtype=torch.float32)))
    return root


def _local_chunk(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s Shard(0) chunk of ``full`` (torch.chunk: ranks past the last chunk hold none)."""
    chunks = torch.chunk(full, world, dim=0)
    return chunks[rank] if rank < len(chunks) else full[:0]


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:32]


class ShardedLearner:
    """A learner of N ranks whose model is ``fully_shard``-ed (module docstring). Every rank runs::

        group = DataParallelGroup()                 # the process group, from torchrun's environment
        fully_shard(block, mesh=...) ...; fully_shard(model, mesh=...)
        learner = ShardedLearner(model, optimizer, group=group).start()   # the run from DDILOCO_* on rank 0
        for step in learner.range(steps):
            learner.step(lambda: loss_fn(model(x)), tokens=x.numel())     # this rank's tokens
        learner.close()
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, store=None,
                 learner_id: str | None = None, config: LearnerConfig = LearnerConfig(), bus=None,
                 events: EventLog | None = None, group: DataParallelGroup | None = None, **learner_kwargs):
        from torch.distributed.tensor import DTensor, Shard
        self.group = group or DataParallelGroup()
        self.rank, self.world_size = self.group.rank, self.group.world_size
        self.model, self.optimizer = model, optimizer
        self.params = dict(model.named_parameters())
        for n, p in self.params.items():
            if not isinstance(p, DTensor) or tuple(p.placements) != (Shard(0),) or p.device_mesh.ndim != 1:
                raise ValueError(f"ShardedLearner: parameter {n!r} is not sharded on dim 0 over a 1-D mesh "
                                 f"({type(p).__name__}{'' if not isinstance(p, DTensor) else p.placements}): shard "
                                 "the model with torch.distributed.fsdp.fully_shard(module, mesh=...) first")
        env = LearnerEnv.from_environ() if learner_id is None else None
        self.id = learner_id or (env.learner_id if env is not None else "learner")
        self.learner: Learner | None = None
        if self.rank == 0:
            self.host = host_module({n: tuple(p.shape) for n, p in self.params.items()})
            self.learner = Learner(self.host, torch.optim.SGD(self.host.parameters(), lr=0.0), store, learner_id,
                                   config, bus=bus, events=events, **learner_kwargs)
            self.events = self.learner.events
        else:
            path = rank_log_path(env.log if env is not None else None, self.rank)
            self.events = events or EventLog(path, RANK_ROLE, f"{self.id}.rank{self.rank}")
        self.descriptor: RunDescriptor | None = None
        self.stopped = False
        self._held: dict[int, int] = {}
        self.step_count = 0
        self.tokens = 0
        self.applies = 0
        self.skipped = 0           # steps every rank skipped (a non-finite loss or gradient on some rank)

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> "ShardedLearner":
        """Rank 0 joins the run (proposing the full model, gathered, when there is none yet); then
        every rank gets the descriptor, rank 0's step count and version 0's (or the latest) weights."""
        self._gather(sorted(self.params))          # the full model, for a proposal: every rank takes part
        if self.learner is not None:
            d = self.learner.start().descriptor
            if d.learner.keep_progress or self.learner.cfg.sync_process:
                raise ValueError(f"learner {self.id}: an FSDP2 learner supports neither keep_progress nor "
                                 "sync_process (workers/learner/fsdp.py)")
        d = self.descriptor = self.group.share_descriptor(self.learner.store if self.learner is not None else None)
        steps = self.group.all_sum([self.learner.step_count if self.learner is not None else 0])[0]
        self.step_count = steps
        held = dict(self.learner.base_version) if self.learner is not None else {}
        self._exchange(d, {p: held.get(p, 0) for p in range(d.num_fragments)} if self.learner is not None else None)
        self.events.emit("fsdp-start", rank=self.rank, world_size=self.world_size, backend=self.group.backend,
                         pid=os.getpid(), step=self.step_count)
        return self

    def close(self, flush: bool = True) -> bool:
        """Every rank gathers the whole model (rank 0's last answers read it), rank 0 closes its Learner
        (drains, records where it stands), every rank leaves the process group."""
        self._gather(sorted(self.params))
        drained = self.learner.close(flush) if self.learner is not None else True
        self.events.emit("fsdp-stop", rank=self.rank, steps=self.step_count, tokens=self.tokens,
                         applies=self.applies, skipped=self.skipped)
        self.group.close()
        return drained

    def range(self, steps: int):
        """The step indices still to take up to ``steps``, from where the learner stands (the same on
        every rank); ends once any rank was asked to stop (SIGTERM/SIGINT: the group leaves together)."""
        while self.step_count < steps and not self.stopped:
            yield self.step_count

    # -- one step --------------------------------------------------------------------------------
    def step(self, closure: Callable[[], torch.Tensor], tokens: int, stop: bool = False) -> float | None:
        """One step of the group (module docstring); ``tokens``: this rank's. Returns rank 0's... this
        rank's loss, or None when a rank is leaving (``stopped`` is then True everywhere)."""
        if not isinstance(tokens, (int, np.integer)) or isinstance(tokens, bool) or tokens <= 0:
            raise ValueError(f"learner {self.id} rank {self.rank}: step(tokens=...) must be a positive int, "
                             f"got {tokens!r}")
        leaving = int(bool(stop) or stop_requested().is_set())
        total, leaving = self.group.all_sum([int(tokens), leaving])
        if leaving:
            self.stopped = True
            return None
        d = self.descriptor
        rounds = arrivals = None
        need: dict[int, int] = {}
        if self.learner is not None:
            rounds, arrivals = self.learner.receiver.opened(), self.learner.receiver.take()
            need = {p: 0 for p in self.learner.fragments_read(rounds, arrivals)}
        header = encode_header(d.num_fragments, need) if self.learner is not None else \
            torch.zeros(d.num_fragments + 3, dtype=torch.int64)
        dist.broadcast(header, src=0)
        self._gather([n for p in sorted(decode_header(header, d.num_fragments)) for n in d.layout.fragments[p]])
        changed = None
        if self.learner is not None:
            mark = self.learner.boundary(total, arrivals, rounds)
            changed = {p: v for p, v in self.learner.base_version.items() if self._held.get(p) != v}
        self._exchange(d, changed)
        self.optimizer.zero_grad(set_to_none=True)
        loss = closure()
        loss.backward()
        value = float(loss.detach())
        # Every rank skips together when any rank's loss or local gradient shard is non-finite (the
        # shards differ per rank, so each checks its own and the group sums the verdicts).
        shards = [SimpleNamespace(grad=p.grad.to_local()) for p in self.params.values() if p.grad is not None]
        bad = not math.isfinite(value) or not grads_finite(shards)    # the one-process learner's own test
        if self.group.all_sum([int(bad)])[0]:
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped += 1
            self.events.emit("nonfinite-step", rank=self.rank, step=self.step_count, loss=value if math.isfinite(value)
                             else str(value), action="skipped on every rank")
            return value
        self.optimizer.step()
        if self.learner is not None:
            self.learner.account(total, value, mark)
        self.step_count += 1
        self.tokens += total
        return value

    # -- collectives -----------------------------------------------------------------------------
    @torch.no_grad()
    def _gather(self, names: list[str]) -> None:
        """All-gather these parameters (every rank calls it, same names in the same order); rank 0
        keeps them in its host copy."""
        host = dict(self.host.named_parameters()) if self.learner is not None else None
        for n in names:
            full = self.params[n].full_tensor()
            if host is not None:
                host[n].copy_(full.to("cpu", torch.float32))

    @torch.no_grad()
    def _exchange(self, d: RunDescriptor, changed: dict[int, int] | None) -> None:
        """Rank 0 sends the header and the changed fragments from its host copy; every rank copies its
        chunk of each into its local shard."""
        header = encode_header(d.num_fragments, changed) if changed is not None else \
            torch.zeros(d.num_fragments + 3, dtype=torch.int64)
        dist.broadcast(header, src=0)
        changed = decode_header(header, d.num_fragments)
        host = dict(self.host.named_parameters()) if self.learner is not None else None
        for p in sorted(changed):
            names = d.layout.fragments[p]
            shards = [self.params[n] for n in names]
            device = shards[0].to_local().device
            flat = torch.cat([host[n].reshape(-1) for n in names]).to(device) if host is not None else \
                torch.empty(sum(s.numel() for s in shards), dtype=torch.float32, device=device)
            dist.broadcast(flat, src=0)
            offset = 0
            for n, s in zip(names, shards):
                full = flat[offset:offset + s.numel()].view(tuple(s.shape))
                offset += s.numel()
                local = s.to_local()
                local.copy_(_local_chunk(full, self.rank, self.world_size).to(local.dtype))
        if not changed:
            return
        self._held.update(changed)
        self.applies += 1
        fields = {}
        if self.group.cfg.digests:   # every rank's shards, gathered, against the version rank 0 applied
            fields["held"] = {str(p): _digest([self.params[n].full_tensor() for n in d.layout.fragments[p]])
                              for p in sorted(changed)}
            if host is not None:
                fields["applied"] = {str(p): _digest([host[n] for n in d.layout.fragments[p]]) for p in sorted(changed)}
        self.events.emit("fsdp-apply", rank=self.rank, n=self.applies, step=self.step_count,
                         versions={str(p): v for p, v in sorted(changed.items())}, **fields)
