"""Muon's step over stacks of same-shape matrices (as nanochat and modded-nanogpt make it).

A hidden weight can hold several matrices side by side (GPT-2's c_attn: q, k and v; SwiGLU's c_fc:
gate and up): each is orthogonalized on its own, as the matrix it is. The step works on stacks:

- a *family* is the parameters of one shape cut into the same parts (the c_attn of every block):
  their momenta live in one [L, rows, cols] buffer (each parameter's momentum is a view of it, so
  the optimizer state stays per parameter, under its name in checkpoints), their gradients are
  concatenated into one stack, and the momentum and Nesterov updates are one op each;
- a *batch* is every part of one shape (a tall part transposed: wide is cheaper), from every family:
  Newton-Schulz runs on it once with batched matmuls (bmm / baddbmm on [N, rows, cols]).

So a step launches a few ops per family and per batch where stepping one matrix at a time launched
~70 per matrix (tests/unit/test_muon_batched.py counts them). On CUDA the two stacked pieces (momentum,
Newton-Schulz) are compiled, a few kernels each.

`found_inf` (a 0-d device tensor, 1 for a step to skip) masks the step without a host sync: the
momentum keeps its value, and the decay and the update are scaled to nothing (train.on_nonfinite).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from trainer.optim.registry import Matrix, State

# Keller Jordan's quintic Newton-Schulz coefficients (torch.optim.Muon's defaults).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
ADJUST_LR = ("original", "match_rms_adamw")


def lr_ratio(rule: str | None, rows: int, cols: int) -> float:
    """How Muon scales its lr for a matrix of this shape: "original" (Keller Jordan's,
    sqrt(max(1, rows/cols))) or "match_rms_adamw" (Moonshot's 0.2 x sqrt(max(rows, cols)), whose
    updates have AdamW's RMS, so AdamW-tuned rates carry over). torch.optim.Muon's rule (None, the
    stock optimizer's default, is "original")."""
    if rule in (None, "original"):
        return math.sqrt(max(1.0, rows / cols))
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"unknown Muon lr rule {rule!r} (one of {', '.join(ADJUST_LR)})")


def newton_schulz(stack: torch.Tensor, coefficients, steps: int, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """The quintic Newton-Schulz iteration on each matrix of a wide [N, rows <= cols] stack at once:
    approximately U V^T of each matrix's SVD. Returns a new stack in `dtype`."""
    a, b, c = coefficients
    x = stack.to(dtype)
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # each spectral norm at most 1
    for _ in range(steps):
        gram = torch.bmm(x, x.mT)
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x


def momentum_update(grads: torch.Tensor, momentum: torch.Tensor, beta: float, nesterov: bool,
                    found_inf: torch.Tensor | None) -> torch.Tensor:
    """Step a family's momentum stack in place by its gradient stack (`grads`, ours to overwrite);
    return what Newton-Schulz orthogonalizes. A step to skip leaves the momentum as it was."""
    if found_inf is not None:
        grads = torch.where(found_inf.bool(), momentum, grads)  # lerp to itself: exactly unchanged
    momentum.lerp_(grads, 1 - beta)
    return grads.lerp_(momentum, beta) if nesterov else momentum


@dataclass
class Band:
    """`count` consecutive parts of `rows` rows each, from row `start` of a family's matrices."""

    start: int
    count: int
    rows: int


@dataclass
class Family:
    params: list[nn.Parameter]
    bands: list[Band]
    momentum: torch.Tensor  # [len(params), rows, cols]
    views: list[torch.Tensor] = field(default_factory=list)  # each parameter's momentum, a view of it

    @property
    def cols(self) -> int:
        return self.momentum.shape[-1]


@dataclass
class Batch:
    """The parts of one oriented (wide) shape: (family index, band index) in stack order."""

    entries: list[tuple[int, int]] = field(default_factory=list)


def bands_of(parts: tuple[int, ...]) -> list[Band]:
    """Row parts (e.g. q, k, v widths) as runs of equal ones."""
    bands, start = [], 0
    for rows in parts:
        if bands and bands[-1].rows == rows and bands[-1].start + bands[-1].count * rows == start:
            bands[-1].count += 1
        else:
            bands.append(Band(start, 1, rows))
        start += rows
    return bands


class BatchedMuon(torch.optim.Optimizer):
    """Muon over stacks (see the module doc). The state is torch.optim.Muon's: one
    `momentum_buffer` per parameter, so checkpoints by parameter name are those of the stock
    optimizer. `row_parts` maps a parameter to the row widths of the matrices it holds (one
    matrix when absent); `ns_dtype` is Newton-Schulz's precision (float32 lets every parallel mode
    match one process within 1e-5 on CPU; bfloat16 is the stock optimizer's). A step skips under
    `found_inf` (an argument, or the attribute GradScaler and trainer.optim.build.verdict set)."""

    masks_on_device = True

    def __init__(self, params, lr: float = 0.02, weight_decay: float = 0.0, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, adjust_lr_fn: str = "original", *,
                 ns_coefficients=NS_COEFFICIENTS, eps: float = 1e-7,
                 row_parts: dict[torch.Tensor, tuple[int, ...]] | None = None,
                 ns_dtype: torch.dtype = torch.float32, compiled: bool = False):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn, ns_coefficients=ns_coefficients, eps=eps)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for param in group["params"]:
                if param.dim() != 2:
                    raise ValueError(f"Muon steps 2-D matrices only, not a parameter of shape {tuple(param.shape)}")
        self.row_parts = {id(p): tuple(parts) for p, parts in (row_parts or {}).items()}
        self.ns_dtype = ns_dtype
        self._momentum_update = torch.compile(momentum_update, dynamic=False) if compiled else momentum_update
        self._newton_schulz = torch.compile(newton_schulz, dynamic=False) if compiled else newton_schulz
        self._layouts: list[tuple[list[Family], dict[tuple[int, int], Batch]]] | None = None

    # --- the stacks, and the state as views of them -----------------------------------------------
    def _layout_is_current(self) -> bool:
        """Whether every parameter's momentum is still a view of its family's stack (a load of a
        state dict or a first step puts new tensors there)."""
        if self._layouts is None:
            return False
        return all(self.state[p].get("momentum_buffer") is view for families, _ in self._layouts
                   for family in families for p, view in zip(family.params, family.views))

    def _build_layouts(self) -> None:
        self._layouts = []
        for group in self.param_groups:
            by_key: dict[tuple, list[nn.Parameter]] = {}
            for param in group["params"]:
                parts = self.row_parts.get(id(param), (param.shape[0],))
                if sum(parts) != param.shape[0]:
                    raise ValueError(f"row parts {parts} do not add up to {param.shape[0]} rows")
                key = (tuple(param.shape), parts, param.dtype, param.device)
                by_key.setdefault(key, []).append(param)
            families, batches = [], {}
            for (shape, parts, _, _), params in by_key.items():
                momentum = torch.stack([self._momentum_of(p) for p in params])
                families.append(Family(params, bands_of(parts), momentum))
                for b, band in enumerate(families[-1].bands):
                    oriented = (min(band.rows, shape[1]), max(band.rows, shape[1]))
                    batches.setdefault(oriented, Batch()).entries.append((len(families) - 1, b))
            for family in families:
                family.views = list(family.momentum.unbind(0))
                for param, view in zip(family.params, family.views):
                    self.state[param]["momentum_buffer"] = view
            self._layouts.append((families, batches))

    def _momentum_of(self, param: nn.Parameter) -> torch.Tensor:
        loaded = self.state[param].get("momentum_buffer")
        if loaded is None:
            return torch.zeros_like(param, memory_format=torch.contiguous_format)
        return loaded.to(device=param.device, dtype=param.dtype)

    # --- the step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable | None = None, found_inf: torch.Tensor | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if found_inf is None:
            found_inf = getattr(self, "found_inf", None)
        if not self._layout_is_current():
            self._build_layouts()
        for group, (families, batches) in zip(self.param_groups, self._layouts):
            self._step_group(group, families, batches, found_inf)
        return loss

    def _step_group(self, group: dict, families: list[Family], batches: dict, found_inf) -> None:
        with_grad = [p.grad is not None for f in families for p in f.params]
        if not any(with_grad):
            return
        if not all(with_grad):
            raise RuntimeError("Muon steps its stacks whole: some of its parameters have no gradient")
        updates = {}
        for index, family in enumerate(families):
            grads = torch.cat([p.grad for p in family.params]).view(family.momentum.shape)
            updates[index] = self._momentum_update(grads, family.momentum, group["momentum"], group["nesterov"],
                                                   found_inf)
        orthogonal = self._orthogonalize(group, families, batches, updates)
        lr, decay = group["lr"], group["lr"] * group["weight_decay"]
        keep = None if found_inf is None else 1 - found_inf.to(torch.float32)
        for index, family in enumerate(families):
            step = []
            for b, band in enumerate(family.bands):
                scale = -lr * lr_ratio(group["adjust_lr_fn"], band.rows, family.cols)
                step.append(orthogonal[index, b].mul_(scale if keep is None else keep * scale))
            step = step[0] if len(step) == 1 else torch.cat(step, dim=1)
            if decay:
                torch._foreach_mul_(family.params, 1 - decay if keep is None else 1 - keep * decay)
            torch._foreach_add_(family.params, list(step.unbind(0)))

    def _orthogonalize(self, group: dict, families: list[Family], batches: dict, updates: dict) -> dict:
        """{(family, band): its orthogonalized parts as [L, count x rows, cols]}, each batch's
        Newton-Schulz run once over all its parts."""
        out = {}
        for (short, _), batch in batches.items():
            pieces = []
            for index, b in batch.entries:
                band, update = families[index].bands[b], updates[index]
                L, cols = update.shape[0], update.shape[-1]
                rows = update[:, band.start: band.start + band.count * band.rows]
                part = rows.reshape(L * band.count, band.rows, cols)
                pieces.append(part if band.rows == short else part.mT)
            stack = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
            result = self._newton_schulz(stack, group["ns_coefficients"], group["ns_steps"], group["eps"],
                                         self.ns_dtype)
            for (index, b), piece in zip(batch.entries, result.split([p.shape[0] for p in pieces])):
                band, L = families[index].bands[b], updates[index].shape[0]
                piece = piece if band.rows == short else piece.mT
                out[index, b] = piece.reshape(L, band.count * band.rows, -1).to(updates[index].dtype)
        return out


def muon_group_options(optim_cfg) -> dict:
    """Muon's one group; `lr_scale` puts its lr on the schedule as the ratio of the two peaks."""
    return {"lr_scale": optim_cfg.muon.lr / optim_cfg.lr}


def muon_kwargs(optim_cfg, device: torch.device) -> dict:
    """Keyword arguments for BatchedMuon (Newton-Schulz in bfloat16 on CUDA and float32 elsewhere
    with optim.muon.ns_dtype=auto; its two stacked steps compiled on CUDA)."""
    m = optim_cfg.muon
    dtype = m.ns_dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    return dict(lr=m.lr, weight_decay=m.weight_decay, momentum=m.momentum, nesterov=m.nesterov,
                ns_steps=m.ns_steps, adjust_lr_fn=m.adjust_lr, ns_dtype=getattr(torch, dtype),
                compiled=device.type == "cuda")


# optim=muon: Muon on the blocks' 2-D hidden matrices (GPT.param_role "hidden"), AdamW on the rest
# (embeddings, the output head, norms and biases are not matrices of that kind).
OPTIMIZER = Matrix("Muon", BatchedMuon, roles=("hidden",), group_options=muon_group_options, kwargs=muon_kwargs,
                   state=State(tensors=("momentum_buffer",)), rest="adamw")
