"""How a learner answers the syncer's rounds (SPEC §3-4): which open round it owes, the delta it
hands to the sender for one, and where the base it is measured against lives.

Mixed into ``Learner`` (workers/learner/learner.py), whose state it reads and updates: ``answered``
and ``_answered_recent`` (never answer a round twice), ``c_steps`` (nothing to answer without
work), ``_stagger`` (a new life's first answers spaced like the schedule's rounds, issue 31:
pipeline/schedule.py ``JoinStagger``).
"""
from __future__ import annotations

from collections import deque

import torch

from pipeline.fragment import extract
from pipeline.types import DeltaHeader
from workers.learner.device_quant import quantise_delta
from workers.learner.host_bases import tensor_of
from workers.learner.sender import delta_made

ANSWERS_KEPT = 8   # rounds of each fragment remembered as answered (never answered twice, issue 25)


class LearnerAnswers:
    """The answering half of a ``Learner``."""

    def answer_rounds(self, rounds: dict | None = None) -> int:
        """Answer every round opened since the last step boundary (the newest one per fragment);
        returns how many deltas were handed to the sender."""
        rounds = self.receiver.opened() if rounds is None else rounds
        if rounds is self._rounds_seen:
            return 0            # the same object as last step (the sync agent's board had no news): all answered
        self._rounds_seen = rounds
        for p, opened in rounds.items():
            self._went_back(p, opened)
        first = self._first_allowed(rounds)
        n = 0
        for p, opened in sorted(rounds.items()):
            if self._owes(p, opened):
                if self.c_steps[p] == 0:
                    # Nothing trained on p yet (a new life, or its version just came): answer at the
                    # first step that has work, not never - a round of a K = 3 run that opened while
                    # a learner restarted waited for it in vain and its fragment froze for 18 steps
                    # (fault simulation, seed 934). Look again next step.
                    self._rounds_seen = None
                    continue
                if self._stagger.is_first(p) and p != first:
                    self._rounds_seen = None      # a first answer, spaced (JoinStagger): a later step
                    continue
                n += self._answer(p, opened)
        return n

    def _first_allowed(self, rounds: dict) -> int | None:
        """The one fragment this boundary may answer for the first time in this life (the oldest
        open round among those), or None: the last first answer was too recent."""
        if not self._stagger.may_answer_first(self.step_count):
            return None
        firsts = [(opened[1], p) for p, opened in rounds.items()
                  if self._stagger.is_first(p) and self.c_steps[p] > 0 and self._owes(p, opened)]
        return min(firsts)[1] if firsts else None

    def fragments_read(self, rounds: dict, arrivals: list) -> set[int]:
        """The fragments whose parameters a boundary with these open rounds and arrivals may read:
        the rounds it owes (an answer's Δ_p) and every arrival's (answered first if owed; mixed)."""
        return {p for p, opened in rounds.items() if self._owes(p, opened)} | {a.fragment for a in arrivals}

    def _owes(self, p: int, opened: tuple[int, int]) -> bool:
        """Whether round ``opened`` = (syncer epoch, round) of fragment ``p`` still wants this
        learner's answer: not when it answered that round (its last ANSWERS_KEPT rounds
        of p are remembered: never twice), nor for an older syncer epoch than its last answer's;
        otherwise yes - also a round below the last one answered in the same epoch, which is the
        syncer's real round replacing one the receiver had extrapolated from the storage clock
        (answering only rounds above the last one stopped the learner for good after a bogus guess).
        (``_went_back`` forgets the answers to guesses above such a replacement.)"""
        last = self.answered.get(p, (-1, -1))
        return opened[0] >= last[0] and opened not in self._answered_recent.get(p, ())

    def _went_back(self, p: int, opened: tuple[int, int]) -> None:
        """The receiver's opening of ``p`` went back within one syncer epoch: it replaced a guess.
        The answers given above it in that epoch answered guesses ahead of the syncer's clock (this
        host's wall clock read ahead of the syncer's, or the clock record was bogus), and those
        rounds are still to open for real: forgotten, each is answered when it does (remembered,
        none was - the fault simulation's clock-skew: a learner 25 s ahead stopped contributing)."""
        before = self._opened_seen.get(p)
        self._opened_seen[p] = opened
        recent = self._answered_recent.get(p)
        if recent and before is not None and before[0] == opened[0] and opened[1] < before[1]:
            self._answered_recent[p] = deque((o for o in recent if o[0] != opened[0] or o[1] <= opened[1]),
                                             maxlen=ANSWERS_KEPT)

    def _unsent(self, p: int) -> bool:
        """Steps on p since the last answer (keep_progress keeps the count since the answer; else the
        last answer holds every step up to it: only steps after it are new)."""
        return self.c_steps[p] > self._answered_steps.get(p, 0)

    def _answer(self, p: int, opened: tuple[int, int]) -> int:
        self.answered[p] = opened
        self._answered_recent.setdefault(p, deque(maxlen=ANSWERS_KEPT)).append(opened)
        self._stagger.answered(p, self.step_count, sent=self.c_steps[p] > 0)
        if self.c_steps[p] == 0:
            # Only from apply_arrivals (answer_rounds waits for work): the arriving version closed
            # this round, so it counts as answered - answering it after the next step would be late.
            return 0
        self._emit_delta(p, opened[1])
        return 1

    def _emit_delta(self, p: int, round_id: int) -> None:
        names = self.descriptor.layout.fragments[p]
        # learner_step = the last step whose work the delta holds (steps are counted after they end).
        header = DeltaHeader(self.id, self.incarnation, self.seq, p, self.base_version[p], self.c_steps[p],
                             self.c_tokens[p], max(self.step_count - 1, 0), round_id)
        self.seq += 1
        self._answered_steps[p] = header.c_steps
        if not self.sender.logs_deltas:   # the sync agent logs it, off this thread
            delta_made(self.events, header)
        if self._device_quantise:   # Δ quantised where θ lives; the sender waits for its bytes
            c = self.descriptor.codec
            self.sender.submit(header, quantise_delta(self._device_base(p, names), self.params, names, c.scheme,
                                                      c.block_size))
            return
        if self.sender.writes_difference and not self.descriptor.learner.keep_progress:
            held = self._fragment_params.get(p)
            if held is None:      # the same dict every answer: the agent keeps its views of it
                held = self._fragment_params[p] = {n: self.params[n] for n in names}
            self.sender.submit_difference(header, self.base[p], held)   # Δ straight into shared memory
            return
        current = extract(self.params, names)
        delta = {n: self.base[p][n] - current[n] for n in names}
        if self.descriptor.learner.keep_progress:
            self._at_answer[p] = (current, header.c_steps, header.c_tokens)
        self.sender.submit(header, delta)

    def _device_base(self, p: int, names: list[str]) -> dict[str, torch.Tensor]:
        """base_p on the parameters' device for one answer (a CPU model: views, no copy). Bases live
        in host memory: by default the upload is dropped after the answer, so the device holds no
        copy of the model beside the parameters (issue 28); ``device_base_cache`` N keeps the uploads
        of the N fragments answered last (each until its base changes) to save the upload."""
        src = self.base[p]
        held = self._base_dev.pop(p, None)
        if held is None or held[0] is not src:
            held = (src, {n: tensor_of(src[n]).to(self.params[n].device) for n in names})
        if self.cfg.device_base_cache:
            self._base_dev[p] = held              # newest last: the dict's order is the LRU order
            while len(self._base_dev) > self.cfg.device_base_cache:
                self._base_dev.pop(next(iter(self._base_dev)))
        return held[1]

    def _device_base_kept(self) -> dict[int, dict[str, torch.Tensor]]:
        """The base uploads kept on the model's device now (``device_base_cache``; tests, memory figures)."""
        return {p: held[1] for p, held in self._base_dev.items()}
