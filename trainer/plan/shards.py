"""What each rank holds of a sharded model, read from the real shards (`dtrain plan`).

A mode that shards parameters into DTensors (fsdp, hsdp; tensor parallelism inside them) is asked
for its own layout rather than a formula: the model is built on the meta device (no memory, even
for 70B), the mode's own `Strategy.wrap` runs on it under torch's "fake" process-group backend
playing rank 0 of the requested world, and every parameter's DTensor placements then give the
local shard of each rank (torch's own `_compute_local_shape_and_global_offset`, the function
DTensor itself sizes its local tensors with; rank 0's equal its `to_local()`). Gradients are
shards of the same layout; the optimizer state is the optimizer's state tensors per shard (AdamW
two, Lion one: trainer/optim/registry.py) and a 0-d step counter per tensor where it keeps one,
and Muon's whole matrices on their owner ranks as the mode's `muon_numels` says.

Whatever wrap applies (the tensor-parallel split of parallel.tp > 1 included) is what is counted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.overrides import TorchFunctionMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from trainer.config.batch import mesh_shape
from trainer.model.config import GPTConfig
from trainer.optim.build import split_params
from trainer.optim.registry import elementwise_of
from trainer.parallel import STRATEGIES
from trainer.parallel.base import FLATTENED
from trainer.plan.meta import meta_model
from trainer.process.runtime import Runtime

FP32 = 4  # parameters, gradients and optimizer state are kept in fp32 (compute casts per unit)


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """Per-rank bytes of the model state of one parallelized model, rank by rank (global rank order)."""

    params: tuple[int, ...]  # the local shards of every parameter (the tied embedding once)
    grads: tuple[int, ...]  # the gradients' shards (the same layout as the parameters)
    optim_tensors: tuple[int, ...]  # the elementwise optimizer's state tensors, per shard
    optim_scalars: tuple[int, ...]  # its 0-d step counters (one per parameter)
    muon: int  # Muon's state on its busiest owner rank (0 without optim=muon)
    largest: int  # elements of the largest local shard (the optimizer step's temporaries)

    @property
    def optim(self) -> tuple[int, ...]:
        return tuple(t + s for t, s in zip(self.optim_tensors, self.optim_scalars))

    @property
    def totals(self) -> tuple[int, ...]:
        return tuple(p + g + o for p, g, o in zip(self.params, self.grads, self.optim))

    @property
    def busiest_rank(self) -> int:
        """The rank holding the most (the first of equals); Muon's owner state is counted on it."""
        return max(range(len(self.totals)), key=lambda r: (self.totals[r], -r))

    @property
    def ranks_differ(self) -> bool:
        return len(set(self.totals)) > 1


def _flat_coordinate(coordinate: tuple[int, ...], dims: tuple[str, ...], root) -> int:
    """A rank's coordinate along a mesh dimension made of the root's `dims`, flattened row-major."""
    flat = 0
    for name in dims:
        index = root.mesh_dim_names.index(name)
        flat = flat * root.mesh.shape[index] + coordinate[index]
    return flat


class _MetaStaysMeta(TorchFunctionMode):
    """The mode's wrap moves the model to the run's device first; a meta model stays on the meta
    device (its shapes are all the plan reads, and a copy out of meta has no values to copy)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.to and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            return args[0]
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _fake_world(world: int):
    """A process group of `world` ranks that communicates nothing, this process playing rank 0;
    torn down after, so the caller's process is left as it was."""
    if dist.is_initialized():
        raise RuntimeError("the shard plan plays its own world; call it where no process group is up")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _rank_numels(param: torch.Tensor, root, cache: dict) -> tuple[int, ...]:
    """Elements of `param` each global rank of the run's mesh `root` holds: its DTensor local shard,
    or the whole tensor on every rank for a plain one. A DTensor lives on a sub-mesh of `root` (FSDP's
    data-parallel dimensions, say): a rank's shard is the one at its coordinates along those."""
    world = root.mesh.numel()
    if not isinstance(param, DTensor):
        return (param.numel(),) * world
    mesh, placements = param.device_mesh, tuple(param.placements)
    names = mesh.mesh_dim_names or ()
    key = (tuple(param.shape), placements, tuple(mesh.shape), names)
    if key not in cache:
        root_names = root.mesh_dim_names
        parts = [(name,) if name in root_names else FLATTENED.get(name, (name,)) for name in names]
        if any(part not in root_names for part in itertools.chain(*parts)):
            raise RuntimeError(f"a parameter's mesh dimensions {names} are not the run's {root_names}")
        numels = [0] * world
        for coordinate in itertools.product(*(range(n) for n in root.mesh.shape)):
            local, _ = _compute_local_shape_and_global_offset(
                param.shape, mesh.shape, [_flat_coordinate(coordinate, dims, root) for dims in parts], placements)
            numels[int(root.mesh[coordinate])] = math.prod(local)
        cache[key] = tuple(numels)
    return cache[key]


def shard_plan(cfg, mode: str, world: int) -> ShardPlan:
    """The model state per rank of `cfg`'s model wrapped by `mode` at `world` ranks (the mesh from
    parallel.dp_replicate / cp / tp). Cached: `dtrain plan` asks for it at every micro batch."""
    def text(node) -> str:
        return OmegaConf.to_yaml(node, resolve=True)

    return _shard_plan(text(cfg.model), text(cfg.parallel), text(cfg.train), text(cfg.optim), mode, world)


@functools.lru_cache(maxsize=16)
def _shard_plan(model_yaml: str, parallel_yaml: str, train_yaml: str, optim_yaml: str, mode: str,
                world: int) -> ShardPlan:
    model_cfg, parallel_cfg = OmegaConf.create(model_yaml), OmegaConf.create(parallel_yaml)
    train_cfg, optim_cfg = OmegaConf.create(train_yaml), OmegaConf.create(optim_yaml)
    parallel_cfg.mode = mode
    strategy_class = STRATEGIES[mode]
    shape = mesh_shape(OmegaConf.create({"parallel": parallel_cfg, "train": train_cfg}), world)
    strategy_class.check_mesh(shape)
    model = meta_model(GPTConfig.from_cfg(model_cfg))
    with _fake_world(world):
        # A CPU runtime whatever train.device says: the layout is the same, and no device is touched.
        runtime = Runtime(rank=0, local_rank=0, world=world, local_world=world, device=torch.device("cpu"),
                          distributed=True, shape=shape)
        strategy = strategy_class(parallel_cfg, train_cfg, runtime)
        with _MetaStaysMeta():
            wrapped = strategy.wrap(model)
        raw = strategy.unwrap(wrapped)
        root = strategy.device_mesh()
        matrices, rest = split_params(raw, optim_cfg)
        cache: dict = {}

        def numels(param) -> tuple[int, ...]:
            held = _rank_numels(param, root, cache)
            if isinstance(param, DTensor) and held[0] != param.to_local().numel():  # this process is rank 0
                raise RuntimeError(f"rank 0's shard of a {tuple(param.shape)} parameter holds "
                                   f"{param.to_local().numel()} elements, the placements say {held[0]}")
            return held

        params = [numels(p) for _, p in (*matrices, *rest)]
        elementwise = elementwise_of(optim_cfg)
        optim_tensors = [0] * world
        for _, param in rest:
            for rank, n in enumerate(numels(param)):
                optim_tensors[rank] += len(elementwise.state.tensors) * n * FP32
        muon = 0
        if matrices:
            kept, _ = strategy_class.muon_numels([p.shape for _, p in matrices], shape)
            muon = kept * FP32
    per_rank = tuple(sum(p[r] for p in params) * FP32 for r in range(world))
    scalars = (4 * len(elementwise.state.scalars) * len(rest),) * world
    return ShardPlan(params=per_rank, grads=per_rank, optim_tensors=tuple(optim_tensors),
                     optim_scalars=scalars, muon=muon, largest=max(max(p) for p in params))
