"""A model's parameters as `dtrain plan` prints them: all of them (what memory holds) and the active
ones (what one token is multiplied with, what FLOPs and MFU count). A dense model's are the same; a
mixture of experts (model.moe, trainer/model/moe.py) routes each token to top_k of its E experts, so
only top_k / E of the routed experts' weights are active, beside the shared experts, the router and
every dense weight."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.model.gpt import GPT


@dataclass(frozen=True)
class ParameterCounts:
    total: int  # every parameter, a tied embedding once: what memory holds
    active: int  # those one token is multiplied with (a MoE model's top_k of E routed experts)
    flops_per_token: float  # training FLOPs per token on the active parameters (GPT.flops_per_token)

    def describe(self, seq_len: int) -> str:
        line = f"parameters: {_short(self.total)} total"
        if self.active != self.total:
            line += f", {_short(self.active)} active per token ({self.active / self.total:.1%})"
        return line + (f"; training FLOPs per token at seq_len {seq_len}: {_short(self.flops_per_token)} "
                       f"(what MFU counts)")


def parameter_counts(model: GPT, seq_len: int) -> ParameterCounts:
    """`model`'s counts (on the meta device: shapes only)."""
    return ParameterCounts(model.num_params(), model.active_params(), model.flops_per_token(seq_len))


def _short(n: float) -> str:
    for size, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"
