"""What produced a run's figures, for its summary (metrics.jsonl, the sweep table, `dtrain report`):
dtrain's version and, when it runs from a git checkout, the commit (`-dirty` with local changes);
torch's version; the device's name and how many the job used; the world size; the kernels the run
chose where a key offers several (model.attention's SDPA kernel, ...). A table of results then says
what made each row."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

import torch

import trainer
from trainer.process.runtime import Runtime

SOURCE_DIR = Path(__file__).resolve().parents[2]


def what_ran(rt: Runtime, kernels: dict) -> dict:
    """{"dtrain", "git", "torch", "device", "device_count", "world", "kernels"} for this job (rank 0
    calls it once, at the end of the run); `kernels`: trainer/fit/run.py Run.kernels."""
    if rt.device.type == "cuda":
        device, count = torch.cuda.get_device_name(rt.device), rt.world
    else:
        device, count = _cpu_name(), rt.world  # one CPU process per rank
    return {"dtrain": trainer.__version__, "git": git_commit(SOURCE_DIR), "torch": torch.__version__,
            "device": device, "device_count": count, "world": rt.world, "kernels": kernels}


def describe(ran: dict) -> str:
    """One line for the summary table: `dtrain 0.1.0 (31b7991) | torch 2.13.0 | 2 x Intel Xeon | world 2`."""
    commit = f" ({ran['git']})" if ran.get("git") else ""
    return (f"dtrain {ran.get('dtrain')}{commit} | torch {ran.get('torch')} | "
            f"{ran.get('device_count')} x {ran.get('device')} | world {ran.get('world')}")


def git_commit(folder: Path) -> str | None:
    """The checkout's commit (12 hex digits, `-dirty` with local changes), or None outside a
    checkout or without git (an installed wheel)."""
    if not (folder / ".git").exists():
        return None
    try:
        # --exclude=*: the commit itself, never a tag name
        done = subprocess.run(["git", "-C", str(folder), "describe", "--always", "--dirty", "--abbrev=12",
                               "--exclude=*"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"
