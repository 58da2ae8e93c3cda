"""The batch arithmetic: how one optimizer step is split over micro batches, workers and accumulation
steps, and how many workers a run asks for. Kept apart from the schema (trainer/config/schema.py)
because it is what changes when the workers are not all data-parallel.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from trainer.errors import ConfigError
from trainer.process.env import launched_world
from trainer.process.mesh_shape import MeshShape


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step is split: micro batch x seq len x data-parallel ranks x accumulation
    steps. Ranks of one tensor- or context-parallel group read the same batch, so they count once."""

    micro_batch_size: int
    seq_len: int
    dp_world: int
    grad_accum_steps: int

    @property
    def tokens_per_micro_step(self) -> int:
        return self.micro_batch_size * self.seq_len * self.dp_world

    @property
    def total_batch_size(self) -> int:
        return self.tokens_per_micro_step * self.grad_accum_steps

    @property
    def chunks_per_step(self) -> int:
        """Micro batches (of micro_batch_size x seq_len) read per optimizer step, all ranks."""
        return self.dp_world * self.grad_accum_steps


def rank_factor(dp_world: int, world) -> str:
    """The global batch's rank factor as users count it: 'world 2' while every rank is data-parallel,
    else '2 data-parallel ranks (world 4)'."""
    return f"world {world}" if dp_world == world else f"{dp_world} data-parallel ranks (world {world})"


def mesh_shape(cfg: DictConfig, world: int) -> MeshShape:
    """The run's mesh from parallel.dp_replicate, parallel.cp and parallel.tp: dp_shard takes the rest
    of `world`, so their product must divide it; parallel.ep splits the experts over part of dp_shard.
    Context parallelism cuts each sequence into 2 x cp equal chunks (trainer/parallel/context_parallel.py),
    so it must divide train.seq_len that way; tensor parallelism splits each rank's positions over its
    tp ranks (sequence parallelism), so cp x tp must divide it too."""
    p = cfg.parallel
    sizes = {"parallel.dp_replicate": p.dp_replicate, "parallel.cp": p.cp, "parallel.tp": p.tp}
    for key, size in sizes.items():
        if not isinstance(size, int) or size < 1:
            raise ConfigError(f"{key}={size} must be a whole number of ranks, 1 or more")
    fixed = p.dp_replicate * p.cp * p.tp
    if world % fixed:
        named = " x ".join(f"{key}={size}" for key, size in sizes.items() if size > 1)
        raise ConfigError(
            f"{named} = {fixed} ranks does not divide world={world}; the mesh is dp_replicate x dp_shard "
            f"x cp x tp = world, so set world to a multiple of {fixed} or lower those sizes"
        )
    seq_len = cfg.train.seq_len
    if p.cp > 1 and seq_len % (2 * p.cp):
        raise ConfigError(
            f"parallel.cp={p.cp} cuts each sequence into 2 x cp = {2 * p.cp} equal chunks (one early and one "
            f"late per rank, for balanced causal attention), which train.seq_len={seq_len} is not a multiple "
            f"of; choose a train.seq_len divisible by {2 * p.cp}"
        )
    if p.tp > 1 and seq_len % (p.cp * p.tp):
        held = f"the {seq_len // p.cp} positions each rank holds of a sequence" if p.cp > 1 else "each sequence"
        raise ConfigError(
            f"parallel.tp={p.tp} splits {held} into {p.tp} equal parts (sequence parallelism), which "
            f"train.seq_len={seq_len} does not allow; choose a train.seq_len divisible by {p.cp * p.tp}"
        )
    dp_shard = world // fixed
    ep = p.get("ep", 1)  # a saved config from before expert parallelism has no key
    if not isinstance(ep, int) or ep < 1:
        raise ConfigError(f"parallel.ep={ep} must be a whole number of ranks, 1 or more")
    if ep > 1 and dp_shard % ep:
        raise ConfigError(
            f"parallel.ep={ep} splits the experts over {ep} of the dp_shard ranks, but dp_shard = world / "
            f"(dp_replicate x cp x tp) = {dp_shard} is not a multiple of {ep}; choose parallel.ep among the "
            f"divisors of {dp_shard}, or a world that makes dp_shard a multiple of {ep}"
        )
    if ep > 1 and p.cp > 1:
        raise ConfigError(
            f"parallel.ep={ep} with parallel.cp={p.cp}: the experts' gradients would have to be averaged over "
            "the cp ranks too, which dtrain does not do yet; use parallel.cp=1 with parallel.ep (or parallel.ep=1)"
        )
    return MeshShape(dp_replicate=p.dp_replicate, dp_shard=dp_shard, cp=p.cp, tp=p.tp, ep=ep)


def batch_plan(cfg: DictConfig, world: int) -> BatchPlan:
    """Derive accumulation steps from the total batch, or check the pair when both are given."""
    t = cfg.train
    shape = mesh_shape(cfg, world)
    dp_world = shape.dp_world
    per_micro = t.micro_batch_size * t.seq_len * dp_world
    # Say "world" while every rank is data-parallel, as users count it; else the mesh's dp size.
    ranks = "world" if dp_world == world else f"data-parallel ranks ({shape.describe()})"
    if t.total_batch_size is None:
        accum = t.grad_accum_steps or 1
    else:
        if t.total_batch_size % per_micro:
            raise ConfigError(
                f"train.total_batch_size={t.total_batch_size} is not divisible by micro_batch_size x "
                f"seq_len x {ranks} = {t.micro_batch_size}x{t.seq_len}x{dp_world} = {per_micro}; "
                f"set train.total_batch_size to a multiple of {per_micro}"
            )
        accum = t.total_batch_size // per_micro
        if t.grad_accum_steps is not None and t.grad_accum_steps != accum:
            raise ConfigError(
                f"train.grad_accum_steps={t.grad_accum_steps} contradicts train.total_batch_size="
                f"{t.total_batch_size} ({t.total_batch_size} / {per_micro} = {accum} steps); "
                "give only one of them"
            )
    return BatchPlan(t.micro_batch_size, t.seq_len, dp_world, accum)


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
