"""`model.init_from=PATH`: a new run's first weights, from a Hugging Face GPT-2, Llama, Qwen3 or
Qwen3-MoE folder or a dtrain checkpoint (its source is checked before the run starts: trainer/weights/init_source.py).

The weights go into the model the strategy has already wrapped, through its own model state dict:
under FSDP that holds each rank's shards (DTensors), and each rank reads only those: safetensors'
get_slice reads the rows (or, for HF's transposed Conv1D weights, the columns) of its shard, of
each of HF's q/k/v or gate/up tensors our fused one holds (trainer/huggingface/llama.py), of
the experts a shard of an expert tensor holds (trainer/huggingface/qwen3_moe.py), DCP
reads the chunks the rank holds. No rank ever holds two full copies of the model. Optimizer,
schedule, step and data start fresh: this is not a resume (which continues a run exactly).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from trainer.checkpoint.deferred import dcp, verify
from trainer.checkpoint.layout import CHECKPOINT_DIR
from trainer.checkpoint.selection import check_explicit, newest_intact
from trainer.errors import CheckpointError
from trainer.huggingface.llama import file_key, llama_parts
from trainer.huggingface.mapping import (
    EMBEDDING,
    HEAD,
    SafetensorsFolder,
    hf_prefix,
    pad_rows,
    read_expert_region,
    read_hf_region,
    read_llama_region,
    safetensors_lib,
)
from trainer.io import dotted_keys, first_line
from trainer.process.joblog import say
from trainer.weights.init_source import InitSource, find_init_source, hf_weight_files


def start_from_weights(run, spec: str, resumed_from: Path | None) -> None:
    """Load model.init_from's weights into `run`'s model on every rank, unless the run continues
    from its own checkpoint (a crashed run resumed: its weights are newer than the source's)."""
    rt = run.rt
    if resumed_from is not None:
        _say(rt, f"model.init_from={spec} ignored: this run continues from its own checkpoint {resumed_from} "
                 "(init_from only starts a new run)")
        return
    source, metadata = rt.from_main(lambda: _verified_source(spec), error=CheckpointError)
    template = run.strategy.model_state_dict(run.model)
    vocab = run.cfg.model.vocab_size
    if source.kind == "hf":
        _load_hf(template, source, vocab)
    else:
        _load_dcp(template, source.path, metadata, vocab)
    run.strategy.load_model_state_dict(run.model, template)
    _say(rt, f"model.init_from={spec}: weights from {source.path} (step 0: fresh optimizer, schedule and data)")


def _say(rt, message: str) -> None:
    if rt.is_main:
        say(message)


def _verified_source(spec: str) -> tuple[InitSource, object]:
    """Rank 0: the source, a checkpoint verified against its checksums (a run directory's newest
    intact one); returns it and the checkpoint's DCP index (None for a HF folder)."""
    source = find_init_source(spec)
    if source.kind == "hf":
        return source, None
    given = Path(spec).expanduser()
    if source.path.resolve() != given.resolve():  # a run directory: its newest intact checkpoint
        ckpt = newest_intact(given / CHECKPOINT_DIR)
        if ckpt is None:
            raise CheckpointError(f"model.init_from={spec} holds no intact checkpoint (every one failed verification)")
        source = dataclasses.replace(source, path=ckpt)
    metadata = check_explicit(source.path, None)[1][0]
    return source, metadata


def _local_part(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple, tuple]:
    """(what this rank holds, its offsets and sizes in the full tensor): a shard of a DTensor (the
    chunk DCP itself would read for it), or the whole of a plain tensor."""
    # Imported here, like DCP (deferred.py): this module loads with every run's loop, and DTensor
    # (torch.distributed.tensor, about half a second) is needed only once init_from is set.
    from torch.distributed.tensor import DTensor  # deferred: heavy (see above)

    if isinstance(tensor, DTensor):
        chunk = tensor.__create_chunk_list__()[0]
        return tensor.to_local(), tuple(chunk.offsets), tuple(chunk.sizes)
    return tensor, (0,) * tensor.dim(), tuple(tensor.shape)


@torch.no_grad()
def _load_hf(template: dict[str, torch.Tensor], source: InitSource, vocab_size: int) -> None:
    """Each tensor's local part read from the folder's safetensors file(s), mapped to our layout."""
    safetensors = safetensors_lib("model.init_from with a Hugging Face folder")
    gpt2 = source.shape["family"] == "gpt2"
    parts = None if gpt2 else llama_parts(source.shape)
    with SafetensorsFolder(safetensors, hf_weight_files(source.path)) as files:
        prefix = hf_prefix(files.keys())
        for name, tensor in template.items():
            local, offsets, sizes = _local_part(tensor)
            if local.numel() == 0:
                continue
            if gpt2:
                part = read_hf_region(files, prefix, name, offsets, sizes, vocab_size)
                key = prefix + "wte.weight"
            elif tensor.dim() == 3:  # an expert tensor [E, rows, cols]
                part = read_expert_region(files, name, parts[name], offsets, sizes, tensor.shape[1])
            else:
                part = read_llama_region(files, name, parts[name], offsets, sizes)
                key = file_key(parts[name][0][0], files.keys())
            if name in (EMBEDDING, HEAD):
                rows, columns = files.get_slice(key), slice(offsets[1], offsets[1] + sizes[1])
                pad_rows(part, offsets[0], vocab_size, lambda a, b, rows=rows, columns=columns: rows[a:b, columns])
            local.copy_(part)


@torch.no_grad()
def _load_dcp(template: dict[str, torch.Tensor], ckpt: Path, metadata, vocab_size: int) -> None:
    """DCP reads each rank's chunks. Only where the vocabulary is padded differently (another
    model.pad_vocab_multiple) are the source's embedding (and untied head) read whole, once, to
    re-pad them."""
    checks = verify()
    source_rows = metadata.state_dict_metadata[f"model.{EMBEDDING}"].size[0]
    wanted = dict(template)
    repad = [n for n in (EMBEDDING, HEAD) if n in template and template[n].shape[0] != source_rows]
    for name in repad:
        wanted[name] = torch.empty((source_rows, template[name].shape[1]), dtype=template[name].dtype)
    checks.check_template(ckpt, metadata, dotted_keys({"model": wanted}))
    try:
        dcp().load({"model": wanted}, storage_reader=checks.SafeReader(ckpt))
    except checks.DCP_ERRORS as err:
        raise CheckpointError(f"model.init_from: checkpoint {ckpt} could not be read: {first_line(err)}") from None
    for name in repad:
        full = wanted[name]
        local, offsets, sizes = _local_part(template[name])
        real = max(0, min(offsets[0] + sizes[0], vocab_size) - offsets[0])  # rows of real tokens held here
        columns = slice(offsets[1], offsets[1] + sizes[1])
        part = torch.full(tuple(sizes), float("nan"), dtype=full.dtype)
        part[:real] = full[offsets[0]:offsets[0] + real, columns]
        pad_rows(part, offsets[0], vocab_size, lambda a, b, full=full, columns=columns: full[a:b, columns])
        local.copy_(part)
