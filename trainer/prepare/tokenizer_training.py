"""A byte-level BPE fitted on the text of a dataset's train split only (`dtrain tokenizer train`).

GPT-2-style byte-level BPE (every byte string encodes; GPT-2's pre-tokenizer split), with
`<|endoftext|>` as its one special token, trained by the `tokenizers` library (the optional extra
dtrain[tokenizers]). The same text and settings give the same tokenizer.

The validation split `dtrain prepare` writes is the last data.val_fraction of the token stream
(each document after the end-of-text id and encoded whole, as with any tokenizer=hf; the stream cut
at data.max_tokens; trainer/prepare/pipeline.py), so the text it starts at depends on the tokenizer
being trained. The fit finds a cut that holds: train on the text before a cut, encode the stream
as prepare will with the result, and when its validation split starts before the cut, move the cut
there and train again. It stops once the split starts at or after the cut, so the tokenizer has
seen no text the validation split holds (and, with data.max_tokens, none past the stream's end).
The first cut is where the last val_fraction of the text's UTF-8 bytes begins (the whole text
under data.max_tokens, whose end in the text only a tokenizer can tell): one or two fits, as a rule.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from trainer.data.layout import val_token_count
from trainer.errors import DataError
from trainer.tokenizers.load import HF_EXTRA

EOT_TOKEN = "<|endoftext|>"

# A place in a dataset's text: (document index, character offset in it); (len(docs), 0) is the end.
Position = tuple[int, int]


@dataclass(frozen=True)
class Fit:
    """A tokenizer fitted on a train split, and what the split holds."""

    tokenizer: object  # a `tokenizers.Tokenizer`
    train_bytes: int  # UTF-8 bytes of the text it was trained on: the train split's
    val_bytes: int  # of the validation split's text (not trained on)
    text_tokens: int  # the stream's tokens less its end-of-text ids, for the bytes-per-token figure
    stream_bytes: int  # the UTF-8 bytes those tokens stand for
    fits: int  # how many trainings it took to find a cut that holds
    cut: Position  # the end of the text it was trained on (the validation split starts there or later)


def fit_train_split(docs: list[str], vocab_size: int, val_fraction: float, max_tokens: int | None,
                    what: str) -> Fit:
    """Fit a BPE of `vocab_size` tokens (or as many as the text allows) on the text of the train
    split that `dtrain prepare` will write of `docs` with it. `what` names the dataset in errors."""
    cut = _first_cut(docs, val_fraction) if max_tokens is None else (len(docs), 0)
    fits = 0
    while True:
        text = _text_before(docs, cut)
        if not any(text):
            raise DataError(f"the train split of {what} would hold no text to train a tokenizer on (all of its "
                            f"{_bytes(docs):,} bytes fall in the validation split, data.val_fraction={val_fraction}"
                            f"{'' if max_tokens is None else f', or past data.max_tokens={max_tokens}'}); "
                            "give it more text, or a smaller data.val_fraction")
        fitted = _train(text, vocab_size)
        fits += 1
        start, text_tokens, stream_bytes = _val_start(docs, fitted, val_fraction, max_tokens)
        if start >= cut:
            train_bytes = _bytes(text)
            return Fit(fitted, train_bytes, stream_bytes - _bytes(_text_before(docs, start)), text_tokens,
                       stream_bytes, fits, cut)
        cut = start


def _train(texts: list[str], vocab_size: int):
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415 - optional extra
    except ImportError:
        raise DataError(f"dtrain tokenizer train needs the `tokenizers` package; {HF_EXTRA}") from None
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's split, bytes as characters
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT_TOKEN], show_progress=sys.stderr.isatty(),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def _val_start(docs: list[str], fitted, val_fraction: float, max_tokens: int | None) -> tuple[Position, int, int]:
    """Where the validation split of the stream prepare writes with `fitted` starts in the text, and
    the stream's text tokens and their UTF-8 bytes (up to data.max_tokens)."""
    # encoded as trainer/tokenizers/load.py's HFTokenizer encodes a document: a special token's text is text
    reader = type(fitted).from_str(fitted.to_str())
    reader.encode_special_tokens = True
    encodings = reader.encode_batch(docs, add_special_tokens=False) if docs else []
    total = sum(1 + len(e.ids) for e in encodings)
    if max_tokens is not None:
        total = min(total, max_tokens)
    start = total - val_token_count(total, val_fraction)
    text_tokens, stream_bytes, at = 0, 0, 0
    place: Position | None = None
    for k, (doc, enc) in enumerate(zip(docs, encodings)):
        if place is None and start <= at:
            place = (k, 0)
        elif place is None and start < at + 1 + len(enc.ids):
            place = (k, enc.offsets[start - at - 1][0])
        kept = max(0, min(len(enc.ids), total - at - 1))  # the document's tokens inside the stream
        text_tokens += kept
        stream_bytes += len(doc[: enc.offsets[kept - 1][1]].encode()) if kept else 0
        at += 1 + len(enc.ids)
    return (place if place is not None else (len(docs), 0)), text_tokens, stream_bytes


def _first_cut(docs: list[str], val_fraction: float) -> Position:
    """Where the last val_fraction of the text's UTF-8 bytes begins."""
    remaining = (1 - val_fraction) * _bytes(docs)
    for k, doc in enumerate(docs):
        size = len(doc.encode())
        if size > remaining:
            return k, int(len(doc) * remaining / size)
        remaining -= size
    return len(docs), 0


def _text_before(docs: list[str], cut: Position) -> list[str]:
    k, offset = cut
    return docs[:k] + ([docs[k][:offset]] if offset > 0 else [])


def _bytes(texts: list[str]) -> int:
    return sum(len(t.encode()) for t in texts)
