"""Stragglers from each rank's share of time waiting in collectives (pure)."""

from orchestrator.diagnosis import stragglers


def test_the_rank_seldom_waiting_while_the_others_wait_is_the_straggler():
    assert stragglers({0: (300, 260), 1: (300, 250), 2: (300, 5), 3: (300, 270)}) == [2]


def test_two_ranks_the_waiting_one_is_not_named():
    assert stragglers({0: (150, 140), 1: (150, 3)}) == [1]


def test_balanced_jobs_name_nobody_even_when_communication_dominates():
    assert stragglers({0: (300, 20), 1: (300, 35), 2: (300, 2), 3: (300, 28)}) == []  # < 30%
    assert stragglers({0: (300, 200), 1: (300, 180), 2: (300, 150), 3: (300, 210)}) == []


def test_too_few_samples_say_nothing():
    assert stragglers({0: (99, 90), 1: (99, 0)}) == []
    assert stragglers({0: (300, 280)}) == []
    assert stragglers({}) == []


def test_several_slow_ranks_are_all_named():
    waits = {r: (300, 270) for r in range(8)} | {3: (300, 4), 6: (300, 9)}
    assert stragglers(waits) == [3, 6]
