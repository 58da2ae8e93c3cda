"""One rank's RNG states (torch, CUDA, numpy, Python) as JSON, for trainer_state.json.

DCP's state holds tensors only, so the states a bit-exact resume needs are saved here instead.
"""

from __future__ import annotations

import base64
import random

import numpy as np
import torch


def _b64(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.cpu().numpy().tobytes()).decode("ascii")


def _unb64(text: str) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(base64.b64decode(text), dtype=np.uint8).copy())


def rng_state(device: torch.device) -> dict:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    state = {
        "torch": _b64(torch.get_rng_state()),
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "python": [version, list(internal), gauss],
    }
    if device.type == "cuda":
        state["cuda"] = _b64(torch.cuda.get_rng_state(device))
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(_unb64(state["torch"]))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(_unb64(state["cuda"]), device)
