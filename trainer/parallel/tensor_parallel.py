"""The tensor-parallel plan of dtrain's blocks (parallel.tp > 1), Megatron's: each block's first
matrices split by output rows (column-wise: c_attn's q, k and v by whole heads, c_fc's hidden units),
its second by input columns (row-wise: both c_proj), so a block costs one all-reduce of the residual
stream in the forward (after each c_proj) and one in the backward (before each first matrix).

Embeddings, norms and the output head stay whole on every tensor-parallel rank (a gathered head):
their inputs are the replicated residual stream, so their gradients agree across the group.

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
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

from trainer.model.gpt import GPT


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


def parallelize(model: GPT, tp_mesh) -> GPT:
    """Split every block of `model` (on its device, or meta) over the 1-D mesh `tp_mesh`, in place."""
    tp = tp_mesh.size()
    parts = fused_parts(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in parts:
                param.data = group_rows(param.data, parts[name], tp)
    attention = {"attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel()}
    mlp = {"mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()}
    for block in model.transformer.h:
        parallelize_module(block, tp_mesh, {**attention, **(mlp if _dense(block) else {})})
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
    return model


def _dense(block) -> bool:
    """A block with a dense MLP. A mixture of experts' layer (trainer/model/moe.py) stays whole on every
    tensor-parallel rank: its input, the attention's all-reduced output, is the same on all of them,
    so are its gradients, and expert parallelism (parallel.ep) is what splits its experts."""
    return hasattr(block.mlp, "c_fc")


def _regrouped(tensor: torch.Tensor, widths: tuple[int, ...], tp: int, forward: bool) -> torch.Tensor:
    """A DTensor with its rows regrouped (group_rows) or ungrouped, in its own sharding. The full
    matrix is gathered once (one matrix at a time: a checkpoint's save or load, not a step)."""
    convert = group_rows if forward else ungroup_rows
    if not isinstance(tensor, DTensor):
        return convert(tensor, widths, tp)
    full = convert(tensor.full_tensor(), widths, tp)
    return distribute_tensor(full, tensor.device_mesh, tensor.placements)


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
