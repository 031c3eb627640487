"""Training data for the default job: bytes of a real text corpus available offline everywhere.

By default the corpus is the Python standard library's own source files (sorted, so every machine
builds the same token stream); ``--data PATH`` takes a text file or a directory of files instead.
Every ``1/eval_fraction``-th block of ``HOLDOUT_BLOCK`` bytes is held out (so the held-out split samples
the whole corpus, not its last files); the rest is cut into one contiguous shard per learner (the
learners' data differ, as separate datasets would). Batches are drawn with a generator seeded by (seed, shard), so a learner and its replica
in the data-parallel baseline see the same data in the same order.
"""
from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


@dataclass(frozen=True)
class DataConfig:
    path: str | None = None          # None = the Python standard library's sources
    max_bytes: int = 2_000_000
    eval_fraction: float = 0.05
    batch_size: int = 8
    block_size: int = 64

    def __post_init__(self) -> None:
        if self.max_bytes < 10_000:
            raise ValueError(f"max_bytes {self.max_bytes} is too small for a corpus (need >= 10000)")
        if not 0.0 < self.eval_fraction < 0.5:
            raise ValueError(f"eval_fraction must lie in (0, 0.5), got {self.eval_fraction}")
        if self.batch_size < 1 or self.block_size < 2:
            raise ValueError(f"batch_size {self.batch_size} and block_size {self.block_size} must be positive")


def _files(path: str | None) -> list[Path]:
    if path is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        return sorted(root.glob("*.py"))
    p = Path(path)
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file())
        if files:
            return files
        raise ValueError(f"--data {path}: directory has no files")
    raise ValueError(f"--data {path}: no such file or directory")


def load_corpus(cfg: DataConfig) -> np.ndarray:
    """The token stream (uint8 bytes), at most ``max_bytes`` long."""
    chunks, total = [], 0
    for f in _files(cfg.path):
        b = f.read_bytes()[: cfg.max_bytes - total]
        chunks.append(b)
        total += len(b)
        if total >= cfg.max_bytes:
            break
    data = np.frombuffer(b"".join(chunks), dtype=np.uint8)
    if len(data) < 10 * (cfg.block_size + 1):
        raise ValueError(f"corpus has only {len(data)} bytes; need at least {10 * (cfg.block_size + 1)}")
    return data


HOLDOUT_BLOCK = 4096     # bytes; held-out blocks are spread evenly over the stream


class Corpus:
    """Train shards and the held-out split of one token stream."""

    def __init__(self, cfg: DataConfig):
        self.cfg = cfg
        data = load_corpus(cfg)
        every = max(2, round(1 / cfg.eval_fraction))
        blocks = np.arange(len(data)) // HOLDOUT_BLOCK
        held = blocks % every == every - 1
        if held.sum() < 4 * (cfg.block_size + 1):    # a tiny corpus: hold out its tail instead
            held = np.arange(len(data)) >= len(data) - 4 * (cfg.block_size + 1)
        self.train = data[~held]
        self.eval = data[held]

    def shard(self, index: int, count: int) -> np.ndarray:
        if not 0 <= index < count:
            raise ValueError(f"shard index {index} not in 0..{count - 1}")
        size = len(self.train) // count
        return self.train[index * size:(index + 1) * size]

    def batches(self, index: int, count: int, seed: int, skip: int = 0):
        """Endless (x, y) batches from shard ``index`` of ``count``; deterministic for the seed.
        ``skip``: start at batch ``skip`` of that order (a resumed learner's data position), drawing
        the skipped batches' offsets without building them."""
        shard = self.shard(index, count)
        rng = np.random.default_rng([seed, index])
        B, T = self.cfg.batch_size, self.cfg.block_size
        hi = len(shard) - T - 1
        if hi < 1:
            raise ValueError(f"shard {index} of {count} has {len(shard)} bytes, too few for block_size {T}")
        if skip < 0:
            raise ValueError(f"skip must be >= 0 batches, got {skip}")
        for _ in range(skip):
            rng.integers(0, hi, size=B)
        while True:
            starts = rng.integers(0, hi, size=B)
            x = np.stack([shard[s:s + T] for s in starts]).astype(np.int64)
            y = np.stack([shard[s + 1:s + T + 1] for s in starts]).astype(np.int64)
            yield torch.from_numpy(x), torch.from_numpy(y)

    def eval_batches(self, max_batches: int = 16):
        """Fixed held-out batches: non-overlapping windows spread evenly over the whole split (about
        one window in 64 spans the seam between two held-out blocks)."""
        B, T = self.cfg.batch_size, self.cfg.block_size
        windows = (len(self.eval) - 1) // T
        n = min(windows, B * max_batches)
        starts = (np.arange(n) * windows // n) * T
        for i in range(0, len(starts), B):
            s = starts[i:i + B]
            x = np.stack([self.eval[j:j + T] for j in s]).astype(np.int64)
            y = np.stack([self.eval[j + 1:j + T + 1] for j in s]).astype(np.int64)
            yield torch.from_numpy(x), torch.from_numpy(y)


@torch.no_grad()
def evaluate(model: torch.nn.Module, corpus: Corpus, max_batches: int = 16) -> float:
    """Mean held-out cross-entropy (nats per byte)."""
    was_training = model.training
    model.eval()
    losses = [float(model(x, y)[1]) for x, y in corpus.eval_batches(max_batches)]
    model.train(was_training)
    return float(np.mean(losses))
