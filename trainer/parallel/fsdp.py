"""parallel=fsdp: FSDP2 (fully_shard) per transformer block and at the root."""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from trainer.errors import ConfigError
from trainer.parallel.base import Strategy, owned_muon_numels, row_shard_numel
from trainer.parallel.muon_owners import OwnedMuon
from trainer.parallel.owned_state import OwnedMatrixState


class FSDPStrategy(OwnedMatrixState, Strategy):
    name = "fsdp"
    needs_process_group = True
    syncs_replicas = True
    shards_parameters = True
    shards_optimizer_state = True
    tensor_parallel = True
    context_parallel = True
    expert_parallel = True

    @classmethod
    def optimizer_state_numels(cls, groups, world):
        # The state follows the parameter shards: rank 0 holds the longest row chunk of each.
        return [row_shard_numel(shape, world) for group in groups for shape in group]

    @classmethod
    def muon_numels(cls, shapes, shape):
        return owned_muon_numels(shapes, cls.muon_owners(shape), shape)

    @classmethod
    def muon_owners(cls, shape) -> int:
        """The ranks Muon's matrices are spread over (matrix_optimizer's OwnedMuon): every rank."""
        return shape.world

    @classmethod
    def parameter_compute_dtype(cls, parallel_cfg, device_type):
        mode = parallel_cfg.mixed_precision
        if mode == "auto":
            mode = "bf16" if device_type == "cuda" else "fp32"
        if mode == "bf16":
            return torch.bfloat16
        if mode == "fp32":
            return None
        raise ConfigError(f"parallel.mixed_precision={mode!r} must be auto, bf16 or fp32")

    def __init__(self, parallel_cfg, train_cfg, runtime):
        super().__init__(parallel_cfg, train_cfg, runtime)
        self.mp_policy = self._mixed_precision()

    def _mixed_precision(self) -> MixedPrecisionPolicy:
        dtype = self.parameter_compute_dtype(self.cfg, self.rt.device.type)
        if dtype is None:
            return MixedPrecisionPolicy()
        # Compute in bf16, but reduce gradients in fp32 so small updates are not lost.
        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)

    def wrap(self, model):
        model = self.split_layers(model.to(self.rt.device))
        # A 1-D data-parallel mesh shards (FSDP); a 2-D one replicates the shards (HSDP).
        mesh = self.data_parallel_mesh()
        kwargs = dict(mesh=mesh, mp_policy=self.mp_policy)
        if self.rt.shape.ep > 1:
            self._shard_experts(model)
        for block in model.transformer.h:
            fully_shard(block, reshard_after_forward=self.cfg.reshard_after_forward, **kwargs)
        # The tied wte / lm_head weight lives in the root unit, so it is sharded once.
        fully_shard(model, reshard_after_forward=self.cfg.reshard_after_forward, **kwargs)
        return model

    def _shard_experts(self, model):
        """Each MoE layer's experts, already split by expert over the ep ranks (split_layers), are an
        FSDP unit of their own over the other data-parallel ranks: sharded along their rows (dimension
        1: dimension 0 is the ep split's), their gradients averaged over every data-parallel rank
        (trainer/parallel/expert_parallel.py says why the divide factor is the whole dp size)."""
        mesh = self.expert_data_parallel_mesh()
        for layer in model.moe_layers():
            fully_shard(layer.experts, mesh=mesh, mp_policy=self.mp_policy,
                        reshard_after_forward=self.cfg.reshard_after_forward,
                        shard_placement_fn=lambda param: Shard(1))
            layer.experts.set_gradient_divide_factor(float(self.rt.dp_world))
            # A custom factor is NCCL's PREMUL_SUM, which gloo lacks: scale before and after a sum. Only
            # where the experts are sharded (dp_shard / ep > 1): with one shard, torch 2.13 skips the
            # reduce-scatter and, forced, the scaling with it (measured, gradients ep x too large,
            # with and without HSDP's replicas); unforced, it scales them itself there.
            layer.experts.set_force_sum_reduction_for_comms(mesh.size(mesh.ndim - 1) > 1)

    def micro_step(self, model, is_last):
        model.set_requires_gradient_sync(is_last)
        return contextlib.nullcontext()

    def autocast(self):
        if self.mp_policy.param_dtype is not None:
            return contextlib.nullcontext()  # the policy already casts parameters per unit
        return super().autocast()

    def clip_grad_norm(self, model, max_norm):
        norm = super().clip_grad_norm(model, max_norm)
        # Sharded gradients give a DTensor norm; its full value is the true global norm.
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    # The elementwise optimizer runs on the DTensor shards as it would on whole tensors (the base
    # class's answer); a whole-matrix one needs each matrix whole, on its owner rank.
    def matrix_optimizer(self, run):
        return OwnedMuon(run, rank=self.rt.rank, world=self.rt.world, sharded=True)
