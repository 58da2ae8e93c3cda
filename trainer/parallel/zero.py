"""parallel=zero: DDP plus ZeRO stage 1 (each rank keeps the optimizer's state for 1/world of every parameter).

Why not torch's ZeroRedundancyOptimizer: it gives each rank whole parameters, so one tensor larger
than 1/world of the model (GPT's tied 50257-row embedding is 40-97% of the small models) decides
the largest rank's share: 0.97 of the full state per rank for model=tiny at world 2. Here every
parameter is split by rows, as DTensor's Shard(0) splits it, so each rank holds 1/world of the
state of every parameter (within a row), the checkpoint is a DTensor state dict that DCP reshards
to any world size and mode, and the updated rows come back in one all-gather per bucket instead of
one broadcast per parameter.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from trainer.optim.build import parts
from trainer.optim.registry import empty_state
from trainer.parallel.base import load_indexed_state, row_range, row_shard_numel
from trainer.parallel.collectives import all_gather_single
from trainer.parallel.ddp import DDPStrategy
from trainer.parallel.muon_owners import OwnedMuon, busiest_owner_numel


class ZeroOptimizer:
    """ZeRO stage 1 after DDP's gradient all-reduce.

    Rank r runs the inner optimizer (an elementwise one, parameter groups as given) on its rows of
    every parameter: views of the model's own parameters and gradients, so nothing is copied on the
    way in. After the update each rank all-gathers the others' rows, bucket by bucket, so every
    replica holds the same weights again. The optimizer is elementwise, so the steps match DDP's.
    """

    def __init__(self, groups, optimizer_class, *, rank: int, world: int, bucket_numel: int, **defaults):
        self.rank, self.world = rank, world
        self.params: list[nn.Parameter] = []
        self.shards: list[nn.Parameter] = []  # this rank's rows of each parameter, same order
        self.my_rows: list[slice] = []
        shard_groups = []
        for group in groups:
            shards = []
            for param in group["params"]:
                if param.dim() == 0:
                    raise ValueError("parallel=zero shards parameters by rows; a 0-d parameter has none")
                rows = slice(*row_range(param.shape[0], rank, world))
                # nn.Parameter over a view shares the model parameter's storage: the inner
                # optimizer's in-place update is the model's update for these rows.
                shards.append(nn.Parameter(param.detach()[rows]))
                self.params.append(param)
                self.my_rows.append(rows)
            self.shards.extend(shards)
            shard_groups.append({**group, "params": shards})
        self.optim = optimizer_class(shard_groups, **defaults)
        self.buckets = [_Bucket(params, world) for params in _consecutive(self.params, bucket_numel)]

    # The loop sets the learning rate through param_groups; checkpoints read state.
    @property
    def param_groups(self) -> list[dict]:
        return self.optim.param_groups

    @property
    def state(self):
        return self.optim.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for shard in self.shards:
            shard.grad = None
        for param in self.params:
            if param.grad is not None:
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        for param, shard, rows in zip(self.params, self.shards, self.my_rows):
            shard.grad = None if param.grad is None else param.grad[rows]
        self.optim.step()
        self._all_gather_rows()

    def _all_gather_rows(self) -> None:
        # The next bucket's gather is in flight while this one's rows are copied out.
        pending = self._start_gather(self.buckets[0]) if self.buckets else None
        for i, bucket in enumerate(self.buckets):
            work, gathered = pending
            pending = self._start_gather(self.buckets[i + 1]) if i + 1 < len(self.buckets) else None
            work.wait()
            self._copy_in_rows(bucket, gathered)

    def _start_gather(self, bucket: _Bucket):
        mine = [p.detach()[rows].reshape(-1) for p, rows in zip(bucket.params, bucket.rows[self.rank])]
        padding = mine[0].new_zeros(bucket.width - sum(t.numel() for t in mine))
        send = torch.cat([*mine, padding])
        gathered = send.new_empty(self.world * bucket.width)  # gloo takes the concatenated form only
        work = all_gather_single(gathered, send, async_op=True)
        return work, gathered.view(self.world, bucket.width)

    def _copy_in_rows(self, bucket: _Bucket, gathered: torch.Tensor) -> None:
        for rank in range(self.world):
            if rank == self.rank:
                continue
            offset = 0
            for param, rows in zip(bucket.params, bucket.rows[rank]):
                target = param.detach()[rows]
                target.copy_(gathered[rank, offset:offset + target.numel()].view_as(target))
                offset += target.numel()


class _Bucket:
    """Parameters all-gathered together: every rank's rows of each, and the padded per-rank width."""

    def __init__(self, params: list[nn.Parameter], world: int):
        self.params = params
        self.rows = [[slice(*row_range(p.shape[0], rank, world)) for p in params] for rank in range(world)]
        self.width = max(
            sum(p.detach()[r].numel() for p, r in zip(params, rows)) for rows in self.rows
        )


def _consecutive(params: list[nn.Parameter], cap_numel: int) -> list[list[nn.Parameter]]:
    """Consecutive parameters in buckets of about cap_numel elements (at least one each)."""
    buckets, current, size = [], [], 0
    for param in params:
        if current and size + param.numel() > cap_numel:
            buckets.append(current)
            current, size = [], 0
        current.append(param)
        size += param.numel()
    if current:
        buckets.append(current)
    return buckets


class ZeroStrategy(DDPStrategy):
    name = "zero"
    shards_optimizer_state = True

    @classmethod
    def optimizer_state_numels(cls, groups, world):
        # Rank 0 holds the first, longest row chunk of every parameter.
        return [row_shard_numel(shape, world) for group in groups for shape in group]

    @classmethod
    def muon_numels(cls, shapes, shape):
        world = shape.world
        # The busiest owner's whole momenta; the all-gather's send buffer and its world-wide result.
        owned = busiest_owner_numel(shapes, world)
        return owned, (world + 1) * owned

    def elementwise_optimizer(self, run):
        params = [param for group in run.groups for param in group["params"]]
        element = params[0].element_size()
        # The checkpoint's DTensors live on this mesh; made here, where every rank passes in step.
        self._device_mesh = init_device_mesh(self.rt.device.type, (self.rt.world,))
        return ZeroOptimizer(run.groups, run.optimizer_class, rank=self.rt.rank, world=self.rt.world,
                             bucket_numel=max(1, int(self.cfg.bucket_cap_mb * 2**20 / element)), **run.kwargs)

    def matrix_optimizer(self, run):
        # Whole hidden matrices by owner rank (trainer/parallel/muon_owners.py).
        return OwnedMuon(run, rank=self.rt.rank, world=self.rt.world, sharded=False)

    @staticmethod
    def _split(optimizer) -> tuple[ZeroOptimizer, OwnedMuon | None]:
        found = parts(optimizer)
        zero = next(p for p in found if isinstance(p, ZeroOptimizer))
        return zero, next((p for p in found if isinstance(p, OwnedMuon)), None)

    # --- checkpoint state ------------------------------------------------------------------
    # The elementwise optimizer's state of each parameter (each tensor shaped like it) is a
    # DTensor sharded by rows over all ranks (the same layout as FSDP's), under the parameter's
    # name: DCP writes each rank's rows once and reads them back at any world size and into any
    # mode; scalars (a step count) are the same on every rank. Muon's momentum (optim=muon) is
    # whole, by name, from its owner (trainer/parallel/muon_owners.py).
    def _named_pairs(self, model, zero: ZeroOptimizer):
        names = {id(p): name for name, p in self.unwrap(model).named_parameters()}
        return [(names[id(p)], p, shard) for p, shard in zip(zero.params, zero.shards)]

    def _sharded(self, local: torch.Tensor, param: nn.Parameter) -> DTensor:
        return DTensor.from_local(local, self._device_mesh, [Shard(0)], run_check=False,
                                  shape=param.shape, stride=param.stride())

    def _as_rows(self, entry: dict, param: nn.Parameter, shard: nn.Parameter) -> dict:
        """A parameter's state with each tensor of its shard's shape as that parameter's rows."""
        return {key: self._sharded(value, param) if value.shape == shard.shape else value
                for key, value in entry.items()}

    def optimizer_state_dict(self, model, optimizer):
        zero, muon = self._split(optimizer)
        state = muon.state_dict_by_name() if muon else {}
        for name, param, shard in self._named_pairs(model, zero):
            entry = zero.state.get(shard)
            if entry:
                state[name] = self._as_rows(entry, param, shard)
        return state

    def optimizer_state_template(self, model, optimizer):
        zero, muon = self._split(optimizer)
        template = muon.state_template() if muon else {}
        for name, param, shard in self._named_pairs(model, zero):  # this rank's rows
            template[name] = self._as_rows(empty_state(zero.optim, shard.detach()), param, shard)
        return template

    def load_optimizer_state_dict(self, model, optimizer, state):
        zero, muon = self._split(optimizer)
        if muon:
            muon.load_state_by_name(state)
        indexed = {}
        for i, (name, _, _) in enumerate(self._named_pairs(model, zero)):
            if name in state:
                entry = state[name]
                indexed[i] = {key: value.to_local() if isinstance(value, DTensor) else value
                              for key, value in entry.items()}
        load_indexed_state(zero.optim, indexed)
