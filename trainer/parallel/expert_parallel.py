"""Expert parallelism (parallel.ep > 1): a mixture of experts' experts split over ep of the data-parallel
ranks, each rank sending every routed token to the rank that holds its expert and getting the
result back (two all-to-alls per MoE layer, forward; two more in the backward).

The ep ranks are data-parallel ranks: each reads its own batch, routes its own tokens, and computes
the dense layers on them as FSDP does. Only the experts' weights are split: expert e lives on ep rank
e // (experts / ep), as a DTensor sharded by expert (Shard(0)) over the `ep` mesh dimension, so DCP
saves and reshards it like any shard and a checkpoint continues under any other layout.

Gradients. An expert's weights see the tokens of every rank of its ep group, through the all-to-all's
backward: their gradient is the sum of those ranks' gradients, where a dense weight's is each rank's
own, averaged by FSDP over dp ranks. FSDP over the rest of the data-parallel ranks (dp_shard / ep, and
dp_replicate) would average the experts' gradients over only those, so their divide factor is set to
the whole data-parallel size: every weight's gradient is then the mean over all ranks' batches, as
in one process (`gradient_divide_factor`).

Dropless: every routed token is computed, whatever its expert's load, so the result does not depend
on how tokens are split over ranks (only the order of floating-point sums may).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.tensor import Shard, distribute_tensor


class ExpertSplit:
    """One MoE layer's token exchange with the ep group (set as MoEFeedForward.expert_split)."""

    def __init__(self, group, size: int):
        self.group, self.size = group, size

    def run(self, experts: nn.Module, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """What `experts(tokens, counts)` would give over all the layer's experts, computed by the ranks
        holding them: `tokens` (rows grouped by expert, in expert order) and `counts` (rows per expert,
        every expert of the layer) are this rank's; the result's rows are in `tokens`' order."""
        local = counts.numel() // self.size
        # counts_in[s, e]: rows rank s sends for this rank's local expert e
        counts_in = torch.empty_like(counts)
        dist.all_to_all_single(counts_in, counts, group=self.group)
        counts_in = counts_in.view(self.size, local)
        send = counts.view(self.size, local).sum(1).tolist()
        receive = counts_in.sum(1).tolist()
        arrived = funcol.all_to_all_single_autograd(tokens.contiguous(), receive, send, self.group)
        # Arrived rows are grouped by source rank, then expert: regroup them by expert for the experts.
        order = _by_expert(counts_in)
        out = experts(arrived[order], counts_in.sum(0))
        back = torch.empty_like(out).index_copy(0, order, out)
        return funcol.all_to_all_single_autograd(back, send, receive, self.group)


def _by_expert(counts_in: torch.Tensor) -> torch.Tensor:
    """Row indices that put rows grouped (source, expert) into expert order, sources ascending
    within an expert (a stable sort by expert of each row's block)."""
    sources, local = counts_in.shape
    expert_of_block = torch.arange(local, device=counts_in.device).repeat(sources)
    expert_of_row = expert_of_block.repeat_interleave(counts_in.flatten())
    return torch.sort(expert_of_row, stable=True).indices


def split_experts(model: nn.Module, ep_mesh) -> nn.Module:
    """Give each ep rank its share of every MoE layer's experts (DTensors sharded by expert over
    `ep_mesh`) and the layer its token exchange. Shapes only: runs on a meta model too."""
    split = ExpertSplit(ep_mesh.get_group(), ep_mesh.size())
    for layer in model.moe_layers():
        experts = layer.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)])
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        layer.expert_split = split
    return model
