"""Building the run's optimizer from the registration of `optim.name` (trainer/optim/registry.py):
an elementwise one (AdamW, Lion) alone, or a whole-matrix one (Muon) on the parameters of its roles
and its elementwise `rest` on the others.

Which parameter goes to which optimizer is decided here once, by its role (GPT.param_role): Muon
orthogonalizes updates of the blocks' 2-D matrices, where that helps; embeddings, the output head,
norms and biases are not matrices of that kind and stay on the elementwise optimizer. What to run
is decided here too (class, parameter groups, keyword arguments); how it runs over the mode's
parameters is the Strategy's answer to two questions (`build_optimizer`):

- elementwise_optimizer(Elementwise run): every element from its own gradient and state, so over
  whole tensors (none, dp, ddp), ZeRO-1's rows, ZeroRedundancyOptimizer's whole parameters or
  FSDP's DTensor shards alike;
- matrix_optimizer(Matrix run): Muon needs each whole matrix (batched on every replica, or owned
  by one rank under zero and fsdp).

The run's first line shows the split (`describe_split`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from trainer.model.gpt import GPT
from trainer.optim.registry import elementwise_of, matrix_of


@dataclass
class ElementwiseRun:
    """An elementwise optimizer to run: `optimizer_class(groups, **kwargs)` on one replica."""

    optimizer_class: type[torch.optim.Optimizer]
    groups: list[dict[str, Any]]
    kwargs: dict[str, Any]


@dataclass
class MatrixRun:
    """A whole-matrix optimizer to run (Muon's BatchedMuon) over the (name, matrix) pairs `named`, in one group
    with the options `group`; `row_parts` holds the row widths of the matrices each parameter
    holds side by side (q, k, v; gate, up)."""

    optimizer_class: type[torch.optim.Optimizer]
    named: list[tuple[str, nn.Parameter]]
    group: dict[str, Any]
    kwargs: dict[str, Any]
    row_parts: dict[nn.Parameter, tuple[int, ...]]

    def build(self, params: list[nn.Parameter], row_parts: dict[nn.Parameter, tuple[int, ...]], **overrides):
        """The optimizer over `params` (the matrices themselves, or whole copies of them)."""
        return self.optimizer_class([{**self.group, "params": params}], row_parts=row_parts,
                                    **{**self.kwargs, **overrides})


def build_optimizer(model: nn.Module, optim_cfg, strategy):
    """The run's optimizer, run as `strategy` runs optimizers: the elementwise one alone, or
    Optimizers([matrix optimizer, elementwise optimizer]) (optim=muon: Muon and AdamW)."""
    raw, device = strategy.unwrap(model), strategy.rt.device
    matrices, rest = split_params(raw, optim_cfg)
    kind = elementwise_of(optim_cfg)
    elementwise = strategy.elementwise_optimizer(ElementwiseRun(
        kind.optimizer_class, param_groups((p for _, p in rest), optim_cfg.weight_decay),
        kind.kwargs(optim_cfg, device)))
    if not matrices:
        return elementwise
    matrix = matrix_of(optim_cfg)
    whole = strategy.matrix_optimizer(MatrixRun(matrix.optimizer_class, matrices, matrix.group_options(optim_cfg),
                                                matrix.kwargs(optim_cfg, device), muon_parts(raw, matrices)))
    return Optimizers([whole, elementwise])


def split_params(model: nn.Module, optim_cfg) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    """(the whole-matrix optimizer's, the elementwise optimizer's) (name, parameter) pairs; the first
    list is empty unless `optim.name` registers a Matrix optimizer (Muon: the hidden matrices)."""
    matrix = matrix_of(optim_cfg)
    roles = matrix.roles if matrix else ()
    matrices, rest = [], []
    for name, param in model.named_parameters():  # the tied embedding once, under transformer.wte
        if not param.requires_grad:
            continue
        (matrices if GPT.param_role(name, param) in roles else rest).append((name, param))
    return matrices, rest


def param_groups(params: Iterable[nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """The elementwise optimizer's two groups: decayed 2-D weights (matmuls, embeddings) and
    undecayed biases / norms."""
    decay, no_decay = [], []
    for param in params:
        (decay if param.dim() >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def muon_parts(model: nn.Module, named: list[tuple[str, nn.Parameter]]) -> dict[nn.Parameter, tuple[int, ...]]:
    """{hidden matrix: the row widths of the matrices it holds} (q, k, v; gate, up), as the model says."""
    return {param: model.matrix_parts(name, param.shape[0]) for name, param in named}


class Optimizers:
    """Several optimizers stepped as one (Muon's and AdamW's): the loop sets the lr through
    `param_groups` and steps; checkpoints hand `parts` to DCP, which takes a list of optimizers."""

    def __init__(self, parts: list[Any]):
        self.parts = parts

    @property
    def param_groups(self) -> list[dict]:
        return [group for part in self.parts for group in part.param_groups]

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)


def parts(optimizer) -> list[Any]:
    """The optimizers inside (one for AdamW alone)."""
    return optimizer.parts if isinstance(optimizer, Optimizers) else [optimizer]


def _arithmetic(part):
    """The optimizer object that does a part's arithmetic (ZeRO's wrappers keep it as `optim`)."""
    return getattr(part, "optim", part)


def masks_on_device(optimizer) -> bool:
    """Whether every part can skip its update on a device-side verdict without a host sync: fused
    AdamW reads `found_inf` (how GradScaler skips a step), and so do Muon's (`masks_on_device`)."""
    return all(getattr(_arithmetic(part), "masks_on_device", False)
               or bool(getattr(_arithmetic(part), "defaults", {}).get("fused")) for part in parts(optimizer))


@contextlib.contextmanager
def verdict(optimizer, found_inf: torch.Tensor | None):
    """The step under `found_inf` (1.0: no update), set where each part's arithmetic reads it."""
    targets = [] if found_inf is None else [_arithmetic(part) for part in parts(optimizer)]
    for target in targets:
        target.found_inf = found_inf
    try:
        yield
    finally:
        for target in targets:
            del target.found_inf


def describe_split(model: nn.Module, optim_cfg) -> str:
    """'optim=muon (Muon 0.79M params in 16 matrices, AdamW 6.44M)' for the run's first line."""
    matrices, rest = split_params(model, optim_cfg)
    if not matrices:
        return f"optim={optim_cfg.name}"
    count = lambda pairs: sum(p.numel() for _, p in pairs) / 1e6  # noqa: E731
    return (f"optim={optim_cfg.name} ({matrix_of(optim_cfg).label} {count(matrices):.2f}M params in "
            f"{len(matrices)} matrices, {elementwise_of(optim_cfg).label} {count(rest):.2f}M in {len(rest)} tensors)")
