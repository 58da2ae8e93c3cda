"""`dtrain tokenizer train data=NAME [data.source=...] tokenizer.vocab_size=N tokenizer.path=OUT [--force]`:
a byte-level BPE trained on the text of a dataset's train split, for `tokenizer=hf tokenizer.path=OUT`.

On small runs the vocabulary dominates: GPT-2's 50,257-row embedding and head are most of a small
model's parameters and much of its step. A tokenizer trained on the corpus itself (as nanochat
trains its own) is the usual answer. This one is GPT-2-style byte-level BPE (every byte string
encodes; GPT-2's pre-tokenizer split), with `<|endoftext|>` as its one special token, the document
separator, trained by the `tokenizers` library (pip install 'dtrain[tokenizers]') on the text of the
train split `dtrain prepare` will write with it, never on the validation split's
(trainer/prepare/tokenizer_training.py). The same text and settings give the same tokenizer. OUT gets
`tokenizer.json` and `tokenizer_config.json`, so `AutoTokenizer.from_pretrained(OUT)` reads it too,
and the command prints the time it took and the bytes per token it reaches on the dataset's text.

A folder that already holds a tokenizer is replaced only with --force (runs trained with it keep
their own: each checkpoint carries a copy). A corpus without text is refused, and a vocabulary
smaller than tokenizer.vocab_size (the text has no more pairs to merge) is said in a line.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

from rich.console import Console

from trainer.checkpoint.layout import enclosing_checkpoint
from trainer.commands.args import ArgParser, folder_to_write
from trainer.config.compose import compose
from trainer.config.validation import check_ranges
from trainer.data.hints import use_tokenizer_command
from trainer.data.layout import as_data_cfg
from trainer.errors import DataError, UserError
from trainer.io import check_writable_dir, new_file_mode, write_atomic
from trainer.prepare import sources
from trainer.prepare.tokenizer_training import EOT_TOKEN, fit_train_split
from trainer.process.joblog import say
from trainer.tokenizers.load import HF_EXTRA, TOKENIZER_FILE, TOKENIZER_FILES, load_tokenizer

# A Hugging Face folder's files that add tokens beside tokenizer.json: gone when --force replaces it.
STALE_FILES = ("special_tokens_map.json", "added_tokens.json")
MIN_VOCAB = 257  # the 256 bytes and the end-of-text token
MAX_VOCAB = 1 << 20


def cmd_tokenizer(argv: list[str]) -> None:
    parser = ArgParser(prog="dtrain tokenizer", description=__doc__)
    parser.add_argument("action", choices=["train"], help="what to do (train: a BPE on a dataset's text)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="data=NAME [data.source=...] tokenizer.vocab_size=N tokenizer.path=OUT")
    parser.add_argument("--force", action="store_true", help="replace the tokenizer tokenizer.path already holds")
    args = parser.parse_args(argv)
    cfg = compose(args.overrides)
    check_ranges(cfg, ("data",))
    vocab_size, out = cfg.tokenizer.vocab_size, cfg.tokenizer.path
    if vocab_size is None or not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise UserError(f"tokenizer.vocab_size={vocab_size}: give the size to train, from {MIN_VOCAB} (the 256 "
                        f"bytes and {EOT_TOKEN}) to {MAX_VOCAB:,}, e.g. tokenizer.vocab_size=8192")
    if not out:
        raise UserError("tokenizer.path=OUT names the folder the tokenizer is written to, e.g. tokenizer.path=tok8k")
    out = folder_to_write_or_fail(out)
    check_own_folder(out, args.force)
    if importlib.util.find_spec("tokenizers") is None:
        raise UserError(f"dtrain tokenizer train needs the `tokenizers` package; {HF_EXTRA}")
    data_cfg = as_data_cfg(cfg.data)
    source = sources.open_source(data_cfg)  # a missing or empty source is one line, before anything is written
    check_writable_dir(out, f"tokenizer.path={out}", "set tokenizer.path to a writable folder")
    docs = list(source.documents())  # the corpus once: the fit encodes it as prepare will
    if not any(docs):
        raise DataError(f"dataset {data_cfg.name!r} has no text (source {source.description}: {len(docs)} empty "
                        "document(s)); check data.source")

    started = time.perf_counter()
    fit = fit_train_split(docs, vocab_size, data_cfg.val_fraction, data_cfg.max_tokens, f"dataset {data_cfg.name!r}")
    seconds = time.perf_counter() - started
    write_tokenizer(out, fit.tokenizer.to_str())
    trained = load_tokenizer({"name": "hf", "path": str(out)})
    if trained.vocab_size < vocab_size:
        say(f"tokenizer.vocab_size={vocab_size:,} asked, but the train split of {data_cfg.name!r} yields "
            f"{trained.vocab_size:,} tokens: the 256 bytes, {EOT_TOKEN} and every merge its text has; more text "
            "gives more")
    held_out = f"; the validation split's {fit.val_bytes:,} held out" if fit.val_bytes else ""
    fitted = "" if fit.fits == 1 else f" ({fit.fits} fits to find where that split ends)"
    Console().print(
        f"[green]trained[/] a byte-level BPE of {trained.vocab_size:,} tokens on the train split of {data_cfg.name} "
        f"({fit.train_bytes:,} bytes{held_out}) in {seconds:.1f} s{fitted}: "
        f"{fit.stream_bytes / max(1, fit.text_tokens):.2f} bytes per token; "
        f"{out / TOKENIZER_FILE}\n  use it: `{use_tokenizer_command(data_cfg, out)}`",
        highlight=False, soft_wrap=True)


def check_own_folder(out: Path, force: bool) -> None:
    """tokenizer.path may not lie in a checkpoint (only a save writes there), and a tokenizer it
    holds is replaced only with --force."""
    checkpoint = enclosing_checkpoint(out)
    if checkpoint is not None:
        raise UserError(f"tokenizer.path={out} is in the checkpoint folder {checkpoint}, where only a save writes; "
                        "choose another tokenizer.path")
    held = [name for name in TOKENIZER_FILES if (out / name).is_file()]
    if held and not force:
        raise UserError(f"tokenizer.path={out} already holds a tokenizer ({', '.join(held)}); add --force to replace "
                        "it (runs trained with it keep theirs: their checkpoints carry a copy), or choose another "
                        "tokenizer.path")


def write_tokenizer(out: Path, tokenizer_json: str) -> None:
    """tokenizer.json and tokenizer_config.json, each replaced in one rename; a special_tokens_map.json
    or added_tokens.json of a tokenizer replaced with --force goes (transformers would read its tokens)."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in STALE_FILES:
        (out / stale).unlink(missing_ok=True)
    write_atomic(out / TOKENIZER_FILE, tokenizer_json, mode=new_file_mode())
    write_atomic(out / "tokenizer_config.json", json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOT_TOKEN, "eos_token": EOT_TOKEN,
        "unk_token": EOT_TOKEN, "model_max_length": 1 << 30, "clean_up_tokenization_spaces": False,
    }, indent=2) + "\n", mode=new_file_mode())


def folder_to_write_or_fail(path: str) -> Path:
    try:
        return folder_to_write(str(path))
    except Exception as e:  # noqa: BLE001 - argparse's ArgumentTypeError: one line
        raise UserError(f"tokenizer.path={path!r}: {e}") from None
