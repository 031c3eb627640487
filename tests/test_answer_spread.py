"""Rounds over a link (issue 14, docs/regions.md "Rounds over a link"): the syncer measures how long
each learner's answers take after a round opens, and the grace window waits for the slowest live
learner by how much later it answers (at most a quarter of a round period), so an answer one round
trip late no longer misses its round by construction."""
from __future__ import annotations

import numpy as np

from pipeline.policy import Pending, PolicyConfig, Timing, Verdict, decide, grace_window
from workers.launch import RunSettings, Schedule, create_run
from workers.syncer.rounds import RoundBook
from storage.store import open_store

STEP = 0.1


def test_the_grace_window_widens_by_the_answer_spread():
    cfg = PolicyConfig(quorum=1, overlap=1)
    base = grace_window(cfg, Timing(STEP, 0.02), 0.0)
    assert abs(base - 0.08) < 1e-9
    assert abs(grace_window(cfg, Timing(STEP, 0.02, answer_spread_s=0.1), 0.0) - 0.18) < 1e-9
    assert abs(grace_window(cfg, Timing(STEP, 0.02, answer_spread_s=0.4), 0.0) - 0.48) < 1e-9
    # the quorum's own wait still counts against the window (it spends the same slack)
    assert abs(grace_window(cfg, Timing(STEP, 0.02, answer_spread_s=0.4), 0.3) - 0.18) < 1e-9
    # before a step time is measured the spread changes nothing
    assert grace_window(cfg, Timing(None, 0.0, answer_spread_s=1.0), 0.0) == 0.0


def test_an_answer_one_round_trip_late_joins_its_round_once_the_spread_is_known():
    """A home answer meets the quorum at t=0; the remote one arrives a round trip (0.1 s) later.
    Without the spread the round closes before it (the answer is late: H steps for the next
    round); with it the window still holds the round open."""
    home = Pending("l0/1/0", "l0", (1, 0), 0.0, 4, 400, round=7)
    remote = Pending("l1/1/0", "l1", (1, 0), 0.1, 4, 400, round=7)
    cfg = PolicyConfig(quorum=1, overlap=1)
    without = decide([home], 0.1, cfg, Timing(STEP, 0.02), live_learners=2, round_id=7)
    assert without.reason is Verdict.GRACE_EXPIRED            # closed at 0.08 s: l1's answer misses it
    with_spread = decide([home], 0.1, cfg, Timing(STEP, 0.02, 0.1), live_learners=2, round_id=7)
    assert with_spread.reason is Verdict.GRACE and with_spread.wait_s > 0
    both = decide([home, remote], 0.1, cfg, Timing(STEP, 0.02, 0.1), live_learners=2, round_id=7)
    assert both.reason is Verdict.ALL_REPORTED and set(both.merge) == {"l0/1/0", "l1/1/0"}


def test_the_round_book_measures_each_learners_answer_lag_and_the_spread(tmp_path):
    store = open_store(str(tmp_path / "s"))
    init = {"a": np.zeros((4, 4), np.float32), "b": np.zeros((8,), np.float32)}
    desc = create_run(store, init, RunSettings(schedule=Schedule(fragments=2, sync_every=4)), embedding_tensors=())
    book = RoundBook(desc, live_timeout_s=5.0, initial_step_s=STEP)
    now = 0.0
    opened = []
    while len(opened) < 12:
        now += STEP
        opened += [(r, p, now) for r, p in book.tick(now)]
    for r, p, t in opened:
        book.answered("home", p, r, t + 0.03)
        book.answered("far", p, r, t + 0.13)          # a round trip later
        book.heartbeat("home", STEP, t + 0.03)
        book.heartbeat("far", STEP, t + 0.13)
    assert abs(book.answer_spread(now) - 0.1) < 1e-6
    book.answered("far", 0, 10_000, now)               # an unknown round: no sample
    assert abs(book.answer_spread(now) - 0.1) < 1e-6
    # bounded by a quarter of a round period (H = 4 steps of 0.1 s here: 0.1 s)
    for r, p, t in opened:
        book.answered("far", p, r, t + 2.0)
    assert abs(book.answer_spread(now) - 4 * STEP / 4) < 1e-6
    # a learner not heard for live_timeout_s no longer counts
    assert book.answer_spread(now + 10.0) == 0.0
    # only the last few openings per fragment are kept
    assert len(book.opened_at) <= 4 * desc.num_fragments


def test_a_backlog_of_held_answers_does_not_widen_the_spread_but_a_lasting_lag_does(tmp_path):
    """After a store outage the answers held meanwhile arrive seconds after their rounds opened: a
    few samples that say nothing about how fast a learner answers. With an average of the lags they
    held every grace window at its cap for about a second and a half; the median of the last
    LAG_SAMPLES ignores them, and still follows a learner whose answers all come later from now on."""
    from workers.syncer.rounds import LAG_SAMPLES
    store = open_store(str(tmp_path / "s"))
    init = {"a": np.zeros((4, 4), np.float32), "b": np.zeros((8,), np.float32)}
    desc = create_run(store, init, RunSettings(schedule=Schedule(fragments=2, sync_every=4)), embedding_tensors=())
    book = RoundBook(desc, live_timeout_s=50.0, initial_step_s=STEP)
    now = 0.0

    def rounds(n, home_lag, far_lag):
        nonlocal now
        done = 0
        while done < n:
            now += STEP
            for r, p in book.tick(now):
                book.answered("home", p, r, now + home_lag)
                book.answered("far", p, r, now + far_lag)
                book.heartbeat("home", STEP, now)
                book.heartbeat("far", STEP, now)
                done += 1
    rounds(LAG_SAMPLES, 0.01, 0.03)
    assert abs(book.answer_spread(now) - 0.02) < 1e-6
    held = list(book.opened_at.items())[-3:]          # three rounds whose answers the outage held
    for (p, r), t in held:
        book.answered("far", p, r, t + 5.0)
        book.answered("home", p, r, t + 4.0)
    assert abs(book.answer_spread(now) - 0.02) < 1e-6
    rounds(LAG_SAMPLES // 2 + 1, 0.01, 0.07)           # far's answers now all come 0.06 s after home's
    assert abs(book.answer_spread(now) - 0.06) < 1e-6
