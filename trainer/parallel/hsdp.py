"""parallel=hsdp: FSDP2 inside each of parallel.dp_replicate groups, the groups replicas of one another.

Across nodes, sharding over every rank puts each layer's all-gather on the slow inter-node network;
HSDP keeps the all-gathers and reduce-scatters inside a group (a node by default) and sends only one
gradient all-reduce between groups per step. The memory per rank is FSDP's at world / dp_replicate.
"""

from __future__ import annotations

from trainer.parallel.fsdp import FSDPStrategy


class HSDPStrategy(FSDPStrategy):
    name = "hsdp"
    replicates_shards = True
    data_parallel_dims = ("dp_replicate", "dp_shard")
