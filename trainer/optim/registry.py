"""An optimizer is one registration: `trainer/optim/NAME.py` defines `OPTIMIZER` (what it is and how
it is built) and `conf/optim/NAME.yaml` (`name: NAME` and its defaults) makes `optim=NAME` a
choice. Nothing else names it: the config checks read the choices from conf/optim/ (torch-free),
and the build, the Strategies' checkpoint templates, the memory check and `dtrain plan` read the
registration found by `optim.name` here.

- Elementwise: updates each element from that element's gradient and state alone (AdamW, Lion,
  SGD), so every parallel mode runs it over whole tensors, row shards or DTensor shards alike (the
  Strategy's `elementwise_optimizer`).
- Matrix: a whole-matrix optimizer (Muon) on the parameters of some roles (GPT.param_role), an
  elementwise one (`rest`) on the others; each mode says how it holds a matrix whole (the
  Strategy's `matrix_optimizer`).

An optimizer from outside the package registers the same way: its YAML in a config folder
(`--config-dir DIR` or `hydra.searchpath`) with `name:` the module that defines OPTIMIZER
(importable, e.g. on PYTHONPATH: `name: my_optims.sgd`), as docs/optimizers.md shows.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from trainer.errors import ConfigError

PACKAGE = "trainer.optim"


@dataclass(frozen=True)
class State:
    """What an optimizer keeps per parameter: tensors shaped like it, and 0-d scalars (a step count)."""

    tensors: tuple[str, ...]
    scalars: tuple[str, ...] = ()


# The state of every registered optimizer class, filled as registrations are made: a checkpoint's
# state is loaded into the optimizer object a Strategy built, which knows only its class.
_STATE_OF_CLASS: dict[type, State] = {}


@dataclass(frozen=True)
class Elementwise:
    """An elementwise optimizer: `optimizer_class(param_groups, **kwargs(cfg.optim, device))`, the
    weight decay per group. `label` names it in messages; `step_copies` (by device type) is how many
    copies of a tensor its step makes at once, for the plan's temporaries (AdamW's sqrt(v) and its
    scaled copy; CUDA's fused AdamW none); `args`, the keys of its own it reads from `optim.args`
    (their defaults in its conf/optim/NAME.yaml)."""

    label: str
    optimizer_class: type[torch.optim.Optimizer]
    kwargs: Callable[[Any, torch.device], dict[str, Any]]
    state: State
    step_copies: dict[str, int] = field(default_factory=lambda: {"cpu": 0, "cuda": 0})
    args: tuple[str, ...] = ()

    def __post_init__(self):
        _STATE_OF_CLASS[self.optimizer_class] = self.state


@dataclass(frozen=True)
class Matrix:
    """A whole-matrix optimizer on the parameters whose role is in `roles`, the elementwise optimizer
    registered as `rest` on the others. `group_options(cfg.optim)` is its one parameter group's
    options, `kwargs(cfg.optim, device)` its class's keyword arguments."""

    label: str
    optimizer_class: type[torch.optim.Optimizer]
    roles: tuple[str, ...]
    group_options: Callable[[Any], dict[str, Any]]
    kwargs: Callable[[Any, torch.device], dict[str, Any]]
    state: State
    rest: str = "adamw"
    args: tuple[str, ...] = ()

    def __post_init__(self):
        _STATE_OF_CLASS[self.optimizer_class] = self.state


def module_of(name: str) -> str:
    """The module that registers `optim.name`: trainer/optim/NAME.py for dtrain's own, else the
    name itself is the module's (an optimizer registered from outside the package)."""
    return name if "." in name else f"{PACKAGE}.{name}"


def registered(name: str) -> Elementwise | Matrix:
    """The registration of `optim.name` (imports its module: the optimizer's class with it)."""
    try:
        module = importlib.import_module(module_of(name))
    except ModuleNotFoundError as err:
        wanted = module_of(name)
        if err.name is None or not (wanted == err.name or wanted.startswith(err.name + ".")):
            raise  # the module was found; something it imports was not
        raise ConfigError(f"optim.name={name!r}: no module {module_of(name)} registers it; add "
                          f"trainer/optim/{name}.py, or name an importable module that defines OPTIMIZER") from None
    registration = getattr(module, "OPTIMIZER", None)
    if not isinstance(registration, (Elementwise, Matrix)):
        raise ConfigError(f"optim.name={name!r}: module {module.__name__} defines no OPTIMIZER; define one there "
                          "(an Elementwise or a Matrix of trainer/optim/registry.py: docs/optimizers.md)")
    return registration


def elementwise_of(optim_cfg) -> Elementwise:
    """The elementwise optimizer of `optim.name`'s non-matrix parameters (all of them but Muon's)."""
    registration = registered(optim_cfg.name)
    return registered(registration.rest) if isinstance(registration, Matrix) else registration


def matrix_of(optim_cfg) -> Matrix | None:
    """The whole-matrix optimizer of `optim.name` (optim=muon's Muon), or None."""
    registration = registered(optim_cfg.name)
    return registration if isinstance(registration, Matrix) else None


def states_of(optim_cfg) -> tuple[tuple[str, State], ...]:
    """(label, state) of each optimizer `optim.name` runs (optim=muon: Muon's for the hidden
    matrices, then AdamW's for the rest): what the memory check and the plan count."""
    matrix, elementwise = matrix_of(optim_cfg), elementwise_of(optim_cfg)
    both = ((matrix.label, matrix.state),) if matrix else ()
    return (*both, (elementwise.label, elementwise.state))


def check_args(optim_cfg) -> None:
    """`optim.args` holds exactly the keys of its own that `optim.name`'s optimizers read (a typo
    would otherwise reach the optimizer's class in every worker as a traceback). Run with the
    checks that need torch, before anything is written."""
    matrix, elementwise = matrix_of(optim_cfg), elementwise_of(optim_cfg)
    takes = {*elementwise.args, *(matrix.args if matrix else ())}
    given = set(optim_cfg.get("args") or {})
    for key in sorted(given - takes):
        choices = f"its keys: {', '.join(sorted(takes))}" if takes else "it takes none"
        raise ConfigError(f"optim.args.{key} is not a key of optim.name={optim_cfg.name} ({choices}); drop it")
    for key in sorted(takes - given):
        raise ConfigError(f"optim.name={optim_cfg.name} reads optim.args.{key}, which has no value; give its default "
                          "in the optimizer's conf/optim/NAME.yaml (args:) or set it")


def empty_state(optimizer, like: torch.Tensor) -> dict[str, torch.Tensor]:
    """Zeroed per-parameter state of `optimizer` for a parameter (or shard) like `like`: what a
    checkpoint's state is loaded into before the optimizer has stepped."""
    state = _STATE_OF_CLASS[type(optimizer)]
    return {**{key: torch.zeros((), dtype=torch.float32) for key in state.scalars},
            **{key: torch.zeros_like(like) for key in state.tensors}}
