"""The mixture-of-experts feed-forward block (model.moe.*): Qwen3-MoE's routing (softmax over the
experts, top-k, the chosen probabilities renormalized when norm_topk_prob), SwiGLU experts computed
dropless (every routed token, no capacity factor, so results do not depend on how tokens are
split), an optional dense shared expert (DeepSeek's), and Hugging Face's load-balancing loss.

Block.mlp is a MoEFeedForward in the layers model.moe.every picks (Qwen3's decoder_sparse_step:
layer i is MoE when (i + 1) % every == 0). Expert parallelism (trainer/parallel/) sets
`expert_split`, which moves the grouped tokens to the ranks holding their experts and back.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainer.model.config import GPTConfig

# torch._grouped_mm's rule (torch 2.13): every stride a multiple of 16 bytes, so a row of each
# operand (the model width, the expert width) must be a multiple of 16 bytes' elements.
GROUPED_MM_ALIGN_BYTES = 16


def is_moe_layer(config: GPTConfig, layer: int) -> bool:
    """Qwen3-MoE's decoder_sparse_step rule: layer `layer` (0-based) is MoE when there are experts
    and (layer + 1) is a multiple of model.moe.every."""
    moe = config.moe
    return moe.num_experts > 0 and (layer + 1) % moe.every == 0


def _local(p: torch.Tensor) -> torch.Tensor:
    """A parameter's local tensor: a DTensor's shard (duck-typed, so the one-process path never
    imports DTensor), the tensor itself otherwise."""
    return p.to_local() if hasattr(p, "to_local") else p


def _can_group(tokens: torch.Tensor, *weights: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm") or tokens.dtype not in (torch.bfloat16, torch.float32):
        return False
    if (tokens.device.type == "cuda" or torch.compiler.is_compiling()) and tokens.dtype != torch.bfloat16:
        # CUDA's kernel takes bf16 only, and so does the shape function torch.compile traces it with
        # (torch 2.13: an fp32 CPU model under train.compile=true failed "Expected inputs of BF16 type")
        return False
    size = tokens.element_size()
    return all(d * size % GROUPED_MM_ALIGN_BYTES == 0 for w in weights for d in w.shape[1:])


class GroupedExperts(nn.Module):
    """E SwiGLU experts as two 3-D weights in nn.Linear's [out, in] orientation: c_fc [E, 2h, d]
    (each expert's gate rows, then its up rows) and c_proj [E, d, h]. The weights may hold a slice
    of the experts (expert parallelism: E_local = c_fc.shape[0])."""

    def __init__(self, num_experts: int, n_embd: int, hidden: int):
        super().__init__()
        self.hidden = hidden
        self.c_fc = nn.Parameter(torch.empty(num_experts, 2 * hidden, n_embd))
        self.c_proj = nn.Parameter(torch.empty(num_experts, n_embd, hidden))
        # Grouped by default on CPU too, by measurement (2026-11-28, torch 2.13, 2 shared cores,
        # forward+backward, balanced counts): qwen3_moe_tiny's shape (8 experts, d 64, h 96, 512
        # rows) grouped 1.12 ms vs loop 1.80 ms; 64 experts, d 1024, h 768, 4096 tokens x top 8:
        # grouped 3.0 s vs loop 15.2 s (one repetition).
        self.use_grouped_mm = True  # False: the per-expert loop (tests compare the two)

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """tokens [N, d] grouped by expert in expert order, counts[e] rows for local expert e ->
        [N, d], each row through its expert."""
        c_fc, c_proj = _local(self.c_fc), _local(self.c_proj)
        if tokens.shape[0] == 0:
            # No rows: an empty result that still depends on the weights (autograd and the
            # gradient all-reduce see them, with zero gradients).
            return tokens.new_zeros(tokens.shape) + 0 * (c_fc.sum() + c_proj.sum()).to(tokens.dtype)
        if self.use_grouped_mm and _can_group(tokens, c_fc, c_proj):
            return self._grouped(tokens, counts, c_fc, c_proj)
        return self._looped(tokens, counts, c_fc, c_proj)

    def _grouped(self, tokens, counts, c_fc, c_proj) -> torch.Tensor:
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        w_fc, w_proj = c_fc.to(tokens.dtype), c_proj.to(tokens.dtype)
        h = torch._grouped_mm(tokens, w_fc.transpose(-2, -1), offs=offsets)
        gate, up = h.split(self.hidden, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, w_proj.transpose(-2, -1), offs=offsets)

    def _looped(self, tokens, counts, c_fc, c_proj) -> torch.Tensor:
        outs = []
        for e, rows in enumerate(tokens.split(counts.tolist(), dim=0)):
            gate, up = F.linear(rows, c_fc[e].to(rows.dtype)).split(self.hidden, dim=-1)
            outs.append(F.linear(F.silu(gate) * up, c_proj[e].to(rows.dtype)))
        return torch.cat(outs, dim=0)


class SharedExperts(nn.Module):
    """The dense SwiGLU every token passes through beside its routed experts (DeepSeek's shared
    experts): num_shared_experts x expert_hidden wide."""

    def __init__(self, n_embd: int, hidden: int):
        super().__init__()
        self.hidden = hidden
        self.c_fc = nn.Linear(n_embd, 2 * hidden, bias=False)
        self.c_proj = nn.Linear(hidden, n_embd, bias=False)
        self.c_proj.residual_scaled_init = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.c_fc(x).chunk(2, dim=-1)
        return self.c_proj(F.silu(gate) * up)


def load_balancing_loss(probs: torch.Tensor, chosen: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Hugging Face's load_balancing_loss_func for one layer without padding (transformers 5.24,
    Qwen3-MoE): num_experts x sum over experts of (the slots that chose e per token, N x k slots in
    all) x (the mean router probability of e over the N tokens); top_k when the load is even.
    probs [N, E] fp32, chosen [N, k]."""
    per_token = F.one_hot(chosen, num_experts).float().sum(dim=1).mean(dim=0)
    return num_experts * (per_token * probs.mean(dim=0)).sum()


class MoEFeedForward(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        moe = config.moe
        self.num_experts, self.top_k, self.norm_topk_prob = moe.num_experts, moe.top_k, moe.norm_topk_prob
        hidden = config.expert_hidden
        self.router = nn.Linear(config.n_embd, moe.num_experts, bias=False)
        self.experts = GroupedExperts(moe.num_experts, config.n_embd, hidden)
        if moe.num_shared_experts > 0:
            self.shared = SharedExperts(config.n_embd, moe.num_shared_experts * hidden)
        self.dropout = nn.Dropout(config.dropout)
        self.expert_split = None  # expert parallelism sets it (trainer/parallel/)
        self.aux_loss: torch.Tensor | None = None
        self.expert_load: torch.Tensor | None = None

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(probs [N, E] fp32, weights [N, k] fp32, chosen [N, k]): the router's softmax, the
        chosen experts' probabilities (renormalized to sum 1 with norm_topk_prob) and their ids."""
        logits = F.linear(flat.float(), self.router.weight.float())
        probs = logits.softmax(dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights, chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        flat = x.reshape(-1, d)
        probs, weights, chosen = self.route(flat)
        slots = chosen.reshape(-1)  # (token, slot) pairs, token-major
        order = torch.argsort(slots, stable=True)
        counts = torch.bincount(slots, minlength=self.num_experts)
        tokens = flat[order // self.top_k]
        if self.expert_split is not None:
            out = self.expert_split.run(self.experts, tokens, counts)
        else:
            out = self.experts(tokens, counts)
        unsorted = torch.empty_like(out)
        unsorted[order] = out
        y = (unsorted.view(-1, self.top_k, d).float() * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)
        if hasattr(self, "shared"):
            y = y + self.shared(flat)
        self.aux_loss = load_balancing_loss(probs, chosen, self.num_experts)
        self.expert_load = counts.detach()
        return self.dropout(y.view(B, T, d))
