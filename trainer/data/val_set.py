"""The validation set: a fixed number of tokens of a val split (train.val_tokens, as nanochat's
eval_tokens), the same tokens whatever the micro batch, world or accumulation.

The split is read as sequences of seq_len tokens (and the next one, for the targets), seq_len apart
as the train loader's rows are, shard after shard in the manifest's order (a sequence never spans
two shards): the set is the first val_tokens // seq_len of them, or as many as the split holds.
Sequence i goes to rank i % world, which reads its share in micro batches of micro_batch_size rows.
Every rank runs the same number of forward passes (an FSDP forward is a collective): where a rank's
share runs out, the rest of its batch is padding that counts for nothing (`kept` is False there).
The loss is then summed per token and divided by the count of tokens scored (trainer/fit/run.py),
so the figure does not depend on how the set was cut into batches.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch

from trainer.data.shard_reader import out_of_vocabulary
from trainer.errors import DataError


def first_sequences(shard_lengths: list[int], seq_len: int, wanted: int) -> list[tuple[int, int]]:
    """(shard index, token offset) of the split's first `wanted` sequences of seq_len (+1) tokens."""
    starts: list[tuple[int, int]] = []
    for index, length in enumerate(shard_lengths):
        take = min(max(0, (length - 1) // seq_len), wanted - len(starts))
        starts += [(index, k * seq_len) for k in range(take)]
        if len(starts) == wanted:
            break
    return starts


class ValidationSet:
    """One rank's share of a val split's validation set, iterated as micro batches (the module docstring)."""

    def __init__(self, shards: list[np.ndarray], val_tokens: int, micro_batch_size: int, seq_len: int,
                 rank: int, world: int, device: torch.device, vocab_size: int, what: str, redo: str):
        self.B, self.T, self.device = micro_batch_size, seq_len, device
        self.shards = shards
        self.wanted = val_tokens // seq_len
        starts = first_sequences([len(s) for s in shards], seq_len, self.wanted)
        if not starts:  # preflight refuses it first (trainer/preflight/checks.py)
            raise DataError(f"the {what} holds no sequence of seq_len {seq_len} (+1 tokens); {redo}")
        self.sequences = len(starts)  # every rank's, together
        self.tokens = self.sequences * seq_len
        self._check_ids(starts, vocab_size, what, redo)
        self._mine = starts[rank::world]
        # the most any rank holds (rank 0's), in micro batches: every rank runs this many forwards
        self.batches = math.ceil(math.ceil(self.sequences / world) / micro_batch_size)
        self._padding = starts[0]  # any real sequence: its rows are computed and not counted

    def _check_ids(self, starts: list[tuple[int, int]], vocab_size: int, what: str, redo: str) -> None:
        """Every id the set holds within the vocabulary (the same check on every rank: all raise alike)."""
        ends: dict[int, int] = {}
        for index, at in starts:
            ends[index] = at + self.T + 1
        for index, end in ends.items():
            largest = int(self.shards[index][:end].max())
            if largest >= vocab_size:
                name = getattr(self.shards[index], "filename", None) or f"#{index} of the {what}"
                raise DataError(out_of_vocabulary(name, largest, vocab_size,
                                                  f"{redo} (data.verify=sha256 checks every id before training)"))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """This rank's micro batches: inputs and targets (micro_batch_size, seq_len), and `kept`
        (micro_batch_size, seq_len), False on the padding rows."""
        for b in range(self.batches):
            rows = self._mine[b * self.B : (b + 1) * self.B]
            real = len(rows)
            rows = rows + [self._padding] * (self.B - real)
            ids = np.stack([self.shards[index][at : at + self.T + 1] for index, at in rows]).astype(np.int64)
            tokens = torch.from_numpy(ids)
            if self.device.type == "cuda":
                tokens = tokens.pin_memory()
            tokens = tokens.to(self.device, non_blocking=True)
            kept = (torch.arange(self.B, device=self.device) < real).unsqueeze(1).expand(self.B, self.T)
            yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), kept
