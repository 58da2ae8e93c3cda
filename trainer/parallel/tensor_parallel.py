"""The tensor-parallel plan of dtrain's blocks (parallel.tp > 1), Megatron's: each block's first
matrices split by output rows (column-wise: c_attn's q, k and v by whole heads, c_fc's hidden units),
its second by input columns (row-wise: both c_proj).

Sequence parallelism (Megatron's, arXiv 2205.05198) runs every training and validation forward:
between the blocks' matrices the residual stream is split by position, each tp rank holding T / tp
positions of every sequence (`SequenceShards`), so the norms, the residual adds, dropout and the
blocks' checkpointed inputs cost 1/tp of their whole-stream memory and compute. Each block's input is
all-gathered before its column-wise matrices (the backward reduce-scatters) and each row-wise output
is reduce-scattered back to positions (the backward all-gathers): the same bytes as the two
all-reduces without it, in collectives of half the traffic each. The head too runs on the rank's own
positions, so its matmul and logits are 1/tp of the whole (a vocabulary-split loss-parallel head
would save the same compute; this one keeps tied embeddings and every loss kernel as they are).
Parameters the tp ranks each hold whole (embeddings, norms, head, a mixture of experts' layer) see
only their rank's positions: their gradients are summed over the group once per step
(`sum_whole_parameter_grads`), one all-reduce. A forward that cannot be split (decoding, scoring a
continuation of any length) runs the stream whole on every rank, as without sequence parallelism.

Two matrices hold several matrices side by side (trainer/model/layers.py): c_attn is [q | k | v] and
SwiGLU's c_fc is [gate | up]. DTensor's Shard(0) gives each rank one contiguous block of rows, which
would hand rank 0 all of q; so the rows are first regrouped rank by rank, [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]
(`group_rows`), and each rank's block is then its own heads' q, k and v (GQA: a rank's query heads
are the ones that read its KV heads). A checkpoint holds the canonical order: `canonical_state` and
`tensor_parallel_state` convert between the two (trainer/parallel/base.py's state-dict methods).

Shape-only work: no values are read or made, so it runs on a meta-device model (dtrain plan).
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

from trainer.model.gpt import GPT
from trainer.parallel.collectives import functional_all_gather


def fused_parts(model: GPT) -> dict[str, tuple[int, ...]]:
    """{parameter name: row widths of the matrices it holds side by side} for the parameters whose
    rows are regrouped by tensor-parallel rank (weights and their biases)."""
    parts = {}
    for i, block in enumerate(model.transformer.h):
        prefix = f"transformer.h.{i}."
        fused = [("attn.c_attn", block.attn.c_attn)] + ([("mlp.c_fc", block.mlp.c_fc)] if _dense(block) else [])
        for module_name, module in fused:
            widths = model.matrix_parts(f"{prefix}{module_name}.weight", module.weight.shape[0])
            if len(widths) < 2:
                continue
            for param_name, _ in module.named_parameters():
                parts[f"{prefix}{module_name}.{param_name}"] = tuple(widths)
    return parts


def group_rows(tensor: torch.Tensor, widths: tuple[int, ...], tp: int) -> torch.Tensor:
    """[a | b | c] (row blocks of `widths`) -> [a_0 b_0 c_0 | a_1 b_1 c_1 | ...], a_r being a's r-th of
    `tp` equal row chunks: rank r's rows of each matrix, side by side."""
    pieces = [piece.unflatten(0, (tp, -1)) for piece in tensor.split(list(widths))]
    return torch.cat(pieces, dim=1).flatten(0, 1)


def ungroup_rows(tensor: torch.Tensor, widths: tuple[int, ...], tp: int) -> torch.Tensor:
    """The inverse of group_rows."""
    grouped = tensor.unflatten(0, (tp, -1)).split([w // tp for w in widths], dim=1)
    return torch.cat([piece.flatten(0, 1) for piece in grouped], dim=0)


class SequenceShards:
    """Sequence parallelism's split of the residual stream over the tp ranks of `mesh` (see the module
    doc). The model calls `begin` at every forward; the blocks' hooks read `active`."""

    def __init__(self, mesh):
        self.mesh, self.group = mesh, mesh.get_group()
        self.size, self.rank = mesh.size(), mesh.get_local_rank()
        self.active = False

    def begin(self, seq_len: int | None) -> bool:
        """Whether this forward runs split: one with targets (`seq_len` its local length; None for a
        forward without) whose positions divide evenly (config validation holds training to it). The
        flag stays until the next forward: activation checkpointing re-runs the blocks in backward."""
        self.active = seq_len is not None and seq_len % self.size == 0
        return self.active

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's positions of (B, T, ...) x: the backward leaves the others' gradient zero, so
        the whole parameters before it (embeddings) get their share, summed after the step's backward."""
        return x.chunk(self.size, dim=1)[self.rank].contiguous()

    def gather(self, x: torch.Tensor) -> DTensor:
        """(B, T / tp, C) positions -> the whole (B, T, C), replicated, as a DTensor a column-wise
        matrix takes as it is: its input gradient, partial over the ranks' heads, reduce-scatters back."""
        return DTensor.from_local(x, self.mesh, (Shard(1),), run_check=False).redistribute(self.mesh, (Replicate(),))

    def mean(self, loss: torch.Tensor) -> torch.Tensor:
        """The mean of the ranks' equal shares of the tokens' loss, as each rank's value; its gradient is
        this rank's share alone, since the collectives and the summed gradients add the ranks' up."""
        share = loss / self.size
        whole = funcol.all_reduce(share.detach(), "sum", self.group)
        return share + (whole - share).detach()

    def whole(self, per_token: torch.Tensor) -> torch.Tensor:
        """(B, T / tp) values of this rank's positions -> (B, T) of every position, on every rank
        (validation's per-token losses; no gradient)."""
        return functional_all_gather(per_token.contiguous(), gather_dim=1, group=self.group)


class _RowwiseToPositions(RowwiseParallel):
    """Row-wise, with the partial sums reduce-scattered to the rank's positions when the forward is
    sequence-parallel and all-reduced to the whole stream when not (torch's RowwiseParallel fixes
    one output layout at parallelize time; this overrides the hook it registers for it)."""

    def __init__(self, shards: SequenceShards):
        super().__init__()
        self.shards = shards

    def _prepare_output_fn(self, _output_layouts, _use_local_output, _module, outputs, _device_mesh):
        placement = Shard(1) if self.shards.active else Replicate()
        return outputs.redistribute(placements=(placement,), async_op=True).to_local()


def parallelize(model: GPT, tp_mesh) -> GPT:
    """Split every block of `model` (on its device, or meta) over the 1-D mesh `tp_mesh`, in place."""
    tp = tp_mesh.size()
    parts = fused_parts(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in parts:
                param.data = group_rows(param.data, parts[name], tp)
    shards = SequenceShards(tp_mesh)

    def gather_input(module, args):
        return (shards.gather(args[0]), *args[1:]) if shards.active else None

    def gather_whole(module, args):
        # A mixture of experts' layer runs whole on every rank (its routing statistics are the whole
        # sequence's): a plain tensor, whose gradient (the rank's positions' share) reduce-scatters back.
        return (shards.gather(args[0]).to_local(grad_placements=(Partial(),)),) if shards.active else None

    def keep_local(module, args, output):
        return shards.local(output) if shards.active else None

    for block in model.transformer.h:
        plan = {"attn.c_attn": ColwiseParallel(), "attn.c_proj": _RowwiseToPositions(shards)}
        if _dense(block):
            plan |= {"mlp.c_fc": ColwiseParallel(), "mlp.c_proj": _RowwiseToPositions(shards)}
            block.mlp.register_forward_pre_hook(gather_input)
        else:
            block.mlp.register_forward_pre_hook(gather_whole)
            block.mlp.register_forward_hook(keep_local)
        parallelize_module(block, tp_mesh, plan)
        block.attn.register_forward_pre_hook(gather_input)
        if block.attn.qk_norm:
            # QK-norm's weights act on every head, but a rank sees only its own heads: as DTensors
            # replicated over the group, with the input sharded by head (dimension 2 of (B, T, heads,
            # head_dim)), their gradients are summed over the group's heads (a local-only weight
            # would train on its rank's heads alone, and the ranks' copies drift apart).
            by_head = SequenceParallel(sequence_dim=2, use_local_output=True)
            parallelize_module(block.attn, tp_mesh, {"q_norm": by_head, "k_norm": by_head})
        attn = block.attn
        # The attention runs on the local shard's heads: n_head / tp queries, n_kv_head / tp keys and values.
        attn.n_head //= tp
        attn.n_kv_head //= tp
        attn.split_sizes = tuple(width // tp for width in attn.split_sizes)
    # Gathering a 2-D (FSDP x TP) shard whole takes two all-gathers in turn, and torch logs a warning
    # about it from every rank at a checkpoint's save (and Muon's first gathered step): the gathers are
    # of whole matrices, once per save or step, by design, and the user can do nothing about it.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    model.tensor_parallel_parts = parts  # what the state-dict conversions regroup, and how
    model.tensor_parallel_degree = tp
    model.sequence_shards = shards
    return model


def sum_whole_parameter_grads(model: GPT) -> None:
    """Sum over the tp group the gradients of the parameters every tp rank holds whole (not split
    over the mesh's tp dimension): under sequence parallelism each holds its positions' share. One
    all-reduce per dtype of their local pieces (FSDP's shards too: the same piece on every tp rank)."""
    shards = model.sequence_shards
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for param in model.parameters():
        if param.grad is None or _split_over_tp(param):
            continue
        grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for grads in by_dtype.values():
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=shards.group)
        for grad, summed in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(summed)


def _split_over_tp(param) -> bool:
    return isinstance(param, DTensor) and "tp" in (param.device_mesh.mesh_dim_names or ())


def _dense(block) -> bool:
    """A block with a dense MLP. A mixture of experts' layer (trainer/model/moe.py) stays whole on every
    tensor-parallel rank: its input, gathered whole, is the same on all of them, and expert parallelism
    (parallel.ep) is what splits its experts."""
    return hasattr(block.mlp, "c_fc")


def _regrouped(tensor: torch.Tensor, widths: tuple[int, ...], tp: int, forward: bool) -> torch.Tensor:
    """A DTensor with its rows regrouped (group_rows) or ungrouped, in its own sharding. The full
    matrix is gathered once (one matrix at a time: a checkpoint's save or load, not a step). Every
    rank then holds the same full matrix, so each cuts its own shard (src_data_rank=None) instead of
    taking it from rank 0 in a scatter: one collective a matrix, not two."""
    convert = group_rows if forward else ungroup_rows
    if not isinstance(tensor, DTensor):
        return convert(tensor, widths, tp)
    full = convert(tensor.full_tensor(), widths, tp)
    return distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None)


def canonical_state(model: GPT, state: dict) -> dict:
    """A model state dict (or optimizer state by name) of a tensor-parallel model with the fused
    matrices' rows back in the model's own order ([q | k | v]), as every other layout saves them."""
    return _convert(model, state, forward=False)


def tensor_parallel_state(model: GPT, state: dict) -> dict:
    """The inverse of canonical_state: a checkpoint's tensors regrouped for this model's shards."""
    return _convert(model, state, forward=True)


def _convert(model: GPT, state: dict, forward: bool) -> dict:
    parts = getattr(model, "tensor_parallel_parts", None)
    if not parts:
        return state
    tp = model.tensor_parallel_degree
    out = {}
    for name, value in state.items():
        widths = parts.get(name)
        if widths is None:
            out[name] = value
        elif isinstance(value, dict):  # optimizer state: {state key: tensor}
            out[name] = {key: _regrouped(t, widths, tp, forward) if _is_rows(t, widths) else t
                         for key, t in value.items()}
        else:
            out[name] = _regrouped(value, widths, tp, forward)
    return out


def _is_rows(tensor, widths: tuple[int, ...]) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.dim() > 0 and tensor.shape[0] == sum(widths)


def grad_norm_over_meshes(parameters, world: int) -> torch.Tensor:
    """The global L2 norm of the gradients of parameters held as DTensors on several meshes (TP's,
    FSDP's data-parallel one, both) or whole on every rank: each rank sums the squares of its local
    pieces, each divided by how many ranks hold the same piece, and one all-reduce adds them up."""
    sums: dict[float, list[torch.Tensor]] = {}
    for param in parameters:
        grad = param.grad
        if grad is None:
            continue
        copies = world
        if isinstance(grad, DTensor):
            mesh = grad.device_mesh
            replicated = [mesh.size(i) for i, p in enumerate(grad.placements) if isinstance(p, Replicate)]
            copies = world // mesh.size() * math.prod(replicated)
            grad = grad.to_local()
        sums.setdefault(copies, []).append(grad)
    device = next(iter(sums.values()))[0].device
    total = torch.zeros((), dtype=torch.float32, device=device)
    for copies, grads in sums.items():
        norms = torch._foreach_norm(grads)
        total += torch.stack([n.float() for n in norms]).square().sum() / copies
    if world > 1:
        dist.all_reduce(total)
    return total.sqrt()


def clip_grads_over_meshes(parameters, max_norm: float, world: int) -> torch.Tensor:
    """Scale the gradients so their global norm is at most max_norm (torch's clip_grad_norm_
    formula); returns the norm before clipping."""
    parameters = list(parameters)
    norm = grad_norm_over_meshes(parameters, world)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for param in parameters:
            if param.grad is not None:
                grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                grad.mul_(coef.to(grad.dtype))
    return norm
