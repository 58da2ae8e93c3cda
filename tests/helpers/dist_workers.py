"""Worker functions the distributed tests launch through torchrun's engine (must be importable)."""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from torch.distributed.tensor import DTensor

from trainer.config.batch import mesh_shape, requested_world
from trainer.config.schema import from_dict
from trainer.fit.run import Run
from trainer.launch.forkserver import forkserver_for
from trainer.model.config import GPTConfig, MoEConfig
from trainer.model.gpt import GPT
from trainer.optim.build import parts
from trainer.parallel import strategy_class
from trainer.parallel.context_parallel import SequenceSplit
from trainer.parallel.tensor_parallel import canonical_state, parallelize, sum_whole_parameter_grads
from trainer.process.mesh_shape import MeshShape
from trainer.process.runtime import init_runtime


def every_rank(worker, world: int, *args) -> dict:
    """worker(*args) on `world` workers through torchrun's engine, forked from a forkserver as dtrain's
    driver starts them (trainer/launch/forkserver.py); rank -> its result."""
    launch = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world, rdzv_backend="c10d",
                          rdzv_endpoint="localhost:0", run_id=f"test-{uuid.uuid4().hex[:8]}", max_restarts=0,
                          start_method="forkserver")
    with forkserver_for(worker):
        return elastic_launch(launch, worker)(*args)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _bytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def _state_tensors(optimizers) -> list[torch.Tensor]:
    return [t for o in optimizers for s in o.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]


def train_and_inspect(cfg_dict: dict, run_dir: str, steps: int) -> dict:
    """Train a few steps, then report this rank's weights digest and what it holds in memory."""
    cfg = from_dict(cfg_dict)
    # the run's own mesh (parallel.dp_replicate, parallel.tp), as trainer/fit/worker.py lays it out
    rt = init_runtime("cpu", strategy_class(cfg.parallel.mode).needs_process_group, 120, 1,
                      shape=mesh_shape(cfg, requested_world(cfg)))
    try:
        run = Run(cfg, rt, Path(run_dir))
        for step in range(steps):
            run.train_step(step)
        run.forward_backward()  # live gradients to measure (the optimizer step drops its own); weights unchanged
        raw = run.strategy.unwrap(run.model)
        full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in raw.named_parameters()}
        digest = hashlib.sha256(b"".join(full[n].numpy().tobytes() for n in sorted(full))).hexdigest()
        # ZeRO's optimizer state is its local AdamW's (`optim`): this rank's rows (zero) or whole
        # parameters (zero_torch) only. Muon by owner (OwnedMuon) apart: its owned matrices' momenta
        # and the zeroed whole copies it steps them on.
        found = parts(run.optimizer)
        owned = [part for part in found if getattr(part, "saves_by_name", False)]
        local = [getattr(part, "optim", part) for part in found if part not in owned]
        work = [copy for part in owned if part.sharded for copy in part.work]
        return {
            "digest": digest,
            "param_bytes": _bytes(raw.parameters()),
            "grad_bytes": _bytes(p.grad for p in raw.parameters() if p.grad is not None),
            "optimizer_bytes": _bytes(_state_tensors(local)),
            "muon_bytes": _bytes(_state_tensors(owned)) + _bytes(work),
            "full_param_bytes": sum(t.numel() * t.element_size() for t in full.values()),
        }
    finally:
        rt.shutdown()


def val_figures_on_weights(cfg_dicts: list[dict], run_dir: str, weights: str) -> list[dict]:
    """Validation figures of each config's Run on the same saved weights (a raw GPT state dict)."""
    first = from_dict(cfg_dicts[0])
    rt = init_runtime("cpu", strategy_class(first.parallel.mode).needs_process_group, 120, 1)
    try:
        figures = []
        for cfg_dict in cfg_dicts:
            run = Run(from_dict(cfg_dict), rt, Path(run_dir))
            run.strategy.unwrap(run.model).load_state_dict(torch.load(weights))
            figures.append(run.val_figures())
        return figures
    finally:
        rt.shutdown()


def _whole_model_figures(blocks: dict, activation_checkpointing: bool, loss_chunks: int) -> tuple:
    """(model, x, y, loss, gradients, per-token losses, logits) of one fp64 forward and backward of a
    tiny GPT of `blocks` (GPTConfig fields; `moe`: MoEConfig fields) on whole sequences (seed 0)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    fields = dict(blocks)
    if "moe" in fields:
        fields["moe"] = MoEConfig(**fields["moe"])
    model = GPT(GPTConfig(**fields)).double()
    model.activation_checkpointing, model.loss_chunks = activation_checkpointing, loss_chunks
    x = torch.randint(0, blocks["vocab_size"], (3, blocks["block_size"]))
    y = torch.randint(0, blocks["vocab_size"], (3, blocks["block_size"]))
    whole = model(x, y)[1]
    whole.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        tokens, logits = model(x, y, per_token=True)[1], model(x)[0]
    model.zero_grad()
    return model, x, y, whole, grads, tokens, logits


def sequence_split_differences(blocks: dict, activation_checkpointing: bool, loss_chunks: int) -> dict:
    """One fp64 forward and backward of a tiny GPT of `blocks` (GPTConfig fields) over whole
    sequences, then over this rank's share of them (trainer/parallel/context_parallel.py) with the
    gradients averaged over the group: the largest differences in the loss, the gradients and the
    per-token losses validation reads."""
    dist.init_process_group("gloo")
    try:
        model, x, y, whole, want, want_tokens, _ = _whole_model_figures(blocks, activation_checkpointing, loss_chunks)
        model.sequence_split = SequenceSplit(dist.group.WORLD, dist.get_rank(), dist.get_world_size())
        local = model(x, y)[1]
        local.backward()
        loss = local.detach().clone()
        dist.all_reduce(loss)
        grads = 0.0
        for name, param in model.named_parameters():
            grad = param.grad.clone()
            dist.all_reduce(grad)
            grads = max(grads, (grad / dist.get_world_size() - want[name]).abs().max().item())
        with torch.no_grad():
            tokens = model(x, y, per_token=True)[1]
        return {"loss": abs(loss.item() / dist.get_world_size() - whole.item()), "grads": grads,
                "per_token": (tokens - want_tokens).abs().max().item()}
    finally:
        dist.destroy_process_group()


def sequence_parallel_differences(blocks: dict, activation_checkpointing: bool, loss_chunks: int) -> dict:
    """One fp64 forward and backward of a tiny GPT of `blocks` (GPTConfig fields; `moe`: MoEConfig
    fields) whole, then split over the ranks by tensor and sequence parallelism
    (trainer/parallel/tensor_parallel.py): the largest differences in the loss, the gradients (the
    whole parameters' summed over the group as a step does), the per-token losses, and the logits of
    a forward without targets; and the positions each rank's first norm saw."""
    dist.init_process_group("gloo")
    try:
        model, x, y, whole, want, want_tokens, want_logits = _whole_model_figures(
            blocks, activation_checkpointing, loss_chunks)
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
        model = parallelize(model, mesh)
        seen = []
        model.transformer.h[0].ln_1.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[1]))
        split = model(x, y)[1]
        split.backward()
        sum_whole_parameter_grads(model)
        got = canonical_state(model, {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                                      for n, p in model.named_parameters()})
        grads = max((got[n] - want[n]).abs().max().item() for n in want)
        with torch.no_grad():
            tokens = model(x, y, per_token=True)[1]
            logits = model(x)[0]
        return {"loss": abs(split.item() - whole.item()), "grads": grads,
                "per_token": (tokens - want_tokens).abs().max().item(),
                "logits": (logits - want_logits).abs().max().item(), "positions": seen}
    finally:
        dist.destroy_process_group()


PROBE_ENV = "DTRAIN_TEST_LAUNCH_PROBE"


def launch_probe() -> dict:
    """What a worker of run_workers saw: the launch's probe variable, its parent process, its rank and
    where its stdout goes."""
    return {"probe": os.environ.get(PROBE_ENV), "parent": os.getppid(), "rank": int(os.environ["RANK"]),
            "stdout": os.readlink("/proc/self/fd/1")}


def gloo_group_threads() -> dict:
    """The worker threads of each kind of gloo group a run makes (the world, a mesh dimension's,
    new_group's) once init_runtime brought the world up, and one all-reduce's sum over each."""
    rt = init_runtime("cpu", True, 60, 1, shape=MeshShape(tp=int(os.environ["WORLD_SIZE"])))
    try:
        groups = {"world": dist.group.WORLD,
                  "mesh": init_device_mesh("cpu", (1, rt.world), mesh_dim_names=("dp", "tp")).get_group("tp"),
                  "new_group": dist.new_group(backend="gloo")}
        found = {}
        for name, group in groups.items():
            backend = group._get_backend(torch.device("cpu"))
            total = torch.tensor([float(rt.rank + 1)])
            dist.all_reduce(total, group=group)
            found[name] = {"threads": backend.options._threads, "devices": len(backend.options._devices),
                           "sum": total.item()}
        return found
    finally:
        dist.destroy_process_group()
