"""What `model.init_from=PATH` names, checked before anything is written (no torch).

PATH is a Hugging Face GPT-2 folder (config.json + model.safetensors, as `huggingface-cli download
gpt2` or `dtrain export` write it), a dtrain run directory (its newest checkpoint) or one `step_*`
checkpoint folder. The source's shape comes from config.json, the safetensors header or the
checkpoint's recorded config, and must be the chosen model group's: the model group describes the
source (a shorter train.seq_len than its block size is fine; validation refuses a longer one).
Only safetensors or DCP files are ever read, never a pickle.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from trainer.checkpoint.layout import CHECKPOINT_DIR, CONFIG_FILE, checkpoint_step, is_complete, resolve_checkpoint
from trainer.config import CONF_DIR
from trainer.errors import CheckpointError, ConfigError

HF_CONFIG = "config.json"
HF_WEIGHTS = "model.safetensors"  # trainer.checkpoint.hf.WEIGHTS_FILE (that module needs torch)
SHAPE_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")
# GELU with the tanh approximation, under both of transformers' names for it.
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")
KINDS = ("a Hugging Face GPT-2 folder (config.json + model.safetensors), a dtrain run directory or a "
         "step_* checkpoint folder")


@dataclass(frozen=True)
class InitSource:
    spec: str  # as the user gave it
    path: Path  # the HF folder, or the checkpoint folder chosen
    kind: str  # "hf" or "dcp"
    shape: dict  # SHAPE_KEYS, plus bias for a dtrain checkpoint


def find_init_source(spec: str) -> InitSource:
    """The source PATH names and its shape; CheckpointError when it is none of the three kinds."""
    path = Path(spec).expanduser()
    label = f"model.init_from={spec}"
    if not path.exists():
        raise CheckpointError(f"{label} does not exist; pass {KINDS}")
    if path.is_dir() and (path / HF_WEIGHTS).is_file() and not is_complete(path):
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
    shape = {k: saved.get(k) for k in (*SHAPE_KEYS, "bias", "pad_vocab_multiple")}
    return InitSource(spec, ckpt, "dcp", shape)


def _hf_shape(folder: Path, label: str) -> dict:
    try:
        cfg = json.loads((folder / HF_CONFIG).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{label} has {HF_WEIGHTS} but no {HF_CONFIG}; download the whole folder") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{label}: cannot read {HF_CONFIG} ({err})") from None
    if cfg.get("model_type") != "gpt2":
        raise CheckpointError(
            f"{label} holds a {cfg.get('model_type')!r} model; model.init_from reads GPT-2 (model_type gpt2)")
    unsupported = []
    if cfg.get("activation_function", "gelu_new") not in TANH_GELU:
        unsupported.append(f"activation_function={cfg['activation_function']}")
    if cfg.get("n_inner") not in (None, 4 * cfg.get("n_embd", 0)):
        unsupported.append(f"n_inner={cfg['n_inner']}")
    if cfg.get("layer_norm_epsilon", 1e-5) != 1e-5:
        unsupported.append(f"layer_norm_epsilon={cfg['layer_norm_epsilon']}")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if cfg.get(flag):
            unsupported.append(f"{flag}=true")
    if unsupported or cfg.get("scale_attn_weights") is False:
        what = ", ".join(unsupported or ["scale_attn_weights=false"])
        raise CheckpointError(f"{label} is a GPT-2 variant dtrain's model cannot reproduce ({what})")
    return {"n_layer": cfg.get("n_layer"), "n_head": cfg.get("n_head"), "n_embd": cfg.get("n_embd"),
            "block_size": cfg.get("n_positions"), "vocab_size": cfg.get("vocab_size")}


def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """(the JSON header of a safetensors file, where its data starts): no tensor is read."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            return json.loads(f.read(length)), 8 + length
    except (OSError, ValueError, struct.error) as err:
        raise CheckpointError(f"{path} is not a readable safetensors file ({err})") from None


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


def _check_hf_file(source: InitSource, bias: bool) -> None:
    """Every tensor there with its shape; with model.bias=false, every bias zero (the same function)."""
    file = source.path / HF_WEIGHTS
    header, start = read_safetensors_header(file)
    prefix = "transformer." if "transformer.wte.weight" in header else ""
    nonzero, label = [], f"model.init_from={source.spec}: {file}"
    for name, shape in hf_tensor_shapes(source.shape).items():
        entry = header.get(prefix + name)
        if entry is None:
            raise CheckpointError(f"{label} has no tensor {prefix + name!r}; it is not a complete GPT-2")
        if entry["shape"] != shape:
            raise CheckpointError(
                f"{label} holds {prefix + name} of shape {entry['shape']}, but its config.json says {shape}")
        if not bias and name.endswith(".bias") and not _all_zero(file, start, entry):
            nonzero.append(prefix + name)
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


def _describe(shape: dict, hf: bool, source: bool) -> str:
    names = {"block_size": "n_positions"} if hf and source else {}
    keys = [*SHAPE_KEYS, *(() if hf else ("bias",))]
    return " ".join(f"{names.get(k, k)}={shape.get(k)}" for k in keys)


def _matching_group(shape: dict) -> str | None:
    """The model group (conf/model/*.yaml) with the source's layers, heads, width and block size."""
    for file in sorted((CONF_DIR / "model").glob("*.yaml")):
        group = OmegaConf.load(file)
        if all(group.get(k) == shape.get(k) for k in ("n_layer", "n_head", "n_embd", "block_size")):
            return file.stem
    return None


def check_init_source(spec: str, model_cfg) -> InitSource:
    """The source, once its shape is the chosen model's: one ConfigError naming both shapes (and
    the model group to choose) when it is not."""
    source = find_init_source(spec)
    hf = source.kind == "hf"
    keys = [*SHAPE_KEYS, *(() if hf else ("bias",))]
    if any(source.shape.get(k) != model_cfg[k] for k in keys):
        group = _matching_group(source.shape)
        fix = f"choose model={group}" if group and group != model_cfg.name else "set " + " ".join(
            f"model.{k}={source.shape.get(k)}" for k in keys if source.shape.get(k) != model_cfg[k])
        raise ConfigError(
            f"model.init_from={spec} has {_describe(source.shape, hf, True)}, model={model_cfg.name} has "
            f"{_describe(dict(model_cfg), hf, False)}; {fix} (the model group must describe the source)"
        )
    if hf:
        _check_hf_file(source, bool(model_cfg.bias))
    return source
