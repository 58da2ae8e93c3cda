"""How a run's processes are laid out: one named device mesh of dp_replicate x dp_shard x cp x tp.

Arithmetic only (no torch): the config checks and the batch plan need it before torch loads, and the
strategies build their torch DeviceMesh from it (trainer/parallel/base.py). The order puts tensor
parallelism innermost, as torchtitan and Megatron do: a tensor-parallel group is neighbouring ranks,
one node's, so its many per-layer collectives stay on the fastest links; data parallelism, which
communicates once per step, spans the nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

DIMENSIONS = ("dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class MeshShape:
    dp_replicate: int = 1  # replicas of the data-parallel shards (HSDP: one per node)
    dp_shard: int = 1  # data-parallel ranks inside one replica (the rest of world)
    cp: int = 1  # context parallel: one sequence split over these ranks
    tp: int = 1  # tensor parallel: one layer's matrices split over these ranks
    # Expert parallel: a mixture of experts' experts split over this many of the dp_shard ranks, which
    # send each other their tokens (all-to-all). Not a dimension of its own: it divides dp_shard, whose
    # ranks still read different batches, so it leaves world and the data arithmetic alone.
    ep: int = 1

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp_world(self) -> int:
        """Data-parallel size: how many different batches one micro step reads."""
        return self.dp_replicate * self.dp_shard

    @property
    def model_parallel(self) -> int:
        """Ranks that share one batch (a tensor- and context-parallel group)."""
        return self.cp * self.tp

    def dp_rank(self, rank: int) -> int:
        """The data-parallel coordinate of a global rank: which batch it reads."""
        return rank // self.model_parallel

    def first_rank(self, dp_rank: int) -> int:
        """The lowest global rank reading data-parallel batch `dp_rank` (its group's speaker)."""
        return dp_rank * self.model_parallel

    def sizes(self) -> dict[str, int]:
        """{dimension: size}, outermost first."""
        return {name: getattr(self, name) for name in DIMENSIONS}

    def describe(self) -> str:
        """'dp_replicate 2 x dp_shard 2 x tp 2' (dimensions of size 1 left out; 'one rank' if all are),
        and ', ep 2' when experts are split over part of dp_shard."""
        parts = [f"{name} {size}" for name, size in self.sizes().items() if size > 1]
        experts = f", ep {self.ep}" if self.ep > 1 else ""
        return (" x ".join(parts) or "one rank") + experts
