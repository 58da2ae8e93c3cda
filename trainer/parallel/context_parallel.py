"""Context parallelism (parallel.cp > 1): each sequence split over a group of ranks, Llama 3's way
(arXiv 2407.21783, section 3.3.2): every rank holds a part of the tokens through the whole model, and
attention all-gathers the keys and values of the group before its own queries attend to them.

Causal attention makes later tokens dearer (a query at position p reads p + 1 keys), so the sequence
is cut into 2 x cp chunks and rank r takes chunks r and 2cp - 1 - r: one early and one late, and
every rank computes the same number of query-key pairs. Each local chunk attends to the prefix of the
gathered sequence that ends with it, under a bottom-right-aligned causal mask (torch's
causal_lower_right: no mask is materialised, and CUDA's flash and memory-efficient kernels take it).

Why not torch's `context_parallel` (torch.distributed.tensor.experimental): in torch 2.13 it has no
sharding rule for the CPU flash kernel and mixes DTensor with plain tensors under the math kernel
(docs/parallelism.md quotes the errors), so nothing of it can be tested here. The all-gather of K/V costs one
collective per layer of 2 x kv_width x local tokens per rank (GQA makes it small) in the forward and
its reduce-scatter in the backward, against ring attention's cp - 1 exchanges per layer.

The model asks this object only where keys and values come from (trainer/model/layers.py
KeyValues); which tokens are local is its `positions`. Gradients differ across the group's ranks (each
saw other tokens), so the data-parallel shards span the cp ranks too: the strategies shard over
dp_shard x cp (trainer/parallel/base.py `shard_dims`), and FSDP's reduce-scatter averages them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.attention.bias import causal_lower_right

from trainer.model.layers import AttentionCall
from trainer.parallel.collectives import all_gather_single, functional_all_gather_autograd


class SequenceSplit:
    """One rank's share of every sequence of a forward with targets, in a context-parallel group of
    `size` ranks (`rank` its place in it, `group` its process group)."""

    def __init__(self, group: dist.ProcessGroup, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size

    def chunk(self, seq_len: int) -> int:
        """Tokens per chunk: a sequence is 2 x size chunks (config validation checks it divides)."""
        return seq_len // (2 * self.size)

    def positions(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """The global positions of this rank's tokens: chunk `rank`, then chunk 2 x size - 1 - rank."""
        c = self.chunk(seq_len)
        early = torch.arange(self.rank * c, (self.rank + 1) * c, device=device)
        late = torch.arange((2 * self.size - 1 - self.rank) * c, (2 * self.size - self.rank) * c, device=device)
        return torch.cat((early, late))

    def local(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's columns of (B, T) tokens or targets."""
        return tokens[:, self.positions(tokens.shape[1], tokens.device)]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sdpa: AttentionCall) -> torch.Tensor:
        """Causal attention of this rank's (B, heads, 2c, head_dim) queries over the whole sequence's
        keys and values, gathered from the group (differentiably: the backward reduce-scatters)."""
        c = q.shape[2] // 2
        keys, values = self._whole_sequence(k, v)
        outputs = []
        for queries, end in ((q[:, :, :c], (self.rank + 1) * c), (q[:, :, c:], (2 * self.size - self.rank) * c)):
            # each chunk reads the sequence up to its own end, causally (bottom-right aligned)
            outputs.append(sdpa(queries, keys[:, :, :end], values[:, :, :end], causal_lower_right(c, end), False))
        return torch.cat(outputs, dim=2)

    def _whole_sequence(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) of every position in order, from each rank's (B, kv_heads, 2c, head_dim)."""
        local = torch.stack((k, v))  # one collective for both
        gathered = functional_all_gather_autograd(local.contiguous(), gather_dim=0, group=self.group)
        # (size, 2, B, H, 2, c, D): rank i holds chunks i and 2 x size - 1 - i
        gathered = gathered.unflatten(0, (self.size, 2)).unflatten(4, (2, -1))
        early = gathered[:, :, :, :, 0]  # chunks 0 .. size - 1, one per rank in rank order
        late = gathered[:, :, :, :, 1].flip(0)  # chunks size .. 2 x size - 1: ranks in reverse
        whole = torch.cat((early, late))  # (2 x size chunks, 2, B, H, c, D)
        whole = whole.permute(1, 2, 3, 0, 4, 5).flatten(3, 4)  # (2, B, H, T, D)
        return whole[0], whole[1]

    def whole(self, per_token: torch.Tensor) -> torch.Tensor:
        """(B, 2c) values of this rank's tokens -> (B, T) of every token in sequence order, on every
        rank of the group (validation's per-token losses; no gradient)."""
        gathered = per_token.new_empty((self.size * per_token.shape[0], per_token.shape[1]))
        all_gather_single(gathered, per_token.contiguous(), group=self.group)
        gathered = gathered.unflatten(0, (self.size, -1)).unflatten(2, (2, -1))  # (size, B, 2, c)
        early, late = gathered[:, :, 0], gathered[:, :, 1].flip(0)
        return torch.cat((early, late)).permute(1, 0, 2).flatten(1)
