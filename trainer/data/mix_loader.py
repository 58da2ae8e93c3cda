"""Rank-sliced, resumable micro batches of a weighted mixture of datasets (trainer/data/mixture.py).

An optimizer step holds micro_batch_size x world x accumulation sequences (rows of seq_len tokens and
the next one). At the step's first micro batch every rank plans the whole step the same way: the
Schedule picks each sequence's source, and each source hands out its next seq_len + 1 tokens (one
after another, seq_len apart, as one dataset's chunk holds its rows). Rank r then reads the rows of
chunk `m * world + r` at micro-step m, as ShardLoader does, so every world size, accumulation and
mode reads the same sequences per step, and the position (each source's epoch, shard, offset and
count, and the Schedule's credits) is the same on every rank: saved once, restored at any world size.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

from trainer.data.mixture import Schedule
from trainer.data.shard_reader import out_of_vocabulary
from trainer.errors import DataError
from trainer.process.joblog import say


class SourceStream:
    """One source's train split read sequence after sequence, through its shards in an order shuffled
    per epoch (by the seed and the source's name); a shard shorter than one sequence is never read."""

    def __init__(self, name: str, shards: list[np.ndarray], seq_len: int, seed: int, redo: str):
        self.name, self.shards, self.T, self.redo = name, shards, seq_len, redo
        self.seed = [seed, zlib.crc32(name.encode())]
        self.usable = [i for i, s in enumerate(shards) if len(s) >= seq_len + 1]
        if not self.usable:  # preflight refuses it first (mixture.check_mixture_data)
            raise DataError(f"data.mix's source {name!r} has no shard of one sequence ({seq_len + 1} tokens)")
        self.tokens = sum(len(shards[i]) for i in self.usable)
        self.reset()

    def reset(self) -> None:
        self.epoch, self.shard_pos, self.offset, self.sequences = 0, 0, 0, 0
        self._order = self._shard_order(0)

    def _shard_order(self, epoch: int) -> list[int]:
        order = list(self.usable)
        if len(order) > 1:
            rng = np.random.default_rng([*self.seed, epoch])
            order = [order[i] for i in rng.permutation(len(order))]
        return order

    def take(self) -> tuple[int, int, bool]:
        """(shard index, token offset) of the next sequence, and whether its source started over for it."""
        started_over = False
        if self.offset + self.T + 1 > len(self.shards[self._order[self.shard_pos]]):
            self.offset, self.shard_pos = 0, self.shard_pos + 1
            if self.shard_pos == len(self._order):
                self.epoch, self.shard_pos, started_over = self.epoch + 1, 0, True
                self._order = self._shard_order(self.epoch)
        at = self.offset
        self.offset += self.T
        self.sequences += 1
        return self._order[self.shard_pos], at, started_over

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "shard_pos": self.shard_pos, "token_offset": self.offset,
                "sequences": self.sequences}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self._order = self._shard_order(self.epoch)
        self.shard_pos, self.offset, self.sequences = (int(state[k]) for k in ("shard_pos", "token_offset",
                                                                               "sequences"))
        if self.shard_pos >= len(self._order):
            raise DataError(f"the saved position of data.mix's source {self.name!r} is past its shards (the "
                            f"dataset changed under the checkpoint); {self.redo}")


class MixtureLoader:
    """The ShardLoader interface (next_batch, state_dict, load_state_dict, reset) over a mixture."""

    def __init__(self, sources: dict[str, list[np.ndarray]], weights: dict[str, float], micro_batch_size: int,
                 seq_len: int, rank: int, world: int, accum_steps: int, seed: int, device: torch.device,
                 vocab_size: int, redo: dict[str, str]):
        self.streams = [SourceStream(name, sources[name], seq_len, seed, redo[name]) for name in weights]
        self.schedule = Schedule(weights)
        self.B, self.T = micro_batch_size, seq_len
        self.rank, self.world, self.accum = rank, world, accum_steps
        self.device, self.vocab_size = device, vocab_size
        self.sequences_per_step = micro_batch_size * world * accum_steps
        self._pin = device.type == "cuda"
        self.micro = 0
        self._plan: list[tuple[int, int, int]] = []  # the step's (source, shard, offset) per sequence

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next micro batch: inputs and targets of shape (micro_batch_size, seq_len)."""
        if self.micro == 0:
            self._plan = self._plan_step()
        first = (self.micro * self.world + self.rank) * self.B
        rows = np.stack([self.streams[s].shards[i][at : at + self.T + 1]
                         for s, i, at in self._plan[first : first + self.B]]).astype(np.int64)
        x, y = (torch.from_numpy(np.ascontiguousarray(part)) for part in (rows[:, :-1], rows[:, 1:]))
        if self._pin:
            x, y = x.pin_memory(), y.pin_memory()
        self.micro += 1
        if self.micro == self.accum:
            self.micro = 0
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def _plan_step(self) -> list[tuple[int, int, int]]:
        """Every rank's sequences of the next step, the sources advanced past them; the largest id
        among all of them checked against the vocabulary (on every rank alike, as ShardLoader does)."""
        step = sum(s.sequences for s in self.streams) // self.sequences_per_step + 1
        plan, spans = [], {}
        for _ in range(self.sequences_per_step):
            source = self.schedule.next()
            stream = self.streams[source]
            index, at, started_over = stream.take()
            if started_over and self.rank == 0:
                say(f"data.mix's source {stream.name!r} was read whole ({stream.tokens:,} tokens of its train "
                    f"split): it starts over at step {step} (epoch {stream.epoch + 1} of it)")
            plan.append((source, index, at))
            low, high = spans.get((source, index), (at, at))
            spans[(source, index)] = (min(low, at), max(high, at + self.T + 1))
        for (source, index), (low, high) in spans.items():
            stream = self.streams[source]
            largest = int(stream.shards[index][low:high].max())
            if largest >= self.vocab_size:
                name = getattr(stream.shards[index], "filename", None) or f"#{index} of source {stream.name!r}"
                redo = f"{stream.redo} (data.verify=sha256 checks every id before training)"
                raise DataError(out_of_vocabulary(name, largest, self.vocab_size, redo))
        return plan

    def tokens_by_source(self) -> dict[str, int]:
        """Training tokens read from each source so far (seq_len per sequence, as the run counts them)."""
        return {s.name: s.sequences * self.T for s in self.streams}

    def reset(self) -> None:
        for stream in self.streams:
            stream.reset()
        self.schedule.load_state_dict({})
        self.micro = 0

    def state_dict(self) -> dict:
        if self.micro:
            raise RuntimeError("loader state is only defined between optimizer steps")
        return {"mixture": {s.name: s.state_dict() for s in self.streams}, "credit": self.schedule.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """A source the saved position lacks (a checkpoint of other data, continued on purpose with
        resume=) starts at its beginning."""
        saved = state.get("mixture") or {}
        self.reset()
        for stream in self.streams:
            if stream.name in saved:
                stream.load_state_dict(saved[stream.name])
        self.schedule.load_state_dict(state.get("credit") or {})
