"""The batch arithmetic: how one optimizer step is split over micro batches, workers and accumulation
steps, and how many workers a run asks for. Kept apart from the schema (trainer/config/schema.py)
because it is what changes when the workers are not all data-parallel.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from trainer.errors import ConfigError
from trainer.process.env import launched_world


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step is split: micro batch x seq len x world x accumulation steps."""

    micro_batch_size: int
    seq_len: int
    world: int
    grad_accum_steps: int

    @property
    def tokens_per_micro_step(self) -> int:
        return self.micro_batch_size * self.seq_len * self.world

    @property
    def total_batch_size(self) -> int:
        return self.tokens_per_micro_step * self.grad_accum_steps

    @property
    def chunks_per_step(self) -> int:
        """Micro batches (of micro_batch_size x seq_len) read per optimizer step, all ranks."""
        return self.world * self.grad_accum_steps


def batch_plan(cfg: DictConfig, world: int) -> BatchPlan:
    """Derive accumulation steps from the total batch, or check the pair when both are given."""
    t = cfg.train
    per_micro = t.micro_batch_size * t.seq_len * world
    if t.total_batch_size is None:
        accum = t.grad_accum_steps or 1
    else:
        if t.total_batch_size % per_micro:
            raise ConfigError(
                f"train.total_batch_size={t.total_batch_size} is not divisible by micro_batch_size x "
                f"seq_len x world = {t.micro_batch_size}x{t.seq_len}x{world} = {per_micro}; "
                f"set train.total_batch_size to a multiple of {per_micro}"
            )
        accum = t.total_batch_size // per_micro
        if t.grad_accum_steps is not None and t.grad_accum_steps != accum:
            raise ConfigError(
                f"train.grad_accum_steps={t.grad_accum_steps} contradicts train.total_batch_size="
                f"{t.total_batch_size} ({t.total_batch_size} / {per_micro} = {accum} steps); "
                "give only one of them"
            )
    return BatchPlan(t.micro_batch_size, t.seq_len, world, accum)


def requested_world(cfg: DictConfig) -> int:
    """World size for this run: cfg.world, checked against torchrun's WORLD_SIZE when under it."""
    env_world = launched_world()
    if env_world is not None:
        if cfg.world is not None and cfg.world != env_world:
            raise ConfigError(
                f"world={cfg.world} but torchrun started {env_world} workers; "
                f"drop world= or set it to {env_world}"
            )
        return env_world
    return 1 if cfg.world is None else cfg.world
