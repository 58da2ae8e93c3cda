"""`dtrain prepare`'s tokenizer against tiktoken's own batch encoder (`scripts/bench.py --tokenize`)."""

from __future__ import annotations

import os
import time

from trainer.prepare.tokenize_pool import encoding_pool, piece_batches
from trainer.tokenizers.gpt2 import gpt2_encoding


def benchmark_tokenize(texts: list[str], num_proc: int | None = None) -> dict:
    """Tokens/s of prepare's process pool (its own task split and encoder, as `prepare` runs them)
    against tiktoken's ``encode_ordinary_batch`` on the same cores."""
    n = max(1, num_proc or os.cpu_count() or 1)
    enc = gpt2_encoding()
    t0 = time.perf_counter()
    ref = enc.encode_ordinary_batch(texts, num_threads=n)
    t_ref = time.perf_counter() - t0
    ref_tokens = sum(map(len, ref)) + len(texts)  # + one EOT per document, as prepare writes
    t0 = time.perf_counter()
    with encoding_pool(n) as run:
        ours = sum(len(toks) for toks, _ in run(piece_batches(texts)))
    t_ours = time.perf_counter() - t0
    return {
        "num_proc": n,
        "chars": sum(map(len, texts)),
        "tokens": ours,
        "tokens_match": ours == ref_tokens,
        "tiktoken_batch_s": t_ref,
        "pool_s": t_ours,
        "tiktoken_tokens_per_s": ref_tokens / t_ref,
        "pool_tokens_per_s": ours / t_ours,
        "ratio": (ours / t_ours) / (ref_tokens / t_ref),
    }
