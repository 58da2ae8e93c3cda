"""The table `dtrain plan` prints (trainer/commands/plan.py reads the arguments and checks the config
before this module, and torch with it, is imported): per-rank memory of every parallel mode for the
composed config, the mode asked for marked, and the largest micro batch that fits."""

from __future__ import annotations

import sys

import torch
from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from trainer.config.batch import mesh_shape, requested_world
from trainer.errors import ConfigError
from trainer.model.config import GPTConfig
from trainer.parallel import STRATEGIES
from trainer.parallel.base import Strategy
from trainer.plan.memory import device_type_of, estimate, host_memory, largest_micro_batch
from trainer.plan.meta import meta_model
from trainer.plan.params import parameter_counts
from trainer.plan.shards import shard_plan
from trainer.plan.sizes import fmt_bytes

ASSUMED_GPU_MEMORY = 80 * 1024**3  # --device cuda on a host without a GPU: an H100's 80 GiB


def _default_memory(device_type: str, workers_per_node: int) -> tuple[int, str]:
    if device_type == "cuda":
        if not torch.cuda.is_available():
            return ASSUMED_GPU_MEMORY, "no GPU here: an 80 GiB H100 assumed; --device-memory to change"
        props = torch.cuda.get_device_properties(0)
        return props.total_memory, f"{props.name} memory"
    share = host_memory() // max(1, workers_per_node)
    return share, f"host RAM / {workers_per_node} worker(s) per node"


def _least_to_most_sharded(strategy: type[Strategy]) -> tuple:
    """Table order: one process, replicas, sharded optimizer state, sharded parameters."""
    return (strategy.shards_parameters, strategy.shards_optimizer_state, strategy.syncs_replicas,
            strategy.one_process_many_devices, strategy.name)


def _summary(strategy: type[Strategy]) -> str:
    """The first paragraph of the mode's module doc ("parallel=zero: DDP plus ZeRO stage 1 (...)"),
    on one line: a sentence wrapped in the source is still one sentence."""
    doc = (sys.modules[strategy.__module__].__doc__ or strategy.name).strip().split("\n\n")[0]
    return " ".join(doc.split()).removeprefix("parallel=")


def _ranks(cfg, strategy: type[Strategy], world: int) -> int:
    """The processes `strategy` runs on: `world`, or for a mode that trains one data-parallel
    replica, its tensor- and context-parallel group (1 without one)."""
    return world if strategy.syncs_replicas else mesh_shape(cfg, world).model_parallel


def _mesh_refusal(cfg, strategy: type[Strategy], world: int) -> str | None:
    """Why `strategy` cannot lay out the config's mesh at `world` ranks (None when it can)."""
    try:
        strategy.check_mesh(mesh_shape(cfg, world))
    except ConfigError as err:
        return str(err).split(";")[0]
    return None


def _shard_note(cfg, strategy: type[Strategy], world: int) -> str:
    """Where a sharded (or tensor-parallel) mode's figures come from, and how its ranks differ."""
    shards = shard_plan(cfg, strategy.name, world)
    busiest, totals = shards.busiest_rank, shards.totals
    least = min(range(len(totals)), key=totals.__getitem__)
    spread = (f"ranks differ: rank {busiest} holds the most ({fmt_bytes(totals[busiest])} of params + grads + "
              f"optimizer, {totals[busiest] - totals[least]:,} bytes more than rank {least})" if shards.ranks_differ
              else "every rank holds the same")
    return (f"{strategy.name}: params, grads and optimizer read from the DTensor shards of its own wrap "
            f"({mesh_shape(cfg, world).describe()}, a meta model under a fake process group); {spread}")


def _full_context_verdict(cfg, mode: str, world: int, memory: int, device_type: str) -> str:
    """Whether one sequence of the model's whole context fits with activation checkpointing."""
    T = cfg.model.block_size
    longest = OmegaConf.merge(cfg, {"train": {"seq_len": T, "micro_batch_size": 1, "activation_checkpointing": True}})
    est = estimate(longest, mode, world, 1, device_type)
    verdict = "[green]fits[/]" if est.total <= memory else "[red]does not fit[/]"
    return (f"parallel={mode} at its whole context: micro batch 1 x seq {T}, activation checkpointing on: "
            f"peak {fmt_bytes(est.total)} per rank, {verdict} in {fmt_bytes(memory)}")


def print_plan(cfg, memory: int | None, device: str | None) -> None:
    """The plan of the checked config `cfg` (memory: --device-memory's bytes; device: --device)."""
    world = requested_world(cfg)
    chosen = cfg.parallel.mode
    # The mode asked for must lay out its mesh (the table then shows the others that can or cannot).
    STRATEGIES[chosen].check_mesh(mesh_shape(cfg, world))
    device_type = device or device_type_of(cfg)
    source = "--device-memory"
    if memory is None:
        memory, source = _default_memory(device_type, max(1, world // max(1, cfg.launch.nnodes)))
    B = cfg.train.micro_batch_size
    shape = mesh_shape(cfg, world)
    model = (f"{cfg.model.name}: {cfg.model.n_layer} layers, n_embd {cfg.model.n_embd} "
             f"({GPTConfig.from_cfg(cfg.model).summary()})")
    table = Table(
        title=f"per-rank memory estimate: {model}, mesh {shape.describe()}, "
              f"micro batch {B} x seq {cfg.train.seq_len}, "
              f"{device_type}{' compiled' if cfg.train.compile and device_type == 'cuda' else ''}, "
              f"{'checkpointed, ' if cfg.train.activation_checkpointing else ''}"
              f"{f'loss in {cfg.train.loss_chunks} pieces, ' if cfg.train.loss_chunks > 1 else ''}"
              f"budget {fmt_bytes(memory)} ({source})"
    )
    for col in ("mode", "world", "params", "grads", "optimizer", "activations", "other", "peak", "fits",
                "max micro batch"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    strategies = sorted(STRATEGIES.values(), key=_least_to_most_sharded)
    notes = []
    for strategy in strategies:
        w = _ranks(cfg, strategy, world)
        refusal = _mesh_refusal(cfg, strategy, w)
        asked = strategy.name == chosen
        name = ("[bold]" if asked else "") + strategy.name + (" *" if asked else "")
        if refusal:
            table.add_row(name, str(w), *["-"] * 6, "[dim]no[/]", "[dim]-[/]")
            notes.append(f"{strategy.name}: {refusal}")
            continue
        est = estimate(cfg, strategy.name, w, B, device_type)
        other = est.gathered + est.runtime + (est.temporaries if est.step_peak > est.backward_peak else 0)
        fits = est.total <= memory
        best = largest_micro_batch(cfg, strategy.name, w, memory, device_type)
        table.add_row(
            name, str(w),
            fmt_bytes(est.params), fmt_bytes(est.grads), fmt_bytes(est.optim), fmt_bytes(est.activations),
            fmt_bytes(other), fmt_bytes(est.total),
            "[green]yes[/]" if fits else "[red]no[/]",
            str(best) if best else "[red]none[/]",
        )
        if strategy.shards_parameters or shape.tp > 1:
            notes.append(_shard_note(cfg, strategy, w))
    console = Console(width=max(Console().width, 150))
    # memory holds every parameter (the table); FLOPs and MFU count the active ones
    counts = parameter_counts(meta_model(GPTConfig.from_cfg(cfg.model)), cfg.train.seq_len)
    console.print(counts.describe(cfg.train.seq_len), highlight=False)
    console.print(table)
    console.print(
        "[dim]peak = the larger of backward's start (params + optimizer + activations, + gradients where "
        "they persist (DDP/ZeRO buckets), + FSDP's gathered units) and the optimizer step (params + "
        "gradients + optimizer + the step's temporaries); other = gathered units + temporaries + the process "
        f"itself ({'CUDA context, workspaces' if device_type == 'cuda' else 'library code, thread pools'}); "
        "optimizer = the rank holding the most. * = the mode asked for.[/]"
    )
    for note in notes:
        console.print(f"[dim]  {note}[/]", highlight=False)
    asked_mode = STRATEGIES[chosen]
    if not _mesh_refusal(cfg, asked_mode, _ranks(cfg, asked_mode, world)):
        console.print(_full_context_verdict(cfg, chosen, _ranks(cfg, asked_mode, world), memory, device_type),
                      highlight=False)
    for strategy in strategies:
        console.print(f"[dim]  {_summary(strategy)}[/]", highlight=False)
