"""What the CUDA caching allocator did: train.memory_snapshot=true records its history from the start
and dumps it once, at the end of the first profiled step (train.profile.steps) or else this start's
first step, to <run dir>/memory/rank<R>_step<N>.pickle, which https://pytorch.org/memory_viz opens.
A step that runs out of device memory ends the run with one `error:` line (DeviceOutOfMemory): the
step, the peak, the snapshot the rank wrote when history was recording (rank<R>_step<N>_oom.pickle),
and the settings that need less memory. Nothing else is written: the newest checkpoint stays the
newest. preflight/torch_checks.py refuses the key on a run that does not train on CUDA."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch

from trainer.errors import DeviceOutOfMemory

# Allocation and free events the history keeps (the newest ones), torchtitan's default: about a
# step of a large model, tens of MB of host memory and a snapshot of some tens of MB.
MAX_ENTRIES = 100_000


class MemoryRecorder:
    """One rank's allocator history (when train.memory_snapshot on CUDA) and its out-of-memory line.
    `dump_step`: the step at whose end the snapshot is dumped."""

    def __init__(self, cfg, rt, run_dir: Path, dump_step: int):
        self.cfg, self.rt, self.dump_step = cfg, rt, dump_step
        self.folder = run_dir / "memory"
        self.recording = bool(cfg.train.memory_snapshot) and rt.device.type == "cuda"
        if self.recording:
            torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES)

    def after_step(self, step: int) -> bool:
        """Dump the snapshot when `step` is the one; whether it did."""
        if not self.recording or step != self.dump_step:
            return False
        self._dump(f"rank{self.rt.rank}_step{step}.pickle")
        return True

    def _dump(self, name: str) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / name
        torch.cuda.memory._dump_snapshot(str(path))
        return path

    @contextmanager
    def watch(self, step: int):
        """Around step `step`: torch's out-of-memory error becomes the one line (DeviceOutOfMemory)."""
        try:
            yield
        except torch.OutOfMemoryError as err:
            raise self.out_of_memory(step) from err

    def out_of_memory(self, step: int) -> DeviceOutOfMemory:
        """The error for a step that ran out of device memory, its snapshot dumped first when the
        history was recording."""
        snapshot = self._dump(f"rank{self.rt.rank}_step{step}_oom.pickle") if self.recording else None
        peak = total = None
        if self.rt.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.rt.device)
            total = torch.cuda.get_device_properties(self.rt.device).total_memory
        return DeviceOutOfMemory(out_of_memory_line(self.cfg, step, self.rt.rank, peak, total, snapshot))

    def close(self) -> None:
        if self.recording:
            torch.cuda.memory._record_memory_history(enabled=None)  # stop recording


def out_of_memory_line(cfg, step: int, rank: int, peak: int | None, total: int | None,
                       snapshot: Path | None) -> str:
    """One line: where it ran out, the peak, the snapshot (or how to get one), and what `dtrain plan`
    would have the run change, only the settings not yet taken."""
    t, mode = cfg.train, cfg.parallel.mode
    held = f"; peak {_gib(peak)} allocated" + (f" of {_gib(total)}" if total else "") if peak else ""
    where = (f"snapshot {snapshot} (open it at https://pytorch.org/memory_viz)" if snapshot else
             "train.memory_snapshot=true records one")
    fixes = []
    if t.micro_batch_size > 1:
        fixes.append(f"train.micro_batch_size={max(1, t.micro_batch_size // 2)}")
    if t.loss_chunks == 1 and t.loss_kernel != "fused":  # plain's whole logits are refused with pieces
        pieces = "train.loss_chunks=4"
        fixes.append(pieces if t.loss_kernel != "plain" else f"train.loss_kernel=chunked {pieces}")
    if not t.activation_checkpointing:
        fixes.append("train.activation_checkpointing=true")
    if mode not in ("fsdp", "hsdp"):
        fixes.append("parallel=fsdp (more shards)")
    else:
        fixes.append("a larger world (more shards)")
    return (f"CUDA out of memory at step {step} on rank {rank}{held}; {where}; try " + ", ".join(fixes)
            + " (`dtrain plan` with the same overrides estimates each)")


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"
