"""Rank 0's verdict on the straggler samples (trainer/observe/straggler_verdict.py) and the sampled
steps' period (trainer/observe/stragglers.py): a rank is named once, after PATIENCE samples in a row
over train.straggler_ratio times the other ranks' median; a balanced run, a streak that breaks or a
slowest rank that changes names nobody."""

from __future__ import annotations

import pytest

from trainer.observe.straggler_verdict import PATIENCE, StragglerVerdict, slowest_over_median
from trainer.observe.stragglers import sample_period

HOSTS = ["node-a", "node-a", "node-b", "node-b"]


def test_the_ratio_is_the_slowest_over_the_other_ranks_median():
    assert slowest_over_median([0.1, 0.1, 0.1, 0.1]) == 1.0
    assert slowest_over_median([0.1, 0.3]) == pytest.approx(3.0)  # world 2: the other rank
    assert slowest_over_median([0.10, 0.12, 0.14, 0.28]) == pytest.approx(0.28 / 0.12)


def test_a_slow_rank_is_named_once_after_patience_samples_in_a_row():
    verdict = StragglerVerdict(1.2, HOSTS)
    slow = [0.10, 0.10, 0.25, 0.11]
    notices = [verdict.add(slow) for _ in range(PATIENCE + 3)]
    assert notices[:PATIENCE - 1] == [None] * (PATIENCE - 1)
    line = notices[PATIENCE - 1]
    assert line.startswith("rank 2 on node-b is a straggler")
    assert "250.0 ms" in line and "median 100.0 ms" in line and "2.50x" in line
    assert "train.straggler_ratio=1.2" in line
    assert notices[PATIENCE:] == [None] * 3  # once per streak


def test_a_balanced_run_a_broken_streak_and_a_changing_rank_name_nobody():
    verdict = StragglerVerdict(1.2, HOSTS)
    assert all(verdict.add([0.10, 0.11, 0.105, 0.118]) is None for _ in range(10))  # within 1.2x
    for _ in range(3):  # over the ratio, but never PATIENCE in a row
        for times in ([0.1, 0.3, 0.1, 0.1],) * (PATIENCE - 1) + ([0.1, 0.1, 0.1, 0.1],):
            assert verdict.add(times) is None
    for rank in range(2 * PATIENCE):  # a different rank slow each time
        times = [0.1] * 4
        times[rank % 4] = 0.3
        assert verdict.add(times) is None
    # a new streak after a broken one is named again
    assert [verdict.add([0.1, 0.1, 0.1, 0.3]) for _ in range(PATIENCE)][-1].startswith("rank 3 on node-b")


@pytest.mark.parametrize("log_interval, every, period", [(1, 10, 10), (5, 10, 10), (3, 10, 12), (10, 50, 50),
                                                         (25, 10, 25), (10, 1, 10)])
def test_a_sample_every_straggler_every_steps_in_whole_log_intervals(log_interval, every, period):
    assert sample_period(log_interval, every) == period
