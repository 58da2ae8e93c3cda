"""float8 training (train.float8) through torchao, an optional extra: the blocks' Linear layers run
their matmuls in float8 (e4m3, scaled dynamically: per tensor or per row), their weights stay in high
precision (Float8Linear is an nn.Linear with the same `weight` and `bias`), so checkpoints, resharding
and `dtrain export` see the model they would without it.

    off         no conversion
    tensorwise  every block Linear, one scale per tensor (torchao's fastest recipe)
    rowwise     every block Linear, one scale per row (more accurate, slower casts)
    auto        tensorwise on the block Linears both of whose dimensions are at least FLOAT8_MIN_DIM,
                on CUDA sm89+ with torchao installed; off anywhere else (it never refuses)

The output head always stays in high precision (its logits feed the softmax; torchtitan and
OLMo-core keep it too). A dimension that is not a multiple of 16 is never converted (float8 GEMMs
need it). The conversion happens on the model as built, before the strategy wraps it (FSDP, DDP) and
before torch.compile. On a CPU tensorwise and rowwise run torchao's emulation (the float8 rounding in
fp32 matmuls): what the tests train with; no speed-up. FSDP's float8 all-gather stays off (it needs
NCCL: gloo has no float8 type), so FSDP gathers the high-precision weights.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging

import torch
import torch.nn as nn

from trainer.errors import ConfigError

# torchtitan's auto_filter_small_kn idea: a float8 GEMM pays only where the casts' cost (linear in
# the matrix's size) is small against the matmul's. torchao's tables (H100) put tensorwise's break-even
# near 2048 x 2048 for the token counts of a training step; the 124M model's 768-wide matrices were
# slower in float8 (0.93x, docs/performance.md). To be measured by make bench-gpu's float8 rows.
FLOAT8_MIN_DIM = 2048
FLOAT8_PACKAGE = "torchao"  # the `float8` extra (pyproject.toml)
FLOAT8_SM = (8, 9)  # float8 tensor cores: Ada (sm89), Hopper (sm90) and later
HEAD = "lm_head"


def resolve_float8(setting: str, device: torch.device) -> str:
    """train.float8 as the run converts: off, tensorwise, rowwise or auto (auto only where it can run:
    CUDA sm89+ with torchao; else off). tensorwise and rowwise without torchao, or on a GPU older than
    sm89: ConfigError (one line). On a CPU they run torchao's emulation."""
    if setting == "off":
        return "off"
    installed = importlib.util.find_spec(FLOAT8_PACKAGE) is not None
    capable = device.type == "cuda" and torch.cuda.get_device_capability(device) >= FLOAT8_SM
    if setting == "auto":
        return "auto" if installed and capable else "off"
    if not installed:
        raise ConfigError(f"train.float8={setting} needs torchao, which is not installed; pip install "
                          "'dtrain[float8]', or use train.float8=off")
    if device.type == "cuda" and not capable:
        major, minor = torch.cuda.get_device_capability(device)
        raise ConfigError(f"train.float8={setting} needs float8 tensor cores (CUDA sm89+: Ada, Hopper or later); "
                          f"{torch.cuda.get_device_name(device)} is sm{major}{minor}; use train.float8=off")
    return setting


def float8_layers(model: nn.Module, setting: str) -> list[str]:
    """The names of the Linear layers `setting` (resolved: tensorwise, rowwise or auto) converts: the
    blocks' (never the head), dimensions multiples of 16, and under auto both at least FLOAT8_MIN_DIM."""
    least = FLOAT8_MIN_DIM if setting == "auto" else 16
    return [name for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and name != HEAD
            and all(d % 16 == 0 and d >= least for d in module.weight.shape)]


def convert_float8(model: nn.Module, setting: str, device: torch.device) -> list[str]:
    """Convert `model`'s layers (float8_layers) in place for `setting` (resolved); returns their names."""
    names = float8_layers(model, setting) if setting != "off" else []
    if not names:
        return []
    Float8LinearConfig, convert_to_float8_training = _torchao()
    recipe = "rowwise" if setting == "rowwise" else "tensorwise"
    config = Float8LinearConfig.from_recipe_name(recipe)
    if device.type != "cuda":
        config = dataclasses.replace(config, emulate=True)
    chosen = set(names)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda _, fqn: fqn in chosen)
    return names


def _torchao():
    """torchao's float8 API, imported only by a run that converts (an optional extra, ~1 s). Its import
    logs a warning per CUDA extension it cannot load (no GPU) and one from torch's pytree: quieted."""
    quieted = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in quieted]
    for log in quieted:
        log.setLevel(logging.ERROR)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    finally:
        for log, level in zip(quieted, levels):
            log.setLevel(level)
    return Float8LinearConfig, convert_to_float8_training
