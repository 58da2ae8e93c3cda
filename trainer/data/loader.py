"""Rank-sliced, resumable micro batches from memory-mapped token shards.

The token stream of a split is cut into chunks of micro_batch_size x seq_len tokens (plus one for
the shifted targets). One optimizer step consumes `world x accum` consecutive chunks and rank r
reads chunk `m * world + r` at micro-step m (rank offsets, stride world). Any world size with the
same global batch therefore reads exactly the same tokens per optimizer step, and the position
(epoch, shard, chunk) is the same on every rank: it can be saved once and restored at another
world size.
"""

from __future__ import annotations

import numpy as np
import torch

from trainer.data.shard_reader import out_of_vocabulary
from trainer.errors import DataError
from trainer.tokenizers.gpt2 import VOCAB_SIZE


class ShardLoader:
    def __init__(
        self,
        shards: list[np.ndarray],
        micro_batch_size: int,
        seq_len: int,
        rank: int,
        world: int,
        accum_steps: int,
        seed: int,
        device: torch.device,
        shuffle_shards: bool = True,
        what: str = "train split",
        redo: str = "prepare the dataset again (`dtrain prepare ... --force`)",
        vocab_size: int = VOCAB_SIZE,
    ):
        self.shards = shards
        self.B, self.T = micro_batch_size, seq_len
        self.rank, self.world, self.accum = rank, world, accum_steps
        self.seed, self.shuffle = seed, shuffle_shards
        self.device = device
        self.vocab_size, self.what, self.redo = vocab_size, what, redo  # the tokenizer's ids
        self.chunk_tokens = micro_batch_size * seq_len
        self.chunks_per_step = world * accum_steps
        # Whole optimizer steps only, so a step never straddles two shards.
        per_shard = [(len(s) - 1) // self.chunk_tokens for s in shards]
        self.steps_in_shard = [n // self.chunks_per_step for n in per_shard]
        if sum(self.steps_in_shard) == 0:
            need = self.chunks_per_step * self.chunk_tokens + 1
            have = max((len(s) for s in shards), default=0)
            raise DataError(
                f"the {what} holds at most {have:,} tokens per shard but one step needs {need:,} "
                f"(micro_batch_size {micro_batch_size} x seq_len {seq_len} x world {world} x "
                f"accumulation {accum_steps}, +1); lower train.micro_batch_size or train.seq_len, "
                "use fewer workers, or use a larger dataset"
            )
        self._pin = device.type == "cuda"
        self.epoch, self.shard_pos, self.step_chunk, self.micro = 0, 0, 0, 0
        self._order = self._shard_order(0)

    def _shard_order(self, epoch: int) -> list[int]:
        order = [i for i, n in enumerate(self.steps_in_shard) if n > 0]
        if self.shuffle and len(order) > 1:
            rng = np.random.default_rng([self.seed, epoch])
            order = [order[i] for i in rng.permutation(len(order))]
        return order

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next micro batch: inputs and targets of shape (micro_batch_size, seq_len)."""
        index = self._order[self.shard_pos]
        shard = self.shards[index]
        start = (self.step_chunk + self.micro * self.world + self.rank) * self.chunk_tokens
        ids = shard[start : start + self.chunk_tokens + 1]
        if self.micro == 0:
            # A shard not read up front (data.verify=size) may hold ids the embedding does not have:
            # a max over the whole step's tokens, every rank's (microseconds), turns that into one
            # line instead of an index error, on every rank at the same step (a rank that failed
            # alone would leave its peers waiting in a collective until the group's timeout).
            step = shard[self.step_chunk * self.chunk_tokens : (self.step_chunk + self.chunks_per_step)
                         * self.chunk_tokens + 1]
            largest = int(step.max())
            if largest >= self.vocab_size:
                raise DataError(self._out_of_vocabulary(index, largest))
        tokens = torch.from_numpy(ids.astype(np.int64))
        if self._pin:
            tokens = tokens.pin_memory()
        tokens = tokens.to(self.device, non_blocking=True)
        self.micro += 1
        if self.micro == self.accum:
            self._advance_step()
        return tokens[:-1].view(self.B, self.T), tokens[1:].view(self.B, self.T)

    def _out_of_vocabulary(self, index: int, token_id: int) -> str:
        name = getattr(self.shards[index], "filename", None) or f"#{index} of the {self.what}"
        redo = f"{self.redo} (data.verify=sha256 checks every id before training)"
        return out_of_vocabulary(name, token_id, self.vocab_size, redo)

    def _advance_step(self) -> None:
        self.micro = 0
        self.step_chunk += self.chunks_per_step
        shard_index = self._order[self.shard_pos]
        if self.step_chunk // self.chunks_per_step >= self.steps_in_shard[shard_index]:
            self.step_chunk = 0
            self.shard_pos += 1
            if self.shard_pos == len(self._order):
                self.epoch += 1
                self.shard_pos = 0
                self._order = self._shard_order(self.epoch)

    def reset(self) -> None:
        self.epoch, self.shard_pos, self.step_chunk, self.micro = 0, 0, 0, 0
        self._order = self._shard_order(0)

    # Position in tokens, so a run may resume with another world size or accumulation split.
    def state_dict(self) -> dict[str, int]:
        if self.micro:
            raise RuntimeError("loader state is only defined between optimizer steps")
        return {
            "epoch": self.epoch,
            "shard_pos": self.shard_pos,
            "token_offset": self.step_chunk * self.chunk_tokens,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        if "mixture" in state:
            raise DataError("the checkpoint read a mixture (data.mix, trainer/data/mix_loader.py), this run one "
                            "dataset; continue it with its data.mix, or start afresh (another hydra.run.dir=)")
        self.epoch = int(state["epoch"])
        self._order = self._shard_order(self.epoch)
        self.shard_pos = int(state["shard_pos"])
        self.step_chunk = int(state["token_offset"]) // self.chunk_tokens
        self.micro = 0
        if self.shard_pos >= len(self._order) or int(state["token_offset"]) % (
            self.chunk_tokens * self.chunks_per_step
        ):
            raise DataError(
                "the saved data position does not fit this run's batch layout; resume with the "
                "same micro_batch_size x seq_len x world x accumulation tokens per step"
            )
        if self.step_chunk // self.chunks_per_step >= self.steps_in_shard[self._order[self.shard_pos]]:
            self._advance_step()
