"""The GPT assembled from its config: token embedding, positions (a learned table or rotary), pre-norm
blocks, final norm, output head (tied to the embedding or its own).

With the defaults this is GPT-2 exactly, under Hugging Face's GPT2LMHeadModel names
(transformer.wte, transformer.h.0.attn.c_attn, ...), so weights can be exchanged; HF stores the
linear weights of c_attn/c_proj/c_fc transposed (Conv1D), which export/import handle.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from trainer.model.config import GPTConfig
from trainer.model.kv_cache import CacheStep
from trainer.model.layers import Block, make_norm, rotary_tables
from trainer.model.loss import chunked_cross_entropy, fused_cross_entropy
from trainer.model.moe import GroupedExperts, MoEFeedForward, is_moe_layer

# What each parameter is to the optimizer (trainer/optim/build.py): Muon takes the hidden matrices.
ROLES = ("hidden", "embedding", "head", "norm", "bias")
FEW_ROWS = 32  # up to this many rows of logits, the inference head is weight @ x^T on CPU


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        layers = dict(wte=nn.Embedding(config.padded_vocab_size, config.n_embd))
        if config.pos == "learned":
            layers["wpe"] = nn.Embedding(config.block_size, config.n_embd)
        blocks = [Block(config, MoEFeedForward(config) if is_moe_layer(config, i) else None)
                  for i in range(config.n_layer)]
        layers.update(drop=nn.Dropout(config.dropout), h=nn.ModuleList(blocks),
                      ln_f=make_norm(config, config.n_embd))
        self.transformer = nn.ModuleDict(layers)
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        if config.tie_embeddings:
            self.transformer.wte.weight = self.lm_head.weight
        self.activation_checkpointing = False
        # train.loss_kernel as resolved (trainer/model/loss.py): plain (the whole logits), chunked (in
        # loss_chunks pieces; loss_chunks > 1 alone means it too) or fused (liger-kernel's, on CUDA)
        self.loss_kernel = "plain"
        self.loss_chunks = 1
        # parallel.cp > 1 (trainer/parallel/context_parallel.py): a forward with targets computes this
        # rank's share of each sequence; forwards without (decoding, scoring) run whole on every rank.
        self.sequence_split = None
        # parallel.tp > 1 (trainer/parallel/tensor_parallel.py): sequence parallelism, each tp rank
        # holding its positions of the residual stream in a forward with targets.
        self.sequence_shards = None
        # A model on the meta device (the memory plan's: shapes only) has no values to initialise, and
        # torch's meta normal_ is a Python reference that costs milliseconds a tensor (and its first
        # call imports torch._dynamo): seconds for a deep model, for nothing.
        if not self.lm_head.weight.is_meta:
            self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "residual_scaled_init", False):
                # GPT-2: residual projections scaled so the residual stream's variance does not
                # grow with depth (two residual adds per block).
                std *= (2 * self.config.n_layer) ** -0.5
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, GroupedExperts):
            nn.init.normal_(module.c_fc, mean=0.0, std=0.02)
            nn.init.normal_(module.c_proj, mean=0.0, std=0.02 * (2 * self.config.n_layer) ** -0.5)

    def num_params(self) -> int:
        """Unique parameters (a tied embedding counted once), positions included."""
        return sum(p.numel() for p in self.parameters())

    def moe_layers(self) -> list[MoEFeedForward]:
        return [block.mlp for block in self.transformer.h if isinstance(block.mlp, MoEFeedForward)]

    def active_params(self) -> int:
        """The parameters one token is multiplied with or looks up: num_params less, in each MoE
        layer, the routed experts it is not sent to (it passes top_k of num_experts)."""
        moe = self.config.moe
        idle = sum(layer.experts.c_fc.numel() + layer.experts.c_proj.numel() for layer in self.moe_layers())
        return self.num_params() - idle * (moe.num_experts - moe.top_k) // max(moe.num_experts, 1)

    @staticmethod
    def param_role(name: str, param: torch.Tensor) -> str:
        """One of ROLES for a parameter of this model, by its name (as named_parameters gives it,
        the tied embedding under transformer.wte) and shape. The 3-D expert weights hold one
        matrix per expert: hidden. The router is a hidden matrix too: Muon orthogonalizes it as
        Moonlight does its MoE router (an [E, d] linear map like any other)."""
        if name.startswith("transformer.h.") and param.dim() in (2, 3):
            return "hidden"
        if name.startswith(("transformer.wte.", "transformer.wpe.")):
            return "embedding"
        if name.startswith("lm_head."):
            return "head"
        return "bias" if name.endswith(".bias") else "norm"

    def matrix_parts(self, name: str, rows: int) -> tuple[int, ...]:
        """The row widths of the separate matrices a hidden weight of `rows` rows holds side by side:
        c_attn's q, k and v (k and v the width of the KV heads), SwiGLU's c_fc gate and up; one
        matrix for the others. Muon orthogonalizes each on its own."""
        c = self.config
        if name.endswith(".attn.c_attn.weight"):
            kv_width = c.kv_heads * c.head_dim
            return (c.q_width, kv_width, kv_width)
        if name.endswith(".mlp.c_fc.weight") and c.mlp == "swiglu":
            return (c.hidden, c.hidden)
        if name.endswith(".mlp.shared.c_fc.weight"):
            width = c.moe.num_shared_experts * c.expert_hidden
            return (width, width)
        if name.endswith(".mlp.experts.c_fc"):  # each expert's gate, then its up (rows: one expert's)
            return (c.expert_hidden, c.expert_hidden)
        return (rows,)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Rotary cos/sin for `positions` (None with a learned position table)."""
        c = self.config
        return rotary_tables(positions, c.head_dim, c.rope_theta) if c.pos == "rope" else None

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                logits_at: torch.Tensor | None = None, cache: CacheStep | None = None, per_token: bool = False):
        """(logits, loss); with targets and a loss kernel that never makes the whole logits (chunked,
        fused), (None, loss); `per_token` (with targets):
        (None, each position's loss, flattened), what bits per byte weighs by the targets' bytes.
        `logits_at` (B,) without targets: only the logits of that one position of each row,
        (B, 1, vocab), all that decoding needs (the largest matmul skips the other rows); (B, K):
        those K positions of each row, (B, K, vocab) (a scored continuation's).
        `cache` (decoding, trainer/model/decode.py): idx fills the cache's next slots, at the
        positions and under the mask it gives, and attends to what the cache holds.
        With `sequence_split` set (context parallelism), a forward with targets computes this rank's
        share of the tokens: the loss is their mean and the logits are theirs; `per_token` gives
        every token's loss, gathered from the group. With `sequence_shards` set (tensor parallelism),
        likewise over the tp ranks' positions, but the loss is the whole mean on every rank."""
        B, T = idx.shape
        split = self.sequence_split if targets is not None and cache is None else None
        if cache is None:
            if T > self.config.block_size:
                raise ValueError(f"sequence of length {T} exceeds block_size {self.config.block_size}")
            pos = torch.arange(T, dtype=torch.long, device=idx.device)
        else:
            pos = cache.positions
        if split is not None:
            pos = split.positions(T, idx.device)
            idx, targets = split.local(idx), split.local(targets)
        shards = self.sequence_shards
        if shards is not None and not shards.begin(idx.shape[1] if targets is not None and cache is None else None):
            shards = None
        x = self.transformer.wte(idx)
        if "wpe" in self.transformer:
            x = x + self.transformer.wpe(pos)
        x = self.transformer.drop(x)
        if shards is not None:
            x, targets = shards.local(x), shards.local(targets)
        rope = self.rope(pos)
        if rope is not None and cache is not None:  # per row (B, T, d): broadcast over the heads
            rope = (rope[0].unsqueeze(1), rope[1].unsqueeze(1))
        for i, block in enumerate(self.transformer.h):
            kv = cache.layer(i) if cache is not None else split
            if self.activation_checkpointing and self.training and cache is None:
                x = torch.utils.checkpoint.checkpoint(block, x, rope, kv, use_reentrant=False)
            else:
                x = block(x, rope, kv)
        x = self.transformer.ln_f(x)
        if logits_at is not None and targets is None:
            rows = torch.arange(B, device=x.device)
            x = x[rows, logits_at].unsqueeze(1) if logits_at.dim() == 1 else x[rows.unsqueeze(1), logits_at]
        if targets is None:
            return self._inference_logits(x)[..., : self.config.vocab_size], None
        if self.loss_kernel == "fused":  # the logits are never whole: none to return
            logits, loss = None, fused_cross_entropy(x, self.lm_head.weight, targets, per_token)
        elif self.loss_kernel == "chunked" or self.loss_chunks > 1:
            logits, loss = None, chunked_cross_entropy(x, self.lm_head.weight, targets, self.loss_chunks, per_token)
        else:
            logits = self.lm_head(x)
            # Padded vocabulary rows never appear as targets; their logits only add to the softmax
            # denominator and are pushed down by training, so they are kept (slicing would copy).
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1),
                                   reduction="none" if per_token else "mean")
        if self.training and not per_token:
            layers = self.moe_layers()
            if layers:
                # the mean over layers: Hugging Face's pools every layer's routing into one loss,
                # so a coefficient means the same at any depth (top_k x coef when balanced)
                aux = sum(layer.aux_loss for layer in layers) / len(layers)
                loss = loss + self.config.moe.aux_loss_coef * aux
        if per_token:
            # under context and sequence parallelism every rank returns the whole sequences' losses, in order
            if shards is not None:
                loss = shards.whole(loss.view(B, -1)).view(-1)
            return None, loss if split is None else split.whole(loss.view(B, -1)).view(-1)
        if shards is not None:  # the tp ranks' positions: their shares' mean
            loss = shards.mean(loss)
        # The mean over this rank's tokens: a context-parallel group's ranks hold equal shares, so the
        # mean of their means (the gradients' average over the group, the logged loss's) is the whole's.
        return logits, loss

    def _inference_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The output head without targets. A decoding step's few rows on CPU go through
        weight @ x^T: 1.5x faster than F.linear's x @ weight^T for 8-24 rows of a 50257 x 128 head
        (torch 2.13, 2 threads), and the head is most of a step's time; from ~64 rows on, the
        transposed logits make the softmax after it slower than that gains."""
        flat = x.reshape(-1, x.size(-1))
        if x.device.type != "cpu" or flat.size(0) > FEW_ROWS:
            return self.lm_head(x)
        return torch.mm(self.lm_head.weight, flat.T).T.reshape(*x.shape[:-1], -1)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward = 3x forward), PaLM appendix B: 6 per weight
        a token is multiplied with (table lookups are not: the position table, and the token
        embedding when the head has its own weight), plus attention's scores and weighted sum. A MoE
        model counts its active parameters (GPT.active_params)."""
        c = self.config
        n = self.active_params()
        if "wpe" in self.transformer:
            n -= self.transformer.wpe.weight.numel()
        if not c.tie_embeddings:
            n -= self.transformer.wte.weight.numel()
        return 6 * n + 12 * c.n_layer * c.q_width * seq_len  # scores and weighted sum: n_head x head_dim wide


def build_model(model_cfg) -> GPT:
    return GPT(GPTConfig.from_cfg(model_cfg))
