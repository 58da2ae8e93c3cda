"""The typed configuration schema, registered in Hydra's ConfigStore by trainer/config/compose.py (the checks:
trainer/config/validation.py).

Every YAML file under conf/ is merged onto these dataclasses, so an unknown key or a value of the
wrong type fails while the config is composed, before any work starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from trainer.config.keys import RENAMED_KEYS, apply_renamed_keys
from trainer.config.vocab import VOCAB_RESOLVER
from trainer.io import dotted_keys

# A checkout (or an editable install) reads the top-level conf/; a wheel carries it as trainer/conf.
_TRAINER_DIR = Path(__file__).resolve().parents[1]
_PACKAGED_CONF = _TRAINER_DIR / "conf"
CONF_DIR = _PACKAGED_CONF if _PACKAGED_CONF.is_dir() else _TRAINER_DIR.parent / "conf"
# The modes are the options of the `parallel` config group (each names its Strategy's module in
# trainer/parallel/); read from the folder so that checking a config never imports torch.
PARALLEL_MODES = tuple(sorted(p.stem for p in (CONF_DIR / "parallel").glob("*.yaml")))
# dtrain's own optimizers, the same way: each is conf/optim/NAME.yaml plus trainer/optim/NAME.py, whose
# OPTIMIZER registers it (trainer/optim/registry.py). An optimizer from outside the package is a
# module path as its name (trainer/config/validation.py, check_optimizer_name).
OPTIMIZERS = tuple(sorted(p.stem for p in (CONF_DIR / "optim").glob("*.yaml")))
DTYPES = ("auto", "float32", "bfloat16")
ON_NONFINITE = ("stop", "skip", "rollback")
START_METHODS = ("forkserver", "spawn")
# torch.compile's modes (train.compile_mode): "reduce-overhead" replays the step's kernels as CUDA
# graphs (one launch instead of hundreds); the max-autotune modes also search kernel configurations.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
MIXED_PRECISION = ("auto", "bf16", "fp32")
# train.loss_kernel (trainer/model/loss.py): the head's matmul and the cross-entropy as one whole
# logits tensor (plain), in train.loss_chunks pieces (chunked), or liger-kernel's fused kernel (fused).
LOSS_KERNELS = ("auto", "plain", "chunked", "fused")
# train.float8 (trainer/model/float8.py): torchao's float8 matmuls in the blocks' Linear layers.
FLOAT8_SETTINGS = ("off", "tensorwise", "rowwise", "auto")
SCHEDULES = ("cosine", "wsd", "linear")  # trainer/optim/schedule.py lr_at
MUON_ADJUST_LR = ("original", "match_rms_adamw")
MUON_NS_DTYPES = ("auto", "bfloat16", "float32")
# `logger=` names: experiment trackers beside metrics.jsonl (trainer/observe/trackers.py); `jsonl` alone means
# metrics.jsonl only, which is always written.
LOGGERS = ("jsonl", "tensorboard", "wandb", "mlflow")
INIT_FROM_REQUIRED = "REQUIRED"
# The block options (model.norm, model.pos, model.mlp), checked torch-free by trainer/config/validation.py.
NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rope")
MLPS = ("gelu", "swiglu", "relu2")
# model.attention: the SDPA kernels the model's attention may use (torch.nn.attention.sdpa_kernel).
# auto lets SDPA choose per call; flash and math run on CPU too, efficient and cudnn need CUDA.
ATTENTION_BACKENDS = ("auto", "flash", "cudnn", "efficient", "math")


# torch.manual_seed and torch.Generator.manual_seed take seeds up to 2**64 - 1 (a larger one is
# "Overflow when unpacking long long" once training or sampling starts); numpy's take any.
MAX_SEED = 2**64 - 1
# Tokens one sample may generate (train.sample_tokens, `dtrain sample --tokens`). Past the block size
# the KV cache is full and every new token runs the model over a whole window of block_size tokens
# (trainer/model/decode.py): the tiny model made about 3 tokens a second there on a busy 2-core CPU,
# so 10,000 tokens (about 40 KB of text, ten GPT-2 windows) is already up to an hour, and 10**20
# never ends. A longer text is several samples, each continuing the last (--prompt).
MAX_SAMPLE_TOKENS = 10_000


def with_old_names(section: str):
    """A section's old key names (trainer/config/keys.py RENAMED_KEYS) as fields that default to
    None, after its own: a command, a preset or an older run's record may still set one, and
    apply_renamed_keys moves its value to the key that replaced it, with a notice."""

    def add(cls):
        for old in RENAMED_KEYS:
            parent, _, name = old.rpartition(".")
            if parent == section:
                cls.__annotations__[name] = "Optional[int]"
                setattr(cls, name, None)
        return cls

    return add


@dataclass
class MoEConfig:
    """model.moe: a mixture-of-experts feed-forward block (trainer/model/moe.py) in every `every`th
    layer (Qwen3's decoder_sparse_step: layer i, 0-based, when (i + 1) % every == 0); 0 experts =
    the dense MLP everywhere. The experts are SwiGLU (model.mlp must be swiglu)."""

    num_experts: int = 0
    top_k: int = 2  # experts each token is routed to
    num_shared_experts: int = 0  # a dense SwiGLU of num_shared_experts x expert_hidden every token passes
    # Each expert's SwiGLU width; null = the dense MLP's width / top_k (the same active MLP width).
    expert_hidden: Optional[int] = None
    every: int = 1
    aux_loss_coef: float = 0.001  # x the load-balancing loss (Hugging Face's), the mean over the MoE layers
    norm_topk_prob: bool = True  # renormalize the chosen experts' probabilities to sum 1 (Qwen3-MoE)


@dataclass
class ModelConfig:
    name: str = "tiny"
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    block_size: int = 128
    # The tokenizer's (tokenizer_vocab_size) unless set: a model reads every id its data can hold.
    vocab_size: int = f"${{{VOCAB_RESOLVER}:${{tokenizer.name}},${{tokenizer.path}},${{tokenizer.checkpoint}}}}"  # type: ignore[assignment]
    # Round the embedding table up to a multiple of this (64 or 128 make matmuls faster on GPUs;
    # GPT-2's 50257 becomes 50304). 1 keeps the exact vocabulary.
    pad_vocab_multiple: int = 1
    dropout: float = 0.0
    bias: bool = True  # biases in every linear layer (and LayerNorm)
    # The block family, key by key (the defaults are GPT-2's; conf/model/llama_*.yaml are Llama's).
    norm: str = "layernorm"  # layernorm | rmsnorm
    norm_eps: float = 1e-5
    pos: str = "learned"  # learned (a position table) | rope (rotary, in attention)
    rope_theta: float = 10000.0
    mlp: str = "gelu"  # gelu | swiglu (gated: three matrices) | relu2 (ReLU squared)
    # The MLP's hidden width; null = 4 x n_embd (gelu, relu2), Llama's 8/3 x n_embd rounded up to a
    # multiple of mlp_multiple_of (swiglu).
    mlp_hidden: Optional[int] = None
    mlp_multiple_of: int = 256
    n_kv_head: Optional[int] = None  # grouped-query attention: key/value heads (null = n_head)
    # Each attention head's width; null = n_embd / n_head. Qwen3 sets it apart from the model width
    # (Qwen3-0.6B: 16 heads of 128 over a 1024-wide stream): q is n_head x head_dim wide.
    head_dim: Optional[int] = None
    qk_norm: bool = False  # RMSNorm on each head's queries and keys (before RoPE), as OLMo 2 and Qwen3
    tie_embeddings: bool = True  # the output head shares the token embedding (GPT-2 ties; Llama does not)
    # Which SDPA kernel computes attention (ATTENTION_BACKENDS). Not a shape: the weights are the same
    # under each, so checkpoints, continuations and exports ignore it (trainer/config/keys.py: operational).
    # auto: SDPA's own choice per call, until make bench-gpu has measured the best per device and shape.
    attention: str = "auto"
    # Start a new run (step 0, fresh optimizer and data) from these weights: a Hugging Face GPT-2
    # folder, a dtrain run directory (its newest checkpoint) or a step_* folder. The group's shape
    # must be the source's. Not resume: a run dir with its own checkpoint continues from that.
    # A recipe that needs one sets INIT_FROM_REQUIRED (OmegaConf's ??? cannot replace a default).
    init_from: Optional[str] = None
    moe: MoEConfig = field(default_factory=MoEConfig)


@dataclass
class TokenizerConfig:
    """The `tokenizer` group (trainer/tokenizers/load.py): gpt2, or hf with path=DIR (a folder with a
    Hugging Face tokenizer.json)."""

    name: str = "gpt2"
    path: Optional[str] = None
    vocab_size: Optional[int] = None  # `dtrain tokenizer train`: the size of the tokenizer it trains
    # A checkpoint whose copy of its run's tokenizer is read instead of tokenizer.path's folder. A
    # continuation sets it when tokenizer.path no longer holds the run's tokenizer (moved or
    # rewritten since: trainer/preflight/run_tokenizer.py); by hand, it reads a run's tokenizer
    # from its checkpoint (e.g. to prepare more data with it).
    checkpoint: Optional[str] = None


@dataclass
class DataConfig:
    name: str = "shakespeare"
    # Where this dataset's shards and manifest live: <dir>/<name>/ (a per-user folder by default).
    dir: str = "${oc.env:DTRAIN_DATA_DIR,'~/.cache/dtrain/data'}"
    # Where the raw text comes from: a URL, a local file, a folder or a glob; null = the dataset's own.
    source: Optional[str] = None
    sha256: Optional[str] = None  # expected checksum of the downloaded source, when it is fixed
    val_fraction: float = 0.05
    shard_tokens: int = 100_000_000
    # What data=hf (and its preset fineweb_edu) reads: a Hub dataset id or local files, the Hub's
    # configuration and split, and the field of each record that holds the text (trainer/config/dataset_names.py).
    hf_path: Optional[str] = None
    hf_name: Optional[str] = None
    hf_split: str = "train"
    text_field: str = "text"
    max_tokens: Optional[int] = None  # stop preparing after this many tokens (null = all)
    # How shards are checked when a run opens them: size (always), sha256 or auto (sha256 when small).
    verify: str = "auto"
    num_proc: Optional[int] = None  # tokenizer processes; null = all cores
    auto_prepare: bool = False  # prepare on first use by `dtrain train` (the embedded default does)
    # A weighted mixture of datasets prepared in data.dir (data=mix): {name: weight}, normalised to
    # sum 1 (trainer/data/mixture.py); null: one dataset. Typed Any (OmegaConf merges no dict into a
    # typed empty one under Hydra's struct mode): the checks name a bad value in one line.
    mix: Any = None
    # The run's tokenizer (the top-level `tokenizer` group), here so that every data function that
    # takes cfg.data knows which ids a dataset holds. Not a key to set: set tokenizer.* instead.
    tokenizer: TokenizerConfig = "${tokenizer}"  # type: ignore[assignment]


@dataclass
class MuonConfig:
    """optim=muon: torch.optim.Muon on the blocks' 2-D hidden matrices (the rest stays on AdamW,
    with the keys of OptimConfig). Its lr follows the same warmup + cosine schedule, scaled."""

    lr: float = 0.02
    weight_decay: float = 0.0  # decoupled, times the scheduled Muon lr (as AdamW's)
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5  # Newton-Schulz iterations
    # How the step is scaled per matrix shape: original (Keller Jordan's sqrt(max(1, rows/cols)))
    # or match_rms_adamw (Moonshot's 0.2 x sqrt(max(rows, cols)), for AdamW-tuned learning rates).
    adjust_lr: str = "original"
    # Newton-Schulz in bfloat16 (torch.optim.Muon as shipped) or float32 (on CPU faster, and what
    # lets every parallel mode match one process within 1e-5); auto: bfloat16 on CUDA, else float32.
    ns_dtype: str = "auto"


@dataclass
class OptimConfig:
    # OPTIMIZERS (adamw; muon: Muon on hidden matrices, AdamW on the rest; lion), or the module of
    # an optimizer registered from outside the package (my_optims.sgd)
    name: str = "adamw"
    lr: float = 6e-4
    min_lr: float = 6e-5
    warmup_steps: int = 10
    schedule: str = "cosine"  # cosine | wsd (warmup-stable-decay) | linear, to min_lr at max_steps
    decay_fraction: float = 0.2  # wsd: the share of max_steps in the final decay
    weight_decay: float = 0.1
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8  # AdamW's (Lion has none)
    grad_clip: float = 1.0  # 0 disables clipping
    fused: str = "auto"  # auto | true | false  (auto: fused on CUDA); AdamW's fused kernel
    muon: MuonConfig = field(default_factory=MuonConfig)
    # An optimizer's own keys beyond the ones above (HF Trainer's optim_args), with their defaults in
    # its conf/optim/NAME.yaml (`args: {momentum: 0.9}`) and read by its registration's kwargs.
    args: Dict[str, Any] = field(default_factory=dict)


@dataclass
class ParallelConfig:
    mode: str = "none"
    bucket_cap_mb: float = 25.0  # DDP gradient bucket size (all-reduce overlaps backward per bucket)
    reshard_after_forward: bool = True  # FSDP: free gathered params after forward (ZeRO-3)
    mixed_precision: str = "auto"  # FSDP: auto = bf16 params / fp32 reduce on CUDA, fp32 on CPU
    # The device mesh (trainer/process/mesh_shape.py): dp_replicate x dp_shard x cp x tp = world,
    # dp_shard being the rest. Only parallel=hsdp replicates shards (its YAML: one replica per node).
    dp_replicate: int = 1
    cp: int = 1  # context-parallel degree: each sequence split over this many ranks
    tp: int = 1  # tensor-parallel degree: each layer's matrices split over this many ranks
    # expert-parallel degree: a mixture of experts' experts split over this many dp_shard ranks
    # (trainer/parallel/expert_parallel.py); it divides dp_shard and model.moe.num_experts
    ep: int = 1


@dataclass
class LaunchConfig:
    nnodes: int = 1
    rdzv_endpoint: str = "localhost:29400"  # one node: unused (a loopback store on a free port)
    rdzv_backend: str = "c10d"
    rdzv_id: str = "dtrain"
    rdzv_timeout: int = 60
    max_restarts: int = 0
    monitor_interval: float = 0.1
    # How long a collective may wait before the job fails instead of hanging (seconds).
    timeout_s: int = 300
    # How long a training step may take before the ranks dump their stacks and the job ends naming
    # the stuck rank (trainer/process/hang_watch.py); null = 10 x the slowest step, 120 s at least
    # (below timeout_s); 0 = off.
    hang_timeout_s: Optional[float] = None
    threads_per_worker: Optional[int] = None  # CPU: null = cores / local workers
    # How this node's workers start (trainer/launch/forkserver.py): forked from one process that
    # imported torch once, or spawn (each a fresh interpreter: about 4 CPU-seconds more per worker).
    start_method: str = "forkserver"


@dataclass
class ProfileConfig:
    # train.profile.steps=[START, END]: torch.profiler over those optimizer steps (1-based, as the step
    # lines number them), a trace per rank in <run dir>/profile/ (trainer/observe/profile.py); the
    # steps are left out of tokens/s and MFU. null = no profiling.
    steps: Optional[List[int]] = None


@dataclass
@with_old_names("train")
class TrainConfig:
    seed: int = 1337
    max_steps: int = 400
    micro_batch_size: int = 8
    seq_len: int = 128
    total_batch_size: Optional[int] = None  # tokens per optimizer step; null = derived
    grad_accum_steps: Optional[int] = None  # null = derived from total_batch_size
    val_interval: int = 100  # validation loss every N steps (0 = never; always at the end)
    # Tokens of the val split each validation scores (0 = no validation), as nanochat's eval_tokens:
    # the split's first val_tokens // seq_len sequences, the same set whatever the micro batch, world
    # or accumulation (trainer/data/val_set.py). 8,192: what val_batches=8 read at the default 8 x 128.
    val_tokens: int = 8192
    log_interval: int = 10
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (bf16 autocast on CUDA, fp32 on CPU) | float32 | bfloat16
    compile: bool = False
    # torch.compile's mode (COMPILE_MODES); needs compile=true. "default" as make bench-gpu chose it
    # (its figures: docs/performance.md).
    compile_mode: str = "default"
    activation_checkpointing: bool = False
    # The loss over the vocabulary computed in this many pieces along the sequence, each piece's
    # logits (and their gradient) made and dropped in turn: B x T x vocab logits are never held
    # whole. 1 = one piece (the logits of the whole micro batch at once), as make bench-gpu chose it
    # (its figures, time against memory: docs/performance.md).
    loss_chunks: int = 1
    # How the head's logits become the loss (LOSS_KERNELS): plain holds B x T x vocab logits; chunked
    # computes them in loss_chunks pieces; fused is liger-kernel's Triton kernel (the `fused` extra,
    # CUDA only). auto: chunked when loss_chunks > 1, fused on CUDA with the extra installed, else plain
    # (make bench-gpu's loss-kernel rows measure them: docs/performance.md).
    loss_kernel: str = "auto"
    # float8 matmuls in the blocks' Linear layers through torchao (the `float8` extra; FLOAT8_SETTINGS):
    # tensorwise or rowwise scaling on every block Linear (CUDA sm89+; a CPU runs torchao's emulation),
    # or auto: tensorwise on the Linears both of whose dimensions are >= 2048, where a GPU has float8,
    # else off. The head stays high precision; checkpoints hold high-precision weights.
    float8: str = "off"
    sample_tokens: int = 64  # tokens generated at the end of training (0 = none)
    # what they continue: a newline fits any corpus, as `dtrain sample`'s default (the Shakespeare
    # presets ask for "ROMEO:")
    sample_prompt: str = "\n"
    # Rank 0 on a terminal: a live progress bar. false, or no terminal (a pipe, a file, nohup, Slurm):
    # one plain line per log_interval steps on stdout. dtrain.log gets those lines either way.
    progress: bool = True
    # Peak FLOP/s of one worker's device, for the `mfu` field of metrics.jsonl. null = known GPUs
    # only (H100/H200 989e12, A100 312e12 dense bf16); set it to get MFU elsewhere (e.g. a CPU).
    peak_flops: Optional[float] = None
    # A non-finite loss or grad norm (checked on every rank before the update): stop (exit 1),
    # skip the update, or rollback to the newest finite checkpoint; max_nonfinite bounds the
    # skips in a row / the rollbacks before the run stops anyway.
    on_nonfinite: str = "stop"
    max_nonfinite: int = 3
    # Time to target (docs/evaluation.md): the first validation at or below this loss records the
    # summary's `target` record and ends the run, unless continue_after_target. null = no target.
    target_val_loss: Optional[float] = None
    target_val_bpb: Optional[float] = None  # the same in bits per byte (comparable across tokenizers)
    continue_after_target: bool = False
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    # CUDA only: the allocator's history recorded from the start and dumped at the first profiled
    # (else the first) step to <run dir>/memory/rank<R>_step<N>.pickle (trainer/observe/memory.py);
    # an out-of-memory error then dumps one too.
    memory_snapshot: bool = False
    # A multi-process run samples one step in every straggler_every (rounded up to whole log
    # intervals; trainer/observe/stragglers.py): each rank's own time in it (compute and reading its
    # batches, not waiting for the others) goes to metrics.jsonl, and a rank slower than
    # straggler_ratio times the other ranks' median for 3 samples in a row is named in a notice.
    # straggler_ratio=0: no sampling.
    straggler_ratio: float = 1.2
    straggler_every: int = 50


@dataclass
class CheckpointConfig:
    # steps between checkpoints (0 = only at the end): on by default, so that a crash or a kill -9
    # costs at most this many steps, not the run; by steps, not minutes, so every rank and every
    # rerun saves at the same steps without a collective to agree on the time
    interval: int = 100
    keep: int = 3
    async_save: bool = False


@dataclass
class HellaswagConfig:
    path: Optional[str] = None  # local jsonl; null = download the public validation set
    url: str = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
    sha256: Optional[str] = None
    batch_examples: int = 8
    interval: int = 0  # HellaSwag during training every N steps (0 = never; `dtrain eval` any time)


@dataclass
@with_old_names("eval")
class EvalConfig:
    limit: Optional[int] = None  # at most this many examples
    hellaswag: HellaswagConfig = field(default_factory=HellaswagConfig)


@dataclass
class SweepConfig:
    # Multirun (`dtrain train -m`): stop at the first failed point (the later ones are recorded
    # as skipped) instead of running every point. Not part of a point's identity on a re-run.
    fail_fast: bool = False
    # Shorthand for the axis train.seed=0,...,N-1 (docs/sweeps.md); null = none.
    seeds: Optional[int] = None


@dataclass
class Config:
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    optim: OptimConfig = MISSING
    parallel: ParallelConfig = MISSING
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    # Total worker processes. null = 1, or WORLD_SIZE when started by torchrun.
    world: Optional[int] = None
    resume: str = "auto"  # auto | never | <path to a checkpoint>
    # Experiment trackers beside metrics.jsonl: a list of LOGGERS (logger=[tensorboard,wandb]) or one
    # name (logger=tensorboard). Typed Any because OmegaConf has no str-or-list type: validation.py
    # checks it, and tracker_names() reads it.
    logger: Any = field(default_factory=list)


# The sections a config group fills (MISSING in Config until the group's YAML is merged), by schema.
GROUP_SCHEMAS = {"model": ModelConfig, "data": DataConfig, "optim": OptimConfig, "parallel": ParallelConfig}


def schema_keys() -> list[str]:
    """Every dotted key the schema has, the groups' sections included."""
    tree = OmegaConf.to_container(OmegaConf.structured(Config))
    for section, schema in GROUP_SCHEMAS.items():
        tree[section] = OmegaConf.to_container(OmegaConf.structured(schema))
    return list(dotted_keys(tree))


def tracker_names(logger) -> list[str]:
    """The trackers a (validated) `logger=` value asks for, in order, once each; jsonl is none."""
    names = [logger] if isinstance(logger, str) else list(logger or [])
    return [name for name in dict.fromkeys(names) if name != "jsonl"]


def to_dict(cfg: DictConfig) -> dict:
    """The resolved config as plain data (what workers receive and checkpoints record)."""
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)


def from_dict(data: dict) -> DictConfig:
    """Rebuild a typed config from plain data (the inverse of to_dict); a record written under a
    key's old name (RENAMED_KEYS) reads as the new one."""
    schema = OmegaConf.structured(Config)
    data = {k: v for k, v in data.items() if k not in ("defaults", "hydra")}
    cfg = OmegaConf.merge(schema, data)
    apply_renamed_keys(cfg)
    return cfg
