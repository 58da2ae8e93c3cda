"""A checkpoint's copy of its run's tokenizer, and the tokenizer that reads a checkpoint's ids.

Each checkpoint of a tokenizer=hf run holds the files of the tokenizer the run trained with
(`tokenizer.json`, and `tokenizer_config.json` / `special_tokens_map.json` when it had them), flat
beside its shards as LitGPT's and the HF Trainer's checkpoints hold theirs. Rank 0 writes them from
the bytes the run read at its start (manager.py), and the marker's checksums cover them like every
other file (integrity.py). A tokenizer=gpt2 run's need no copy: `gpt2` names one fixed vocabulary,
built in and checked by its sha256 at every load (trainer/tokenizers/gpt2.py), and no folder of the
user's can move or change it.

`dtrain sample`, `export` and `eval` read a checkpoint's tokenizer here (checkpoint_tokenizer): its
copy, or a checkpoint from before copies were kept reads the folder its run's tokenizer.path names,
or the `--tokenizer DIR` given, each checked against the identity the checkpoint's trainer state
records (name, ids, end-of-text id, fingerprint: the first 16 hex digits of tokenizer.json's
sha256). A tokenizer folder moved or rewritten since the run changes nothing, and a wrong one is one
line. A continuation reads the same copy through the config (trainer/preflight/run_tokenizer.py).

Torch-free: the run's checks read it before torch is imported.
"""

from __future__ import annotations

from pathlib import Path

from trainer.checkpoint.integrity import verify_named_files
from trainer.checkpoint.layout import CONFIG_FILE, STATE_FILE
from trainer.checkpoint.records import read_checkpoint_config, read_trainer_state
from trainer.data.identity import tokenizer_changes
from trainer.data.manifest import describe_tokenizer
from trainer.errors import DataError
from trainer.tokenizers.load import TOKENIZER_FILE, TOKENIZER_FILES, load_tokenizer

# --tokenizer DIR, as sample, export and eval describe it
TOKENIZER_HELP = ("the run's tokenizer folder, for a checkpoint saved before checkpoints kept a copy of it "
                  "(checked against the fingerprint the checkpoint records)")


def has_copy(ckpt: Path) -> bool:
    """Whether the checkpoint holds a copy of its run's tokenizer (a tokenizer=hf run's, saved by a
    dtrain that kept one)."""
    return (Path(ckpt) / TOKENIZER_FILE).is_file()


def recorded_tokenizer(state: dict) -> dict | None:
    """The tokenizer identity a checkpoint's trainer state records, or None (a checkpoint from
    before it was recorded)."""
    recorded = state.get("tokenizer")
    return recorded if isinstance(recorded, dict) and recorded.get("tokenizer") else None


def describe_recorded(recorded: dict | None) -> str:
    """"tokenizer 'hf' with 500 ids (end-of-text 0, fingerprint ...)", or "its tokenizer" unrecorded."""
    if recorded is None or not {"tokenizer", "vocab_size", "eot"} <= set(recorded):
        return "its tokenizer"
    return describe_tokenizer(recorded)


def checkpoint_tokenizer(ckpt: Path, given: str | None = None):
    """The tokenizer a checkpoint's ids were made with (trainer/tokenizers/load.py): `given` (a
    folder, --tokenizer DIR), else the checkpoint's copy, else (a checkpoint without one) the folder
    its run's tokenizer.path names, else GPT-2's, each checked against the checkpoint's record.
    CorruptCheckpoint when the copy or the records differ from their checksums; DataError in one line
    when the tokenizer cannot be read or is another than the run's."""
    ckpt = Path(ckpt)
    verify_named_files(ckpt, [STATE_FILE, CONFIG_FILE, *TOKENIZER_FILES])
    recorded = recorded_tokenizer(read_trainer_state(ckpt))
    fix = f"pass --tokenizer DIR, a folder holding the tokenizer it was trained with ({describe_recorded(recorded)})"
    if given is not None:
        where = f"--tokenizer {given}"
        if not (Path(given).expanduser() / TOKENIZER_FILE).is_file():
            raise DataError(f"{where} holds no {TOKENIZER_FILE}; {fix}")
        tokenizer = load_tokenizer({"name": "hf", "path": given})
    elif has_copy(ckpt):
        where = f"the copy in {ckpt}"
        tokenizer = load_tokenizer({"name": "hf", "path": str(ckpt)})
    else:
        tok_cfg = read_checkpoint_config(ckpt).get("tokenizer") or {"name": "gpt2"}
        where = f"tokenizer.path={tok_cfg.get('path')}" if tok_cfg.get("path") else f"tokenizer={tok_cfg.get('name')}"
        try:
            tokenizer = load_tokenizer(tok_cfg)
        except DataError as err:
            why = str(err).split(";")[0]
            raise DataError(f"checkpoint {ckpt} holds no copy of its tokenizer (saved before checkpoints kept one), "
                            f"and the {where} its run read cannot be read now ({why}); {fix}") from None
    changes = tokenizer_changes(recorded, tokenizer.identity) if recorded else []
    if changes:
        copy = "" if given is not None or has_copy(ckpt) else " (it holds no copy: saved before checkpoints kept one)"
        raise DataError(f"{where} is not the tokenizer checkpoint {ckpt} was trained with{copy}: "
                        f"{'; '.join(changes)}; {fix}")
    return tokenizer
