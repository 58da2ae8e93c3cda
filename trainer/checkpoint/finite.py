"""Whether a state's tensors are all finite: checked before a checkpoint is written (a diverged
run's NaN weights are never saved) and after weights are read for eval, sample and export; and
how many bytes they take (what a save is about to write)."""

from __future__ import annotations

import sys

import torch


def _tensors(state, prefix: str = ""):
    if isinstance(state, dict):
        for key, value in state.items():
            yield from _tensors(value, f"{prefix}{key}.")
    elif isinstance(state, torch.Tensor):
        yield prefix.rstrip("."), state


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's shard, any other tensor itself. DTensor is looked up
    only where its module is loaded (a tensor cannot be one otherwise), so a one-process run never
    imports torch.distributed.tensor (about half a second) for this check."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return tensor.to_local() if dtensor is not None and isinstance(tensor, dtensor.DTensor) else tensor


def nonfinite_tensors(state) -> list[str]:
    """Dotted names of the floating-point tensors in a (nested) state dict that hold a NaN or an
    inf; a sharded DTensor counts this rank's shard. One host sync for the whole state."""
    by_device: dict[torch.device, tuple[list[str], list[torch.Tensor]]] = {}
    for name, tensor in _tensors(state):
        local = _local(tensor)
        if local.is_floating_point() and local.numel():
            names, flags = by_device.setdefault(local.device, ([], []))
            names.append(name)
            flags.append(torch.isfinite(local).all())
    bad = []
    for names, flags in by_device.values():  # one read per device (AdamW keeps `step` on the CPU)
        bad += [name for name, ok in zip(names, torch.stack(flags).tolist()) if not ok]
    return sorted(bad)


def state_bytes(state) -> int:
    """The bytes of a (nested) state dict's tensors on this rank (a DTensor: this rank's shard): what
    this rank writes into a checkpoint, for the free-space check before a save."""
    total = 0
    for _, tensor in _tensors(state):
        local = _local(tensor)
        total += local.numel() * local.element_size()
    return total


def module_state_bytes(module: torch.nn.Module) -> int:
    """state_bytes of the module's state dict as a checkpoint holds it (a tied alias is the same
    tensor, counted once), read from the module itself rather than through DCP's state-dict helpers."""
    own = {str(id(t)): t for t in module.state_dict(keep_vars=True).values()}
    return state_bytes(own)


def describe_nonfinite(names: list[str]) -> str:
    """A few of the tensor names, for an error line."""
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return f"{len(names)} tensor{'s' if len(names) != 1 else ''} with NaN or inf ({shown})"
