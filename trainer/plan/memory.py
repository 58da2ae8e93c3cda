"""Per-rank memory estimates for each parallel mode (`dtrain plan`): what one rank holds in each mode
and at which moment of a step it peaks, the largest micro batch that fits, a checkpoint's size. The
activations of a micro batch come from the activation model, trainer/plan/activations.py.

What one rank holds, in bytes:

* parameters, gradients and optimizer state (AdamW: exp_avg + exp_avg_sq + a step counter per
  tensor; each optimizer's as its registration says, trainer/optim/registry.py), full or sharded as the
  mode keeps them. A mode that shards parameters into DTensors (fsdp, hsdp, with tensor
  parallelism inside) is counted on the real shards of its own wrap of a meta model, every rank
  of the mesh (trainer/plan/shards.py), and the busiest rank reported; for the others the strategy
  classes say how (trainer/parallel/): each mode's `optimizer_state_numels` gives what its busiest
  rank keeps of the optimizer state (row chunks of every tensor for zero, whole tensors for
  zero_torch).
* activations of one micro batch (trainer/plan/activations.py), and beside them here: context
  parallelism's gathered keys and values of the group, and on CUDA under bf16 autocast the bf16 copies
  of the weights that autocast keeps for the backward (under FSDP they are `gathered`).
* transients at the peak: FSDP's gathered (unsharded) parameters and gradients of the units in
  flight, DDP's gradient buckets, the optimizer step's temporaries (none in CUDA's fused AdamW).

On CUDA (`train.device=cuda`, or `dtrain plan --device cuda` from any host) the estimate is of
`torch.cuda.max_memory_allocated` (what tensors hold; the CUDA context and the caching
allocator's unused reserve come on top as `runtime`).

tests/cli/test_plan.py keeps the CPU estimate within 15% of a measured peak;
tests/unit/test_plan_cuda.py keeps the CUDA estimate within 5% of max_memory_allocated in every case
`make bench-gpu` measures; what it measured is in docs/performance.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
from omegaconf import OmegaConf

from trainer.config.batch import mesh_shape
from trainer.config.shape import parameter_count
from trainer.errors import UserError
from trainer.model.config import GPTConfig
from trainer.optim.build import param_groups, split_params
from trainer.optim.registry import elementwise_of, states_of
from trainer.parallel import STRATEGIES
from trainer.parallel.base import Strategy
from trainer.plan.activations import activation_bytes
from trainer.plan.meta import meta_model


def host_memory() -> int:
    """This machine's RAM in bytes (/proc/meminfo's MemTotal; 0 where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return 0


def model_state_floor(cfg, strategy: type[Strategy], world: int) -> int:
    """Bytes of fp32 weights, gradients and optimizer state that the busiest of `world` ranks holds
    at least in `strategy`'s mode: estimate()'s params + grads + optim, from the parameter count
    alone (an even split where the mode shards, the fewest state tensors a parameter has: AdamW's
    two moments, Lion's or Muon's one).
    No model is built, not even on the meta device, whose first build imports torch._dynamo (a
    second more at every run's start), and a model too large to build is answered too."""
    count = parameter_count(cfg.model)
    optim_per_param = 4 * min(len(state.tensors) for _, state in states_of(cfg.optim))
    weights_and_grads = 2 * 4 * (math.ceil(count / world) if strategy.shards_parameters else count)
    shards_state = strategy.shards_parameters or strategy.shards_optimizer_state
    return weights_and_grads + optim_per_param * (math.ceil(count / world) if shards_state else count)


# -------------------------------------------------------------------------------- estimation

ROOT_COPIES_TIED, ROOT_COPIES_UNTIED = 6.0, 1.5  # FSDP's root unit in flight (see estimate)
CPU_RUNTIME = 100 * 1024**2  # library code, kernels and thread pools a worker touches, allocator slack
CUDA_RUNTIME = 1024**3  # CUDA context, cuBLAS/NCCL workspaces, caching-allocator slack (not in max_memory_allocated)


@dataclasses.dataclass
class Estimate:
    """Per-rank bytes. `peak` is the larger of two moments of a step:
    backward's start (activations live, gradients only where they persist: DDP/ZeRO buckets) and
    the optimizer step (all gradients, the optimizer's temporaries, no activations)."""

    mode: str
    world: int
    micro_batch: int
    params: int  # held between steps (the local shard under FSDP)
    grads: int  # at their largest (right after backward)
    optim: int  # optimizer state held by this rank
    activations: int  # kept for backward at its start, the language-model head included
    gathered: int  # FSDP: unsharded units in flight (the root, with the tied embedding, and blocks)
    temporaries: int  # optimizer step: the per-tensor temporaries for the largest tensor
    runtime: int  # the process itself (not tensors)
    grads_persist: bool  # gradients stay allocated across steps (DDP's bucket views)

    @property
    def backward_peak(self) -> int:
        grads = self.grads if self.grads_persist else 0
        return self.params + self.optim + grads + self.activations + self.gathered + self.runtime

    @property
    def step_peak(self) -> int:
        return self.params + self.optim + self.grads + self.temporaries + self.runtime

    @property
    def total(self) -> int:
        return max(self.backward_peak, self.step_peak)

    @property
    def allocated(self) -> int:
        """The peak of what tensors hold: torch.cuda.max_memory_allocated's counterpart on CUDA."""
        return self.total - self.runtime

    def as_dict(self) -> dict:
        keys = ("mode", "world", "micro_batch", "params", "grads", "optim", "activations", "gathered",
                "temporaries", "runtime")
        return {**{k: getattr(self, k) for k in keys}, "backward_peak": self.backward_peak,
                "step_peak": self.step_peak, "total": self.total}


@dataclasses.dataclass(frozen=True)
class _Shapes:
    """What the estimate reads of a model: its parameters' shapes (the tied embedding once), those
    of one block, and how the optimizer splits them (AdamW's two groups, Muon's matrices)."""

    config: GPTConfig
    params: tuple[torch.Size, ...]
    block: tuple[torch.Size, ...]
    adamw_groups: tuple[tuple[torch.Size, ...], ...]
    muon: tuple[torch.Size, ...]


def _shapes(model_cfg, optim_name: str) -> _Shapes:
    """The model's shapes, read once per architecture and optimizer: `dtrain plan` estimates every
    mode and searches micro batches on the same model (about 90 estimates), and walking a deep
    model's parameters (through the config's OmegaConf nodes) each time took minutes."""
    return _shapes_of(dataclasses.astuple(GPTConfig.from_cfg(model_cfg)), optim_name)


@functools.lru_cache(maxsize=8)
def _shapes_of(fields: tuple, optim_name: str) -> _Shapes:
    model = meta_model(GPTConfig(*fields))
    muon, adamw = split_params(model, OmegaConf.create({"name": optim_name}))
    groups = param_groups((p for _, p in adamw), 0.0)
    blocks = model.transformer.h
    return _Shapes(model.config, tuple(p.shape for p in model.parameters()),
                   tuple(p.shape for p in blocks[0].parameters()) if len(blocks) else (),
                   tuple(tuple(p.shape for p in group["params"]) for group in groups),
                   tuple(p.shape for _, p in muon))


def device_type_of(cfg) -> str:
    spec = cfg.train.device
    if spec == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(spec).type


def estimate(cfg, mode: str, world: int, micro_batch: int, device_type: str | None = None) -> Estimate:
    """Per-rank memory of a training step of `cfg`'s model in `mode` at `world` ranks (worst rank)."""
    strategy = STRATEGIES.get(mode)
    if strategy is None:
        raise UserError(f"unknown parallel mode {mode!r}; choose from {', '.join(sorted(STRATEGIES))}")
    if world < 1:
        raise UserError(f"world={world} must be at least 1")
    if micro_batch < 1:
        raise UserError(f"train.micro_batch_size={micro_batch} must be at least 1")
    m, t = cfg.model, cfg.train
    device_type = device_type or device_type_of(cfg)
    shapes = _shapes(m, cfg.optim.name)
    params = shapes.params  # the tied embedding once
    n_total = sum(math.prod(p) for p in params)
    fp32 = 4  # parameters, gradients and AdamW state stay fp32 (autocast computes in bf16)
    if t.dtype == "auto":
        act = 2 if device_type == "cuda" else 4
    else:
        act = {"float32": 4, "bfloat16": 2, "float16": 2}[t.dtype]
    cast = strategy.parameter_compute_dtype(cfg.parallel, device_type)
    if cast is not None:
        act = cast.itemsize  # the mode's own mixed precision computes in that dtype

    # --- activations of one micro batch ------------------------------------------------------
    L = m.n_layer
    # Tensor parallelism splits what a block keeps of its heads and MLP width over the tp ranks; the
    # residual stream, the norms' outputs and the (replicated) head's logits stay whole on each.
    shape = mesh_shape(cfg, world)
    tp = shape.tp if strategy.tensor_parallel else 1
    # Context parallelism gives each rank 1/cp of each sequence's tokens; its attention also keeps the
    # group's gathered keys and values (the other ranks' share) for the backward, per layer.
    cp = shape.cp if strategy.context_parallel else 1
    tokens = micro_batch * t.seq_len
    activations = activation_bytes(shapes.config, t, device_type, act, tokens // cp, tp)
    if cp > 1:
        kv_width = shapes.config.kv_heads * shapes.config.head_dim
        activations += L * act * 2 * kv_width * (tokens - tokens // cp) // tp
    if device_type == "cuda" and act == 2 and not strategy.shards_parameters:
        activations += 2 * n_total // tp  # bf16 copies of the weights, kept for the backward (FSDP: `gathered`)

    # --- model state per rank -------------------------------------------------------------------
    # The elementwise optimizer's state tensors (AdamW's exp_avg and exp_avg_sq, Lion's exp_avg) for
    # the tensors (or rows) the busiest rank keeps, and its scalars (AdamW's step counter) per
    # tensor; with optim=muon the hidden matrices instead keep Muon's one momentum buffer each
    # (whole, on their owner rank where the mode steps it by owner), plus the mode's step buffers.
    elementwise = elementwise_of(cfg.optim)
    muon_buffers = 0
    if shapes.muon:
        _, muon_buffers = strategy.muon_numels(list(shapes.muon), shape)
        # Newton-Schulz's float32 temporaries: the update, its transpose, two Gram products.
        largest_muon = max(math.prod(p) for p in shapes.muon)
        muon_buffers += 3 * largest_muon + 2 * max(min(p) ** 2 for p in shapes.muon)
    gathered = 0
    if strategy.shards_parameters or tp > 1:
        # DTensor shards (FSDP's, tensor parallelism's): counted on the mode's own wrap of a meta
        # model (trainer/plan/shards.py).
        # Deferred import: DTensor and the fake process group load only when a sharded mode is
        # planned, not at every run's start (the preflight imports this module).
        from trainer.plan.shards import shard_plan

        shards = shard_plan(cfg, mode, world)
        busiest = shards.busiest_rank
        p_b, g_b, o_b = shards.params[busiest], shards.grads[busiest], shards.optim[busiest] + shards.muon
        largest = shards.largest
        if strategy.shards_parameters and world > 1:
            # The root unit (embedding, head, positions, final norm) is gathered at backward's
            # start: all-gather buffer + unsharded parameters, then its unsharded gradient +
            # reduce-scatter input; a tied embedding also sums the head's and the lookup's dense
            # gradients there. Copies of the root measured on torch 2.13 (CPU, world 2): about 6
            # tied, 1.5 untied (its two tables' gradients are not summed). Blocks one at a time
            # + prefetch. Under tensor parallelism a unit gathers only its tp shard.
            per_block = sum(math.prod(p) for p in shapes.block)
            root = n_total - per_block * L
            copies = ROOT_COPIES_TIED if m.get("tie_embeddings", True) else ROOT_COPIES_UNTIED
            gathered = int((copies * root + 2 * per_block) * (2 if act == 2 else 4) / tp)
    else:
        p_b = g_b = n_total * fp32
        largest = max(math.prod(p) for p in params)
        held = strategy.optimizer_state_numels([list(group) for group in shapes.adamw_groups], world)
        o_b = len(elementwise.state.tensors) * sum(held) * fp32 + 4 * len(elementwise.state.scalars) * len(held)
        if shapes.muon:
            o_b += strategy.muon_numels(list(shapes.muon), shape)[0] * fp32
    # The elementwise step's copies of one tensor at a time (AdamW's sqrt(v) and its scaled copy,
    # none in CUDA's fused AdamW; Lion's interpolation); or Muon's step (they run in turn)
    copies = elementwise.step_copies["cuda" if device_type == "cuda" else "cpu"]
    temporaries = max(copies * largest, muon_buffers) * fp32
    runtime = CUDA_RUNTIME if device_type == "cuda" else CPU_RUNTIME
    return Estimate(mode, world, micro_batch, p_b, g_b, o_b, activations, gathered, temporaries, runtime,
                    strategy.keeps_gradient_buckets)


def checkpoint_bytes(cfg) -> int:
    """The tensor bytes of one checkpoint of `cfg`'s run: the whole model and optimizer state in
    fp32 (weights, AdamW's two moments and step counters, Muon's momentum), whatever the mode
    shards, for a save writes every rank's part. Sized on meta models of one and two blocks: the
    blocks are alike, so the state grows by the same bytes per block and a deep model costs no
    time to size."""

    def state(n_layer: int) -> int:
        # Sized as one process holding it all: no mesh dimension splits it.
        sized = OmegaConf.merge(cfg, {"model": {"n_layer": n_layer},
                                      "parallel": {"tp": 1, "cp": 1, "dp_replicate": 1, "ep": 1}})
        one_rank = estimate(sized, "none", 1, 1, "cpu")
        return one_rank.params + one_rank.optim

    depth = cfg.model.n_layer
    # The blocks repeat with a period: 1, or model.moe.every (every such layer's MLP is a mixture of
    # experts, the others dense; trainer/model/moe.py is_moe_layer).
    moe = cfg.model.get("moe")
    period = moe.every if moe is not None and moe.num_experts > 0 else 1
    if depth <= 2 * period:
        return state(depth)
    one, two = state(period), state(2 * period)
    periods, rest = divmod(depth, period)
    # the rest's layers are a period's first ones: dense
    return one + (periods - 1) * (two - one) + (state(period + rest) - one if rest else 0)


def largest_micro_batch(cfg, mode: str, world: int, device_memory: int, device_type: str | None = None,
                        limit: int = 1 << 16) -> int:
    """The largest micro batch whose estimated peak fits `device_memory` bytes (0: none fits)."""
    if estimate(cfg, mode, world, 1, device_type).total > device_memory:
        return 0
    lo, hi = 1, 2
    while hi <= limit and estimate(cfg, mode, world, hi, device_type).total <= device_memory:
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # estimate() grows with the batch: bisect between a fit and a miss
        mid = (lo + hi) // 2
        if estimate(cfg, mode, world, mid, device_type).total <= device_memory:
            lo = mid
        else:
            hi = mid
    return lo
