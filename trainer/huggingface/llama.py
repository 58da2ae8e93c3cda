"""Hugging Face Llama (and Qwen3: Llama with QK-norm; Qwen3-MoE: Qwen3 with MoE layers, whose
additions are qwen3_moe.py's) names and config.json <-> ours: the mapping
`dtrain export` writes Llama-shaped models with and `model.init_from` reads them with, beside
GPT-2's (mapping.py, which applies this table to tensors). Torch-free: a folder is checked with it
before anything runs.

What differs between our Llama-shaped GPT and transformers' LlamaForCausalLM:
- ours fuse q|k|v into attn.c_attn and gate|up into mlp.c_fc (one matmul each); HF keeps
  q_proj/k_proj/v_proj and gate_proj/up_proj: a fused tensor is HF's parts stacked along dim 0;
- both store nn.Linear's (out, in) and rotate q/k with the same "rotate half" RoPE (see
  trainer/model/layers.py), so no tensor is transposed or permuted (Meta's original checkpoints
  interleave the rotary pairs; transformers' conversion already undid that);
- padded vocabulary rows (model.pad_vocab_multiple) are not in HF's embed_tokens / lm_head;
- a tied head is not stored (tie_word_embeddings), as save_pretrained does;
- the Hub also has LlamaModel saves (names without `model.`) and sharded files
  (model.safetensors.index.json): both are read.
"""

from __future__ import annotations

from trainer.config.shape import mlp_width
from trainer.errors import CheckpointError, ConfigError
from trainer.huggingface import qwen3_moe
from trainer.tokenizers.gpt2 import EOT

ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 qwen3_moe.FAMILY: qwen3_moe.ARCHITECTURE}
LLAMA_TYPES = ("llama", "qwen3", qwen3_moe.FAMILY)
PREFIX = "model."
EMBED = "model.embed_tokens.weight"
# our block options that make each family (the keys not named here are free: widths, heads, eps, theta)
GPT2_BLOCK = {"norm": "layernorm", "pos": "learned", "mlp": "gelu", "qk_norm": False, "tie_embeddings": True}
LLAMA_BLOCK = {"norm": "rmsnorm", "pos": "rope", "mlp": "swiglu"}


def _kv_heads(m) -> int:
    return m["n_kv_head"] or m["n_head"]


def _head_dim(m) -> int:
    """Each head's width: model.head_dim, or n_embd / n_head (null, or a shape without the key)."""
    return m.get("head_dim") or m["n_embd"] // m["n_head"]


def _hidden(m) -> int:
    return mlp_width(m["n_embd"], m["mlp"], m["mlp_hidden"], m.get("mlp_multiple_of", 256))


def export_family(m) -> str:
    """The transformers model_type that computes the same function as our model config `m`:
    "gpt2", "llama", "qwen3" or "qwen3_moe"; otherwise one ConfigError naming what the Hub formats lack."""
    who = f"model={m['name']}" if m.get("name") else "this model"
    if qwen3_moe.num_experts(m):
        gaps = [f"model.{k}={m[k]} (Qwen3-MoE's is {v})" for k, v in LLAMA_BLOCK.items() if m[k] != v]
        gaps += qwen3_moe.export_gaps(m)
        if gaps:
            raise ConfigError(f"{who} is a mixture of experts, and Qwen3-MoE (the Hugging Face format dtrain "
                              f"exports one to) lacks {', '.join(gaps)}; train without them to export it")
        return qwen3_moe.FAMILY
    gpt2_gaps = [f"model.{k}={m[k]}" for k, v in GPT2_BLOCK.items() if m[k] != v]
    if _kv_heads(m) != m["n_head"]:
        gpt2_gaps.append(f"model.n_kv_head={m['n_kv_head']}")
    if _head_dim(m) * m["n_head"] != m["n_embd"]:
        gpt2_gaps.append(f"model.head_dim={m['head_dim']}")
    if _hidden(m) != 4 * m["n_embd"]:
        gpt2_gaps.append(f"model.mlp_hidden={m['mlp_hidden']}")
    if not gpt2_gaps:
        return "gpt2"
    llama_gaps = [f"model.{k}={m[k]} (Llama's is {v})" for k, v in LLAMA_BLOCK.items() if m[k] != v]
    if llama_gaps:
        closest, gaps = ("GPT-2", gpt2_gaps) if len(gpt2_gaps) < len(llama_gaps) else ("Llama", llama_gaps)
        raise ConfigError(
            f"{who} has no Hugging Face format to export to: the nearest, {closest}, lacks "
            f"{', '.join(gaps)}; GPT-2 is layernorm + learned positions + gelu (4 x n_embd, tied, every head "
            "its own k/v), Llama is rmsnorm + rope + swiglu")
    if not m["qk_norm"]:
        return "llama"
    if m["bias"]:
        raise ConfigError(
            f"{who} has qk_norm with model.bias=true: transformers' Llama has no QK-norm and "
            "Qwen3's (its QK-norm family) has no MLP biases; train with model.bias=false to export it")
    return "qwen3"


def llama_config(m, family: str, dtype: str, eot: int = EOT) -> dict:
    """config.json of the transformers LlamaForCausalLM / Qwen3ForCausalLM / Qwen3MoeForCausalLM
    equal to model config `m`."""
    config = {
        "architectures": [ARCHITECTURES[family]],
        "model_type": family,
        "vocab_size": m["vocab_size"],
        "hidden_size": m["n_embd"],
        "intermediate_size": _hidden(m),
        "num_hidden_layers": m["n_layer"],
        "num_attention_heads": m["n_head"],
        "num_key_value_heads": _kv_heads(m),
        "head_dim": _head_dim(m),
        "hidden_act": "silu",
        "max_position_embeddings": m["block_size"],
        "rms_norm_eps": m["norm_eps"],
        # transformers 5 reads rope_parameters, 4.x rope_theta: both, so either loads the folder
        "rope_theta": m["rope_theta"],
        "rope_parameters": {"rope_type": "default", "rope_theta": m["rope_theta"]},
        "attention_bias": bool(m["bias"]),
        "attention_dropout": 0.0,
        "tie_word_embeddings": bool(m["tie_embeddings"]),
        "initializer_range": 0.02,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "use_cache": True,
        "torch_dtype": dtype,
    }
    if family == "llama":
        config.update(mlp_bias=bool(m["bias"]), pretraining_tp=1)
    else:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=m["n_layer"])
    if family == qwen3_moe.FAMILY:
        config.update(qwen3_moe.config_keys(m))
    return config


def llama_shape(cfg: dict, label: str) -> dict:
    """Our model keys for a Llama / Qwen3 config.json; CheckpointError for what our model cannot
    reproduce (another activation, RoPE scaling, ...). config.json's head_dim (Qwen3's differs
    from hidden_size / num_attention_heads) is model.head_dim; null where it is that quotient."""
    family = cfg.get("model_type")
    heads, width = cfg.get("num_attention_heads"), cfg.get("hidden_size")
    unsupported = []
    if cfg.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={cfg['hidden_act']}")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        unsupported.append(f"rope_type={rope.get('rope_type', rope.get('type'))}")
    attention_bias = bool(cfg.get("attention_bias", False))
    if family == "llama" and bool(cfg.get("mlp_bias", False)) != attention_bias:
        unsupported.append(
            f"attention_bias={attention_bias} with mlp_bias={cfg.get('mlp_bias')} (model.bias sets both)")
    if family != "llama" and attention_bias:
        unsupported.append("attention_bias=true without MLP biases")
    if family != "llama" and cfg.get("use_sliding_window"):
        unsupported.append("use_sliding_window=true")
    moe, moe_unsupported = qwen3_moe.moe_shape(cfg, cfg.get("num_hidden_layers") or 0)
    unsupported += moe_unsupported if family == qwen3_moe.FAMILY else []
    if unsupported:
        raise CheckpointError(
            f"{label} is a {family} variant dtrain's model cannot reproduce ({', '.join(unsupported)})")
    return {
        "n_layer": cfg.get("num_hidden_layers"), "n_head": heads, "n_embd": width,
        "head_dim": None if not heads or not width or cfg.get("head_dim") in (None, width // heads)
        else cfg["head_dim"],
        "block_size": cfg.get("max_position_embeddings"), "vocab_size": cfg.get("vocab_size"),
        "norm": "rmsnorm", "pos": "rope", "mlp": "swiglu", "qk_norm": family != "llama",
        "n_kv_head": cfg.get("num_key_value_heads") or heads, "mlp_hidden": cfg.get("intermediate_size"),
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", True)), "bias": attention_bias,
        "norm_eps": cfg.get("rms_norm_eps", 1e-6),
        "rope_theta": rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
        "moe": moe if family == qwen3_moe.FAMILY else {"num_experts": 0},
    }


def llama_parts(s) -> dict[str, list[tuple[str, list[int]]]]:
    """For each of our tensors (model config or shape `s`), the HF tensors it is made of, stacked
    along dim 0: [(LlamaForCausalLM name, its shape)] (an expert tensor's first two dims merged).
    Vocabulary tensors list HF's real rows."""
    e, heads, layers = s["n_embd"], s["n_head"], s["n_layer"]
    moe = qwen3_moe.moe_keys(s)
    moe_layers = qwen3_moe.moe_layers(layers, moe["every"]) if qwen3_moe.num_experts(s) else []
    head_dim, hidden = _head_dim(s), _hidden(s)
    q, kv = heads * head_dim, _kv_heads(s) * head_dim
    parts = {"transformer.wte.weight": [(EMBED, [s["vocab_size"], e])],
             "transformer.ln_f.weight": [("model.norm.weight", [e])]}
    if not s["tie_embeddings"]:
        parts["lm_head.weight"] = [("lm_head.weight", [s["vocab_size"], e])]
    for i in range(layers):
        ours, hf = f"transformer.h.{i}.", f"model.layers.{i}."
        attn, mlp = hf + "self_attn.", hf + "mlp."
        block = {
            "ln_1.weight": [(hf + "input_layernorm.weight", [e])],
            "ln_2.weight": [(hf + "post_attention_layernorm.weight", [e])],
            "attn.c_attn.weight": [(attn + "q_proj.weight", [q, e]), (attn + "k_proj.weight", [kv, e]),
                                   (attn + "v_proj.weight", [kv, e])],
            "attn.c_proj.weight": [(attn + "o_proj.weight", [e, q])],
            "mlp.c_fc.weight": [(mlp + "gate_proj.weight", [hidden, e]), (mlp + "up_proj.weight", [hidden, e])],
            "mlp.c_proj.weight": [(mlp + "down_proj.weight", [e, hidden])],
        }
        if s["bias"]:
            block.update({
                "attn.c_attn.bias": [(attn + "q_proj.bias", [q]), (attn + "k_proj.bias", [kv]),
                                     (attn + "v_proj.bias", [kv])],
                "attn.c_proj.bias": [(attn + "o_proj.bias", [e])],
                "mlp.c_fc.bias": [(mlp + "gate_proj.bias", [hidden]), (mlp + "up_proj.bias", [hidden])],
                "mlp.c_proj.bias": [(mlp + "down_proj.bias", [e])],
            })
        if s["qk_norm"]:
            block.update({"attn.q_norm.weight": [(attn + "q_norm.weight", [head_dim])],
                          "attn.k_norm.weight": [(attn + "k_norm.weight", [head_dim])]})
        if i in moe_layers:  # the MoE block in place of the dense MLP
            block = {k: v for k, v in block.items() if not k.startswith("mlp.")}
            parts.update(qwen3_moe.layer_parts(ours, hf, s, e))
        parts.update({ours + k: v for k, v in block.items()})
    return parts


def file_key(name: str, keys) -> str:
    """The name a file uses for LlamaForCausalLM's tensor `name`: a LlamaModel save (some Hub
    folders) drops the `model.` prefix."""
    if name.startswith(PREFIX) and EMBED not in keys:
        return name.removeprefix(PREFIX)
    return name
