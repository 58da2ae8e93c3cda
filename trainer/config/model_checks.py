"""The model group's own checks (torch-free): its block options fit together, parallel.tp divides
its heads and widths, and the parameter count is one a machine could hold."""

from __future__ import annotations

from omegaconf import DictConfig

from trainer.config.schema import ATTENTION_BACKENDS, MLPS, NORMS, POSITIONS
from trainer.config.shape import head_width, mlp_width, parameter_count
from trainer.errors import ConfigError

# Parameters a model shape may have (each needs 16 bytes of weights, gradients and AdamW state to
# train): 10**15 is 16 PB, beyond any machine, and keeps every tensor's size within torch's int64
# (model.n_embd=10**10 would overflow it in `dtrain plan`'s shapes-only model).
MAX_PARAMETERS = 10**15


def check_block(m: DictConfig) -> None:
    """The block options name known choices and fit together (model.*)."""
    for key, choices in (("norm", NORMS), ("pos", POSITIONS), ("mlp", MLPS), ("attention", ATTENTION_BACKENDS)):
        if m[key] not in choices:
            raise ConfigError(f"model.{key}={m[key]!r} is unknown; choose one of {', '.join(choices)}")
    explicit = m.get("head_dim")
    if explicit is None and m.n_embd % m.n_head:
        raise ConfigError(f"model.n_embd={m.n_embd} is not divisible by model.n_head={m.n_head}; choose a "
                          "model.n_head that divides it, or set model.head_dim (each head's width)")
    if m.n_kv_head is not None and m.n_head % m.n_kv_head:
        raise ConfigError(
            f"model.n_kv_head={m.n_kv_head} must divide model.n_head={m.n_head} (each key/value head serves "
            f"a whole group of query heads); e.g. model.n_kv_head={m.n_head} (or null: n_head)"
        )
    head_dim = head_width(m)
    if m.pos == "rope" and head_dim % 2:
        if explicit is not None:
            size, fix = f"model.head_dim={head_dim}", "an even model.head_dim"
        else:
            size, fix = f"n_embd / n_head = {head_dim}", "model.n_embd and model.n_head with an even head size"
        raise ConfigError(
            f"model.pos=rope rotates pairs of dimensions, but each head has {size}, an odd number; choose {fix}, "
            "or model.pos=learned"
        )
    check_moe(m)


def check_moe(m: DictConfig) -> None:
    """model.moe's counts are sensible and its SwiGLU experts sit in a SwiGLU block."""
    moe = m.get("moe")
    if moe is None:
        return
    for key in ("num_experts", "num_shared_experts"):
        if moe[key] < 0:
            raise ConfigError(f"model.moe.{key}={moe[key]} is negative; give 0 or more")
    if moe.expert_hidden is not None and moe.expert_hidden < 1:
        raise ConfigError(f"model.moe.expert_hidden={moe.expert_hidden} must be 1 or more (or null)")
    if moe.every < 1:
        raise ConfigError(f"model.moe.every={moe.every} must be 1 or more (1: every layer is MoE)")
    if moe.aux_loss_coef < 0:  # a negative weight would reward the routers for sending every token to a few experts
        raise ConfigError(f"model.moe.aux_loss_coef={moe.aux_loss_coef} is negative, which rewards unbalanced "
                          "routing; give 0 (no load-balancing loss) or more (e.g. 0.001)")
    if moe.num_experts == 0:
        return
    if moe.every > m.n_layer:
        raise ConfigError(f"model.moe.every={moe.every} makes no layer of model.n_layer={m.n_layer} a mixture of "
                          "experts (layer i is one when (i + 1) % every == 0): the model would be dense; use "
                          f"model.moe.every={m.n_layer} or less, or model.moe.num_experts=0 for a dense model")
    if not 1 <= moe.top_k <= moe.num_experts:
        raise ConfigError(f"model.moe.top_k={moe.top_k} must be between 1 and model.moe.num_experts="
                          f"{moe.num_experts}; choose a top_k within that range")
    if m.mlp != "swiglu":
        raise ConfigError(f"model.moe.num_experts={moe.num_experts} builds SwiGLU experts, but model.mlp={m.mlp}; "
                          "set model.mlp=swiglu (e.g. model=qwen3_moe_tiny) or model.moe.num_experts=0")


def check_tensor_parallel(m: DictConfig, tp: int) -> None:
    """parallel.tp splits whole heads and whole rows of every matrix: it must divide the counts."""
    if tp == 1:
        return
    kv_heads = m.n_head if m.n_kv_head is None else m.n_kv_head
    counts = {"model.n_head": m.n_head, "model.n_kv_head": kv_heads, "model.n_embd": m.n_embd,
              "the MLP width": mlp_width(m.n_embd, m.mlp, m.mlp_hidden, m.mlp_multiple_of)}
    for what, count in counts.items():
        if count % tp:
            raise ConfigError(
                f"parallel.tp={tp} does not divide {what}={count}: each tensor-parallel rank takes whole heads "
                f"and an equal part of each matrix; choose parallel.tp among the divisors of {count}"
            )


def check_model_size(m: DictConfig) -> None:
    """The shape's parameter count is one a machine could hold (whether this machine can is
    trainer/preflight/torch_checks.py's check, with torch, since `dtrain plan` answers for any machine)."""
    count = parameter_count(m)
    if count > MAX_PARAMETERS:
        raise ConfigError(
            f"model.n_layer={m.n_layer}, model.n_embd={m.n_embd}: the model has {count:.3g} parameters, more than "
            f"{MAX_PARAMETERS:.0e} (each needs 16 bytes of weights, gradients and AdamW state: petabytes beyond any "
            "machine); choose a smaller model.n_embd, model.n_layer or model.mlp_hidden"
        )


def check_expert_parallel(m: DictConfig, optimizer: str, ep: int) -> None:
    """parallel.ep splits whole experts of a mixture-of-experts model over its ranks."""
    if ep == 1:
        return
    experts = m.moe.num_experts if "moe" in m else 0
    if not experts:
        raise ConfigError(f"parallel.ep={ep} splits a mixture of experts' experts over {ep} ranks, but this model "
                          "is dense (model.moe.num_experts=0); use a MoE model (e.g. model=qwen3_moe_tiny) or drop "
                          "parallel.ep")
    if experts % ep:
        raise ConfigError(f"parallel.ep={ep} does not divide model.moe.num_experts={experts}: each expert-parallel "
                          f"rank holds an equal number of whole experts; choose parallel.ep among the divisors of "
                          f"{experts}")
    if optimizer == "muon":
        raise ConfigError(f"optim=muon with parallel.ep={ep}: Muon's owner ranks step whole matrices gathered over "
                          "FSDP's ranks, which the experts' split over the ep ranks does not give; use optim=adamw "
                          "(or lion) with parallel.ep, or parallel.ep=1")
