"""The elementwise optimizers by `optim.name`, and the state each optimizer keeps per parameter.

An elementwise optimizer updates each element from that element's gradient and state alone, so
every parallel mode can run it over whole tensors, row shards or DTensor shards alike (the
Strategy's `elementwise_optimizer`). Adding one is an entry in ELEMENTWISE and in STATE, its class
(here in trainer/optim/ if torch has none), conf/optim/NAME.yaml, and its name in
trainer/config/schema.py's OPTIMIZERS: nothing in trainer/parallel/ changes (docs/optimizers.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from trainer.optim.lion import Lion
from trainer.optim.muon import BatchedMuon


@dataclass(frozen=True)
class State:
    """What an optimizer keeps per parameter: tensors shaped like it, and 0-d scalars (a step count);
    `name`: the optimizer as a message names it."""

    name: str
    tensors: tuple[str, ...]
    scalars: tuple[str, ...] = ()


STATE: dict[type, State] = {
    torch.optim.AdamW: State("AdamW", tensors=("exp_avg", "exp_avg_sq"), scalars=("step",)),
    Lion: State("Lion", tensors=("exp_avg",)),
    BatchedMuon: State("Muon", tensors=("momentum_buffer",)),
}


def empty_state(optimizer, like: torch.Tensor) -> dict[str, torch.Tensor]:
    """Zeroed per-parameter state of `optimizer` for a parameter (or shard) like `like`: what a
    checkpoint's state is loaded into before the optimizer has stepped."""
    state = STATE[type(optimizer)]
    return {**{key: torch.zeros((), dtype=torch.float32) for key in state.scalars},
            **{key: torch.zeros_like(like) for key in state.tensors}}


def adamw_kwargs(optim_cfg, device: torch.device) -> dict[str, Any]:
    """Keyword arguments for torch.optim.AdamW (the weight decay is per parameter group)."""
    choice = optim_cfg.fused.lower()  # `optim.fused=true` arrives as 'True' (Hydra reads a bool)
    fused = device.type == "cuda" if choice == "auto" else choice == "true"
    return dict(
        lr=optim_cfg.lr,
        betas=tuple(optim_cfg.betas),
        eps=optim_cfg.eps,
        fused=fused,
    )


def lion_kwargs(optim_cfg, device: torch.device) -> dict[str, Any]:
    """Keyword arguments for Lion (the weight decay is per parameter group)."""
    return dict(lr=optim_cfg.lr, betas=tuple(optim_cfg.betas))


@dataclass(frozen=True)
class Elementwise:
    """One elementwise optimizer: its class, its keyword arguments from the config, and how many
    copies of a tensor its unfused step makes at once (the memory plan's temporaries; AdamW's sqrt(v)
    and its scaled copy; CUDA's fused AdamW makes none)."""

    optimizer_class: type[torch.optim.Optimizer]
    kwargs: Callable[[Any, torch.device], dict[str, Any]]
    step_copies: dict[str, int]  # by device type

    @property
    def state(self) -> State:
        return STATE[self.optimizer_class]


ELEMENTWISE = {
    "adamw": Elementwise(torch.optim.AdamW, adamw_kwargs, {"cpu": 2, "cuda": 0}),
    "lion": Elementwise(Lion, lion_kwargs, {"cpu": 1, "cuda": 1}),  # its one interpolation
}


def elementwise_of(optim_cfg) -> Elementwise:
    """The elementwise optimizer of `optim.name` (optim=muon's non-matrix part is AdamW's)."""
    return ELEMENTWISE["adamw" if optim_cfg.name == "muon" else optim_cfg.name]


def states_of(optim_cfg) -> tuple[State, ...]:
    """The state each optimizer of `optim.name` keeps (optim=muon: Muon's for the hidden matrices,
    then AdamW's for the rest): what the memory check and the plan count, from this one table."""
    elementwise = STATE[elementwise_of(optim_cfg).optimizer_class]
    return (STATE[BatchedMuon], elementwise) if optim_cfg.name == "muon" else (elementwise,)
