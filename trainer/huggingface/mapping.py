"""Hugging Face names and layouts <-> ours: the one mapping `dtrain export` writes with and
`model.init_from` reads with. GPT-2's is here; Llama's table of names (and Qwen3's, Llama with
QK-norm, and Qwen3-MoE's, whose experts qwen3_moe.py adds) is in llama.py, applied to tensors here.

Our parameter names are GPT2LMHeadModel's (`transformer.h.0.attn.c_attn.weight` ...). What differs:
- HF's Conv1D stores c_attn / c_proj / c_fc weights as (in, out), the transpose of nn.Linear;
- our embedding may be padded to `padded_vocab_size` rows (model.pad_vocab_multiple), HF's has
  exactly `vocab_size`: export drops the padded rows, init_from fills them (see `pad_rows`);
- lm_head is tied to wte, so HF files do not store it;
- HF GPT-2 always has biases; our model.bias=false equals HF weights whose biases are zero;
- HF files from the Hub (GPT2Model's save) name tensors without `transformer.` and may carry the
  attention-mask buffers `attn.bias` / `attn.masked_bias`, which are not weights: ignored.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import torch

from trainer.errors import UserError
from trainer.huggingface.llama import export_family, file_key, llama_config, llama_parts
from trainer.huggingface.qwen3_moe import expert_aliases
from trainer.tokenizers.gpt2 import EOT

CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
WEIGHTS_FILE = "model.safetensors"
PREFIX = "transformer."
EMBEDDING = "transformer.wte.weight"
HEAD = "lm_head.weight"


def safetensors_lib(what: str):
    """The safetensors package (`safetensors.safe_open`, `.SafetensorError`, `.torch.save_file`), or a
    UserError naming the install command. `what` names the feature that needs it."""
    try:
        import safetensors.torch  # optional extra dtrain[export]: only HF folders need it
    except ImportError:
        raise UserError(
            f"{what} needs the safetensors package: pip install 'dtrain[export]' (or pip install safetensors)"
        ) from None
    return safetensors


def is_conv1d(name: str) -> bool:
    return name.endswith(CONV1D_WEIGHTS)


def bias_names(n_layer: int) -> list[str]:
    """Every bias HF GPT-2 has, in our (= GPT2LMHeadModel's) names."""
    per_block = ("ln_1.bias", "ln_2.bias", "attn.c_attn.bias", "attn.c_proj.bias", "mlp.c_fc.bias", "mlp.c_proj.bias")
    return [f"transformer.h.{i}.{b}" for i in range(n_layer) for b in per_block] + ["transformer.ln_f.bias"]


def model_family(model) -> str:
    """The transformers model_type our GPT exports as (gpt2, llama, qwen3), or one ConfigError."""
    return export_family(dataclasses.asdict(model.config))


# --- ours -> HF (dtrain export) -------------------------------------------------------------

def to_hf_state_dict(model, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Our GPT's weights under the Hugging Face family's names and layouts (contiguous, unshared)."""
    if model_family(model) != "gpt2":
        return _to_llama_state_dict(model, dtype)
    c = model.config
    out = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied to transformer.wte.weight
        if name == EMBEDDING:
            tensor = tensor[: c.vocab_size]
        if is_conv1d(name):
            tensor = tensor.t()
        out[name] = tensor.detach().to("cpu", dtype).contiguous().clone()
    if not c.bias:
        # HF GPT-2 always has biases: zeros are the same function.
        for name in bias_names(c.n_layer):
            width = 3 * c.n_embd if "c_attn" in name else 4 * c.n_embd if "c_fc" in name else c.n_embd
            out[name] = torch.zeros(width, dtype=dtype)
    return out


def _to_llama_state_dict(model, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Each of our tensors split into the HF tensors llama.llama_parts stacks in it (an expert
    tensor [E, rows, cols] as [E x rows, cols]: the Hub's per-expert matrices, in order)."""
    c = model.config
    parts = llama_parts(dataclasses.asdict(c))
    out = {}
    for name, tensor in model.state_dict().items():
        if name not in parts:  # the tied head's alias of the embedding
            continue
        if tensor.dim() == 3:
            tensor = tensor.flatten(0, 1)
        start = 0
        for key, shape in parts[name]:
            out[key] = tensor[start:start + shape[0]].detach().to("cpu", dtype).contiguous().clone()
            start += shape[0]
    return out


def hf_config(model, dtype: str = "float32", eot: int = EOT) -> dict:
    """config.json of the equivalent transformers model (GPT2LMHeadModel, LlamaForCausalLM...);
    `eot`: the run's tokenizer's end-of-text id (its bos and eos)."""
    c = model.config
    family = model_family(model)
    if family != "gpt2":
        return llama_config(dataclasses.asdict(c), family, dtype, eot)
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": c.vocab_size,
        "n_positions": c.block_size,
        "n_ctx": c.block_size,
        "n_embd": c.n_embd,
        "n_layer": c.n_layer,
        "n_head": c.n_head,
        "n_inner": None,  # 4 x n_embd
        "activation_function": "gelu_new",  # GELU, tanh approximation
        "layer_norm_epsilon": c.norm_eps,
        "resid_pdrop": c.dropout,
        "embd_pdrop": c.dropout,
        "attn_pdrop": c.dropout,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "tie_word_embeddings": True,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "use_cache": True,
        "torch_dtype": dtype,
    }


# --- HF -> ours (model.init_from) -----------------------------------------------------------

class SafetensorsFolder:
    """The tensors of a HF folder by name, across its files (one model.safetensors, or the shards
    model.safetensors.index.json lists), each opened once; get_slice reads only the part asked for.
    A transformers-5 stacked expert tensor (`mlp.experts.gate_up_proj`) is also named as the
    per-expert tensors it holds (`mlp.experts.3.up_proj.weight`: qwen3_moe.expert_aliases), so
    one table of names reads both layouts."""

    def __init__(self, safetensors, files: list[Path]):
        self._safetensors, self._files = safetensors, files
        self._stack = contextlib.ExitStack()
        self._owner: dict = {}
        self._alias: dict[str, tuple[str, int, int, int]] = {}

    def __enter__(self) -> SafetensorsFolder:
        for file in self._files:
            handle = self._stack.enter_context(self._safetensors.safe_open(str(file), framework="pt"))
            self._owner.update(dict.fromkeys(handle.keys(), handle))
            for key in handle.keys():
                aliases = expert_aliases(key, handle.get_slice(key).get_shape())
                self._alias.update({name: (key, *where) for name, where in aliases.items()})
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def keys(self):
        return self._owner.keys() | self._alias.keys()

    def get_slice(self, key: str):
        if key in self._alias:
            return _ExpertSlice(self.get_slice(self._alias[key][0]), *self._alias[key][1:])
        return self._owner[key].get_slice(key)


class _ExpertSlice:
    """One expert's rows [first, first + rows) of a stacked [E, rows, cols] tensor's slice, indexed
    as the 2D tensor they are (rows and columns as slices: all read_llama_region asks)."""

    def __init__(self, stacked, expert: int, first: int, rows: int):
        self._stacked, self._expert, self._first, self._rows = stacked, expert, first, rows

    def __getitem__(self, index: tuple[slice, slice]) -> torch.Tensor:
        rows, columns = index
        start, stop, _ = rows.indices(self._rows)
        return self._stacked[self._expert, self._first + start:self._first + stop, columns]


def read_llama_region(files, name: str, parts: list, offsets: tuple, sizes: tuple) -> torch.Tensor:
    """The part [offsets, offsets + sizes) of our tensor `name`, made of HF's `parts` stacked along
    dim 0 (llama.llama_parts): only the rows of each part that fall in it are read. Vocabulary
    rows past HF's come back NaN for `pad_rows` to fill."""
    start, stop = offsets[0], offsets[0] + sizes[0]
    columns = tuple(slice(o, o + s) for o, s in zip(offsets[1:], sizes[1:]))
    pieces, base = [], 0
    for key, shape in parts:
        lo, hi = max(start, base), min(stop, base + shape[0])
        if lo < hi:
            pieces.append(files.get_slice(file_key(key, files.keys()))[(slice(lo - base, hi - base), *columns)])
        base += shape[0]
    if stop > base:
        pieces.append(torch.full((stop - max(start, base), *sizes[1:]), float("nan")))
    return torch.cat(pieces)


def read_expert_region(files, name: str, parts: list, offsets: tuple, sizes: tuple,
                       rows_per_expert: int) -> torch.Tensor:
    """The part [offsets, offsets + sizes) of our expert tensor `name` ([E, rows_per_expert, cols]),
    whose rows, the first two dims merged, are HF's `parts` stacked: read expert by expert (a shard
    of the experts reads only its experts)."""
    first, rows = offsets[1:], sizes[1:]
    return torch.stack([
        read_llama_region(files, name, parts, (expert * rows_per_expert + first[0], first[1]), rows)
        for expert in range(offsets[0], offsets[0] + sizes[0])])


def hf_prefix(keys) -> str:
    """How the file names our `transformer.*` tensors: GPT2LMHeadModel's save keeps the prefix, a
    GPT2Model save (the Hub's original gpt2 files) has none."""
    return PREFIX if EMBEDDING in keys else ""


def read_hf_region(handle, prefix: str, name: str, offsets: tuple, sizes: tuple, vocab_size: int) -> torch.Tensor:
    """The part [offsets, offsets + sizes) of our tensor `name`, read from an open safetensors file
    (safe_open's get_slice reads only that part, so a rank holding a shard reads only its shard).

    Embedding rows past `vocab_size` (our padding) are not in the file: they come back as NaN for
    `pad_rows` to fill."""
    key = prefix + name.removeprefix(PREFIX)
    stop = [o + s for o, s in zip(offsets, sizes)]
    if is_conv1d(name):  # ours (out, in) is HF's (in, out)
        return handle.get_slice(key)[offsets[1]:stop[1], offsets[0]:stop[0]].t()
    if name == EMBEDDING:
        real_stop = max(offsets[0], min(stop[0], vocab_size))
        real = handle.get_slice(key)[offsets[0]:real_stop, offsets[1]:stop[1]]
        pad = torch.full((sizes[0] - real.shape[0], sizes[1]), float("nan"), dtype=real.dtype)
        return torch.cat([real, pad])
    return handle.get_slice(key)[tuple(slice(o, e) for o, e in zip(offsets, stop))]


def pad_rows(local: torch.Tensor, offset: int, vocab_size: int, real_rows) -> None:
    """Fill the embedding rows past `vocab_size` held locally (they start at global row `offset`)
    with the mean of the real rows (`real_rows(start, stop)` reads them). A padded row's logit is
    then the mean of the real tokens' logits, so the padding takes at most 1/vocab_size of the
    softmax each (zeros or random rows would give logit ~0, far above GPT-2's typical logits, and
    swamp the loss). The mean is read in blocks: no rank holds the whole table for it."""
    first = max(vocab_size - offset, 0)
    if first >= local.shape[0]:
        return
    total = torch.zeros(local.shape[1], dtype=torch.float64)
    block = 4096
    for start in range(0, vocab_size, block):
        total += real_rows(start, min(start + block, vocab_size)).to(torch.float64).sum(0)
    local[first:] = (total / vocab_size).to(local.dtype)
