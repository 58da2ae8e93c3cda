"""Parallelism modes behind one interface (see base.Strategy).

A mode is one module here named as the mode (a Strategy subclass with that `name`) and one YAML in
conf/parallel/: the classes are found by importing this package's modules, so adding a mode changes
nothing else. A run imports only its own mode's module: the others pull in DTensor, FSDP and
ZeRO (torch.distributed.tensor alone is about half a second), which parallel=none never needs.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterator, Mapping

from trainer.parallel.base import Strategy


def _found(module_names) -> dict[str, type[Strategy]]:
    """Every Strategy subclass defined so far, by mode name, after importing these modules."""
    for name in module_names:
        importlib.import_module(f"{__name__}.{name}")
    found: dict[str, type[Strategy]] = {}
    pending = [Strategy]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if cls.__module__ != f"{__name__}.base":
            found[cls.name] = cls
    return found


class _Strategies(Mapping):
    """{mode name: Strategy class}; looking one mode up imports that mode's module only, listing
    them imports them all."""

    def __getitem__(self, mode: str) -> type[Strategy]:
        modules = {m.name for m in pkgutil.iter_modules(__path__)}
        found = _found([mode] if mode in modules else [])
        if mode not in found:
            found = dict(self.items())  # a mode not in a module of its name (or none at all)
        return found[mode]

    def __iter__(self) -> Iterator[str]:
        return iter(_found(m.name for m in pkgutil.iter_modules(__path__)))

    def __len__(self) -> int:
        return len(_found(m.name for m in pkgutil.iter_modules(__path__)))

    def items(self):
        return _found(m.name for m in pkgutil.iter_modules(__path__)).items()


STRATEGIES: Mapping[str, type[Strategy]] = _Strategies()


def strategy_class(mode: str) -> type[Strategy]:
    return STRATEGIES[mode]


def make_strategy(parallel_cfg, train_cfg, runtime, training: bool = True) -> Strategy:
    """The mode's Strategy for this worker; `training=False` for work that needs no synchronised
    replicas (evaluation), where a mode such as parallel=none may run at world > 1."""
    cls = STRATEGIES[parallel_cfg.mode]
    cls.check_mesh(runtime.shape)
    cls.check_world(runtime.dp_world, training=training, model_parallel=runtime.shape.model_parallel)
    return cls(parallel_cfg, train_cfg, runtime)
