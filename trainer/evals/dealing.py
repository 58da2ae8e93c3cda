"""Batches of evaluation work dealt to the workers of `dtrain eval ... world=N`, results gathered.

Every rank builds the same list of batches (the one a single process would run) and scores batch
j when j % dp_world is its data-parallel rank (a tensor-parallel group scores its batches together);
the results come back to every rank in batch order. A batch is
computed whole on one rank, with the same shapes as in one process, so the numbers do not depend
on the world size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from trainer.process.runtime import Runtime

Batch = TypeVar("Batch")
Item = TypeVar("Item")


class Dealer:
    def __init__(self, rt: Runtime | None = None):
        self.rt = rt
        self.rank = rt.dp_rank if rt else 0
        self.world = rt.dp_world if rt else 1

    def map(self, batches: Sequence[Batch], score: Callable[[Batch], list[Item]]) -> list[Item]:
        """score(batch) for every batch, this rank's share computed here; every rank gets all items
        (each batch's, in batch order)."""
        mine = [score(batch) for j, batch in enumerate(batches) if j % self.world == self.rank]
        if self.world == 1:
            return [item for items in mine for item in items]
        parts = self.rt.all_gather_object(mine)  # by global rank; a group's ranks hold the same
        first = self.rt.shape.first_rank
        out: list[Item] = []
        for j in range(len(batches)):
            out += parts[first(j % self.world)][j // self.world]
        return out
