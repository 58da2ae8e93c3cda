"""`model.init_from=PATH`: a new run's first weights, from a Hugging Face GPT-2 folder or a dtrain
checkpoint (its source is checked before the run starts: trainer/checkpoint/init_source.py).

The weights go into the model the strategy has already wrapped, through its own model state dict:
under FSDP that holds each rank's shards (DTensors), and each rank reads only those: safetensors'
get_slice reads the rows (or, for HF's transposed Conv1D weights, the columns) of its shard, DCP
reads the chunks the rank holds. No rank ever holds two full copies of the model. Optimizer,
schedule, step and data start fresh: this is not a resume (which continues a run exactly).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from trainer.checkpoint.hf import EMBEDDING, WEIGHTS_FILE, hf_prefix, pad_rows, read_hf_region, safetensors_lib
from trainer.checkpoint.init_source import InitSource, find_init_source
from trainer.checkpoint.layout import CHECKPOINT_DIR
from trainer.checkpoint.selection import check_explicit, newest_intact
from trainer.checkpoint.verify import DCP_ERRORS, SafeReader, check_template
from trainer.errors import CheckpointError
from trainer.io import dotted_keys, first_line


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
        _load_hf(template, source.path / WEIGHTS_FILE, vocab)
    else:
        _load_dcp(template, source.path, metadata, vocab)
    run.strategy.load_model_state_dict(run.model, template)
    _say(rt, f"model.init_from={spec}: weights from {source.path} (step 0: fresh optimizer, schedule and data)")


def _say(rt, message: str) -> None:
    if rt.is_main:
        print(f"dtrain: {message}", file=sys.stderr, flush=True)


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
    if isinstance(tensor, DTensor):
        chunk = tensor.__create_chunk_list__()[0]
        return tensor.to_local(), tuple(chunk.offsets), tuple(chunk.sizes)
    return tensor, (0,) * tensor.dim(), tuple(tensor.shape)


@torch.no_grad()
def _load_hf(template: dict[str, torch.Tensor], file: Path, vocab_size: int) -> None:
    """Each tensor's local part read from the safetensors file, mapped to our layout."""
    safetensors = safetensors_lib("model.init_from with a Hugging Face folder")
    with safetensors.safe_open(str(file), framework="pt") as handle:
        prefix = hf_prefix(handle.keys())
        for name, tensor in template.items():
            local, offsets, sizes = _local_part(tensor)
            if local.numel() == 0:
                continue
            part = read_hf_region(handle, prefix, name, offsets, sizes, vocab_size)
            if name == EMBEDDING:
                wte, columns = handle.get_slice(prefix + "wte.weight"), slice(offsets[1], offsets[1] + sizes[1])
                pad_rows(part, offsets[0], vocab_size, lambda a, b, wte=wte, columns=columns: wte[a:b, columns])
            local.copy_(part)


@torch.no_grad()
def _load_dcp(template: dict[str, torch.Tensor], ckpt: Path, metadata, vocab_size: int) -> None:
    """DCP reads each rank's chunks. Only where the embedding is padded differently (another
    model.pad_vocab_multiple) is the source's embedding read whole, once, to re-pad it."""
    source_rows = metadata.state_dict_metadata[f"model.{EMBEDDING}"].size[0]
    embedding = template[EMBEDDING]
    repad = source_rows != embedding.shape[0]
    wanted = dict(template)
    if repad:
        wanted[EMBEDDING] = torch.empty((source_rows, embedding.shape[1]), dtype=embedding.dtype)
    check_template(ckpt, metadata, dotted_keys({"model": wanted}))
    try:
        dcp.load({"model": wanted}, storage_reader=SafeReader(ckpt))
    except DCP_ERRORS as err:
        raise CheckpointError(f"model.init_from: checkpoint {ckpt} could not be read: {first_line(err)}") from None
    if repad:
        full = wanted[EMBEDDING]
        local, offsets, sizes = _local_part(embedding)
        real = max(0, min(offsets[0] + sizes[0], vocab_size) - offsets[0])  # rows of real tokens held here
        columns = slice(offsets[1], offsets[1] + sizes[1])
        part = torch.full(tuple(sizes), float("nan"), dtype=full.dtype)
        part[:real] = full[offsets[0]:offsets[0] + real, columns]
        pad_rows(part, offsets[0], vocab_size, lambda a, b: full[a:b, columns])
        local.copy_(part)
