"""In-process baselines for the quality comparisons: lock-step DiLoCo, and an
idealised model of syncer-driven rounds used to sweep the demo job's defaults.

Both run M replicas of the default job's GPT in one process on the same data streams as the real
learners (workers/job/job.py) and use the pipeline's own merge and outer optimizer (token weights,
RDA, Nesterov, versions rounded to bf16), so they differ from a real run only in what the real
system adds: processes, the network, storage, and latency.

* ``fragments=1, latency=0``: **lock-step DiLoCo** (DiLoCo, arXiv 2311.08105; torchft's
  behaviour): every H steps every replica stops, the full model is merged and the outer step is
  applied before anyone trains on. Nothing is lost; everyone waits.
* ``fragments=P, latency=L``: **syncer-driven rounds** (SPEC §3-4) without processes: fragment p
  is merged from every replica's state at its round (every H steps at offset t_p) and the version
  reaches the replicas L steps later, overwriting what they did on p in between (the paper's τ).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.codec import CodecConfig, dequantize, quantize, round_to_bf16
from pipeline.descriptor import LearnerRules
from pipeline.fragment import fragment_offsets, make_layout, specs_from_arrays
from pipeline.merge import MergeConfig, merge_fragment, token_weights
from pipeline.outer import OuterConfig, nesterov_step
from workers.job.data import Corpus, evaluate
from workers.common.events import EventLog
from workers.job.job import JobSettings, make_optimizer, set_lr
from workers.job.model import EMBEDDING_TENSORS, GPTConfig, build_model


@dataclass(frozen=True)
class OuterSettings:
    """The outer loop of the baselines: H, P and the version latency in steps, with the run's own
    sections for the outer optimizer, the merge and what a replica does when a version lands."""

    sync_every: int = 16           # the demo's H: 4 x P for P = 4 (workers/launch.py Schedule)
    fragments: int = 1             # 1: lock-step DiLoCo
    latency: int = 0
    outer: OuterConfig = OuterConfig()
    merge: MergeConfig = MergeConfig()
    learner: LearnerRules = LearnerRules()
    # the replicas' deltas go through the run's codec (its block quantisation, as a learner's blob and
    # the syncer's decode), so lock-step carries the same int4 error as a decoupled run; None: exact
    codec: CodecConfig | None = None

    def __post_init__(self) -> None:
        if self.fragments < 1 or self.sync_every < self.fragments:
            raise ValueError(f"need 1 <= fragments (P={self.fragments}) <= sync_every (H={self.sync_every})")
        if not 0 <= self.latency < self.sync_every:
            raise ValueError(f"latency must lie in 0..H-1={self.sync_every - 1}, got {self.latency}")


def _load(model: torch.nn.Module, values: dict[str, np.ndarray]) -> None:
    with torch.no_grad():
        params = dict(model.named_parameters())
        for n, v in values.items():
            params[n].copy_(torch.from_numpy(v))


def _through(delta: np.ndarray, codec: CodecConfig | None) -> np.ndarray:
    """A replica's delta as the syncer decodes it: the codec's quantise/dequantise round trip per tensor."""
    d = delta.astype(np.float32)
    if codec is None:
        return d
    return dequantize(quantize(d, codec.scheme, codec.block_size), codec.scheme, codec.block_size,
                      d.size).reshape(d.shape)


def _land(model: torch.nn.Module, p: int, version: dict[str, np.ndarray], at_answer: dict[int, tuple],
          c_steps: list[int], c_tokens: list[int], keep_progress: bool) -> None:
    """Fragment p's new version reaches one replica: it overwrites what the replica did on p since
    its answer (the latency's steps are lost), or with ``keep_progress`` keeps it on top
    (Theta_new + (theta - theta at the answer)) and the counters keep those steps."""
    cur, s0, k0 = at_answer.pop(p)
    if keep_progress:
        params = dict(model.named_parameters())
        _load(model, {n: version[n] + (params[n].detach().numpy() - cur[n]) for n in version})
        c_steps[p] -= s0
        c_tokens[p] -= k0
    else:
        _load(model, version)
        c_steps[p] = 0
        c_tokens[p] = 0


def diloco_baseline(gcfg: GPTConfig, job: JobSettings, learners: int, seed: int, events: EventLog,
                    outer: OuterSettings = OuterSettings(), eval_every: int = 50) -> dict:
    """Train ``learners`` replicas for ``job.steps`` inner steps each with the outer loop ``outer``;
    evaluate the global model (what storage would hold). Returns the same fields as ``dp_baseline``."""
    torch.set_num_threads(1)
    corpus = Corpus(job.data_config(gcfg.block_size))
    models = [build_model(gcfg, seed) for _ in range(learners)]    # one initial model (same seed)
    opts = [make_optimizer(m, job) for m in models]
    streams = [corpus.batches(m % job.shards, job.shards, seed) for m in range(learners)]
    init = {n: p.detach().numpy().copy() for n, p in models[0].named_parameters()}
    layout = make_layout(specs_from_arrays(init), outer.fragments, "balanced")
    offsets = fragment_offsets(outer.fragments, outer.sync_every)
    cfg = MergeConfig(outer.merge.method, frozenset(EMBEDDING_TENSORS))
    master = {n: a.astype(np.float32) for n, a in init.items()}
    momentum = {n: np.zeros_like(a) for n, a in master.items()}
    published = {n: round_to_bf16(a) for n, a in master.items()}
    for m in models:
        _load(m, published)
    evaluator = build_model(gcfg, seed)
    init_eval = evaluate(models[0], corpus)
    events.emit("eval", tokens=0, loss=init_eval)
    c_tokens = [[0] * outer.fragments for _ in range(learners)]
    c_steps = [[0] * outer.fragments for _ in range(learners)]
    arriving: list[tuple[int, int, dict[str, np.ndarray]]] = []     # (apply after step, fragment, values)
    at_answer: list[dict[int, tuple]] = [{} for _ in range(learners)]
    tokens, t_start = 0, time.monotonic()
    for step in range(job.steps):
        for m, (model, opt, s) in enumerate(zip(models, opts, streams)):
            x, y = next(s)
            set_lr(opt, job, step)
            opt.zero_grad(set_to_none=True)
            model(x, y)[1].backward()
            opt.step()
            tokens += x.numel()
            for p in range(outer.fragments):
                c_steps[m][p] += 1
                c_tokens[m][p] += x.numel()
        for p in range(outer.fragments):
            if step % outer.sync_every != offsets[p]:
                continue
            names = layout[p]
            grads = []
            for m, model in enumerate(models):                      # v_m = Theta_current - theta_m
                cur = {n: t.detach().numpy().copy() for n, t in model.named_parameters() if n in names}
                at_answer[m][p] = (cur, c_steps[m][p], c_tokens[m][p])
                grads.append({n: _through(published[n] - cur[n], outer.codec) for n in names})
            w = token_weights([c_tokens[m][p] for m in range(learners)], [c_steps[m][p] for m in range(learners)])
            g = merge_fragment(grads, w, cfg)
            new_p, new_b = nesterov_step({n: master[n] for n in names}, {n: momentum[n] for n in names}, g,
                                         outer.outer.lr, outer.outer.momentum)
            master.update(new_p)
            momentum.update(new_b)
            version = {n: round_to_bf16(new_p[n]) for n in names}
            published.update(version)
            arriving.append((step + outer.latency, p, version))
        for item in [a for a in arriving if a[0] == step]:
            arriving.remove(item)
            for m, model in enumerate(models):
                _land(model, item[1], item[2], at_answer[m], c_steps[m], c_tokens[m], outer.learner.keep_progress)
        if (step + 1) % 10 == 0:
            events.emit("step", step=step + 1, tokens=tokens)
        if (step + 1) % eval_every == 0:
            _load(evaluator, published)
            events.emit("eval", tokens=tokens, loss=evaluate(evaluator, corpus))
    _load(evaluator, published)
    final = evaluate(evaluator, corpus)
    events.emit("eval", tokens=tokens, loss=final)
    frag_bytes = 4 * sum(a.size for a in init.values()) / outer.fragments
    return {"mode": "diloco" if outer.fragments == 1 and outer.latency == 0 else "rounds-model",
            "tokens": tokens, "initial_eval_loss": init_eval, "final_eval_loss": final,
            "wall_s": time.monotonic() - t_start, "sync_every": outer.sync_every, "fragments": outer.fragments,
            "latency_steps": outer.latency, "outer_lr": outer.outer.lr, "outer_momentum": outer.outer.momentum,
            "codec": outer.codec.scheme if outer.codec is not None else "exact",
            # one fragment up (int4 ~ 1/8 of fp32) and down (bf16) per H/P steps
            "bytes_per_learner_per_step": (frag_bytes / 8 + frag_bytes / 2) * outer.fragments / outer.sync_every}
