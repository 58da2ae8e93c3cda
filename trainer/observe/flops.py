"""A device's dense bf16 peak FLOP/s, the denominator of MFU (the step lines, the summary and
`make bench-gpu`)."""

from __future__ import annotations

import torch

# Dense bf16 peak FLOP/s per GPU (no sparsity), matched against torch.cuda.get_device_name().
# Most specific names first.
PEAK_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM
    ("H200", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A10G", 70e12),
    ("L4", 121e12),
    ("L40S", 362e12),
    ("V100", 125e12),  # fp16 tensor cores (no bf16)
)


def device_peak_flops(device: torch.device, override: float | None = None) -> float | None:
    """Peak FLOP/s of one device: `override` (train.peak_flops) when given, else the table for
    known GPUs, else None (then no MFU is reported)."""
    if override:
        return float(override)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_FLOPS:
        if key in name:
            return flops
    return None
