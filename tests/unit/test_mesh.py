"""The device mesh as arithmetic (trainer/process/mesh_shape.py) and as a continuation sees it: the
mesh keys are layout keys like world, so another mesh continues a run (and says so) while the global
batch, counted over the data-parallel ranks only, is still checked. Torch-free, in-process."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.checkpoint.records import Resumable
from trainer.checkpoint.resume_notes import sum_order_changes
from trainer.config.batch import batch_plan, mesh_shape
from trainer.config.compose import compose
from trainer.errors import ConfigError
from trainer.preflight.continuation import recorded_batch
from trainer.process.mesh_shape import MeshShape


def test_tensor_parallel_is_innermost_and_shares_one_batch():
    shape = MeshShape(dp_replicate=2, dp_shard=2, tp=2)
    assert (shape.world, shape.dp_world, shape.model_parallel) == (8, 4, 2)
    # ranks 0 and 1 are one tensor-parallel group: the same data-parallel rank, the same batch
    assert [shape.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [shape.first_rank(d) for d in range(4)] == [0, 2, 4, 6]
    assert shape.describe() == "dp_replicate 2 x dp_shard 2 x tp 2"
    assert MeshShape().describe() == "one rank"


def test_hsdp_replicates_one_group_per_node_by_default():
    cfg = compose(["parallel=hsdp", "launch.nnodes=2", "world=8"])
    assert mesh_shape(cfg, 8) == MeshShape(dp_replicate=2, dp_shard=4)


@pytest.mark.parametrize("overrides,world,needle", [
    (["parallel=hsdp", "parallel.dp_replicate=3"], 4, "does not divide world=4"),
    (["parallel=fsdp", "parallel.tp=0"], 2, "parallel.tp=0 must be a whole number"),
    # sequence parallelism splits each sequence (each cp rank's positions) over the tp ranks
    (["parallel=none", "parallel.tp=4", "train.seq_len=66"], 4, "choose a train.seq_len divisible by 4"),
    (["parallel=fsdp", "parallel.cp=2", "parallel.tp=3", "train.seq_len=40"], 6,
     "splits the 20 positions each rank holds of a sequence into 3 equal parts"),
])
def test_a_mesh_that_does_not_fill_the_world_is_refused(overrides, world, needle):
    with pytest.raises(ConfigError, match=needle):
        mesh_shape(compose(overrides), world)


def test_the_global_batch_counts_data_parallel_ranks_only():
    cfg = compose(["parallel=fsdp", "parallel.tp=2", "train.micro_batch_size=2", "train.seq_len=32",
                   "train.total_batch_size=256"])
    plan = batch_plan(cfg, 4)  # 2 data-parallel ranks of 2 tensor-parallel ranks each
    assert (plan.dp_world, plan.grad_accum_steps, plan.total_batch_size) == (2, 2, 256)


HSDP_STATE = {"world": 4, "parallel": "hsdp", "mesh": "dp_replicate 2 x dp_shard 2", "dp_world": 4,
              "total_batch_size": 256, "micro_batch_size": 2, "seq_len": 32, "grad_accum_steps": 1}


def test_another_mesh_is_named_in_the_resume_note():
    fsdp = {**HSDP_STATE, "world": 2, "parallel": "fsdp", "mesh": "dp_shard 2", "dp_world": 2, "grad_accum_steps": 2}
    changes = sum_order_changes(HSDP_STATE, fsdp)
    assert "the device mesh dp_replicate 2 x dp_shard 2 then, dp_shard 2 now" in changes, changes
    assert "grad_accum_steps" not in " ".join(changes) and "accumulation 1 then, 2 now" in changes
    # plain data parallelism on both sides: the world alone says it
    plain = {**fsdp, "world": 4, "mesh": "dp_shard 4", "dp_world": 4}
    assert not any("mesh" in c for c in sum_order_changes(fsdp, plain))
    same_world = {**HSDP_STATE, "mesh": "dp_replicate 4 x dp_shard 1"}
    assert sum_order_changes(HSDP_STATE, same_world) == [
        "the device mesh dp_replicate 2 x dp_shard 2 then, dp_replicate 4 x dp_shard 1 now"]


def test_the_recorded_batch_counts_the_data_parallel_ranks():
    tp_state = {**HSDP_STATE, "world": 4, "parallel": "fsdp", "mesh": "dp_shard 2 x tp 2", "dp_world": 2,
                "total_batch_size": None, "grad_accum_steps": 2}
    config = {"train": {"total_batch_size": None, "micro_batch_size": 2, "seq_len": 32, "grad_accum_steps": 2}}
    chosen = Resumable(Path("step_000004"), tp_state, config, [])
    assert recorded_batch(chosen, None) == (256, " (from its config at 2 data-parallel ranks (world 4))")
    chosen = Resumable(Path("step_000004"), {**tp_state, "total_batch_size": 256}, config, [])
    assert recorded_batch(chosen, None) == (256, " = 2 x 32 x 2 data-parallel ranks (world 4) x 2 accumulation")
