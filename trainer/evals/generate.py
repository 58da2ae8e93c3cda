"""Text in, text out: a prompt continued by a GPT (training's periodic samples and `dtrain sample`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from trainer.model.decode import Sampling, generate
from trainer.tokenizers.load import GPT2Tokenizer


@torch.no_grad()
def generate_text(
    model,
    prompt: str,
    max_new_tokens: int,
    *,
    device: torch.device,
    seed: int,
    temperature: float = 1.0,
    top_k: int | None = 50,
    top_p: float | None = None,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    tokenizer=None,
) -> str:
    """The prompt and its continuation. The same seed gives the same text; an empty prompt starts
    from the end-of-text token; temperature 0 is greedy. `tokenizer`: the run's (trainer/tokenizers/load.py;
    GPT-2's by default). `model` is a GPT or a wrapped model's inference
    view (its forward is GPT's), decoded with the KV cache (trainer/model/decode.py); `autocast` is
    the strategy's, where the model trains in mixed precision. Ids in the padded part of the
    vocabulary (no token) are dropped from the text."""
    tok = tokenizer or GPT2Tokenizer()
    ids = [int(i) for i in tok.encode(prompt)] or [tok.eot]
    generator = torch.Generator(device=device).manual_seed(seed)
    with autocast():
        [new] = generate(model, [ids], max_new_tokens, Sampling(temperature, top_k, top_p), generator)
    return tok.decode([t for t in ids + new if t < tok.vocab_size])
