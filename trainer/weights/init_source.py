"""What `model.init_from=PATH` names, checked before anything is written (no torch).

PATH is a Hugging Face folder (config.json + model.safetensors or its sharded index, as
`huggingface-cli download` or `dtrain export` write it) of a GPT-2, Llama, Qwen3 or Qwen3-MoE model, a dtrain
run directory (its newest checkpoint) or one `step_*` checkpoint folder. The source's shape and
block (norm, positions, MLP, KV heads...) come from config.json, the safetensors headers or the
checkpoint's recorded config, and must be the chosen model group's (model.moe.* too): the model group describes the
source (a shorter train.seq_len than its block size is fine; validation refuses a longer one).
Only safetensors or DCP files are ever read, never a pickle.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from trainer.checkpoint.layout import CHECKPOINT_DIR, CONFIG_FILE, checkpoint_step, is_complete, resolve_checkpoint
from trainer.config.schema import CONF_DIR, ModelConfig
from trainer.config.shape import mlp_width
from trainer.errors import CheckpointError, ConfigError
from trainer.huggingface import qwen3_moe
from trainer.huggingface.llama import LLAMA_TYPES, file_key, llama_parts, llama_shape
from trainer.io import not_a_folder

HF_CONFIG = "config.json"
HF_WEIGHTS = "model.safetensors"  # trainer.huggingface.mapping.WEIGHTS_FILE (that module needs torch)
HF_INDEX = "model.safetensors.index.json"  # a sharded save: which file holds each tensor
SHAPE_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")
# the block's keys a source must share with the model group (widths and heads as the model builds them)
BLOCK_KEYS = ("norm", "pos", "mlp", "mlp_hidden", "n_kv_head", "head_dim", "qk_norm", "tie_embeddings", "norm_eps",
              "rope_theta")
# model.moe's, flat as a source's shape holds them (trainer/huggingface/qwen3_moe.py reads both forms)
MOE_KEYS = tuple(f"moe.{k}" for k in qwen3_moe.SHAPE_KEYS)
DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
# model.moe's defaults (a nested group: the schema's factory makes them)
MOE_DEFAULTS = next((dataclasses.asdict(f.default_factory()) for f in dataclasses.fields(ModelConfig)
                     if f.name == "moe"), {})
# GELU with the tanh approximation, under both of transformers' names for it.
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")
KINDS = ("a Hugging Face GPT-2, Llama, Qwen3 or Qwen3-MoE folder (config.json + model.safetensors), a dtrain run "
         "directory or a step_* checkpoint folder")


@dataclass(frozen=True)
class InitSource:
    spec: str  # as the user gave it
    path: Path  # the HF folder, or the checkpoint folder chosen
    kind: str  # "hf" or "dcp"
    shape: dict  # SHAPE_KEYS and BLOCK_KEYS as the model builds them, plus bias (not of a HF GPT-2)


def hf_weight_files(folder: Path) -> list[Path]:
    """The folder's safetensors files: model.safetensors, or the shards its index names ([] if neither)."""
    if (folder / HF_WEIGHTS).is_file():
        return [folder / HF_WEIGHTS]
    try:
        weight_map = json.loads((folder / HF_INDEX).read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [folder / name for name in sorted(set(weight_map.values()))]


def effective(m) -> dict:
    """SHAPE_KEYS, BLOCK_KEYS and MOE_KEYS of a model config (or a source's shape) as the model
    builds them: n_kv_head, head_dim and mlp_hidden resolved, rope_theta only where positions are
    rotary, model.moe's keys only with experts, mlp_hidden only where some layer is dense."""
    out = {k: m.get(k, DEFAULTS[k]) for k in (*SHAPE_KEYS, *BLOCK_KEYS)}
    out["n_kv_head"] = out["n_kv_head"] or out["n_head"]
    out["head_dim"] = out["head_dim"] or (out["n_embd"] // out["n_head"] if out["n_embd"] and out["n_head"] else None)
    out["mlp_hidden"] = mlp_width(out["n_embd"], out["mlp"], out["mlp_hidden"],
                                  m.get("mlp_multiple_of", DEFAULTS["mlp_multiple_of"]))
    if out["pos"] != "rope":
        out["rope_theta"] = None
    moe = {**MOE_DEFAULTS, **qwen3_moe.moe_keys(m)}
    experts = moe.get("num_experts") or 0
    out.update({f"moe.{k}": moe.get(k) if experts else None for k in qwen3_moe.SHAPE_KEYS})
    out["moe.num_experts"] = experts
    if experts:  # null: the dense width / top_k, resolved as the model builds it
        out["moe.expert_hidden"] = qwen3_moe.expert_hidden({**out, "moe": moe})
    if experts and len(qwen3_moe.moe_layers(out["n_layer"], moe["every"])) == out["n_layer"]:
        out["mlp_hidden"] = None  # every layer's MLP is the MoE block: no dense width to compare
    return out


def find_init_source(spec: str) -> InitSource:
    """The source PATH names and its shape; CheckpointError when it is none of the three kinds."""
    path = Path(spec).expanduser()
    label = f"model.init_from={spec}"
    if not path.is_dir():
        raise CheckpointError(f"{label} {not_a_folder(path)}; pass {KINDS}")
    if path.is_dir() and hf_weight_files(path) and not is_complete(path):
        return InitSource(spec, path, "hf", _hf_shape(path, label))
    if not (is_complete(path) or checkpoint_step(path) is not None or (path / CHECKPOINT_DIR).is_dir()):
        pickle = (path / "pytorch_model.bin").exists()
        note = " (its pytorch_model.bin is a pickle, which dtrain never loads)" if pickle else ""
        raise CheckpointError(f"{label} holds no model.safetensors and no dtrain checkpoint{note}; pass {KINDS}")
    try:
        ckpt = resolve_checkpoint(path)  # an interrupted or corrupt step_* folder, a run without one
    except CheckpointError as err:
        raise CheckpointError(f"{label}: {err}") from None
    try:
        saved = json.loads((ckpt / CONFIG_FILE).read_text()).get("model", {})
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{label}: checkpoint {ckpt} has no readable {CONFIG_FILE} ({err})") from None
    shape = {**effective(saved), "bias": saved.get("bias", DEFAULTS["bias"]),
             "pad_vocab_multiple": saved.get("pad_vocab_multiple", 1)}
    return InitSource(spec, ckpt, "dcp", shape)


def _hf_shape(folder: Path, label: str) -> dict:
    try:
        cfg = json.loads((folder / HF_CONFIG).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{label} has {HF_WEIGHTS} but no {HF_CONFIG}; download the whole folder") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{label}: cannot read {HF_CONFIG} ({err})") from None
    if cfg.get("model_type") in LLAMA_TYPES:
        shape = llama_shape(cfg, label)
        return {**effective(shape), "bias": shape["bias"], "family": cfg["model_type"]}
    if cfg.get("model_type") != "gpt2":
        raise CheckpointError(f"{label} holds a {cfg.get('model_type')!r} model; model.init_from reads GPT-2, "
                              f"Llama and Qwen3 (model_type gpt2, {', '.join(LLAMA_TYPES)})")
    unsupported = []
    if cfg.get("activation_function", "gelu_new") not in TANH_GELU:
        unsupported.append(f"activation_function={cfg['activation_function']}")
    if cfg.get("n_inner") not in (None, 4 * cfg.get("n_embd", 0)):
        unsupported.append(f"n_inner={cfg['n_inner']}")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if cfg.get(flag):
            unsupported.append(f"{flag}=true")
    if unsupported or cfg.get("scale_attn_weights") is False:
        what = ", ".join(unsupported or ["scale_attn_weights=false"])
        raise CheckpointError(f"{label} is a GPT-2 variant dtrain's model cannot reproduce ({what})")
    return effective({"n_layer": cfg.get("n_layer"), "n_head": cfg.get("n_head"), "n_embd": cfg.get("n_embd"),
                      "block_size": cfg.get("n_positions"), "vocab_size": cfg.get("vocab_size"),
                      "norm_eps": cfg.get("layer_norm_epsilon", 1e-5)}) | {"family": "gpt2"}


def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """(the JSON header of a safetensors file, where its data starts), once the header is well formed
    and the file holds exactly the bytes it promises (a partial download or copy fails here, not in
    a worker): no tensor is read."""
    fix = "download or export the model again"
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if 8 + length > size:
                raise CheckpointError(f"{path} is truncated: it holds {size:,} bytes, fewer than its {length:,}-byte "
                                      f"header; {fix}")
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as err:
        raise CheckpointError(f"{path} is not a readable safetensors file ({err}); {fix}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} is not a safetensors file (its header is not an object); {fix}")
    data_bytes = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        problem = _entry_problem(entry)
        if problem:
            raise CheckpointError(f"{path}: the header entry of tensor {name!r} {problem}; {fix}")
        data_bytes = max(data_bytes, entry["data_offsets"][1])
    promised = 8 + length + data_bytes
    if size != promised:
        state = "truncated" if size < promised else "longer than its header says"
        raise CheckpointError(f"{path} is {state}: it holds {size:,} bytes, its header promises {promised:,}; {fix}")
    return header, 8 + length


# bytes per element of each safetensors dtype
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
               "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}


def _entry_problem(entry) -> str | None:
    """What is wrong with one tensor's header entry (dtype, shape, data_offsets that agree)."""
    if not isinstance(entry, dict):
        return "is not an object"
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        return f"has dtype {dtype!r}, not one of {', '.join(DTYPE_BYTES)}"
    if not (isinstance(shape, list) and isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in shape + offsets)):
        return "has no whole-number shape and data_offsets [begin, end]"
    if offsets[1] - offsets[0] != math.prod(shape) * DTYPE_BYTES[dtype]:
        return f"has data_offsets {offsets} for {math.prod(shape):,} {dtype} values"
    return None


def hf_tensor_shapes(s: dict) -> dict[str, list[int]]:
    """Every tensor a GPT-2 of shape `s` stores, HF's names (without `transformer.`) and layouts."""
    e = s["n_embd"]
    shapes = {"wte.weight": [s["vocab_size"], e], "wpe.weight": [s["block_size"], e],
              "ln_f.weight": [e], "ln_f.bias": [e]}
    block = {"ln_1.weight": [e], "ln_1.bias": [e], "ln_2.weight": [e], "ln_2.bias": [e],
             "attn.c_attn.weight": [e, 3 * e], "attn.c_attn.bias": [3 * e],
             "attn.c_proj.weight": [e, e], "attn.c_proj.bias": [e],
             "mlp.c_fc.weight": [e, 4 * e], "mlp.c_fc.bias": [4 * e],
             "mlp.c_proj.weight": [4 * e, e], "mlp.c_proj.bias": [e]}
    for i in range(s["n_layer"]):
        shapes.update({f"h.{i}.{k}": v for k, v in block.items()})
    return shapes


def _headers(folder: Path) -> dict[str, tuple[Path, int, dict]]:
    """Every tensor the folder's safetensors files hold: name -> (file, data start, header entry)."""
    out = {}
    for file in hf_weight_files(folder):
        header, start = read_safetensors_header(file)
        out.update({name: (file, start, entry) for name, entry in header.items() if name != "__metadata__"})
    return out


def _expected_tensors(source: InitSource, keys) -> dict[str, list[int]]:
    """Every tensor the source's family stores for its shape, under the file's names."""
    if source.shape["norm"] == "layernorm":  # GPT-2: the only HF family with LayerNorm
        prefix = "transformer." if "transformer.wte.weight" in keys else ""
        return {prefix + name: shape for name, shape in hf_tensor_shapes(source.shape).items()}
    expected = {file_key(key, keys): shape for parts in llama_parts(source.shape).values() for key, shape in parts}
    if any(qwen3_moe.FUSED.match(key) for key in keys):  # transformers 5's stacked experts
        return qwen3_moe.fused_expected(expected)
    return expected


def _check_hf_file(source: InitSource, bias: bool) -> None:
    """Every tensor there with its shape; with model.bias=false, every bias zero (the same function)."""
    try:
        tensors = _headers(source.path)
    except CheckpointError as err:
        raise CheckpointError(f"model.init_from={source.spec}: {err}") from None
    nonzero, label = [], f"model.init_from={source.spec}: {source.path}"
    for name, shape in _expected_tensors(source, tensors.keys()).items():
        if name not in tensors:
            raise CheckpointError(f"{label} has no tensor {name!r}; it is not a complete {source.shape['family']}")
        file, start, entry = tensors[name]
        if entry["shape"] != shape:
            raise CheckpointError(
                f"{label} holds {name} of shape {entry['shape']} in {file.name}, but its config.json says {shape}")
        if not bias and name.endswith(".bias") and not _all_zero(file, start, entry):
            nonzero.append(name)
    if nonzero:
        raise ConfigError(f"model.init_from={source.spec} has non-zero biases ({nonzero[0]} and "
                          f"{len(nonzero) - 1} more) but model.bias=false would drop them; set model.bias=true")


def _all_zero(file: Path, start: int, entry: dict) -> bool:
    """A float tensor's bytes all zero, sign bits aside (-0.0 is zero too)."""
    begin, end = entry["data_offsets"]
    with open(file, "rb") as f:
        f.seek(start + begin)
        data = bytearray(f.read(end - begin))
    width = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}.get(entry["dtype"], 1)
    data[width - 1::width] = bytes(b & 0x7F for b in data[width - 1::width])  # little-endian: sign in the last byte
    return not any(data)


def _compared(source: InitSource) -> list[str]:
    """The keys the model group must share with the source: a HF GPT-2's biases are always stored
    (zeros are model.bias=false's function), everywhere else model.bias is part of the shape."""
    gpt2_file = source.kind == "hf" and source.shape["norm"] == "layernorm"
    return [*SHAPE_KEYS, *BLOCK_KEYS, *MOE_KEYS, *(() if gpt2_file else ("bias",))]


def _value(v) -> str:
    """As a Hydra override spells it (true, not Python's True)."""
    return str(v).lower() if isinstance(v, bool) or v is None else str(v)


def _describe(shape: dict, keys: list[str], hf_gpt2: bool) -> str:
    names = {"block_size": "n_positions"} if hf_gpt2 else {}
    return " ".join(f"{names.get(k, k)}={_value(shape.get(k))}" for k in keys)


def _matching_group(shape: dict, keys: list[str]) -> str | None:
    """The model group (conf/model/*.yaml) with the source's layers, heads, width, block size and block."""
    for file in sorted((CONF_DIR / "model").glob("*.yaml")):
        preset = OmegaConf.load(file)
        group = {**effective(preset), "bias": preset.get("bias", DEFAULTS["bias"])}
        if all(group[k] == shape.get(k) for k in keys if k != "vocab_size"):
            return file.stem
    return None


def check_init_source(spec: str, model_cfg) -> InitSource:
    """The source, once its shape and block are the chosen model's: one ConfigError naming both
    (and the model group to choose, or the keys to set) when they are not."""
    source = find_init_source(spec)
    model = {**effective(model_cfg), "bias": model_cfg.get("bias", DEFAULTS["bias"])}
    keys = _compared(source)
    # a source's None is "not in this model" (model.moe's keys without experts, mlp_hidden without a
    # dense layer): no value to set; the keys that say so (moe.num_experts, moe.every) differ instead
    optional = (*MOE_KEYS, "mlp_hidden")
    differ = [k for k in keys if source.shape.get(k) != model[k]
              and not (k in optional and source.shape.get(k) is None)]
    if differ:
        group = _matching_group(source.shape, keys)
        fix = f"choose model={group}" if group and group != model_cfg.name else "set " + " ".join(
            f"model.{k}={_value(source.shape.get(k))}" for k in differ)
        # the shape always, then the block keys that differ (all of them would bury the difference)
        shown = [*SHAPE_KEYS, *(k for k in differ if k not in SHAPE_KEYS)]
        hf_gpt2 = "bias" not in keys
        raise ConfigError(
            f"model.init_from={spec} has {_describe(source.shape, shown, hf_gpt2)}, model={model_cfg.name} has "
            f"{_describe(model, shown, False)}; {fix} (the model group must describe the source)"
        )
    if source.kind == "hf":
        _check_hf_file(source, bool(model_cfg.bias))
    return source
