"""When a fragment's round closes: minimum quorum plus the adaptive grace window (SPEC §4).

A round closes when at least K distinct learners have a pending delta for the fragment and the
grace window after the quorum has passed (K is a minimum, issue 25: no decision here ever merges
fewer than K distinct learners' work; answers of fewer are held, bounded, or dropped with a reason):

    grace = clamp(gamma * (tau * step_time - quorum_wait - sync_time), 0, cap)

The window spends only slack that the tau-step overlap already hides, so no learner ever waits for
it; deltas arriving inside it join the round. *Choices*: gamma = 1 (the SPEC said 0.5; measured on
the demo over 6 seeds, 1 halves the answers that miss their round and gives a lower loss, README
"Rounds"), cap = one step time, and before any step time is measured the window is the cap.

Pure: the caller passes ``now`` and its smoothed measurements (``Timing``, see ``Ewma``); the
decision says what to merge now, or how long until asking again can change the answer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Sequence

__all__ = ["PolicyConfig", "Pending", "Timing", "Decision", "Ewma", "grace_window", "decide", "late_deadline",
           "late_answers", "expire_late"]


def _finite(name: str, value: float, minimum: float = 0.0) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < minimum:
        raise ValueError(f"{name} must be a finite number >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class PolicyConfig:
    """K (``quorum``), tau (``overlap``), gamma and the cap in seconds (0: one measured step time).
    The defaults are a new run's (tau = 2, the paper's main setting); a stored run names every field."""

    quorum: int = 1
    overlap: int = 2
    gamma: float = 1.0
    cap_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("quorum", "overlap"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"policy {name} must be an int >= 1, got {v!r}")
        _finite("policy gamma", self.gamma)
        _finite("policy cap_s", self.cap_s)


@dataclass(frozen=True)
class Pending:
    """One unmerged delta for the fragment, as the syncer saw it arrive."""

    delta_id: str
    learner: str
    order: tuple[int, int]      # (incarnation, seq): larger is newer
    arrived_at: float
    c_steps: int
    c_tokens: int
    round: int = -1             # the round it answers (-1: learner-driven runs)


@dataclass(frozen=True)
class Timing:
    """Smoothed measurements: learners' inner step time (None until measured), the syncer's
    merge+commit+publish time, and ``answer_spread_s``: how much later after a round opens the
    slowest live learner's answers arrive than the fastest's (workers/syncer/rounds.py; e.g. a
    learner across a WAN link hears the round and is heard back a round trip later)."""

    step_time_s: float | None = None
    sync_time_s: float = 0.0
    answer_spread_s: float = 0.0

    def __post_init__(self) -> None:
        if self.step_time_s is not None:
            _finite("step_time_s", self.step_time_s)
        _finite("sync_time_s", self.sync_time_s)
        _finite("answer_spread_s", self.answer_spread_s)


class Verdict(str, Enum):
    """Why a round is decided as it is; the value is what a commit records as ``info["decided"]``."""

    EMPTY = "empty"                      # nothing pending
    QUORUM_NOT_MET = "quorum-not-met"    # fewer than K answered: wait
    GRACE = "grace"                      # K answered, the grace window is open: wait
    GRACE_EXPIRED = "grace-expired"      # the window closed: merge what answered
    ALL_REPORTED = "all-reported"        # every live learner answered: merge now
    NO_ROUND = "no-round"                # the fragment has no open round: late answers wait for the next
    LATE_EXPIRED = "late-expired"        # late answers held past their deadline, >= K learners: merged
    BELOW_QUORUM = "below-quorum"        # late answers of < K learners past their deadline: recorded dropped
    FOLD_BELOW_QUORUM = "fold-below-quorum"   # the fold left < K learners: only its drops are committed
    REJECTED_ONLY = "rejected-only"      # only refused deltas: a commit that records their drops


@dataclass(frozen=True)
class Decision:
    """``merge``: delta ids to merge now (empty: not yet), in (learner, order) order; includes
    zero-step deltas so that the fold records them as dropped. ``superseded``: older pending deltas of
    a learner that has a newer one; pass them to the fold with ``merge`` so it records them.
    ``wait_s``: time until the decision may change without new deltas (None: only new deltas can
    change it). ``reason``: a ``Verdict`` (its string value is accepted and converted).
    ``dropped``: delta ids the syncer records as dropped ``below-quorum`` now (``expire_late``,
    issue 25); never in ``merge``."""

    merge: tuple[str, ...]
    superseded: tuple[str, ...]
    wait_s: float | None
    quorum_met_at: float | None
    grace_s: float | None
    reason: Verdict
    dropped: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if set(self.dropped) & set(self.merge):
            raise ValueError(f"Decision.dropped and merge overlap: {sorted(set(self.dropped) & set(self.merge))}")
        try:
            object.__setattr__(self, "reason", Verdict(self.reason))
        except ValueError:
            raise ValueError(f"Decision.reason {self.reason!r} is not one of "
                             f"{[v.value for v in Verdict]}") from None


@dataclass(frozen=True)
class Ewma:
    """Exponentially weighted moving average: ``value`` is None until the first sample."""

    alpha: float = 0.2
    value: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.alpha, (int, float)) or not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"EWMA alpha must lie in (0, 1], got {self.alpha!r}")

    def update(self, sample: float) -> "Ewma":
        """A new average including ``sample`` (the first sample is taken as is)."""
        _finite("EWMA sample", sample)
        if self.value is None:
            return Ewma(self.alpha, float(sample))
        return Ewma(self.alpha, self.value + self.alpha * (float(sample) - self.value))


def grace_window(cfg: PolicyConfig, timing: Timing, quorum_wait_s: float) -> float:
    """The grace window in seconds for a round whose quorum took ``quorum_wait_s`` to gather.

    Learners whose answers take longer to arrive (``timing.answer_spread_s``: a region across a
    link) get that much more window: without it an answer one round trip late misses its round
    whenever the round trip exceeds the window (about one step) and waits H steps for the next
    (docs/regions.md "Rounds over a link"); waiting costs every learner at most the spread, which
    the caller bounds (workers/syncer/rounds.py: a quarter of a round period), so a straggler
    cannot hold rounds for long."""
    _finite("quorum_wait_s", quorum_wait_s)
    step = timing.step_time_s
    cap = cfg.cap_s if cfg.cap_s > 0 else (step if step is not None else 0.0)
    if step is None:
        return cap                                  # no measurement yet: the cap (0 if it is unknown too)
    spread = timing.answer_spread_s
    slack = cfg.gamma * (cfg.overlap * step + spread - quorum_wait_s - timing.sync_time_s)
    return min(max(slack, 0.0), cap + spread)


def decide(pending: Sequence[Pending], now: float, cfg: PolicyConfig, timing: Timing,
           live_learners: int | None = None, round_id: int | None = None) -> Decision:
    """Decide one fragment's round from its pending deltas at time ``now``.

    Per learner only the newest delta counts (older ones are superseded). Learners whose newest
    delta has ``c_steps == 0`` or ``c_tokens == 0`` do not count toward the quorum (the fold drops
    them). The quorum is met when the K-th distinct learner had a pending delta (its first pending arrival); the round started at the
    earliest pending arrival among counting learners. If ``live_learners`` is known and every live
    learner has reported, the round closes at once - but only once the quorum is met: with fewer
    live learners than K nothing closes (K is a minimum, issue 25).

    ``round_id`` (syncer-driven rounds, SPEC §4): only answers to this round (or a later one) count
    toward its quorum; late answers to earlier rounds are merged with it but never close it.
    ``merge`` then lists every pending delta: the fold decides which supersede which.
    """
    _finite("now", now, minimum=-math.inf)
    if live_learners is not None and (not isinstance(live_learners, int) or live_learners < 0):
        raise ValueError(f"live_learners must be None or an int >= 0, got {live_learners!r}")
    newest: dict[str, Pending] = {}
    first_arrival: dict[str, float] = {}
    for p in pending:
        _finite(f"arrival time of {p.delta_id}", p.arrived_at, minimum=-math.inf)
        cur = newest.get(p.learner)
        if cur is None or p.order > cur.order:
            newest[p.learner] = p
        first_arrival[p.learner] = min(first_arrival.get(p.learner, p.arrived_at), p.arrived_at)
    superseded = tuple(p.delta_id for p in sorted(pending, key=lambda p: (p.learner, p.order, p.delta_id))
                       if newest[p.learner].delta_id != p.delta_id)   # a second copy of the newest is not older
    merge_set = tuple(newest[learner].delta_id for learner in sorted(newest))
    if not newest:
        return Decision((), (), None, None, None, Verdict.EMPTY)
    if round_id is not None:
        merge_set = tuple(p.delta_id for p in sorted(pending, key=lambda p: (p.learner, p.order, p.delta_id)))
        superseded = ()
        answers = [p for p in pending if p.round >= round_id and p.c_steps > 0 and p.c_tokens > 0]
        first_arrival = {}
        for p in answers:
            first_arrival[p.learner] = min(first_arrival.get(p.learner, p.arrived_at), p.arrived_at)
        counting = sorted((t, m) for m, t in first_arrival.items())
    else:
        counting = sorted((first_arrival[m], m) for m, p in newest.items() if p.c_steps > 0 and p.c_tokens > 0)
    if len(counting) < cfg.quorum:
        return Decision((), superseded, None, None, None, Verdict.QUORUM_NOT_MET)
    round_start = counting[0][0]
    quorum_met_at = counting[cfg.quorum - 1][0]
    grace = grace_window(cfg, timing, quorum_met_at - round_start)
    if live_learners is not None and len(counting) >= live_learners:
        return Decision(merge_set, superseded, 0.0, quorum_met_at, grace, Verdict.ALL_REPORTED)
    close_at = quorum_met_at + grace
    if now >= close_at:
        return Decision(merge_set, superseded, 0.0, quorum_met_at, grace, Verdict.GRACE_EXPIRED)
    return Decision((), superseded, close_at - now, quorum_met_at, grace, Verdict.GRACE)


def late_deadline(oldest_arrival: float, step_time_s: float, sync_every: int) -> float:
    """When late answers that no round took stop waiting for one (SPEC §4, syncer-driven rounds).

    A late answer (``late_answers``) joins its fragment's next round; if no round can take it (no
    learner left to answer: the run is ending, everyone stalled, or fewer than K learners run)
    ``expire_late`` decides its fate once two full round periods (2·H steps) have passed since it
    arrived, so no delta waits forever.
    """
    _finite("oldest_arrival", oldest_arrival, minimum=-math.inf)
    _finite("step_time_s", step_time_s)
    if not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"sync_every must be an int >= 1, got {sync_every!r}")
    return oldest_arrival + 2 * sync_every * step_time_s


def late_answers(pending: Sequence[Pending], round_id: int | None) -> list[Pending]:
    """The answers to a round that was closed or replaced: every pending delta when the
    fragment has no open round (``round_id`` None), else those to an earlier round. An answer to
    the open round is merely below its quorum: it is never late, and never expires on its own -
    it becomes late when its round is replaced (workers/syncer/rounds.py), so it waits at most
    H + 2·H steps."""
    return [p for p in pending if round_id is None or p.round < round_id]


def expire_late(pending: Sequence[Pending], cfg: PolicyConfig, round_id: int | None) -> Decision:
    """What becomes of a fragment's pending deltas once its oldest late answer is past its
    ``late_deadline`` (SPEC §4, issue 25: K is a minimum). ``round_id``: the open round (None).

    * at least K distinct learners with work (steps and tokens) among ``pending``: merge every
      pending delta (``late-expired``; the fold sorts out which supersede which);
    * none with work: hand them all to the fold too, which records each one's own reason
      (``zero-steps``, ``zero-tokens``) - a drop commit, nothing of value is lost;
    * otherwise (1..K-1 learners): record the late answers as dropped (``below-quorum``,
      ``Decision.dropped``; never-merged work, counted lost); answers to the open round stay
      pending, they may still make its quorum.
    """
    working = {p.learner for p in pending if p.c_steps > 0 and p.c_tokens > 0}
    ordered = sorted(pending, key=lambda p: (p.learner, p.order, p.delta_id))
    if len(working) >= cfg.quorum or not working:
        return Decision(tuple(p.delta_id for p in ordered), (), 0.0, None, None, Verdict.LATE_EXPIRED)
    late = {p.delta_id for p in late_answers(pending, round_id)}
    return Decision((), (), 0.0, None, None, Verdict.BELOW_QUORUM,
                    dropped=tuple(dict.fromkeys(p.delta_id for p in ordered if p.delta_id in late)))
