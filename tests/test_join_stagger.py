"""A new life's first answers are spaced like the schedule's rounds (issue 31, pipeline/schedule.py
``JoinStagger``): a learner that comes up to find a round open for every fragment answered them all
at its first step - the whole model at once, then P versions at once (~18 s for its first two steps
at 101M). Fake receiver, no timing."""
from __future__ import annotations

import pytest

from pipeline.schedule import JoinStagger, join_gap
from workers.common.events import read_events

from runhelpers import rounds_learner


def test_the_gap_is_the_schedules_spacing():
    assert join_gap(20, 4) == 5 and join_gap(8, 2) == 4 and join_gap(3, 4) == 1 and join_gap(1, 1) == 1
    with pytest.raises(ValueError, match="num_fragments"):
        join_gap(8, 0)
    with pytest.raises(ValueError, match="H must be"):
        join_gap(0, 2)


def test_first_answers_are_gap_steps_apart():
    s = JoinStagger(4)
    assert s.may_answer_first(0) and s.is_first(0)
    s.answered(1, 2, sent=False)                 # closed by a version before any work: spaces nothing
    assert s.may_answer_first(2) and not s.is_first(1)
    s.answered(0, 3, sent=True)
    assert not s.may_answer_first(6) and s.may_answer_first(7) and not s.is_first(0)
    s.answered(0, 4, sent=True)                  # a later answer of the same fragment moves nothing
    assert s.may_answer_first(7)


def _answers(tmp_path) -> list[tuple[int, int]]:
    return [(e["fragment"], e["round"]) for e in read_events(tmp_path / "l0.jsonl") if e.get("event") == "delta"]


def test_a_learner_finding_every_round_open_answers_them_one_gap_apart_oldest_first(tmp_path):
    learner, _, step, _ = rounds_learner(tmp_path, fragments=2, sync_every=8)      # gap 4
    try:
        learner.receiver.rounds = {0: (1, 41), 1: (1, 40)}      # both open before it came up
        step()                                                 # no work yet: nothing
        step()                                                 # the older round only
        assert _answers(tmp_path) == [(1, 40)]
        learner.receiver.rounds = {0: (1, 41), 1: (1, 44)}      # fragment 1 again: answered at once
        step()
        assert _answers(tmp_path) == [(1, 40), (1, 44)]
        step()
        step()
        assert _answers(tmp_path) == [(1, 40), (1, 44)]         # fragment 0's first answer waits ...
        step()                                                 # ... 4 steps after the first one
        assert _answers(tmp_path) == [(1, 40), (1, 44), (0, 41)]
        step()
        assert len(_answers(tmp_path)) == 3                    # and only once
    finally:
        learner.close(flush=False)


def test_a_version_of_a_held_back_fragment_is_answered_before_it_overwrites(tmp_path):
    """Holding a first answer back never loses its steps: a version of that fragment arriving
    meanwhile is answered first, as any owed round is (workers/learner/learner.py apply_arrivals)."""
    import numpy as np
    from workers.learner.receiver import Arrival
    learner, _, step, _ = rounds_learner(tmp_path, fragments=2, sync_every=8)
    try:
        learner.receiver.rounds = {0: (1, 41), 1: (1, 40)}
        step()
        step()
        assert _answers(tmp_path) == [(1, 40)]
        values = {n: v.astype(np.float32) for n, v in learner.base[0].items()}
        learner.receiver.arrivals = [Arrival(0, 1, 11, values, "announce", 0.0, 1, 41)]
        step()
        assert _answers(tmp_path) == [(1, 40), (0, 41)] and learner.base_version[0] == 1
    finally:
        learner.close(flush=False)
