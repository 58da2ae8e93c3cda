"""Rank 0's reading of the straggler watch's samples (trainer/observe/stragglers.py): which rank, if
any, has been slower than train.straggler_ratio times the other ranks' median for PATIENCE samples
in a row. No torch here: `dtrain report` draws the same ratio (ranks.png)."""

from __future__ import annotations

import math
import statistics

PATIENCE = 3  # samples in a row over the ratio before a notice


def slowest_and_median(times: list[float]) -> tuple[int, float]:
    """The slowest rank and the other ranks' median time."""
    slowest = max(range(len(times)), key=times.__getitem__)
    return slowest, statistics.median(times[:slowest] + times[slowest + 1:])


def slowest_over_median(times: list[float]) -> float:
    """The slowest rank's time over the other ranks' median (1.0: balanced)."""
    slowest, median = slowest_and_median(times)
    return times[slowest] / median if median > 0 else math.inf


class StragglerVerdict:
    """Rank 0's reading of the samples: `add(times)` takes one sample's seconds by rank and returns
    the notice to print, if this sample makes one (else None). A rank is named once per streak of
    PATIENCE or more samples in a row with the slowest time over `ratio` x the other ranks' median."""

    def __init__(self, ratio: float, hosts: list[str]):
        self.ratio, self.hosts = ratio, hosts
        self.streak_rank: int | None = None
        self.streak = 0

    def add(self, times: list[float]) -> str | None:
        slowest, median = slowest_and_median(times)
        if median <= 0 or times[slowest] <= self.ratio * median:  # no figure to compare with, or balanced
            self.streak_rank, self.streak = None, 0
            return None
        if slowest != self.streak_rank:
            self.streak_rank, self.streak = slowest, 0
        self.streak += 1
        if self.streak != PATIENCE:
            return None
        return (f"rank {slowest} on {self.hosts[slowest]} is a straggler: its own time in a step is "
                f"{times[slowest] * 1e3:.1f} ms against the other ranks' median {median * 1e3:.1f} ms "
                f"({times[slowest] / median:.2f}x, over train.straggler_ratio={self.ratio:g} for {PATIENCE} "
                f"samples in a row; each rank's times: rank_step_s in metrics.jsonl)")
