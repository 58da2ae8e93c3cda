"""`dtrain export RUN_DIR [--out DIR] [--step N] [--dtype D]`: a checkpoint as a Hugging Face model.

Writes a complete Hugging Face model folder, loadable without dtrain: `model.safetensors`,
`config.json`, `generation_config.json` and the run's tokenizer: GPT-2's (`vocab.json`, `merges.txt`,
`tokenizer_config.json`, `special_tokens_map.json`, derived offline from the cached ranks), or with
tokenizer=hf the copy its checkpoint holds (`tokenizer.json`, `tokenizer_config.json` and any
`special_tokens_map.json`: trainer/checkpoint/tokenizer_copy.py), which encode exactly as training
did whatever became of the run's tokenizer folder since (`--tokenizer DIR` names it for a checkpoint
saved before checkpoints kept a copy). A
GPT-2-shaped model becomes a GPT2LMHeadModel (`transformer.h.0.attn.c_attn.weight` ...), a
Llama-shaped one (rmsnorm, rope, swiglu) a LlamaForCausalLM (`model.layers.0.self_attn.q_proj.weight`
...) or, with model.qk_norm, a Qwen3ForCausalLM, and a mixture of experts (model.moe.num_experts > 0)
a Qwen3MoeForCausalLM (its experts one matrix each, `model.layers.1.mlp.experts.0.gate_proj.weight`
..., as the Hub's Qwen3-MoE files and save_pretrained hold them); any other block (shared
experts, MoE without QK-norm...) is one error line, before anything is written:

    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
    model = AutoModelForCausalLM.from_pretrained("OUT_DIR")
    tokenizer = AutoTokenizer.from_pretrained("OUT_DIR")
    pipeline("text-generation", model="OUT_DIR")

Names and layouts go through trainer/huggingface/ (mapping.py and llama.py), the mapping
`model.init_from` reads with (qwen3_moe.py for the experts): GPT-2's Conv1D weights transposed,
Llama's q/k/v and gate/up split out of our fused matrices, each expert's gate/up/down out of our
stacked ones, padded vocabulary rows dropped, a tied lm_head not stored (from_pretrained ties it,
as save_pretrained does). Needs the optional
`safetensors` package (`pip install 'dtrain[export]'`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import torch

from trainer.checkpoint.layout import enclosing_checkpoint
from trainer.checkpoint.tokenizer_copy import TOKENIZER_HELP
from trainer.commands.args import ArgParser, folder_to_write, non_negative_int
from trainer.errors import UserError
from trainer.huggingface.llama import export_family
from trainer.huggingface.mapping import WEIGHTS_FILE, hf_config, safetensors_lib, to_hf_state_dict
from trainer.io import check_room, check_writable_dir, new_file_mode, write_atomic, write_errors_as_user_errors
from trainer.tokenizers.hf_files import write_hf_tokenizer
from trainer.weights.from_checkpoint import checkpoint_of, model_from_run, tokenizer_of

OUT_FIX = "choose another --out DIR"
# safetensors' header: a JSON entry per tensor (name, dtype, shape, offsets), under 200 bytes for our names
SAFETENSORS_ENTRY_BYTES = 200
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export(run_dir: Path, out: Path, step: int | None = None, dtype: str = "float32",
           out_label: str | None = None, tokenizer_dir: str | None = None) -> tuple[Path, str]:
    """Write out/model.safetensors, out/config.json and the tokenizer files from a run's checkpoint;
    returns out and which tokenizer it holds (for the command's last line).
    `out_label` names the output folder in errors (default: `--out OUT`); `tokenizer_dir`: --tokenizer
    DIR, for a checkpoint without a copy of its tokenizer."""
    safetensors = safetensors_lib("dtrain export")
    label = out_label or f"--out {out}"
    # the run directory itself, a checkpoint, a file, a read-only folder or a full disk: one line
    # before the weights are read
    check_own_folder(run_dir, out, label)
    check_writable_dir(out, label, OUT_FIX)
    ckpt = checkpoint_of(run_dir, step)
    # the run's tokenizer (GPT-2's ranks, or the checkpoint's copy of its tokenizer.json) is read
    # before anything is written: without it, one line and no half folder
    tokenizer = tokenizer_of(ckpt, tokenizer_dir)
    model, cfg = model_from_run(ckpt)
    export_family({**dataclasses.asdict(model.config), "name": cfg.model.get("name")})  # one line if none fits
    tensors = to_hf_state_dict(model, DTYPES[dtype])
    tokenizer_files = tokenizer.export_files(model.config.block_size)
    config_text = json.dumps(hf_config(model, dtype, tokenizer.eot), indent=2) + "\n"
    # every byte the export writes is known now: a disk without room for them is one line, not a
    # half-written weights file
    check_room(out, [sum(t.numel() * t.element_size() + SAFETENSORS_ENTRY_BYTES for t in tensors.values()),
                     len(config_text.encode()), *(len(text.encode()) for text in tokenizer_files.values())],
               f"the export ({len(tensors)} {dtype} tensors, config and tokenizer)", OUT_FIX)
    tmp = out / "model.safetensors.tmp"
    # the disk filling up while the weights are written (another writer): one line, and no
    # half-written files left
    with write_errors_as_user_errors(out, OUT_FIX):
        try:
            out.mkdir(parents=True, exist_ok=True)
            _save_safetensors(safetensors.torch.save_file, safetensors.SafetensorError, tensors, tmp)
            mode = new_file_mode()
            tmp.chmod(mode)
            tmp.replace(out / WEIGHTS_FILE)
            write_atomic(out / "config.json", config_text, mode=mode)
            write_hf_tokenizer(out, tokenizer_files, mode=mode)
        finally:
            tmp.unlink(missing_ok=True)
    return out, tokenizer_words(tokenizer, tokenizer_files)


def tokenizer_words(tokenizer, files: dict[str, str]) -> str:
    """The exported tokenizer as the command's last line names it: GPT-2's, or the run's own."""
    whose = "GPT-2's tokenizer" if tokenizer.name == "gpt2" else f"the run's tokenizer ({tokenizer.vocab_size:,} ids)"
    return f"{whose}: {', '.join(name for name in files if name != 'generation_config.json')}"


def check_own_folder(run_dir: Path, out: Path, label: str) -> None:
    """The export gets a folder of its own: not the run directory (its files would mix with the
    run's, config.json beside resolved_config.json) and not inside a checkpoint, where only a save
    writes."""
    checkpoint = enclosing_checkpoint(out)
    if checkpoint is not None:
        raise UserError(f"{label} is in the checkpoint folder {checkpoint}, where only a save writes; "
                        f"{OUT_FIX} outside it")
    if out.exists() and run_dir.is_dir() and out.resolve() == run_dir.resolve():
        raise UserError(f"{label} is the run directory itself; {OUT_FIX} (e.g. {run_dir / 'export'})")


def _save_safetensors(save_file, error_type, tensors: dict, path: Path) -> None:
    """safetensors' save_file, its I/O failures (a full disk...) raised as the OSError they are: its
    Rust side reports them as SafetensorError("... (os error 28)")."""
    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except error_type as err:
        code = re.search(r"\(os error (\d+)\)", str(err))
        if code is None:
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1])), str(path)) from None


def cmd_export(argv: list[str]) -> None:
    parser = ArgParser(prog="dtrain export", description=__doc__)
    parser.add_argument("run_dir", metavar="RUN_DIR",
                        help="a run directory (its newest checkpoint) or a checkpoint folder")
    parser.add_argument("--out", metavar="DIR", type=folder_to_write,
                        help="output folder (default: RUN_DIR/export)")
    parser.add_argument("--step", metavar="N", type=non_negative_int,
                        help="the checkpoint at this step (default: newest)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="weights dtype (default float32)")
    parser.add_argument("--tokenizer", metavar="DIR", help=TOKENIZER_HELP)
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir).expanduser()
    out = args.out or run_dir / "export"
    label = f"--out {out}" if args.out else f"the default output folder {out} (RUN_DIR/export)"
    _, tokenizer = export(run_dir, out, args.step, args.dtype, out_label=label, tokenizer_dir=args.tokenizer)
    print(f"exported {run_dir} -> {out}, a Hugging Face model folder: model.safetensors, config.json, "
          f"generation_config.json and {tokenizer}")
