"""The tokenizer a run's ids come from (the `tokenizer` config group), behind one interface.

    tokenizer=gpt2                    GPT-2's BPE through tiktoken (trainer/tokenizers/gpt2.py), offline
    tokenizer=hf tokenizer.path=DIR   a Hugging Face `tokenizer.json` in DIR (a model folder, or one
                                      `dtrain tokenizer train` wrote), through the `tokenizers` library

Each says what a prepared dataset and a checkpoint record of it (`identity`: name, vocabulary size,
end-of-text id and a fingerprint of its files), encodes text as plain text (special-token strings
in a document are its text, not control tokens), decodes, and gives each id's length in UTF-8
bytes (bits per byte's denominator). Torch-free: the run's checks compare tokenizers before torch
is imported.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

from trainer.config.vocab import tokenizer_folder
from trainer.errors import DataError
from trainer.io import sha256_bytes
from trainer.tokenizers import gpt2
from trainer.tokenizers.hf_files import bytes_to_unicode, hf_tokenizer_files

# Ids up to this many fit uint16 shards; a larger vocabulary is written as uint32.
UINT16_IDS = 1 << 16
# A Hugging Face tokenizer's document separator: its tokenizer_config.json's eos_token, else the
# first of these it has (GPT-2, SmolLM and Qwen base models; Llama 3; SentencePiece models).
EOT_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
TOKENIZER_FILE = "tokenizer.json"
# A Hugging Face tokenizer's files, as a model folder (and a checkpoint's copy) holds them: the
# tokenizer itself, then the two that name its special tokens when there are such.
TOKENIZER_FILES = (TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json")
HF_EXTRA = "pip install 'dtrain[tokenizers]'"


def shard_dtype(vocab_size: int) -> str:
    """The narrowest little-endian dtype that holds every id: "uint16" or "uint32"."""
    return "uint16" if vocab_size <= UINT16_IDS else "uint32"


class GPT2Tokenizer:
    """GPT-2's BPE (tiktoken): 50,257 ids, <|endoftext|> 50256; fingerprint: its ranks file's sha256."""

    name = "gpt2"
    vocab_size = gpt2.VOCAB_SIZE
    eot = gpt2.EOT
    fingerprint = gpt2.GPT2_FINGERPRINT
    # GPT-2's pre-tokenizer always splits at a newline between non-spaces, so prepare may cut a long
    # document there and encode the pieces apart (trainer/prepare/tokenize_pool.py)
    cuts_documents = True
    path = None
    # Nothing to copy into a checkpoint: the vocabulary is built in, and every load checks the ranks'
    # sha256, which the fingerprint is the start of (trainer/tokenizers/gpt2.py).
    files: dict[str, bytes] = {}

    def encode(self, text: str) -> np.ndarray:
        return gpt2.gpt2_encoding().encode_to_numpy(text, disallowed_special=())

    def decode(self, ids) -> str:
        return gpt2.decode(ids)

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt as transformers' tokenizer reads it: a special token's text is that token."""
        return gpt2.gpt2_encoding().encode(text, allowed_special="all")

    def byte_lengths(self) -> tuple[int, ...]:
        return gpt2.token_byte_lengths()

    def export_files(self, model_max_length: int) -> dict[str, str]:
        """The Hugging Face tokenizer files `dtrain export` writes (derived offline from the ranks)."""
        return hf_tokenizer_files(model_max_length)

    @property
    def identity(self) -> dict:
        return identity_of(self)


class HFTokenizer:
    """A Hugging Face tokenizer.json (byte-level BPE, SentencePiece-style BPE, ...)."""

    name = "hf"
    cuts_documents = False  # no pre-tokenizer guarantee: documents are encoded whole

    def __init__(self, folder: Path):
        self.path = str(folder)
        file = folder / TOKENIZER_FILE
        try:
            from tokenizers import Tokenizer  # noqa: PLC0415 - the optional `tokenizers` extra, only for tokenizer=hf
        except ImportError:
            raise DataError(f"tokenizer=hf needs the `tokenizers` package; {HF_EXTRA}") from None
        if not file.is_file():
            raise DataError(f"tokenizer.path={folder} holds no {TOKENIZER_FILE}; point it at a Hugging Face model "
                            "folder or one `dtrain tokenizer train` wrote")
        # The files as read once: what this tokenizer is, whatever becomes of the folder (a checkpoint
        # keeps this copy; an export writes it)
        self.files = {name: (folder / name).read_bytes() for name in TOKENIZER_FILES if (folder / name).is_file()}
        raw = self.files[TOKENIZER_FILE]
        try:
            self._tok = Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # noqa: BLE001 - the library's own exception types vary by version
            raise DataError(f"{file} is not a tokenizer the `tokenizers` library reads ({str(e)[:120]}); "
                            "use the tokenizer.json of a Hugging Face model folder") from None
        self._tok.encode_special_tokens = True  # a special token's text in a document is text
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eot = self._end_of_text(folder)
        self.fingerprint = sha256_bytes(raw)[:16]
        self._spec = json.loads(raw)

    def _config(self) -> dict:
        """tokenizer_config.json's settings ({} without one)."""
        raw = self.files.get("tokenizer_config.json")
        try:
            config = json.loads(raw) if raw is not None else {}
        except ValueError:
            raise DataError(f"{Path(self.path) / 'tokenizer_config.json'} is not JSON; fix or remove it") from None
        return config if isinstance(config, dict) else {}

    def _end_of_text(self, folder: Path) -> int:
        names = []
        if "tokenizer_config.json" in self.files:
            eos = self._config().get("eos_token")
            names.append(eos.get("content") if isinstance(eos, dict) else eos)
        for name in [*names, *EOT_CANDIDATES]:
            token_id = self._tok.token_to_id(name) if isinstance(name, str) else None
            if token_id is not None:
                return token_id
        raise DataError(f"the tokenizer in {folder} has no end-of-text token ({', '.join(EOT_CANDIDATES)} or "
                        "tokenizer_config.json's eos_token): dtrain separates documents with it; add one")

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt as transformers' tokenizer reads it: a special token's text is that token."""
        self._tok.encode_special_tokens = False
        try:
            return self._tok.encode(text, add_special_tokens=False).ids
        finally:
            self._tok.encode_special_tokens = True

    @functools.cached_property
    def _lengths(self) -> tuple[int, ...]:
        special = {i for i, token in self._tok.get_added_tokens_decoder().items() if token.special}
        byte_level = "ByteLevel" in json.dumps(self._spec.get("decoder"))
        to_byte = {ch: b for b, ch in bytes_to_unicode().items()}
        lengths = []
        for i in range(self.vocab_size):
            token = self._tok.id_to_token(i)
            if token is None or i in special:
                lengths.append(0)
            elif byte_level:  # each character stands for one byte (GPT-2's byte-to-unicode map)
                lengths.append(sum(1 for ch in token if ch in to_byte) or len(token.encode()))
            elif token.startswith("<0x") and token.endswith(">") and len(token) == 6:  # SentencePiece byte fallback
                lengths.append(1)
            else:
                lengths.append(len(token.replace("\u2581", " ").encode()))
        return tuple(lengths)

    def byte_lengths(self) -> tuple[int, ...]:
        return self._lengths

    def export_files(self, model_max_length: int) -> dict[str, str]:
        """This tokenizer's own files for an exported model folder: tokenizer.json as it is, its
        tokenizer_config.json (written if the folder has none) with the model's context length, its
        special_tokens_map.json when there is one, and generation_config.json ending at its end-of-text."""
        config = {"tokenizer_class": "PreTrainedTokenizerFast"}
        if "tokenizer_config.json" in self.files:
            config = self._config()
        eot_text = self._tok.id_to_token(self.eot)
        config.setdefault("eos_token", eot_text)
        config.setdefault("bos_token", eot_text)
        config["model_max_length"] = model_max_length
        files = {TOKENIZER_FILE: self.files[TOKENIZER_FILE].decode("utf-8"),
                 "tokenizer_config.json": json.dumps(config, indent=2) + "\n",
                 "generation_config.json": json.dumps({"_from_model_config": True, "bos_token_id": self.eot,
                                                       "eos_token_id": self.eot}, indent=2) + "\n"}
        if "special_tokens_map.json" in self.files:
            files["special_tokens_map.json"] = self.files["special_tokens_map.json"].decode("utf-8")
        return files

    @property
    def identity(self) -> dict:
        return identity_of(self)


def identity_of(tok) -> dict:
    """What a manifest and a checkpoint record of a tokenizer."""
    return {"tokenizer": tok.name, "vocab_size": tok.vocab_size, "eot": tok.eot,
            "tokenizer_fingerprint": tok.fingerprint}


def load_tokenizer(tok_cfg) -> GPT2Tokenizer | HFTokenizer:
    """The tokenizer a `tokenizer` config (name, path, checkpoint) names; DataError in one line when
    it cannot be read. tokenizer.checkpoint, when set, is read instead of tokenizer.path (config/vocab.py)."""
    name = tok_cfg["name"] if isinstance(tok_cfg, dict) else tok_cfg.name
    path = tokenizer_folder(tok_cfg.get("path"), tok_cfg.get("checkpoint"))
    folder = str(Path(path).expanduser().absolute()) if path else None
    return _load(name, folder, _files_state(folder))


def _files_state(folder: str | None) -> tuple:
    """Each tokenizer file's size and mtime: a folder whose tokenizer was replaced since
    (`dtrain tokenizer train --force`) is read again, not served from the cache."""
    state = []
    for name in TOKENIZER_FILES if folder else ():
        try:
            stat = (Path(folder) / name).stat()
            state.append((name, stat.st_size, stat.st_mtime_ns))
        except OSError:
            continue
    return tuple(state)


@functools.lru_cache(maxsize=4)
def _load(name: str, path: str | None, _state: tuple):
    if name == "gpt2":
        return GPT2Tokenizer()
    if name == "hf":
        if not path:
            raise DataError("tokenizer=hf needs tokenizer.path=DIR, a folder holding tokenizer.json")
        return HFTokenizer(Path(path))
    raise DataError(f"tokenizer={name!r} is unknown; choose gpt2 or hf (with tokenizer.path=DIR)")
