"""A learner's figures: its step times, the pace it reports to the syncer, its traffic and the
totals ``Learner.stats`` returns (learner.py stays the training loop; this is what it reports)."""
from __future__ import annotations

import statistics

import numpy as np

from workers.learner.sender import SenderStats

# A learner that has not begun a step for this many of its periods (and at least STILL_MIN_S) says
# so in its heartbeats (step_time_s 0): it is not stepping, so its old period must not pace the
# global clock. Issue 29's SLURM test: two learners held at a gate kept reporting their 1 ms
# period, the syncer's median followed them, and it opened ~9,700 rounds while the one learner
# still training (0.1 s steps) took 235, so it sent 417-455 deltas instead of ~60.
STILL_FACTOR = 4.0
STILL_MIN_S = 1.0


class LearnerFigures:
    """Mixed into ``Learner`` (workers/learner/learner.py): reads its counters, never changes them."""

    def _report_traffic(self, final: bool = False) -> None:
        if self.traffic is not None:
            self.traffic.report(self.incarnation, final, step=self.step_count,
                                outer_step=self.step_count // self.descriptor.schedule.sync_every)

    def _step_time(self) -> float:
        recent = list(self.step_times)[-20:]
        return statistics.median(recent) if recent else 0.0

    def _period(self) -> float:
        """Step-to-step time (training, data and any pause between steps): the pace the syncer's
        global clock follows (SPEC §2)."""
        recent = list(self.gaps)[-20:]
        return statistics.median(recent) if recent else self._step_time()

    def _pace(self) -> float:
        """The period its heartbeats report: ``_period``, or 0 while it is not stepping (no step
        begun for STILL_FACTOR periods and STILL_MIN_S), which tells the syncer not to follow it."""
        period = self._period()
        since = None if self._last_start is None else self.clock() - self._last_start
        if period > 0 and since is not None and since > max(STILL_FACTOR * period, STILL_MIN_S):
            return 0.0
        return period

    def _heartbeat(self) -> dict:
        st = self._step_time()
        return {"learner": self.id, "incarnation": self.incarnation, "step": self.step_count,
                "step_time_s": self._pace(), "tokens_per_s": (self.tokens / max(self.step_count, 1)) / st if st else 0.0,
                "loss": self.loss_ewma if self.loss_ewma is not None else -1.0}

    def stats(self) -> dict:
        """Totals, and recent figures over bounded windows. ``evicted``,
        ``undelivered``, ``spill_errors``/``last_error`` say whether work was lost and why
        (item 11); ``receiver_failed`` whether versions stopped arriving (item 12)."""
        s = self.sender.stats if self.sender else SenderStats()
        r = self.receiver
        timed, seconds = self._step_total
        return {
            "deltas": self.seq, "acked": s.acked, "spilled": s.spilled,
            "superseded": s.superseded, "superseded_tokens": s.superseded_tokens,
            "evicted": s.evicted, "evicted_tokens": s.evicted_tokens, "nonfinite_deltas": s.nonfinite,
            "undelivered": self.sender.undelivered() if self.sender else 0,
            "spill_errors": s.spill_errors, "last_error": s.last_error,
            "bytes_sent": s.bytes_sent, "bytes_spilled": s.bytes_spilled, "spill_found": s.spill_found,
            "ack_wait_s": round(s.ack_wait_s, 4), "longest_ack_s": round(s.longest_ack_s, 4),
            "bytes_received": r.bytes_received if r else 0,
            "versions_applied": self.applied, "receiver_errors": r.errors if r else 0,
            "versions_refused": r.refused if r else 0, "receiver_failed": r.failed if r else None,
            # announced commits not in this learner's store yet (its region's copy), reads that missed them
            "versions_awaited": r.awaited if r else 0, "copy_misses": r.copy_misses if r else 0,
            "copy_wait_s": round(r.copy_wait_s, 4) if r else 0.0,
            "nonfinite_steps": self.health.skipped, "fragments_reloaded": self.health.reloads,
            "median_step_s": statistics.median(self.step_times) if self.step_times else 0.0,
            # tails over the same window (issue 15: p99 <= 1.1x the median with sync on)
            "p95_step_s": float(np.percentile(self.step_times, 95)) if self.step_times else 0.0,
            "p99_step_s": float(np.percentile(self.step_times, 99)) if self.step_times else 0.0,
            "mean_step_s": seconds / timed if timed else 0.0,
            "max_gap_s": self._max_gap, "median_gap_s": statistics.median(self.gaps) if self.gaps else 0.0,
        }
