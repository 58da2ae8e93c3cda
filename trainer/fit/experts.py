"""A mixture-of-experts model's training figures (model.moe, trainer/model/moe.py): the load-balancing
aux loss and each MoE layer's expert load, for metrics.jsonl, the step lines and `dtrain report`.

After each forward a MoE layer holds `aux_loss` (its load-balancing loss for that forward) and
`expert_load` (routed (token, slot) pairs per expert, int64 [E], global expert indices, of this rank's
tokens). Per micro-step this adds them up on the device, with no host sync:
  * the aux loss, the mean over the layers (what model.moe.aux_loss_coef multiplies in the training
    loss) and averaged over the step's micro-steps like the loss; the step's non-finite check
    (trainer/fit/nonfinite.py) averages it over the ranks in the all-reduce it already makes for the
    loss and the gradient norm, so it costs no collective of its own;
  * the expert load, summed over the log interval's micro-steps; at a logged step one all-reduce
    sums it over the data-parallel ranks (per log interval, not per step).
A dense model has no MoE layer: none of this runs and its records are unchanged.
"""

from __future__ import annotations

import torch

from trainer.model.moe import MoEFeedForward
from trainer.process.runtime import Runtime


def moe_layers(model: torch.nn.Module) -> list[tuple[int, MoEFeedForward]]:
    """(block index, MoE feed-forward) of each MoE layer of an unwrapped GPT, in depth order (none for a
    dense model)."""
    return [(i, block.mlp) for i, block in enumerate(model.transformer.h) if isinstance(block.mlp, MoEFeedForward)]


def load_shares(tokens: list[int]) -> tuple[float, float]:
    """(min, max) over experts of each expert's tokens as a share of the mean: 1.0 and 1.0 when every
    expert gets as many (perfect balance); a max of 2.0 means one expert got twice its fair share, a
    min of 0.0 that one got none. (nan, nan) before any token was routed."""
    mean = sum(tokens) / len(tokens)
    if mean == 0:
        return float("nan"), float("nan")
    return min(tokens) / mean, max(tokens) / mean


class ExpertStats:
    """Run.experts of a MoE model (None for a dense one): fed after each micro-step, read by StepLog."""

    def __init__(self, layers: list[tuple[int, MoEFeedForward]], rt: Runtime):
        self.layers, self.rt = layers, rt
        self._aux = torch.zeros((), device=rt.device)  # this step's aux loss, summed over its micro-steps
        self._load: torch.Tensor | None = None  # [layers, experts] int64 since the last logged step
        self.aux_loss = float("nan")  # the last checked step's, averaged over micro-steps and ranks

    @classmethod
    def of(cls, model: torch.nn.Module, rt: Runtime) -> ExpertStats | None:
        layers = moe_layers(model)
        return cls(layers, rt) if layers else None

    def after_micro_step(self) -> None:
        """Add the forward just made (its layers' aux losses and loads) to the step's and interval's sums."""
        mlps = [mlp for _, mlp in self.layers]
        self._aux += torch.stack([mlp.aux_loss.detach().float() for mlp in mlps]).mean()
        load = torch.stack([mlp.expert_load for mlp in mlps])
        self._load = load if self._load is None else self._load + load

    def step_aux(self, micro_steps: int) -> torch.Tensor:
        """The step's aux loss averaged over its micro-steps (on device), for the rank reduction in the
        step's check; the sum starts anew."""
        aux, self._aux = self._aux / micro_steps, torch.zeros((), device=self.rt.device)
        return aux

    def take_load(self) -> dict[int, list[int]]:
        """Tokens per expert of each MoE layer since the last call, summed over the data-parallel ranks
        (one all-reduce; every rank calls it at the same logged step). Ranks that read the same batch
        (tensor- or context-parallel) route the same tokens, so the sum over all ranks is divided by how
        many do: the count of different tokens."""
        load = self._load
        if load is None:
            load = torch.zeros(len(self.layers), 1, dtype=torch.int64, device=self.rt.device)
        self._load = None
        total = self.rt.all_reduce_sum(load) // (self.rt.world // self.rt.dp_world)
        return {i: row for (i, _), row in zip(self.layers, total.tolist(), strict=True)}

    def record(self, load: dict[int, list[int]]) -> dict:
        """The metrics.jsonl fields of a logged step (see docs/model.md, "Mixture of experts")."""
        shares = {i: load_shares(tokens) for i, tokens in load.items()}
        return {
            "aux_loss": self.aux_loss,
            "expert_load_min": min(low for low, _ in shares.values()),
            "expert_load_max": max(high for _, high in shares.values()),
            # dropless routing (no capacity factor): every routed token is computed
            "dropped_tokens": 0.0,
            "expert_load": {str(i): {"min": round(low, 4), "max": round(high, 4), "tokens": load[i]}
                            for i, (low, high) in shares.items()},
        }


def console_part(record: dict) -> str:
    """The step line's addition for a MoE model: ` | aux 0.0021 | load 0.71-1.34` (the extremes over
    every layer and expert of the load's share of the mean)."""
    return f" | aux {record['aux_loss']:.4f} | load {record['expert_load_min']:.2f}-{record['expert_load_max']:.2f}"
