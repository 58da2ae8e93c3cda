"""parallel=hsdp: FSDP2 inside each of parallel.dp_replicate groups, the groups replicas of one another.

Across nodes, sharding over every rank puts each layer's all-gather on the slow inter-node network;
HSDP keeps the all-gathers and reduce-scatters inside a group (a node by default) and sends only one
gradient all-reduce between groups per step. The memory per rank is FSDP's at world / dp_replicate.
"""

from __future__ import annotations

from trainer.parallel.fsdp import FSDPStrategy
from trainer.parallel.muon_owners import OwnedMuon


class HSDPStrategy(FSDPStrategy):
    name = "hsdp"
    replicates_shards = True
    data_parallel_dims = ("dp_replicate", "dp_shard")

    @classmethod
    def muon_owners(cls, shape):
        # one replica's shard group, as matrix_optimizer spreads them: dp_shard with the cp ranks folded in,
        # and under tensor parallelism with the tp ranks too (OwnedMuon exchanges blocks among all of them)
        return shape.dp_shard * shape.cp * shape.tp

    def matrix_optimizer(self, run):
        # A replica's ranks hold the row shards of its copy, and every replica's gradients are the same
        # after HSDP's all-reduce: each replica runs the owners' exchange inside its own shard group
        # (FSDP's over all ranks would mix two copies' rows) and computes the same update.
        mesh = self.data_parallel_mesh()
        shards = mesh[mesh.mesh_dim_names[-1]]  # dp_shard (with cp: dp_shard_cp)
        return OwnedMuon(run, rank=shards.get_local_rank(), world=shards.size(), sharded=True,
                         group=shards.get_group())
