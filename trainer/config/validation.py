"""The config's checks: the range of every numeric key, and the cross-field checks that types alone
cannot express. Torch-free, like the schema (a user error arrives before torch would load)."""

from __future__ import annotations

import importlib.util
import math
import os
import re

from omegaconf import DictConfig, ListConfig, OmegaConf

from trainer.config.batch import batch_plan, requested_world
from trainer.config.dataset_names import HF_PATH_NEEDED, UNNAMED
from trainer.config.model_checks import check_block, check_expert_parallel, check_model_size, check_tensor_parallel
from trainer.config.schema import (
    COMPILE_MODES,
    DTYPES,
    FLOAT8_SETTINGS,
    GROUP_SCHEMAS,
    INIT_FROM_REQUIRED,
    LOGGERS,
    LOSS_KERNELS,
    MAX_SAMPLE_TOKENS,
    MAX_SEED,
    MIXED_PRECISION,
    MUON_ADJUST_LR,
    MUON_NS_DTYPES,
    ON_NONFINITE,
    OPTIMIZERS,
    PARALLEL_MODES,
    SCHEDULES,
    START_METHODS,
    Config,
)
from trainer.config.vocab import TOKENIZER_VOCAB_SIZE, TOKENIZERS, tokenizer_vocab_size
from trainer.errors import ConfigError
from trainer.io import dotted_keys
from trainer.process.env import launched_world

# train.device: what the runtime picks from (a device string torch would not parse is refused here,
# torch-free; whether a CUDA device is there is checked once torch is loaded, before anything is written).
DEVICE_SPEC = re.compile(r"auto|cpu|cuda(:\d+)?")


def _at_least(low):
    return lambda v: v >= low, f"at least {low}"


def _positive():
    return lambda v: v > 0, "positive"


def _fraction():
    return lambda v: 0 <= v < 1, "in [0, 1)"


# The range of every numeric key (a type alone lets through -1 or 1.5), with what the value means
# where the range alone would not say it. A null (None) always passes: it means "derive it".
RANGES = {
    "model.n_layer": _at_least(1),
    "model.n_head": _at_least(1),
    "model.n_embd": _at_least(1),
    "model.block_size": _at_least(1),
    "model.pad_vocab_multiple": _at_least(1),
    "model.dropout": _fraction(),
    "model.norm_eps": _positive(),
    "model.rope_theta": _positive(),
    "model.mlp_hidden": _at_least(1),
    "model.mlp_multiple_of": _at_least(1),
    "model.n_kv_head": _at_least(1),
    "model.head_dim": _at_least(1),
    "data.val_fraction": _fraction(),
    "data.shard_tokens": _at_least(1),
    "data.max_tokens": _at_least(1),
    "data.num_proc": _at_least(1),
    "optim.lr": _positive(),
    "optim.warmup_steps": _at_least(0),
    "optim.decay_fraction": (lambda v: 0 < v <= 1, "in (0, 1] (the share of train.max_steps in the decay)"),
    "optim.weight_decay": _at_least(0),
    "optim.eps": _positive(),
    "optim.grad_clip": _at_least(0),  # 0 = no clipping
    "optim.muon.lr": _positive(),
    "optim.muon.weight_decay": _at_least(0),
    "optim.muon.momentum": _fraction(),
    "optim.muon.ns_steps": _at_least(1),
    "parallel.bucket_cap_mb": _positive(),
    "parallel.dp_replicate": _at_least(1),
    "parallel.cp": _at_least(1),
    "parallel.tp": _at_least(1),
    "parallel.ep": _at_least(1),
    "launch.nnodes": _at_least(1),
    "launch.rdzv_timeout": _at_least(1),
    "launch.max_restarts": _at_least(0),
    "launch.monitor_interval": _positive(),
    "launch.timeout_s": _at_least(1),
    # 0 = no hang watch; under a second the watch (it looks every 0.25 s) would call an ordinary step a hang
    "launch.hang_timeout_s": (lambda v: v == 0 or v >= 1, "0 (no hang watch) or at least 1 (seconds)"),
    "train.straggler_ratio": (lambda v: v == 0 or v > 1,
                              "0 (off) or above 1 (a rank's time over the other ranks' median)"),
    "train.straggler_every": _at_least(1),
    "launch.threads_per_worker": _at_least(1),
    "train.seed": _at_least(0),  # numpy's generators take no negative seed
    "train.max_steps": _at_least(1),
    "train.micro_batch_size": _at_least(1),
    "train.seq_len": _at_least(1),
    "train.total_batch_size": _at_least(1),
    "train.grad_accum_steps": _at_least(1),
    "train.val_interval": _at_least(0),  # 0 = only at the end
    "train.val_tokens": _at_least(0),  # 0 = no validation loss
    "train.val_batches": _at_least(0),  # the old measure (keys.py _val_batches_as_tokens): left here only when negative
    "train.log_interval": _at_least(1),
    "train.sample_tokens": _at_least(0),  # 0 = no sample
    "train.peak_flops": _positive(),
    "train.max_nonfinite": _at_least(1),
    "train.loss_chunks": _at_least(1),
    "train.target_val_loss": (lambda v: v > 0, "a positive loss in nats (e.g. 4.5)"),
    "train.target_val_bpb": (lambda v: v > 0, "a positive figure in bits per byte (e.g. 2.0)"),
    "checkpoint.interval": _at_least(0),  # 0 = only at the end
    "checkpoint.keep": _at_least(1),
    "eval.hellaswag.interval": _at_least(0),  # 0 = never during training
    "eval.limit": _at_least(1),
    "eval.hellaswag.batch_examples": _at_least(1),
    "sweep.seeds": _at_least(1),
    "world": _at_least(1),
}

# The keys whose values past a bound would overflow what torch, numpy or C take, or stall the job,
# only once it runs: key -> (the largest value, why; said in the line of a value above it).
_WEEK = "a week: a longer wait is a hang, and torch's deadlines overflow their int64 nanoseconds near 10**10 s"
_CORES = "more than a machine has cores; torch and the OS take a C int"
_CLUSTER = "more than any cluster has"
UPPER_BOUNDS = {
    # `dtrain plan` lays a model out (shapes only) in about 4 ms a layer: 1024 in seconds, 10**9 never
    "model.n_layer": (1024, "deeper than any GPT trained, which have about a hundred"),
    "data.num_proc": (1024, f"tokenizer processes: {_CORES}"),
    "optim.muon.ns_steps": (100, "Newton-Schulz converges in about 5, each one three matmuls a matrix and step"),
    # DDP keeps the bucket's bytes in a C int64 (1e20 MB is a TypeError in its Reducer)
    "parallel.bucket_cap_mb": (10**6, "a terabyte: a bucket beyond the gradients' size is one bucket"),
    "launch.nnodes": (2**20, _CLUSTER),
    "launch.rdzv_timeout": (7 * 24 * 3600, _WEEK),
    # torch elastic's agent sleeps this long between looks at its workers (LaunchConfig.monitor_interval)
    "launch.monitor_interval": (10, "seconds between the launcher's looks at its workers: a job outlives its "
                                "training, and notices a failed worker, that late"),
    "launch.timeout_s": (7 * 24 * 3600, _WEEK),
    "launch.hang_timeout_s": (7 * 24 * 3600, _WEEK),
    "launch.threads_per_worker": (1024, _CORES),
    "train.seed": (MAX_SEED, "torch's generators take none larger"),
    "train.sample_tokens": (MAX_SAMPLE_TOKENS, "past the block size each token re-reads the whole window"),
    "world": (2**20, _CLUSTER),
}


# What a null means for the keys that take one (said beside the range a value missed).
NULL_MEANS = {
    "model.mlp_hidden": "4 x n_embd, or Llama's rule for swiglu", "model.n_kv_head": "n_head",
    "model.head_dim": "n_embd / n_head",
    "data.max_tokens": "all", "data.num_proc": "all cores", "launch.threads_per_worker": "cores / local workers",
    "launch.hang_timeout_s": "10 x the slowest step, 120 s at least",
    "train.total_batch_size": "derived", "train.grad_accum_steps": "derived", "train.peak_flops": "known GPUs only",
    "eval.limit": "every example", "train.target_val_loss": "no target",
    "train.target_val_bpb": "no target", "sweep.seeds": "no seed axis",
    "world": "1, or torchrun's WORLD_SIZE",
}


def _schema_default(key: str):
    """The schema's default for a dotted key (None where the schema has none)."""
    section, _, name = key.partition(".")
    if section in GROUP_SCHEMAS:  # MISSING in Config (a group's YAML fills them): their own dataclass's
        return OmegaConf.select(OmegaConf.structured(GROUP_SCHEMAS[section]), name, default=None)
    return OmegaConf.select(OmegaConf.structured(Config), key, default=None)


def check_ranges(cfg: DictConfig, sections: tuple[str, ...] | None = None) -> None:
    """Every numeric key within its range (only the keys under `sections`, when given). Raises
    ConfigError naming the key, its range and a value that works."""
    check_finite(cfg, sections)
    for key, (ok, requirement) in RANGES.items():
        if sections is not None and key.split(".")[0] not in sections:
            continue
        value = OmegaConf.select(cfg, key, default=None)
        if value is None or ok(value):
            continue
        default = _schema_default(key)
        fix = f"; e.g. {key}={default}" if default is not None and ok(default) else ""
        nullable = f" (or null: {NULL_MEANS[key]})" if key in NULL_MEANS else ""
        raise ConfigError(f"{key}={value} must be {requirement}{nullable}{fix}")
    for key, (high, why) in UPPER_BOUNDS.items():
        if sections is not None and key.split(".")[0] not in sections:
            continue
        value = OmegaConf.select(cfg, key, default=None)
        if value is not None and value > high:
            default = _schema_default(key)
            fix = f"; e.g. {key}={default}" if default is not None else f" (or null: {NULL_MEANS[key]})"
            raise ConfigError(f"{key}={value} must be at most {high} ({why}){fix}")
    vocab = OmegaConf.select(cfg, "model.vocab_size", default=None)
    tok = OmegaConf.select(cfg, "tokenizer", default=None)
    if tok is not None and tok.name not in TOKENIZERS:
        raise ConfigError(f"tokenizer={tok.name} is unknown; choose one of {', '.join(TOKENIZERS)}")
    if tok is not None and tok.name == "hf" and not tok.path and not tok.get("checkpoint"):
        raise ConfigError("tokenizer=hf needs tokenizer.path=DIR, a folder holding a Hugging Face tokenizer.json "
                          "(a model folder, or one `dtrain tokenizer train` wrote)")
    ids = tokenizer_vocab_size(tok.name, tok.path, tok.get("checkpoint")) if tok is not None else TOKENIZER_VOCAB_SIZE
    which = "the GPT-2 tokenizer's" if tok is None or tok.name == "gpt2" else f"tokenizer.path={tok.path}'s"
    if (sections is None or "model" in sections) and vocab is not None and vocab < ids:
        raise ConfigError(
            f"model.vocab_size={vocab} is smaller than {which} {ids} tokens "
            f"that the data is encoded with (ids up to {ids - 1}); set "
            f"model.vocab_size={ids} or leave it unset (it follows the tokenizer; model.pad_vocab_multiple=64 "
            "rounds the table up)"
        )


def check_finite(cfg: DictConfig, sections: tuple[str, ...] | None = None) -> None:
    """No float key (nor a list's item) is inf or nan, whatever its range says: inf passes `> 0`."""
    for key, value in dotted_keys(OmegaConf.to_container(cfg, resolve=True)).items():
        if sections is not None and key.split(".")[0] not in sections:
            continue
        items = value if isinstance(value, list) else [value]
        if any(isinstance(v, float) and not math.isfinite(v) for v in items):
            default = _schema_default(key)
            fix = f"; e.g. {key}={default}" if default is not None else ""
            nullable = f" (or null: {NULL_MEANS[key]})" if key in NULL_MEANS else ""
            what = "finite numbers" if isinstance(value, list) else "a finite number"
            raise ConfigError(f"{key}={value} must be {what}{nullable}{fix}")


def validate(cfg: DictConfig) -> None:
    """Every key's range, then the cross-field checks that types alone cannot express. Raises
    ConfigError."""
    check_ranges(cfg)
    m, t, o, p = cfg.model, cfg.train, cfg.optim, cfg.parallel
    if p.mode not in PARALLEL_MODES:
        raise ConfigError(f"parallel.mode={p.mode!r} is unknown; choose one of {', '.join(PARALLEL_MODES)}")
    if t.dtype == "float16":
        raise ConfigError(
            "train.dtype=float16 needs loss scaling, which dtrain does not do (small fp16 gradients "
            "underflow to zero); use train.dtype=bfloat16 (fp32's range at half the memory) or float32"
        )
    if t.dtype not in DTYPES:
        raise ConfigError(f"train.dtype={t.dtype!r} is unknown; choose one of {', '.join(DTYPES)}")
    if not DEVICE_SPEC.fullmatch(str(t.device)):
        raise ConfigError(f"train.device={t.device!r} is not a device; use auto, cpu, cuda or cuda:N")
    if cfg.launch.start_method not in START_METHODS:
        raise ConfigError(f"launch.start_method={cfg.launch.start_method!r} is unknown; "
                          f"choose one of {', '.join(START_METHODS)}")
    if t.on_nonfinite not in ON_NONFINITE:
        raise ConfigError(f"train.on_nonfinite={t.on_nonfinite!r} is unknown; choose one of {', '.join(ON_NONFINITE)}")
    if t.target_val_loss is not None and t.target_val_bpb is not None:
        raise ConfigError(f"train.target_val_loss={t.target_val_loss} and train.target_val_bpb={t.target_val_bpb}: "
                          "a run stops at one target; set one of them (the other null)")
    if t.compile_mode not in COMPILE_MODES:
        raise ConfigError(f"train.compile_mode={t.compile_mode!r} is unknown; choose one of {', '.join(COMPILE_MODES)}")
    if t.compile_mode != "default" and not t.compile:
        raise ConfigError(f"train.compile_mode={t.compile_mode} needs train.compile=true "
                          "(or leave compile_mode=default)")
    if t.float8 not in FLOAT8_SETTINGS:
        raise ConfigError(f"train.float8={t.float8!r} is unknown; choose one of {', '.join(FLOAT8_SETTINGS)}")
    if t.float8 != "off" and p.tp > 1:
        raise ConfigError(f"train.float8={t.float8} with parallel.tp={p.tp}: tensor parallelism of float8 layers "
                          "is not built; use train.float8=off or parallel.tp=1")
    if t.loss_kernel not in LOSS_KERNELS:
        raise ConfigError(f"train.loss_kernel={t.loss_kernel!r} is unknown; choose one of {', '.join(LOSS_KERNELS)}")
    if t.loss_chunks > 1 and t.loss_kernel in ("plain", "fused"):
        raise ConfigError(f"train.loss_chunks={t.loss_chunks} computes the loss in pieces, which "
                          f"train.loss_kernel={t.loss_kernel} does not; use train.loss_kernel=chunked (or auto), "
                          "or train.loss_chunks=1")
    if t.loss_chunks > t.seq_len:
        raise ConfigError(f"train.loss_chunks={t.loss_chunks} exceeds train.seq_len={t.seq_len}: a piece needs at "
                          f"least one position; use train.loss_chunks={t.seq_len} or fewer")
    check_profile_steps(t.profile.steps, t.max_steps)
    check_block(m)
    check_tensor_parallel(m, p.tp)
    check_expert_parallel(m, o.name, p.get("ep", 1))
    check_model_size(m)
    check_dataset_name(cfg.data)
    if m.init_from == INIT_FROM_REQUIRED:
        raise ConfigError(
            "this recipe fine-tunes pretrained weights: pass model.init_from=PATH (a Hugging Face GPT-2 folder, "
            "e.g. from `huggingface-cli download gpt2 --local-dir ./gpt2`, a dtrain run directory or a step_* folder)"
        )
    if t.seq_len > m.block_size:
        # With init_from the block size is the source's position table, which cannot grow.
        fix = (f"the positions of model.init_from={m.init_from} end there, so lower train.seq_len" if m.init_from
               else "lower train.seq_len or raise model.block_size")
        raise ConfigError(f"train.seq_len={t.seq_len} is longer than model.block_size={m.block_size}; {fix}")
    if 0 < t.val_tokens < t.seq_len:
        raise ConfigError(f"train.val_tokens={t.val_tokens} is less than one sequence of train.seq_len={t.seq_len}: "
                          f"validation scores whole sequences; set train.val_tokens={t.seq_len} or more "
                          "(or 0 for no validation)")
    if not 0 <= o.min_lr <= o.lr:
        raise ConfigError(f"optim.min_lr={o.min_lr} must be in [0, optim.lr={o.lr}] (0: cosine to zero)")
    if o.schedule not in SCHEDULES:
        raise ConfigError(f"optim.schedule={o.schedule!r} is unknown; choose one of {', '.join(SCHEDULES)}")
    check_optimizer_name(o.name)
    if o.name == "muon" and cfg.model.get("moe") is not None and cfg.model.moe.num_experts > 0:
        # Not yet built: BatchedMuon steps 2-D matrices; the experts' [E, rows, cols] stacks are next.
        raise ConfigError("optim=muon does not yet step the 3-D expert weights of model.moe.num_experts > 0; "
                          "use optim=adamw for a mixture-of-experts model")
    if o.muon.adjust_lr not in MUON_ADJUST_LR:
        raise ConfigError(f"optim.muon.adjust_lr={o.muon.adjust_lr!r} must be one of {', '.join(MUON_ADJUST_LR)}")
    if o.muon.ns_dtype not in MUON_NS_DTYPES:
        raise ConfigError(f"optim.muon.ns_dtype={o.muon.ns_dtype!r} must be one of {', '.join(MUON_NS_DTYPES)}")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        raise ConfigError(f"optim.betas={list(o.betas)} must be two numbers in [0, 1)")
    if o.fused.lower() not in ("auto", "true", "false"):  # Hydra reads `optim.fused=true` as a bool: 'True' here
        raise ConfigError(f"optim.fused={o.fused!r} must be auto, true or false")
    if o.name == "lion" and o.fused.lower() == "true":
        raise ConfigError("optim.fused=true asks for AdamW's fused kernel, which optim=lion does not use; "
                          "drop optim.fused (or set it to auto)")
    if p.mixed_precision not in MIXED_PRECISION:
        raise ConfigError(f"parallel.mixed_precision={p.mixed_precision!r} must be one of {', '.join(MIXED_PRECISION)}")
    world = 1 if cfg.world is None else cfg.world
    if launched_world() is None and world % cfg.launch.nnodes:
        raise ConfigError(
            f"world={world} is not divisible by launch.nnodes={cfg.launch.nnodes}; "
            "world is the total number of workers across all nodes"
        )
    if cfg.resume not in ("auto", "never") and not cfg.resume:
        raise ConfigError("resume= must be auto, never or a checkpoint path")
    check_logger(cfg.logger)
    check_endpoint(cfg.launch.rdzv_endpoint)
    batch_plan(cfg, requested_world(cfg))


def check_profile_steps(steps, max_steps: int) -> None:
    """train.profile.steps is null or [START, END], two step numbers (1-based, as the step lines
    print them) with 1 <= START <= END <= train.max_steps."""
    if steps is None:
        return
    values = list(steps)
    whole = all(isinstance(v, int) and not isinstance(v, bool) for v in values)
    if len(values) == 2 and whole and 1 <= values[0] <= values[1] <= max_steps:
        return
    start = min(3, max_steps)
    raise ConfigError(f"train.profile.steps=[{','.join(str(v) for v in values)}] must be two step numbers "
                      f"[START,END] with 1 <= START <= END <= train.max_steps={max_steps}; "
                      f"e.g. train.profile.steps=[{start},{min(start + 1, max_steps)}]")


def check_optimizer_name(name: str) -> None:
    """`optim.name` is one of dtrain's optimizers (conf/optim/*.yaml) or the module path of one
    registered from outside the package, found on the path without importing it (its parents
    are imported: `importlib.util.find_spec`). Whether that module registers an OPTIMIZER is read
    with torch, by the memory check before anything is written."""
    if name in OPTIMIZERS:
        return
    if "." in name and not name.startswith("."):
        try:
            if importlib.util.find_spec(name) is not None:
                return
        except (ImportError, ValueError):
            pass
        raise ConfigError(f"optim.name={name!r} names no module on the Python path; put the module that defines its "
                          "OPTIMIZER on PYTHONPATH (docs/optimizers.md), or choose one of "
                          f"{', '.join(OPTIMIZERS)}")
    raise ConfigError(f"optim.name={name!r} must be one of {', '.join(OPTIMIZERS)} or the module path of a registered "
                      "optimizer (optim=NAME sets it; docs/optimizers.md)")


def check_dataset_name(data: DictConfig) -> None:
    """data.name is one folder name: the dataset is <data.dir>/<data.name>, so an empty name would put
    its shards into data.dir itself, and '..', '/' or an absolute path somewhere outside it. data=hf
    without data.hf_path (or a data.name of its own) names no dataset at all."""
    name = str(data.name)
    if name == UNNAMED and not data.get("hf_path"):
        raise ConfigError(HF_PATH_NEEDED)
    if not name.strip():
        raise ConfigError(f"data.name is empty: a dataset lives in its own folder under data.dir={data.dir}; "
                          "name it, e.g. data.name=corpus")
    separators = {"/", os.sep, os.altsep} - {None}
    if name in (".", "..") or any(sep in name for sep in separators):
        tail = name.rstrip("/").rsplit("/", 1)[-1].strip(".") or "corpus"
        raise ConfigError(
            f"data.name={name} is not a folder name: the dataset is written to data.dir/data.name, which this "
            f"name puts {'in data.dir itself' if name == '.' else 'elsewhere'}; give one folder name "
            f"(e.g. data.name={tail}) and choose where with data.dir"
        )


def check_logger(logger) -> None:
    """`logger=` is one name of LOGGERS or a list of them (null, like [], is metrics.jsonl alone)."""
    listed = isinstance(logger, ListConfig)
    names = list(logger) if listed else [] if logger is None else [logger]
    unknown = [name for name in names if name not in LOGGERS]
    if unknown:
        shown = f"[{','.join(str(n) for n in logger)}]" if listed else logger
        raise ConfigError(
            f"logger={shown}: {unknown[0]!r} is unknown; choose from {', '.join(LOGGERS)}, "
            "one name or a list (logger=[tensorboard,wandb])"
        )
    twice = next((name for i, name in enumerate(names) if name in names[:i]), None)
    if twice is not None:
        raise ConfigError(f"logger=[{','.join(str(n) for n in logger)}] names {twice} twice; list each tracker once")


def check_endpoint(endpoint: str) -> None:
    """launch.rdzv_endpoint is HOST or HOST:PORT with a port in 1-65535 (on any node count: one
    node does not use it, but a typo there is still a typo)."""
    host, colon, port = str(endpoint).rpartition(":")
    if not colon:
        return  # HOST alone: the c10d default port
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"launch.rdzv_endpoint={endpoint}: the port must be a number in 1-65535; "
                          "give HOST:PORT, e.g. launch.rdzv_endpoint=node0:29400")
