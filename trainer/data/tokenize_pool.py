"""Tokenizing a stream of documents in a process pool, in pieces of about 0.5 MB of text.

Long documents are cut at line breaks whose neighbours are not whitespace; GPT-2's pre-tokenizer
always splits there, so the pieces encode to exactly the tokens of the whole document. Each
document's tokens are preceded by EOT (the separator prepare writes between documents).

This module is what the pool's worker processes load (see _pool_context), so it imports only
numpy and the tokenizer.
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing as mp
from collections.abc import Iterable, Iterator

import numpy as np

from trainer.data.layout import DTYPE
from trainer.data.tokenizer import EOT, gpt2_encoding

PIECE_CHARS = 1 << 19  # text per pool task (and the size long documents are cut to)
_EOT_ARRAY = np.array([EOT], dtype=DTYPE)


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


def piece_batches(docs: Iterable[str], task_chars: int = PIECE_CHARS) -> Iterator[list[tuple[bool, str]]]:
    """Batches of (starts_a_document, text) of about ``task_chars`` characters."""
    batch, size = [], 0
    for doc in docs:
        for i, piece in enumerate(split_document(doc, task_chars)):
            batch.append((i == 0, piece))
            size += len(piece)
            if size >= task_chars:
                yield batch
                batch, size = [], 0
    if batch:
        yield batch


def _encode_batch(batch: list[tuple[bool, str]]) -> tuple[np.ndarray, int]:
    enc = gpt2_encoding()
    parts, chars = [], 0
    for starts_doc, piece in batch:
        if starts_doc:
            parts.append(_EOT_ARRAY)
        # encode_to_numpy with no special tokens allowed == encode_ordinary, without a Python list
        parts.append(enc.encode_to_numpy(piece, disallowed_special=()).astype(DTYPE))
        chars += len(piece)
    return (np.concatenate(parts) if parts else np.empty(0, DTYPE)), chars


def _init_worker() -> None:
    gpt2_encoding()


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
def encoding_pool(num_proc: int):
    """Yields ``run(batches) -> iterator of (tokens, chars)``, in order, on ``num_proc`` processes
    (``batches`` as piece_batches makes them)."""
    gpt2_encoding()  # load (or fetch) once here, so forked workers inherit it and errors surface early
    if num_proc <= 1:
        yield lambda batches: (_encode_batch(b) for b in batches)
        return
    pool = _pool_context().Pool(num_proc, initializer=_init_worker)

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
