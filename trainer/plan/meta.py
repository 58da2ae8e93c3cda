"""A model built for its shapes only: on the meta device, with no values and no memory."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from trainer.model.config import GPTConfig
from trainer.model.gpt import GPT


class ValuesSkipped(TorchFunctionMode):
    """torch.nn.init's fills skipped while a model is built for its shapes: a meta tensor holds no
    values, and meta normal_ (nn.Embedding's own init) is a Python reference whose first call
    imports torch._dynamo, about a second of every run's start (tests/system/test_startup.py)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def meta_model(config: GPTConfig) -> GPT:
    """The model of `config` on the meta device: shapes only, nothing allocated (70B included)."""
    with torch.device("meta"), ValuesSkipped():
        return GPT(config)
