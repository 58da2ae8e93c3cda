"""Tokenizing a stream of documents in a process pool, in pieces of about 0.5 MB of text.

Long documents are cut at line breaks whose neighbours are not whitespace when the tokenizer is
GPT-2's: its pre-tokenizer always splits there, so the pieces encode to exactly the tokens of the
whole document (another tokenizer's documents are encoded whole). Each document's tokens are
preceded by the tokenizer's end-of-text id (the separator prepare writes between documents).

This module is what the pool's worker processes load (see _pool_context), so it imports only
numpy and the tokenizer.
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing as mp
from collections.abc import Iterable, Iterator

import numpy as np

from trainer.data.layout import DTYPES
from trainer.tokenizers.load import load_tokenizer, shard_dtype

PIECE_CHARS = 1 << 19  # text per pool task (and the size long documents are cut to)
_SPEC: dict = {}  # the pool's tokenizer config (name, path): set in each worker by _init_worker


def _safe_cut(text: str, lo: int, hi: int) -> int:
    """A cut in [lo, hi] just after a newline with non-space on both sides, or -1."""
    while hi > lo:
        j = text.rfind("\n", lo, hi)
        if j < 1:
            return -1
        if j + 1 < len(text) and not text[j - 1].isspace() and not text[j + 1].isspace():
            return j + 1
        hi = j
    return -1


def split_document(text: str, max_chars: int = PIECE_CHARS) -> Iterator[str]:
    """Cut a long document into pieces of about ``max_chars`` whose encodings concatenate to the
    document's. A cut falls just after a newline with non-whitespace on both sides (GPT-2's
    pre-tokenizer always breaks there); a document without such a line break is cut hard."""
    start, n = 0, len(text)
    while n - start > max_chars:
        cut = _safe_cut(text, start + max_chars // 2, start + max_chars)
        if cut < 0:
            cut = _safe_cut(text, start + 1, start + max_chars // 2)
        if cut < 0:
            cut = start + max_chars
        yield text[start:cut]
        start = cut
    if start < n or n == 0:
        yield text[start:]


def piece_batches(docs: Iterable[str], task_chars: int = PIECE_CHARS,
                  cut_documents: bool = True) -> Iterator[list[tuple[bool, str]]]:
    """Batches of (starts_a_document, text) of about ``task_chars`` characters (a document longer
    than that is cut only when ``cut_documents``: GPT-2's pre-tokenizer makes the cut exact)."""
    batch, size = [], 0
    for doc in docs:
        for i, piece in enumerate(split_document(doc, task_chars) if cut_documents else [doc]):
            batch.append((i == 0, piece))
            size += len(piece)
            if size >= task_chars:
                yield batch
                batch, size = [], 0
    if batch:
        yield batch


def _encode_batch(batch: list[tuple[bool, str]]) -> tuple[np.ndarray, int]:
    tok = load_tokenizer(_SPEC)
    dtype = DTYPES[shard_dtype(tok.vocab_size)]
    eot = np.array([tok.eot], dtype=dtype)
    parts, chars = [], 0
    for starts_doc, piece in batch:
        if starts_doc:
            parts.append(eot)
        parts.append(tok.encode(piece).astype(dtype))  # plain text: special tokens' strings are text
        chars += len(piece)
    return (np.concatenate(parts) if parts else np.empty(0, dtype)), chars


def _init_worker(spec: dict) -> None:
    _SPEC.update(spec)
    load_tokenizer(spec)


def _pool_context():
    # Not fork: forking a process that already runs threads (torch's, tiktoken's, pytest's) can
    # leave a lock held in the child forever (seen: a tokenizer worker stuck on a futex).
    if "forkserver" in mp.get_all_start_methods():
        context = mp.get_context("forkserver")
        # The server imports this module once; each worker forks from it with the module (and
        # numpy, tiktoken) loaded instead of importing them again.
        context.set_forkserver_preload([__name__])
        return context
    return mp.get_context("spawn")


@contextlib.contextmanager
def encoding_pool(num_proc: int, spec: dict | None = None):
    """Yields ``run(batches) -> iterator of (tokens, chars)``, in order, on ``num_proc`` processes
    (``batches`` as piece_batches makes them), encoded by the tokenizer ``spec`` names (a
    `tokenizer` config as a dict: name, path; GPT-2's by default)."""
    spec = dict(spec or {"name": "gpt2", "path": None})
    _init_worker(spec)  # load (or fetch) once here, so errors surface before the pool starts
    if num_proc <= 1:
        yield lambda batches: (_encode_batch(b) for b in batches)
        return
    pool = _pool_context().Pool(num_proc, initializer=_init_worker, initargs=(spec,))

    def run(batches):
        pending = collections.deque()
        for b in batches:
            pending.append(pool.apply_async(_encode_batch, (b,)))
            if len(pending) >= 2 * num_proc:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()

    try:
        yield run
    finally:
        pool.terminate()
        pool.join()
