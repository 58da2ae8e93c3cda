"""Text in, text out: a prompt continued by a GPT (training's periodic samples and `dtrain sample`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from trainer.data.tokenizer import gpt2_encoding


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
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> str:
    """The prompt and its continuation. The same seed gives the same text; an empty prompt starts
    from <|endoftext|>. `model` is anything with GPT.generate (a wrapped model's inference view);
    `autocast` is the strategy's, where the model trains in mixed precision. Ids in the padded part
    of the vocabulary (no token) are dropped from the text."""
    enc = gpt2_encoding()
    ids = enc.encode_ordinary(prompt) or [enc.eot_token]
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with autocast():
        out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=generator)
    return enc.decode([t for t in out[0].tolist() if t < enc.n_vocab])
