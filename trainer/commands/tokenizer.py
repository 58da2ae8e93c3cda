"""`dtrain tokenizer train data=NAME [data.source=...] tokenizer.vocab_size=N tokenizer.path=OUT`:
a byte-level BPE trained on a dataset's text, for `tokenizer=hf tokenizer.path=OUT`.

On small runs the vocabulary dominates: GPT-2's 50,257-row embedding and head are most of a small
model's parameters and much of its step. A tokenizer trained on the corpus itself (as nanochat
trains its own) is the usual answer. This one is GPT-2-style byte-level BPE (every byte string
encodes; GPT-2's pre-tokenizer split), with `<|endoftext|>` as its one special token, the document
separator, trained by the `tokenizers` library (pip install 'dtrain[tokenizers]'). The same text and
settings give the same tokenizer. OUT gets `tokenizer.json` and `tokenizer_config.json`, so
`AutoTokenizer.from_pretrained(OUT)` reads it too, and the command prints the time it took and the
bytes per token it reaches on the dataset's text.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from rich.console import Console

from trainer.config.args import ArgParser, folder_to_write
from trainer.config.compose import compose
from trainer.config.validation import check_ranges
from trainer.data import sources
from trainer.data.hints import use_tokenizer_command
from trainer.data.prepare import as_data_cfg
from trainer.data.tokenizers import HF_EXTRA, TOKENIZER_FILE, load_tokenizer
from trainer.errors import UserError
from trainer.io import check_writable_dir

EOT_TOKEN = "<|endoftext|>"
MIN_VOCAB = 257  # the 256 bytes and the end-of-text token
MAX_VOCAB = 1 << 20


def cmd_tokenizer(argv: list[str]) -> None:
    parser = ArgParser(prog="dtrain tokenizer", description=__doc__)
    parser.add_argument("action", choices=["train"], help="what to do (train: a BPE on a dataset's text)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="data=NAME [data.source=...] tokenizer.vocab_size=N tokenizer.path=OUT")
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
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415 - optional extra
    except ImportError:
        raise UserError(f"dtrain tokenizer train needs the `tokenizers` package; {HF_EXTRA}") from None
    data_cfg = as_data_cfg(cfg.data)
    source = sources.open_source(data_cfg)  # a missing or empty source is one line, before anything is written
    check_writable_dir(out, f"tokenizer.path={out}", "set tokenizer.path to a writable folder")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's split, bytes as characters
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT_TOKEN], show_progress=sys.stderr.isatty(),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = list(source.documents())  # the corpus once: training and the bytes-per-token figure read it
    started = time.perf_counter()
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    seconds = time.perf_counter() - started

    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / TOKENIZER_FILE))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOT_TOKEN, "eos_token": EOT_TOKEN,
        "unk_token": EOT_TOKEN, "model_max_length": 1 << 30, "clean_up_tokenization_spaces": False,
    }, indent=2) + "\n")
    trained = load_tokenizer({"name": "hf", "path": str(out)})
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    n_tokens = sum(len(trained.encode(t)) for t in texts)
    Console().print(
        f"[green]trained[/] a byte-level BPE of {trained.vocab_size:,} tokens on {data_cfg.name} "
        f"({n_bytes:,} bytes) in {seconds:.1f} s: {n_bytes / max(1, n_tokens):.2f} bytes per token; "
        f"{out / TOKENIZER_FILE}\n  use it: `{use_tokenizer_command(data_cfg, out)}`",
        highlight=False, soft_wrap=True)


def folder_to_write_or_fail(path: str) -> Path:
    try:
        return folder_to_write(str(path))
    except Exception as e:  # noqa: BLE001 - argparse's ArgumentTypeError: one line
        raise UserError(f"tokenizer.path={path!r}: {e}") from None
