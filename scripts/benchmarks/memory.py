"""Peak memory of a worker and the bytes of model and optimizer state one rank holds."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from trainer.optim.build import parts


def _status_kib() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, value = line.split(":", 1)
                    out[key] = int(value.split()[0])
    except OSError:
        pass
    return out


def reset_peak(device: torch.device) -> bool:
    """Start a new peak-memory window; False when the peak cannot be reset (then it is a bound)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


class PeakMemory:
    """Peak memory growth since `start()`: RSS high-water mark on CPU, allocator peak on CUDA."""

    def __init__(self, device: torch.device):
        self.device = device

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            self.base = _status_kib().get("VmRSS", 0) * 1024
        self.exact = reset_peak(self.device)

    def peak_growth(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self.base
        return _status_kib().get("VmHWM", 0) * 1024 - self.base


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def tensor_bytes(tensors) -> int:
    """Bytes of these tensors held on this rank (a DTensor counts its local shard)."""
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors if t is not None)


def optimizer_state_entries(optimizer) -> list[dict]:
    """The per-parameter state this rank's optimizer holds, read the same way for every mode: its
    own `state`, and that of an optimizer it wraps (`.optim`): a ZeRO optimizer runs a local
    optimizer over this rank's part, and torch's ZeroRedundancyOptimizer keeps the state there
    only; optim=muon's optimizers are several (`parts`), the sharded modes' Muon keeps its state in
    `inner`. An entry reachable both ways counts once."""
    entries, seen = [], set()
    holders = [holder for part in parts(optimizer)
               for holder in (part, getattr(part, "optim", None), getattr(part, "inner", None))]
    for holder in holders:
        for entry in getattr(holder, "state", {}).values():
            if id(entry) not in seen:
                seen.add(id(entry))
                entries.append(entry)
    return entries


def optimizer_state_tensors(optimizer) -> list[torch.Tensor]:
    return [t for entry in optimizer_state_entries(optimizer) for t in entry.values() if torch.is_tensor(t)]


def state_tensors_per_parameter(optimizer) -> int:
    """How many parameter-shaped tensors the optimizer keeps per parameter (AdamW: exp_avg and
    exp_avg_sq; its scalar step is not one); 0 when this rank holds no state."""
    return max((sum(1 for t in entry.values() if torch.is_tensor(t) and t.dim() > 0)
                for entry in optimizer_state_entries(optimizer)), default=0)
