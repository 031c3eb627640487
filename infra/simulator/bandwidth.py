"""Cross-site bandwidth: data parallelism against Decoupled DiLoCo (SPEC §10, docs/simulator.md).

Both systems exchange data between ``sites`` sites as an all-reduce; a ring all-reduce puts
2·(S−1)/S times the payload on every site's link in each direction. Utilisation u = compute time /
wall time; a step computes for s seconds, so at utilisation u it may take s/u.

Data parallel: the full gradient (B values of ``dp_bits``) is all-reduced every step, overlapped with
the backward pass only (the gradient does not exist before it). The step ends when both are done:
wall = forward + max(backward, t_comm), forward = (1 − b)·s, b = backward fraction (2/3: backward
costs twice the forward). Reaching u needs t_comm ≤ s/u − (1 − b)·s, so

    dp_bps = 2(S−1)/S · B · dp_bits / (s/u − (1 − b)·s)

Decoupled DiLoCo (arXiv 2604.21428 §3; SPEC §2: P = H = 24, τ = 2): one fragment of B/P values
(int4 or bf16) falls due every g = H/P steps, is exchanged in the background and must be back
within τ steps. How many steps one fragment's exchange may use — its *budget* — has two readings:

- ``budget="step"`` (default, sustained): the link must keep up with the stream of fragments.
  With τ ≥ g, ⌈τ/g⌉ exchanges are in flight at once and share the link, so it must carry one
  fragment per g steps; with τ < g one fragment must finish within τ steps. Budget min(τ, g)·s/u.
- ``budget="tau"`` (per τ steps): each fragment's exchange gets the link for its τ steps, as if
  consecutive exchanges did not overlap. Budget τ·s/u. It is min(τ, g)/τ times the sustained
  figure: half at the paper's setting (g = 1, τ = 2); equal when τ ≤ g.

    decoupled_bps = 2(S−1)/S · (B/P) · bits / (budget_steps · s/u)

Were the link slower, a learner that waited for its fragment (as Streaming DiLoCo does) would
compute only a fraction u of the time; ours never wait: they keep computing and staleness grows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

FORMULA = """\
ring(S)        = 2 (S-1) / S                       (per-site share of a ring all-reduce)
dp_bps         = ring(S) * B * dp_bits / (s/u - (1-b) s)
decoupled_bps  = ring(S) * (B/P) * bits / (budget * s/u)             bits = 16 (bf16) or 4 (int4)
budget         = min(tau, H/P) steps  (sustained: the link keeps up with one fragment per H/P steps)
               | tau steps            (per tau: each fragment's exchange has the link for tau steps)
B params, s step time [s], u utilisation, b backward fraction of a step, P fragments,
H sync period [steps], tau overlap [steps], S sites"""

BUDGETS = ("step", "tau")


@dataclass(frozen=True)
class BandwidthConfig:
    params: float                 # B
    step_time_s: float = 1.0      # s: compute time of one step
    utilisation: float = 0.9      # u
    sites: int = 2                # S
    fragments: int = 24           # P (SPEC §2: the paper's main setting P = H = 24)
    sync_every: int | None = None  # H; None = P
    overlap: int = 2              # tau (SPEC §2: 2)
    dp_bits: int = 16             # data parallel gradients in bf16
    backward_fraction: float = 2 / 3
    budget: str = "step"          # how many steps a fragment's exchange may take: "step" | "tau"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.params) and self.params > 0):
            raise ValueError(f"params must be a finite number > 0, got {self.params!r}")
        if not (math.isfinite(self.step_time_s) and self.step_time_s > 0):
            raise ValueError(f"step_time_s must be > 0 seconds, got {self.step_time_s!r}")
        if not (0 < self.utilisation <= 1):
            raise ValueError(f"utilisation must be in (0, 1], got {self.utilisation!r}")
        if not isinstance(self.sites, int) or self.sites < 2:
            raise ValueError(f"sites must be an int >= 2 (one site needs no cross-site link), got {self.sites!r}")
        if not isinstance(self.fragments, int) or self.fragments < 1:
            raise ValueError(f"fragments (P) must be an int >= 1, got {self.fragments!r}")
        if self.sync_every is not None and (not isinstance(self.sync_every, int) or self.sync_every < self.fragments):
            raise ValueError(f"sync_every (H) must be an int >= fragments P={self.fragments} "
                             f"(each fragment needs its own offset), got {self.sync_every!r}")
        if not isinstance(self.overlap, int) or self.overlap < 1:
            raise ValueError(f"overlap (tau) must be an int >= 1, got {self.overlap!r}")
        if not isinstance(self.dp_bits, int) or self.dp_bits < 1:
            raise ValueError(f"dp_bits must be an int >= 1, got {self.dp_bits!r}")
        if not (0 < self.backward_fraction <= 1):
            raise ValueError(f"backward_fraction must be in (0, 1], got {self.backward_fraction!r}")
        if self.budget not in BUDGETS:
            raise ValueError(f"budget must be one of {BUDGETS} (sustained per step, or per tau steps), "
                             f"got {self.budget!r}")

    @property
    def period(self) -> int:
        return self.sync_every if self.sync_every is not None else self.fragments


def ring_factor(sites: int) -> float:
    return 2 * (sites - 1) / sites


def dp_bps(cfg: BandwidthConfig) -> float:
    s = cfg.step_time_s
    budget = s / cfg.utilisation - (1 - cfg.backward_fraction) * s
    return ring_factor(cfg.sites) * cfg.params * cfg.dp_bits / budget


def budget_steps(cfg: BandwidthConfig, budget: str | None = None) -> float:
    """Steps one fragment's exchange may use under ``budget`` (default: ``cfg.budget``)."""
    budget = budget or cfg.budget
    if budget not in BUDGETS:
        raise ValueError(f"budget must be one of {BUDGETS}, got {budget!r}")
    gap_steps = cfg.period / cfg.fragments
    return min(cfg.overlap, gap_steps) if budget == "step" else float(cfg.overlap)


def decoupled_bps(cfg: BandwidthConfig, bits: int, budget: str | None = None) -> float:
    window = budget_steps(cfg, budget) * cfg.step_time_s / cfg.utilisation
    return ring_factor(cfg.sites) * (cfg.params / cfg.fragments) * bits / window


def bandwidth(cfg: BandwidthConfig, budget: str | None = None) -> dict[str, float]:
    """Required per-site cross-site bandwidth in Gbit/s (10^9 bit/s), under ``budget`` (default
    ``cfg.budget``)."""
    return {"dp_gbps": dp_bps(cfg) / 1e9,
            "decoupled_bf16_gbps": decoupled_bps(cfg, 16, budget) / 1e9,
            "decoupled_int4_gbps": decoupled_bps(cfg, 4, budget) / 1e9}
