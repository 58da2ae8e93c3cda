"""The one interface every parallelism mode implements; the train loop knows nothing else."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn

from trainer.errors import ConfigError
from trainer.model.gpt import GPT
from trainer.optim.build import ElementwiseRun, MatrixRun, parts, verdict
from trainer.process.mesh_shape import MeshShape
from trainer.process.runtime import Runtime


class Strategy:
    """Single-process behaviour; each mode overrides only what it changes."""

    name = "none"
    # What the mode is; the rest of dtrain (config checks, preflight, memory plan, eval) asks these
    # instead of comparing mode names.
    needs_process_group = False  # a process group is up even at world 1
    syncs_replicas = False  # several workers train one model (gradients are synchronised)
    one_process_many_devices = False  # one process drives every visible device (no multi-process launch)
    shards_parameters = False  # each rank holds 1/world of the parameters and gradients
    shards_optimizer_state = False  # each rank holds a part of the optimizer state
    # Gradients live in DDP's communication buckets (gradient_as_bucket_view), so they stay
    # allocated between steps instead of being freed after the optimizer step.
    keeps_gradient_buckets = False
    # The device-mesh dimensions besides plain data parallelism this mode can run with: tensor
    # parallelism splits matrices into DTensor shards, which only FSDP2-based modes compose with.
    tensor_parallel = False
    # Context parallelism gives each rank of a group other tokens of the same sequences, so their
    # gradients differ: only modes whose data-parallel shards can span the cp ranks (FSDP2) average them.
    context_parallel = False
    # Expert parallelism shards the experts over data-parallel ranks, whose gradients for them arrive
    # through the all-to-all: only modes that shard parameters as DTensors (FSDP2) hold such shards.
    expert_parallel = False
    replicates_shards = False  # parallel.dp_replicate > 1: shards replicated across groups (HSDP)
    # The mesh dimensions this mode's data parallelism runs over, kept in its DeviceMesh even at size 1.
    data_parallel_dims: tuple[str, ...] = ("dp_shard",)

    # --- what the memory plan asks (class-level: no process group or device needed) -------------
    @classmethod
    def optimizer_state_numels(cls, groups: list[list[torch.Size]], world: int) -> list[int]:
        """Elements of each tensor whose optimizer state the rank holding the most keeps at `world`
        ranks, for parameters of these shapes in parameter groups as trainer.optim.build.param_groups
        makes them (a partition by whole parameters depends on the groups and sizes)."""
        return [math.prod(shape) for group in groups for shape in group]

    @classmethod
    def muon_numels(cls, shapes: list[torch.Size], shape: MeshShape) -> tuple[int, int]:
        """(elements of Muon state the busiest rank keeps, elements of buffers its step adds) for
        optim=muon's hidden matrices of these shapes on the mesh `shape` (which ranks own which
        matrices is the mode's: its whole world, or one replica's shard group): here every rank
        steps every whole matrix."""
        return sum(math.prod(matrix) for matrix in shapes), 0

    @classmethod
    def parameter_compute_dtype(cls, parallel_cfg, device_type: str) -> torch.dtype | None:
        """The dtype this mode itself casts parameters to for forward and backward (a mixed-
        precision policy), or None where autocast (train.dtype) decides."""
        return None

    def __init__(self, parallel_cfg, train_cfg, runtime: Runtime):
        # Only what the mode can run on at all: whether it may train at this world is
        # make_strategy's check (an eval runs parallel=none replicas at any world).
        self.check_world(runtime.dp_world, training=False)
        self.cfg = parallel_cfg
        self.train_cfg = train_cfg
        self.rt = runtime
        self._mesh = None
        self._data_parallel_mesh = None

    @classmethod
    def check_world(cls, world: int, training: bool = True, model_parallel: int = 1) -> None:
        """Refuse a worker count this mode cannot run on (one line, before anything starts). `world`
        counts data-parallel replicas; `model_parallel` is the ranks each one spans (cp x tp).

        `training=False` is for work where each worker needs only its own full replica (`dtrain
        eval` scores its share of the examples): a mode that does not sync replicas runs there at
        any world, while training with it would train `world` separate models.
        """
        if cls.one_process_many_devices and world > 1:
            raise ConfigError(
                f"parallel={cls.name} drives every GPU from one process and cannot run under a multi-process "
                f"launch; use parallel=ddp for several workers, or world=1 with parallel={cls.name}"
            )
        if training and world > 1 and not cls.syncs_replicas:
            if model_parallel > 1:
                raise ConfigError(
                    f"parallel={cls.name} does not synchronise gradients, so world={world * model_parallel} over "
                    f"groups of {model_parallel} (parallel.cp x parallel.tp) would train {world} unrelated copies "
                    f"of the model; use world={model_parallel} for one model over those ranks, or parallel=fsdp "
                    f"for {world} synchronised copies"
                )
            raise ConfigError(
                f"parallel={cls.name} does not synchronise gradients, so world={world} would train {world} "
                f"unrelated copies of the model; use parallel=ddp (or fsdp, zero) for {world} workers, "
                f"or world=1 with parallel={cls.name}"
            )

    @classmethod
    def check_mesh(cls, shape: MeshShape) -> None:
        """Refuse mesh sizes this mode cannot lay out (one line, before anything starts)."""
        if shape.tp > 1 and not cls.tensor_parallel:
            raise ConfigError(
                f"parallel={cls.name} cannot split layers over parallel.tp={shape.tp} ranks: tensor parallelism "
                f"composes with parallel=fsdp, hsdp or none; use parallel=fsdp parallel.tp={shape.tp}"
            )
        if shape.cp > 1 and not cls.context_parallel:
            raise ConfigError(
                f"parallel={cls.name} cannot split sequences over parallel.cp={shape.cp} ranks: context parallelism "
                f"runs under parallel=fsdp or hsdp (their shards span the cp ranks, which averages the gradients "
                f"of each rank's tokens); use parallel=fsdp parallel.cp={shape.cp}"
            )
        if shape.ep > 1 and not cls.expert_parallel:
            raise ConfigError(
                f"parallel={cls.name} cannot split experts over parallel.ep={shape.ep} ranks: expert parallelism "
                f"shards the experts as FSDP2 shards its parameters; use parallel=fsdp parallel.ep={shape.ep}"
            )
        if shape.dp_replicate > 1 and not cls.replicates_shards:
            raise ConfigError(
                f"parallel.dp_replicate={shape.dp_replicate} replicates sharded groups, which parallel={cls.name} "
                f"does not do; use parallel=hsdp parallel.dp_replicate={shape.dp_replicate}, or drop the key"
            )

    @classmethod
    def world_advice(cls, world: int) -> str | None:
        """A word for a worker count that runs but misses the mode's point (None when it fits)."""
        if (cls.shards_parameters or cls.shards_optimizer_state) and world == 1:
            return f"parallel={cls.name} with world=1 shards nothing; it runs, but use world>1 for its memory savings"
        return None

    # --- model and optimizer -------------------------------------------------------------
    def wrap(self, model: GPT) -> nn.Module:
        """Put the model on its device and wrap it for this mode."""
        return self.split_layers(model.to(self.rt.device))

    def split_layers(self, model: GPT) -> GPT:
        """The model split over the mesh's model-parallel ranks, before any data-parallel wrapping or
        compile: its blocks over the tp ranks (parallel.tp > 1), its sequences over the cp ranks
        (parallel.cp > 1); unchanged when both are 1."""
        shape = self.rt.shape
        if shape.tp > 1:
            model = tensor_parallel_plan().parallelize(model, self.device_mesh()["tp"])
        if shape.cp > 1:
            cp_mesh = self.device_mesh()["cp"]
            split = context_parallel_module().SequenceSplit
            model.sequence_split = split(cp_mesh.get_group(), cp_mesh.get_local_rank(), shape.cp)
        if shape.ep > 1:
            model = expert_parallel_module().split_experts(model, self.device_mesh()[EXPERT])
        return model

    def unwrap(self, model: nn.Module) -> GPT:
        """The GPT inside the wrapper (for inference and for names in checkpoints)."""
        return model

    # The two questions trainer.optim.build asks a mode: how to run the optimizer it chose over
    # this mode's parameters. Here every rank holds every whole parameter and the same gradients.
    def elementwise_optimizer(self, run: ElementwiseRun):
        """An elementwise optimizer (trainer.optim.registry) over `run.groups` of this mode's parameters."""
        return run.optimizer_class(run.groups, **run.kwargs)

    def matrix_optimizer(self, run: MatrixRun):
        """A whole-matrix optimizer (Muon) over `run.named`'s matrices: stepped whole on every replica."""
        params = [param for _, param in run.named]
        return run.build(params, run.row_parts)

    # --- one optimizer step ----------------------------------------------------------------
    def micro_step(self, model: nn.Module, is_last: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-step's forward and backward; gradients sync only on the last."""
        return contextlib.nullcontext()

    def autocast(self) -> contextlib.AbstractContextManager:
        dtype = compute_dtype(self.train_cfg.dtype, self.rt.device)
        if dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.rt.device.type, dtype=dtype)

    def reduce_gradients(self, model: nn.Module) -> None:
        """Complete what the step's backward left partial, before anything reads the gradients: with
        parallel.tp > 1 the parameters every tp rank holds whole saw only that rank's positions
        (sequence parallelism), so they are summed over the tp group."""
        if self.rt.shape.tp > 1:
            tensor_parallel_plan().sum_whole_parameter_grads(self.unwrap(model))

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip by the global norm over all gradients and return that norm (before clipping)."""
        if self.rt.shape.tp > 1 or self.rt.shape.ep > 1:  # DTensors on several meshes (tp's, ep's, FSDP's)
            return tensor_parallel_plan().clip_grads_over_meshes(model.parameters(), max_norm, self.rt.world)
        # max_norm=inf measures the norm without clipping (optim.grad_clip=0).
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else float("inf"))

    def optimizer_step(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor | None = None) -> None:
        """Update and drop the gradients; `found_inf` (a device tensor, 1.0: no update) masks the
        update on device (trainer.optim.build.masks_on_device says whether the optimizer can)."""
        with verdict(optimizer, found_inf):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    # --- inference ------------------------------------------------------------------------
    def inference_model(self, model: nn.Module) -> nn.Module:
        """The module to run evaluation forwards on (every rank calls it the same number of times)."""
        return self.unwrap(model)

    def describe(self) -> str:
        shape = self.rt.shape
        if shape.model_parallel == 1 and shape.dp_replicate == 1 and shape.ep == 1:
            return self.name
        return f"{self.name} ({shape.describe()})"

    def data_parallel_mesh(self):
        """The mesh the mode's data parallelism shards and averages over: its data-parallel dimensions,
        with the cp ranks folded into dp_shard (one flattened dimension, dp_shard_cp), since their
        gradients are averaged like data-parallel ranks'. Built once."""
        mesh = self.device_mesh()
        if self.rt.shape.cp == 1 and self.rt.shape.ep == 1:
            return mesh[self.data_parallel_dims]
        if self._data_parallel_mesh is None and self.rt.shape.ep > 1:
            # dp_shard is the ep ranks inside their dp_shard / ep groups (device_mesh), flattened back
            flat = mesh[FLATTENED["dp_shard"]]._flatten("dp_shard")
            replicas = self.replicates_shards  # HSDP: dp_replicate outside
            self._data_parallel_mesh = _concatenated(mesh, ["dp_replicate"], flat) if replicas else flat
        if self._data_parallel_mesh is None:
            # Kept, not sliced from the root again: torch 2.13 deprecates slicing a flattened dimension.
            flat = mesh[FLATTENED[SHARD_CP]]._flatten(SHARD_CP)
            others = [dim for dim in self.data_parallel_dims if dim != "dp_shard"]  # HSDP's dp_replicate
            self._data_parallel_mesh = _concatenated(mesh, others, flat) if others else flat
        return self._data_parallel_mesh

    def expert_data_parallel_mesh(self):
        """The mesh FSDP shards (and HSDP replicates) the experts over under expert parallelism: the
        data-parallel dimensions less the ep ranks, which split the experts among themselves."""
        mesh = self.device_mesh()
        return mesh[(*(dim for dim in self.data_parallel_dims if dim != "dp_shard"), EXPERT_SHARD)]

    def device_mesh(self):
        """The run's torch DeviceMesh, named by trainer/process/mesh_shape.py's dimensions: those above
        1 and the mode's data-parallel ones. Built once; needs the process group."""
        if self._mesh is None:
            # Deferred: parallel=none and ddp never build a mesh, and DeviceMesh's import is slow.
            from torch.distributed.device_mesh import init_device_mesh

            shape = self.rt.shape
            sizes = {name: size for name, size in shape.sizes().items()
                     if size > 1 or name in self.data_parallel_dims}
            if shape.ep > 1:  # dp_shard as its two parts (flattened back by data_parallel_mesh)
                sizes = {part: size for name, size in sizes.items()
                         for part, size in (((EXPERT_SHARD, size // shape.ep), (EXPERT, shape.ep))
                                            if name == "dp_shard" else ((name, size),))}
            self._mesh = init_device_mesh(self.rt.device.type, tuple(sizes.values()), mesh_dim_names=tuple(sizes))
        return self._mesh

    # --- checkpoint state (saved and loaded with torch.distributed.checkpoint) ----------------
    # Model state: {parameter name: tensor} with GPT's names, full or sharded (DTensor) as this
    # mode holds it; a tied alias (lm_head.weight = transformer.wte.weight) appears once.
    # Optimizer state: {parameter name: {state key: tensor}} as the optimizer keeps it
    # (trainer.optim.registry.State: e.g. AdamW's step, exp_avg and exp_avg_sq, or Muon's
    # momentum_buffer), keyed by name so it reshards across world sizes and modes. Hyperparameters
    # come from the config.
    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        raw = self.unwrap(model)
        state = tensor_parallel_plan().canonical_state(raw, dcp_state().get_model_state_dict(raw))
        for alias in tied_aliases(raw):
            state.pop(alias, None)
        return state

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        raw = self.unwrap(model)
        full = tensor_parallel_plan().tensor_parallel_state(raw, state)
        for alias, name in tied_aliases(raw).items():
            full[alias] = full[name]
        dcp_state().set_model_state_dict(raw, full)

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        raw = self.unwrap(model)
        state = dcp_state().get_optimizer_state_dict(raw, parts(optimizer))["state"]
        return tensor_parallel_plan().canonical_state(raw, state)

    def optimizer_state_template(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """Tensors of the right shapes (and sharding) for a checkpoint's optimizer state to load
        into. (An optimizer with no state yet gets it from a zero-lr step, as DCP does.)"""
        return self.optimizer_state_dict(model, optimizer)

    def load_optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict
    ) -> None:
        raw = self.unwrap(model)
        full = dcp_state().get_optimizer_state_dict(raw, parts(optimizer))  # this run's groups and hyperparameters
        full["state"] = tensor_parallel_plan().tensor_parallel_state(raw, state)
        dcp_state().set_optimizer_state_dict(raw, parts(optimizer), full)


# A mesh dimension made of neighbouring dimensions of the run's mesh, row-major (trainer/plan/shards.py
# reads a shard's coordinates along it).
SHARD_CP = "dp_shard_cp"
# Expert parallelism's parts of dp_shard (trainer/parallel/expert_parallel.py): dp_shard is then made
# of them, the ep ranks innermost.
EXPERT_SHARD, EXPERT = "dp_shard_mod_ep", "ep"
FLATTENED = {SHARD_CP: ("dp_shard", "cp"), "dp_shard": (EXPERT_SHARD, EXPERT)}


def _concatenated(mesh, dims: list[str], flat):
    """The mesh of the root's `dims` followed by the flattened dimension `flat`."""
    concatenate = getattr(type(mesh), "_concatenate", None)  # torch >= 2.13; before, slicing was the way
    if concatenate is not None:
        return concatenate([*(mesh[dim] for dim in dims), flat])
    return mesh[(*dims, flat.mesh_dim_names[0])]


def dcp_state():
    """torch.distributed.checkpoint.state_dict, the state-dict helpers every mode saves and restores
    through. Imported at the first save or restore, not with this module: torch.distributed.checkpoint
    pulls in DTensor and sympy (about 0.7 s), which a one-process run needs for nothing else."""
    from torch.distributed.checkpoint import state_dict  # deferred: heavy (see above)

    return state_dict


def tensor_parallel_plan():
    """trainer.parallel.tensor_parallel, imported where a run splits layers (or saves a state dict,
    which pulls in DTensor anyway): it imports torch.distributed.tensor (about half a second), which
    a parallel=none run at tp 1 never needs."""
    from trainer.parallel import tensor_parallel as module  # deferred: heavy (see above)

    return module


def context_parallel_module():
    """trainer.parallel.context_parallel, imported where a run splits sequences: torch's causal mask
    for attention (torch.nn.attention.bias) imports torch._dynamo, about a second that a run at cp 1
    never needs."""
    from trainer.parallel import context_parallel as module  # deferred: heavy (see above)

    return module


def expert_parallel_module():
    """trainer.parallel.expert_parallel, imported where a run splits experts: it imports DTensor,
    which a run at ep 1 may never need."""
    from trainer.parallel import expert_parallel as module  # deferred: heavy (see above)

    return module


def load_indexed_state(optimizer: torch.optim.Optimizer, indexed: dict[int, dict]) -> None:
    """optimizer.load_state_dict of per-parameter state by position (the optimizer's own order),
    under its current parameter groups and hyperparameters. torch casts "step" and the buffers to
    each parameter's device and dtype."""
    groups, start = [], 0
    for group in optimizer.param_groups:
        count = len(group["params"])
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append({**hyper, "params": list(range(start, start + count))})
        start += count
    optimizer.load_state_dict({"state": indexed, "param_groups": groups})


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """{alias: name} for parameters registered under a second name (GPT's lm_head / wte tie)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def row_shard_numel(shape: torch.Size, world: int) -> int:
    """Elements of the largest piece of a tensor split by rows over `world` ranks, as torch.chunk
    and DTensor's Shard(0) split it (chunks of ceil(rows / world)); a 0-d tensor is one piece."""
    if len(shape) == 0:
        return 1
    return math.ceil(shape[0] / world) * math.prod(shape[1:])


def row_range(rows: int, rank: int, world: int) -> tuple[int, int]:
    """Rank's rows of a `rows`-row tensor, split as torch.chunk and DTensor's Shard(0) split it:
    chunks of ceil(rows / world), the last ranks' shorter or empty."""
    chunk = math.ceil(rows / world)
    start = min(rank * chunk, rows)
    return start, min(start + chunk, rows)


def compute_dtype(spec: str, device: torch.device) -> torch.dtype:
    if spec == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[spec]


def owned_muon_numels(shapes: list[torch.Size], owners: int, shape: MeshShape) -> tuple[int, int]:
    """muon_numels of a mode whose ranks hold shards of the hidden matrices and step Muon by owner
    (trainer/parallel/muon_owners.py OwnedMuon, `sharded`), over `owners` ranks that split the
    matrices among themselves (the whole world, or one replica's shard group). Kept: the busiest
    owner's whole momenta and zeroed work copies. At the step: its matrices' whole gradients and the
    all_to_all buffers (its share of every matrix out, its matrices' shares in): FSDP's rows, or
    under tensor parallelism its block, about 1/owners of each matrix either way."""
    # Deferred: muon_owners imports DTensor, which a plan without Muon's owners never needs.
    from trainer.parallel.muon_owners import busiest_owner_numel

    owned = busiest_owner_numel(shapes, owners)
    rows = sum(row_shard_numel(matrix, owners) for matrix in shapes)
    return 2 * owned, owned + rows + owned
