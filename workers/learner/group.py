"""A learner that is a data-parallel group: one ``torchrun`` job of N ranks (SPEC §2: "inside it may
itself be a data-parallel job"; paper §3, each learner on its own accelerators). Issue 17.

Rank 0 is the learner the rest of the system sees: it runs a ``Learner`` (workers/learner/learner.py)
that talks to the syncer and storage; the other ranks never touch the network or storage. Inside the
group the ranks train one replica with DistributedDataParallel (gradients all-reduced every step;
FSDP is the next step, docs/running.md "A learner under torchrun"). At every step boundary:

1. one small all-reduce of ``[tokens, leaving, skipped]``: the group's tokens for the step (the sum
   of every rank's local batch, so counters and deltas carry the group's work), whether any rank is
   leaving (SIGTERM reaches ranks at different steps; they leave together, at the same boundary,
   or the collectives would hang), and whether any rank skipped its last step (non-finite);
2. rank 0 answers open rounds and applies the versions that arrived (``Learner.step``'s own
   order: its decision, at its boundary, from what its receiver already holds - nothing waits
   for the network), then broadcasts a small header naming every fragment whose weights changed
   (format below), then those fragments' tensors, one flat buffer per fragment;
3. every rank takes the inner step.

Ranks hold identical weights before the broadcast (DDP keeps them so), and the broadcast copies rank
0's weights after its apply, so mixing (α) and ``keep_progress`` need no special case. A non-finite
reload on rank 0 (workers/learner/nonfinite.py) or a skipped step on any rank re-broadcasts every
fragment at the next boundary. With ``GroupConfig.digests`` every rank logs a digest of its whole
model after each broadcast (``group-apply`` events), which is what tests compare.

Header wire format (docs/formats.md "In-group broadcast"): int64 tensor
``[GROUP_FORMAT, P, v_0+1, ..., v_{P-1}+1, crc32]`` - ``v_p+1`` the version of fragment p now held
(0: unchanged), crc32 over the little-endian bytes of the preceding entries. The tensors follow in
fragment order, each fragment as one float buffer of its tensors in layout order (collective
transport: TCP for gloo, NCCL's own for CUDA).

Devices: the model's device decides; the process group is gloo for CPU tensors plus NCCL for CUDA
tensors where CUDA and NCCL exist (``cpu:gloo,cuda:nccl``), so the header always travels on CPU;
gloo alone where ranks share a GPU (NCCL refuses that).
"""
from __future__ import annotations

import datetime
import gc
import hashlib
import math
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import numpy as np
import torch
import torch.distributed as dist

from pipeline.descriptor import RunDescriptor
from storage.layout import read_descriptor
from storage.store import ObjectStore, open_store
from workers.common.events import EventLog
from workers.learner.learner import Learner, LearnerConfig
from workers.learner.nonfinite import grads_finite

GROUP_FORMAT = 1
RANK_ROLE = "rank"     # the event role of ranks > 0 (rank 0's events are the learner's own)
BACKENDS = ("gloo", "cpu:gloo,cuda:nccl")   # the header travels on CPU: NCCL alone cannot carry it


@dataclass(frozen=True)
class GroupConfig:
    """``digests``: every rank logs a sha256 of its whole model after each broadcast (costs a device
    to host copy of the model per applied version: for tests and debugging). ``backend``: None picks
    gloo, plus NCCL for CUDA tensors where both CUDA and NCCL exist. ``timeout_s``: collectives."""

    digests: bool = False
    backend: str | None = None
    timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"GroupConfig.backend must be None or one of {BACKENDS}, got {self.backend!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"GroupConfig.timeout_s must be > 0, got {self.timeout_s}")


def torchrun_env(environ: Mapping[str, str] = os.environ) -> tuple[int, int, int] | None:
    """``(rank, world_size, local_rank)`` when this process is a rank of a torchrun job of more than
    one rank (torchrun sets RANK, WORLD_SIZE, LOCAL_RANK), else None."""
    if "WORLD_SIZE" not in environ or "RANK" not in environ:
        return None
    try:
        rank, world = int(environ["RANK"]), int(environ["WORLD_SIZE"])
        local = int(environ.get("LOCAL_RANK", rank))
    except ValueError:
        raise ValueError(f"RANK/WORLD_SIZE/LOCAL_RANK must be integers, got {environ.get('RANK')!r}, "
                         f"{environ.get('WORLD_SIZE')!r}, {environ.get('LOCAL_RANK')!r}") from None
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"need 0 <= RANK < WORLD_SIZE, got RANK={rank} WORLD_SIZE={world}")
    return (rank, world, local) if world > 1 else None


def rank_log_path(path: str | Path | None, rank: int) -> str | None:
    """Rank 0 logs to ``path`` (the learner's log); rank r to ``<stem>.rank<r><suffix>`` beside it."""
    if path is None or rank == 0:
        return None if path is None else str(path)
    p = Path(path)
    return str(p.with_name(f"{p.stem}.rank{rank}{p.suffix}"))


def encode_header(num_fragments: int, changed: Mapping[int, int]) -> torch.Tensor:
    """The header of one boundary (module docstring): which fragments changed, at which version."""
    body = [GROUP_FORMAT, num_fragments, *(changed[p] + 1 if p in changed else 0 for p in range(num_fragments))]
    crc = zlib.crc32(np.asarray(body, dtype="<i8").tobytes())
    return torch.tensor([*body, crc], dtype=torch.int64)


def decode_header(header: torch.Tensor, num_fragments: int) -> dict[int, int]:
    """``{fragment: version}`` of a header; ValueError naming what is wrong with a bad one."""
    vals = [int(v) for v in header.tolist()]
    if vals[0] != GROUP_FORMAT or vals[1] != num_fragments:
        raise ValueError(f"group header: format {vals[0]} for {vals[1]} fragments, expected format "
                         f"{GROUP_FORMAT} for {num_fragments} (ranks of different versions?)")
    if zlib.crc32(np.asarray(vals[:-1], dtype="<i8").tobytes()) != vals[-1]:
        raise ValueError("group header: checksum mismatch")
    return {p: v - 1 for p, v in enumerate(vals[2:-1]) if v > 0}


def model_digest(model: torch.nn.Module) -> str:
    """sha256 over every parameter (name order) as float32 bytes on the host: equal on every rank
    exactly when the ranks hold the same weights."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:32]


class DataParallelGroup:
    """This process's place in the torchrun job: rank, world size, device, and the process group
    (created here from torchrun's environment unless the caller already created one)."""

    def __init__(self, config: GroupConfig = GroupConfig(), environ: Mapping[str, str] = os.environ):
        env = torchrun_env(environ)
        if env is None and not dist.is_initialized():
            raise ValueError("not a rank of a torchrun job of 2 or more ranks (RANK/WORLD_SIZE unset or "
                             "WORLD_SIZE=1): start it with `torchrun --nproc-per-node N ...`, or use Learner")
        self.cfg = config
        self.rank, self.world_size, self.local_rank = env or (dist.get_rank(), dist.get_world_size(), 0)
        self.cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", self.local_rank % torch.cuda.device_count()) if self.cuda \
            else torch.device("cpu")
        self._own = not dist.is_initialized()
        if self._own:
            if self.cuda:
                torch.cuda.set_device(self.device)
            # NCCL refuses two ranks on one GPU; gloo also moves CUDA tensors (through the host), so
            # ranks that share a GPU (more ranks on this host than GPUs) use gloo for everything.
            shared = self.cuda and torch.cuda.device_count() < int(environ.get("LOCAL_WORLD_SIZE", 1))
            backend = config.backend or ("cpu:gloo,cuda:nccl" if self.cuda and dist.is_nccl_available()
                                         and not shared else "gloo")
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=config.timeout_s))
        self.backend = str(dist.get_backend())
        self.descriptor: RunDescriptor | None = None

    def all_sum(self, values: list[int]) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return [int(v) for v in t.tolist()]

    def share_bytes(self, blob: bytes | None) -> bytes:
        """Rank 0's ``blob`` on every rank (length, then the bytes: no pickle)."""
        n = torch.tensor([len(blob) if self.rank == 0 else 0], dtype=torch.int64)
        dist.broadcast(n, src=0)
        buf = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if self.rank == 0 else \
            torch.empty(int(n.item()), dtype=torch.uint8)
        dist.broadcast(buf, src=0)
        return buf.numpy().tobytes()

    def share_descriptor(self, store: str | ObjectStore | None) -> RunDescriptor:
        """The run descriptor on every rank: rank 0 reads it from ``store``, the others receive it
        (they never touch storage; its bytes carry their own version and checksum)."""
        if self.descriptor is None:
            blob = None
            if self.rank == 0:
                st = open_store(store, create=False) if isinstance(store, str) else store
                blob = read_descriptor(st).to_bytes()
            self.descriptor = RunDescriptor.from_bytes(self.share_bytes(blob), what="descriptor from rank 0")
        return self.descriptor

    def close(self) -> None:
        if self._own and dist.is_initialized():
            # Leave together: a rank that tears the group down while a peer still drains (rank 0
            # flushing its deltas) can make gloo's connection thread abort the peer at exit
            # ("terminate called without an active exception", seen once in CI).
            try:
                dist.barrier()
            except RuntimeError:   # a peer is already gone: nothing left to wait for
                pass
            dist.destroy_process_group()


class _RankZeroLearner(Learner):
    """The group's rank 0: a Learner whose step-boundary apply is followed by the broadcast."""

    def __init__(self, *args, on_applied: Callable[[], None], **kwargs):
        super().__init__(*args, **kwargs)
        self._on_applied = on_applied

    def apply_arrivals(self, arrivals: list | None = None) -> int:
        n = super().apply_arrivals(arrivals)
        self._on_applied()
        return n


@dataclass
class _RankState:
    """What every rank tracks across boundaries (rank 0 reads most of it from its Learner)."""

    held: dict[int, int] = field(default_factory=dict)   # fragment -> version broadcast last
    reloads: int = 0              # rank 0's non-finite reloads at the last broadcast
    resync: bool = False          # a rank skipped its last step: broadcast every fragment
    skipped_last: bool = False    # this rank skipped its last step
    steps: int = 0
    tokens: int = 0
    skipped: int = 0
    applies: int = 0


class GroupLearner:
    """A learner of N ranks under torchrun; same use as ``Learner`` (module docstring)::

        learner = GroupLearner(model.to(device), optimizer, "runs/x", "l0")   # every rank runs this
        learner.start()
        for x, y in my_batches(rank=learner.rank, world=learner.world_size):
            learner.step(lambda: loss_fn(learner.ddp(x), y), tokens=x.numel())   # this rank's tokens
        learner.close()

    ``store``, ``bus`` and ``config.keys`` are used by rank 0 only (None is fine on the others).
    ``step(..., stop=True)`` on any rank makes the whole group leave at that boundary: ``step``
    then takes no step and returns None, and ``stopped`` is True on every rank."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, store: str | ObjectStore | None,
                 learner_id: str, config: LearnerConfig = LearnerConfig(), bus=None, events: EventLog | None = None,
                 group: DataParallelGroup | None = None, **learner_kwargs):
        self.group = group or DataParallelGroup()
        self.rank, self.world_size = self.group.rank, self.group.world_size
        self.model, self.optimizer, self.store, self.id = model, optimizer, store, learner_id
        self.device = next(model.parameters()).device
        self.learner: _RankZeroLearner | None = None
        if self.rank == 0:
            self.learner = _RankZeroLearner(model, optimizer, store, learner_id, config, bus=bus, events=events,
                                            on_applied=self._broadcast, **learner_kwargs)
            self.events = self.learner.events
        else:
            self.events = events or EventLog(None, RANK_ROLE, f"{learner_id}.rank{self.rank}")
        self.params = dict(model.named_parameters())
        self.ddp: torch.nn.Module = model
        self.stopped = False
        self._s = _RankState()

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> "GroupLearner":
        """Rank 0 joins the run (loads the global model); every rank then gets the descriptor and
        rank 0's weights, and the replica is wrapped in DistributedDataParallel."""
        if self.learner is not None:
            self.learner.start()
        d = self.group.share_descriptor(self.learner.store if self.learner is not None else None)
        versions = dict(self.learner.base_version) if self.learner is not None else {}
        self._exchange(d, {p: versions.get(p, 0) for p in range(d.num_fragments)})
        from torch.nn.parallel import DistributedDataParallel
        self.ddp = DistributedDataParallel(self.model, device_ids=[self.device.index] if self.device.type == "cuda"
                                           else None)
        self.events.emit("group-start", rank=self.rank, world_size=self.world_size, backend=self.group.backend,
                         device=str(self.device), pid=os.getpid())
        return self

    def close(self, flush: bool = True) -> bool:
        """Rank 0 closes its Learner (``Learner.close``: drains its deltas); every rank leaves the
        process group. True when every delta was made durable (always on ranks > 0)."""
        drained = self.learner.close(flush) if self.learner is not None else True
        self.events.emit("group-stop", rank=self.rank, steps=self._s.steps, tokens=self._s.tokens,
                         skipped=self._s.skipped, applies=self._s.applies)
        # DDP's reducer holds the process group: let it go now, so the group's C++ side (gloo's
        # threads) is torn down here, not in whatever order the interpreter's exit frees things
        # (a rank once aborted at exit, "terminate called without an active exception", twice in CI).
        self.ddp = self.model      # (a plain module: nothing holds the group any more)
        gc.collect()
        self.group.close()
        return drained

    # -- the training loop -----------------------------------------------------------------------
    def step(self, closure: Callable[[], torch.Tensor], tokens: int, stop: bool = False) -> float | None:
        """One step of the group. ``closure``: this rank's loss (forward through ``self.ddp``);
        ``tokens``: this rank's tokens (> 0); the learner counts the group's sum. ``stop``: this
        rank wants to leave; if any rank does, no step is taken and None is returned."""
        if not isinstance(tokens, (int, np.integer)) or isinstance(tokens, bool) or tokens <= 0:
            raise ValueError(f"learner {self.id} rank {self.rank}: step(tokens=...) must be a positive int, "
                             f"got {tokens!r}")
        if self.stopped:
            raise RuntimeError(f"learner {self.id}: the group has left (a rank asked to stop)")
        total, leaving, skipped = self.group.all_sum([int(tokens), int(bool(stop)), int(self._s.skipped_last)])
        if leaving:
            self.stopped = True
            return None
        self._s.resync = skipped > 0
        if self.learner is not None:
            before = self.learner.health.skipped
            value = self.learner.step(closure, tokens=total)
            self._s.skipped_last = self.learner.health.skipped != before
        else:
            self._broadcast()
            value = self._local_step(closure)
        if not self._s.skipped_last:
            self._s.steps += 1
            self._s.tokens += total
        else:
            self._s.skipped += 1
        return value

    def _local_step(self, closure: Callable[[], torch.Tensor]) -> float:
        """A rank > 0's inner step. It skips exactly when rank 0's guard would (loss or all-reduced
        gradients non-finite); a rare disagreement is repaired by the next boundary's resync."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = closure()
        loss.backward()
        value = float(loss.detach())
        self._s.skipped_last = not (math.isfinite(value) and grads_finite(self.params.values()))
        if not self._s.skipped_last:
            self.optimizer.step()
        if (self._s.steps + 1) % 10 == 0:
            self.events.emit("rank-step", rank=self.rank, step=self._s.steps + 1, loss=round(value, 4))
        return value

    # -- the in-group broadcast ------------------------------------------------------------------
    def _broadcast(self) -> None:
        """At the step boundary, after rank 0's apply: header, then the changed fragments."""
        d = self.group.descriptor
        if self.learner is None:
            self._exchange(d, None)
            return
        held = dict(self.learner.base_version)
        everything = self._s.resync or self.learner.health.reloads != self._s.reloads
        changed = {p: v for p, v in held.items() if everything or self._s.held.get(p) != v}
        self._s.reloads = self.learner.health.reloads
        self._exchange(d, changed)

    @torch.no_grad()
    def _exchange(self, d: RunDescriptor, changed: dict[int, int] | None) -> None:
        """Rank 0 sends ``changed`` (fragment -> version) and those fragments; the others receive."""
        header = encode_header(d.num_fragments, changed) if changed is not None else \
            torch.zeros(d.num_fragments + 3, dtype=torch.int64)
        dist.broadcast(header, src=0)
        changed = decode_header(header, d.num_fragments)
        for p in sorted(changed):
            tensors = [self.params[n] for n in d.layout.fragments[p]]
            # float32 on every rank whatever the parameters' dtypes (runs train float32 models)
            flat = torch.cat([t.detach().reshape(-1).float() for t in tensors]) if self.rank == 0 else \
                torch.empty(sum(t.numel() for t in tensors), dtype=torch.float32, device=self.device)
            dist.broadcast(flat, src=0)
            if self.rank != 0:
                offset = 0
                for t in tensors:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()
        if not changed:
            return
        self._s.held.update(changed)
        self._s.applies += 1
        fields = {"digest": model_digest(self.model)} if self.group.cfg.digests else {}
        self.events.emit("group-apply", rank=self.rank, n=self._s.applies, step=self._s.steps,
                         versions={str(p): v for p, v in sorted(changed.items())}, **fields)

    # -- what the job reads ----------------------------------------------------------------------
    @property
    def step_count(self) -> int:
        return self._s.steps

    @property
    def tokens(self) -> int:
        return self._s.tokens

    def stats(self) -> dict:
        """Rank 0: its Learner's figures; every rank: the group's shape and its own applies."""
        own = {"rank": self.rank, "world_size": self.world_size, "group_applies": self._s.applies,
               "skipped_steps": self._s.skipped}
        return {**(self.learner.stats() if self.learner is not None else {}), **own}
