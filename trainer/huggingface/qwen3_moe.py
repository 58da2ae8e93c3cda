"""What Hugging Face's Qwen3-MoE (Qwen3MoeForCausalLM) adds to Qwen3: its config.json keys and its
expert tensors <-> our model.moe.* and MoE block. llama.py applies this to the rest of the model
(attention, norms, embeddings and the dense layers are Qwen3's); torch-free, like llama.py.

What differs between our MoE block (trainer/model/moe.py) and transformers':
- the router is ours `mlp.router.weight`, theirs `mlp.gate.weight` ([experts, hidden] both);
- our experts are two 3D tensors, `mlp.experts.c_fc` [E, 2 x expert_hidden, hidden] (each expert's
  gate rows, then its up rows) and `mlp.experts.c_proj` [E, hidden, expert_hidden]. The Hub's
  files (Qwen3-30B-A3B's, and what transformers' save_pretrained writes by default) hold one matrix
  per expert, `mlp.experts.<j>.gate_proj/up_proj/down_proj.weight`: ours, with its first two dims
  merged, is those stacked along dim 0 (gate_0, up_0, gate_1, up_1, ...), so the table below lists
  them as llama.py lists q|k|v. transformers 5 in memory (and save_pretrained with
  save_original_format=False) stacks them as `mlp.experts.gate_up_proj` [E, 2 x moe_intermediate,
  hidden] (gate first: its forward chunks gate, up) and `mlp.experts.down_proj`: exactly ours; such a
  folder is read through `expert_aliases`, which names each expert's rows of it;
- layer i is MoE when (i + 1) % model.moe.every == 0: Qwen3's decoder_sparse_step. Its
  mlp_only_layers (dense layers by index) is read when some `every` gives the same layers;
- Qwen3-MoE has no shared experts, no biases and always QK-norm: a model with any of those is
  refused by name (`export_gaps`).
"""

from __future__ import annotations

import dataclasses
import re

from trainer.config.shape import mlp_width

FAMILY = "qwen3_moe"
ARCHITECTURE = "Qwen3MoeForCausalLM"
# model.moe's keys that shape the model (a source must share them with the model group);
# aux_loss_coef is a training knob, carried both ways but never compared
SHAPE_KEYS = ("num_experts", "top_k", "expert_hidden", "every", "norm_topk_prob", "num_shared_experts")
# a stacked expert tensor of transformers 5: its per-expert parts and the rows each takes
FUSED = re.compile(r"^(?P<layer>(?:.*\.)?layers\.\d+\.mlp\.experts\.)(?P<name>gate_up_proj|down_proj)$")
PER_EXPERT = re.compile(r"^(?P<layer>.*\.experts\.)(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
FUSED_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def moe_keys(m) -> dict:
    """model.moe of a model config (a nested dataclass, dict or OmegaConf node) or of a checked
    source's shape (flat `moe.*` keys), as a plain dict; {} for a dense model's older config."""
    nested = m.get("moe") if hasattr(m, "get") else getattr(m, "moe", None)
    if nested is None:
        return {k.removeprefix("moe."): v for k, v in m.items() if k.startswith("moe.")}
    if dataclasses.is_dataclass(nested):
        return dataclasses.asdict(nested)
    return {k: nested[k] for k in nested}


def num_experts(m) -> int:
    return moe_keys(m).get("num_experts") or 0


def expert_hidden(m) -> int:
    """Each expert's width as the model builds it (GPTConfig.expert_hidden): model.moe.expert_hidden,
    or the dense MLP's width / top_k."""
    moe = moe_keys(m)
    dense = mlp_width(m["n_embd"], m["mlp"], m["mlp_hidden"], m.get("mlp_multiple_of", 256))
    return moe.get("expert_hidden") or max(1, dense // moe["top_k"])


def moe_layers(n_layer: int, every: int) -> list[int]:
    """The layers (0-based) whose MLP is the MoE block: every `every`-th, as Qwen3's decoder_sparse_step."""
    return [i for i in range(n_layer) if (i + 1) % every == 0]


def export_gaps(m) -> list[str]:
    """What Qwen3MoeForCausalLM cannot compute of the MoE model config `m` (empty: it exports)."""
    moe, gaps = moe_keys(m), []
    if not m["qk_norm"]:
        gaps.append("model.qk_norm=false (Qwen3-MoE always has QK-norm)")
    if m["bias"]:
        gaps.append("model.bias=true (Qwen3-MoE has no biases)")
    if moe.get("num_shared_experts"):
        gaps.append(f"model.moe.num_shared_experts={moe['num_shared_experts']} (Qwen3-MoE has no shared experts)")
    return gaps


def config_keys(m) -> dict:
    """config.json's MoE keys for the MoE model config `m` (beside Qwen3's)."""
    moe = moe_keys(m)
    return {
        "architectures": [ARCHITECTURE], "model_type": FAMILY,
        # transformers 5 writes num_local_experts (an alias), 4.x reads only num_experts: Qwen's own name
        "num_experts": moe["num_experts"], "num_experts_per_tok": moe["top_k"],
        "moe_intermediate_size": expert_hidden(m), "decoder_sparse_step": moe["every"], "mlp_only_layers": [],
        "norm_topk_prob": bool(moe["norm_topk_prob"]), "router_aux_loss_coef": moe.get("aux_loss_coef", 0.0),
        "output_router_logits": False,
    }


def moe_shape(cfg: dict, n_layer: int) -> tuple[dict, list[str]]:
    """(our model.moe keys for a Qwen3-MoE config.json, what of it our model cannot reproduce).
    Its MoE layers are every decoder_sparse_step-th not in mlp_only_layers: some model.moe.every
    must make the same ones (none at all is Qwen3, every layer dense)."""
    experts = cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0
    step, dense = cfg.get("decoder_sparse_step", 1) or 1, set(cfg.get("mlp_only_layers") or [])
    wanted = [i for i in moe_layers(n_layer, step) if i not in dense]
    if not experts or not wanted:
        return {"num_experts": 0}, []
    every = next((every for every in range(1, n_layer + 1) if moe_layers(n_layer, every) == wanted), None)
    unsupported = [] if every else [
        f"mlp_only_layers={cfg.get('mlp_only_layers')} with decoder_sparse_step={step} "
        "(model.moe.every makes every every-th layer MoE)"]
    return {"num_experts": experts, "top_k": cfg.get("num_experts_per_tok"),
            "expert_hidden": cfg.get("moe_intermediate_size"), "every": every,
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)), "num_shared_experts": 0,
            "aux_loss_coef": cfg.get("router_aux_loss_coef", 0.0)}, unsupported


def layer_parts(ours: str, hf: str, s, e: int) -> dict[str, list[tuple[str, list[int]]]]:
    """One MoE layer's MLP tensors (`ours`/`hf`: the layer's name prefixes) as llama.llama_parts
    lists them: each of ours is its HF tensors stacked along dim 0 (an expert tensor's first two
    dims merged)."""
    moe = moe_keys(s)
    hidden, experts = expert_hidden(s), range(moe["num_experts"])
    mlp = hf + "mlp."
    return {
        ours + "mlp.router.weight": [(mlp + "gate.weight", [moe["num_experts"], e])],
        ours + "mlp.experts.c_fc": [(f"{mlp}experts.{j}.{proj}.weight", [hidden, e])
                                    for j in experts for proj in ("gate_proj", "up_proj")],
        ours + "mlp.experts.c_proj": [(f"{mlp}experts.{j}.down_proj.weight", [e, hidden]) for j in experts],
    }


def expert_aliases(name: str, shape: list[int]) -> dict[str, tuple[int, int, int]]:
    """For a stacked expert tensor of transformers 5 (`...mlp.experts.gate_up_proj` [E, 2I, H] or
    `down_proj` [E, H, I]), each per-expert tensor it holds: name -> (expert, first row, rows).
    {} for any other tensor."""
    match = FUSED.match(name)
    if not match:
        return {}
    projections = FUSED_PARTS[match["name"]]
    rows = shape[1] // len(projections)
    return {f"{match['layer']}{j}.{proj}.weight": (j, k * rows, rows)
            for j in range(shape[0]) for k, proj in enumerate(projections)}


def fused_expected(expected: dict[str, list[int]]) -> dict[str, list[int]]:
    """The tensors a transformers-5 stacked folder holds in place of the per-expert ones in
    `expected` (name -> shape, the Hub's layout): each layer's experts as gate_up_proj and down_proj."""
    out = {}
    for name, shape in expected.items():
        match = PER_EXPERT.match(name)
        if not match:
            out[name] = shape
            continue
        fused = match["layer"] + ("down_proj" if match["proj"] == "down_proj" else "gate_up_proj")
        expert = int(match["expert"])
        count, rows, _ = out.get(fused, [0, 0, shape[1]])
        out[fused] = [max(count, expert + 1), rows + (shape[0] if expert == 0 else 0), shape[1]]
    return out
