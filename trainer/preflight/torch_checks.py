"""The checks that need torch or a tracker's package: run once the torch-free checks have passed and
before anything is written (the run directory, its .hydra/ record, dtrain.log, resolved_config.json),
so that a mistake they catch leaves nothing a later command would take for a run to continue.

    the parallel mode on this many workers   (the mode's Strategy class)
    optim.name's registration and its optim.args (trainer/optim/registry.py)
    train.device=cuda[:N] with no CUDA device
    train.memory_snapshot=true on a run that will not use CUDA (the allocator's history is CUDA's)
    model.attention naming an SDPA kernel the device cannot run for this model's heads and dtype
    train.loss_kernel=fused off CUDA or without liger-kernel
    train.float8 without torchao or on a GPU older than sm89
    resume=PATH naming another model's checkpoint
    logger=wandb with no W&B credentials
    a model whose weights, gradients and optimizer state cannot fit the device's (or RAM's) memory
    a fresh run directory on a disk without room for one checkpoint (its size needs the model)
"""

from __future__ import annotations

import inspect
import os
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from trainer.checkpoint.layout import latest_checkpoint, resolve_checkpoint
from trainer.checkpoint.records import check_model_config, read_checkpoint_config
from trainer.checkpoint.space import check_space_for_first_checkpoint
from trainer.config.batch import mesh_shape
from trainer.config.schema import tracker_names
from trainer.config.shape import parameter_count
from trainer.errors import ConfigError, UserError
from trainer.io import one_line
from trainer.model.float8 import resolve_float8
from trainer.model.layers import SDPA_BACKENDS
from trainer.model.loss import resolve_loss_kernel
from trainer.optim.registry import check_args, states_of
from trainer.parallel import strategy_class
from trainer.parallel.base import compute_dtype
from trainer.plan.memory import checkpoint_bytes, host_memory, model_state_floor
from trainer.plan.sizes import fmt_bytes
from trainer.preflight.checks import say_notice
from trainer.process.runtime import pick_device

# WANDB_MODE values under which a W&B run needs no credentials.
WANDB_LOCAL_MODES = ("offline", "dryrun", "disabled")


def check_with_torch(cfg, world: int, run_dir: Path | None = None) -> None:
    """Every check of this module, in the order a user would fix them; raises UserError. `run_dir`:
    the run's directory (None: a sweep's points before its folders are known). trainer.preflight.claim runs
    them, after the checks that need no torch."""
    check_mode(cfg, world)
    check_args(cfg.optim)  # finds the optimizer's registration, or says why not
    device = pick_device(cfg.train.device, 0)  # ConfigError when CUDA is asked for and there is none
    check_memory_snapshot(cfg, device)
    check_attention(cfg, device)
    resolve_loss_kernel(cfg.train.loss_kernel, cfg.train.loss_chunks, device)  # fused: CUDA and the extra
    resolve_float8(cfg.train.float8, device)  # torchao installed, a GPU with float8
    check_model_fits(cfg, world, device)
    check_resume_model(cfg)
    if "wandb" in tracker_names(cfg.logger):
        check_wandb_credentials()
    if run_dir is not None and latest_checkpoint(run_dir) is None:
        # a continuation's room was checked by preflight against its newest checkpoint
        check_space_for_first_checkpoint(run_dir, checkpoint_bytes(cfg))


def check_mode(cfg, world: int) -> None:
    """The parallel mode can run on this many workers (asks the mode's Strategy class)."""
    strategy, shape = check_layout(cfg, world)
    # the ranks the mode's shards span: context-parallel ranks are folded into its data parallelism
    advice = strategy.world_advice(shape.dp_world * shape.cp)
    if advice:
        say_notice(advice)


def check_layout(cfg, world: int):
    """The mode can lay out this mesh over `world` workers; returns (its Strategy class, the mesh).
    Silent, so plain torchrun's every rank runs it before Hydra writes anything (commands/train.py)."""
    strategy = strategy_class(cfg.parallel.mode)
    shape = mesh_shape(cfg, world)
    strategy.check_mesh(shape)
    # Replicas are counted along data parallelism: a tensor-parallel group trains one model.
    strategy.check_world(shape.dp_world, model_parallel=shape.model_parallel)
    return strategy, shape


def check_attention(cfg, device: torch.device) -> None:
    """model.attention names a kernel that runs here: tried for real, forward and backward, on a few
    positions of the model's heads (grouped as the model groups them) in the run's compute dtype,
    since which kernel takes which device, dtype, head width and grouping is SDPA's own knowledge.
    Only a named kernel is tried (auto needs none). On CUDA the try makes a CUDA context in the
    process that checks: under dtrain's own launcher that is the launcher, which keeps it (a few
    hundred MB on the first GPU) while the workers train."""
    name = cfg.model.attention
    if name == "auto":
        return
    runnable = [other for other in SDPA_BACKENDS if _attention_runs(other, cfg, device)]
    if name not in runnable:
        dtype = str(compute_dtype(cfg.train.dtype, device)).removeprefix("torch.")
        raise ConfigError(f"model.attention={name} has no kernel for this model on {device.type} ({dtype}, head "
                          f"width {cfg.model.n_embd // cfg.model.n_head}); choose model.attention=auto or one "
                          f"of {', '.join(runnable) or 'none'}")


def _attention_runs(name: str, cfg, device: torch.device) -> bool:
    m = cfg.model
    dtype, head_dim, kv_heads = compute_dtype(cfg.train.dtype, device), m.n_embd // m.n_head, m.n_kv_head or m.n_head
    q = torch.zeros(1, m.n_head, 8, head_dim, dtype=dtype, device=device, requires_grad=True)
    kv = torch.zeros(1, kv_heads, 8, head_dim, dtype=dtype, device=device)
    grouped = {"enable_gqa": True} if kv_heads != m.n_head else {}
    try:
        with sdpa_kernel(SDPA_BACKENDS[name]), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SDPA's warning per kernel it could not use
            F.scaled_dot_product_attention(q, kv, kv, is_causal=True, dropout_p=m.dropout, **grouped).sum().backward()
    except RuntimeError:  # "No viable backend for scaled_dot_product_attention was found", with its warnings
        return False
    return True


def check_memory_snapshot(cfg, device: torch.device) -> None:
    """train.memory_snapshot records the CUDA caching allocator's history: a run on the CPU has none.
    Here, where train.device=auto is resolved, not in the torch-free checks."""
    if cfg.train.memory_snapshot and device.type != "cuda":
        raise ConfigError(f"train.memory_snapshot=true needs a CUDA device; this run trains on {device.type} "
                          f"(train.device={cfg.train.device}); drop train.memory_snapshot (on the CPU, "
                          "train.profile.steps=[START,END] shows memory in the profile)")


def check_model_fits(cfg, world: int, device: torch.device) -> None:
    """The model's weights, gradients and optimizer state fit one worker's memory: the device's, or
    this machine's RAM shared by its workers. Here, not in the torch-free checks: a GPU's memory is
    torch's to tell and the sharding is the mode's Strategy's, and `dtrain plan`, which runs those
    checks too, still answers for a model that does not fit (it says so, mode by mode)."""
    strategy = strategy_class(cfg.parallel.mode)
    ranks = world if strategy.syncs_replicas else 1  # the other modes run one process
    need = model_state_floor(cfg, strategy, ranks)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        budget, where = props.total_memory, f"the {props.name}'s memory"
    else:
        local = max(1, ranks // cfg.launch.nnodes)
        budget, where = host_memory() // local, f"this machine's RAM{f' / {local} workers' if local > 1 else ''}"
    if budget and need > budget:
        shard = "" if strategy.shards_parameters else ", shard it over more workers (parallel=fsdp world=N)"
        m, state = cfg.model, " and ".join(label for label, _ in states_of(cfg.optim))
        raise UserError(
            f"model.n_layer={m.n_layer}, model.n_embd={m.n_embd}: {parameter_count(m):,} parameters need "
            f"{fmt_bytes(need)} per worker for fp32 weights, gradients and {state} state "
            f"(parallel={cfg.parallel.mode}, world={ranks}), more than {where} ({fmt_bytes(budget)}); choose a "
            f"smaller model (model.n_layer, model.n_embd){shard}; `dtrain plan` shows what fits"
        )


def check_resume_model(cfg) -> None:
    """resume=PATH: the checkpoint was written for this model's shape (a run's own checkpoint is
    covered by the run directory's record, where the model keys must match)."""
    if cfg.resume in ("auto", "never"):
        return
    ckpt = resolve_checkpoint(cfg.resume)
    check_model_config(ckpt, read_checkpoint_config(ckpt), cfg.model)


def check_wandb_credentials() -> None:
    """W&B finds an API key (WANDB_API_KEY, its settings file, .netrc) unless WANDB_MODE keeps the
    run local; asked without a prompt, without contacting the server and without printing."""
    if os.environ.get("WANDB_MODE", "").lower() in WANDB_LOCAL_MODES:
        return
    import wandb  # the optional extra dtrain[wandb] (a heavy import): only runs that log to W&B

    if "prompt" not in inspect.signature(wandb.login).parameters:
        return  # an older wandb would prompt here: its run start reports a missing key instead
    silent = os.environ.get("WANDB_SILENT")
    os.environ["WANDB_SILENT"] = "true"  # read by wandb in this process only; the workers start later
    try:
        found = wandb.login(verify=False, prompt=False)
    except wandb.Error as err:
        found, reason = False, one_line(err)
    else:
        reason = "no API key configured"
    finally:
        if silent is None:
            os.environ.pop("WANDB_SILENT", None)
        else:
            os.environ["WANDB_SILENT"] = silent
    if not found:
        raise UserError(f"logger=wandb has no W&B credentials ({reason}); run `wandb login` or set "
                        "WANDB_API_KEY, or set WANDB_MODE=offline and `wandb sync` the run later")
