"""Decoding with the KV cache: a batch of prompts (padded left or right) read in one forward, then
one position per new token; greedy by default, or sampled with temperature, top-k and top-p.

The cache is sized to the request (longest prompt + new tokens, at most the block size). Past
the block size a row goes on as before the cache existed: each new token's forward reads the last
block_size tokens (a sliding window, recomputed), so long samples stay what they were.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trainer.model.kv_cache import KVCache

Generators = torch.Generator | list[torch.Generator] | None


@dataclass(frozen=True)
class Sampling:
    """temperature 0: greedy (argmax); otherwise softmax(logits / temperature) over the top_k
    likeliest tokens (None: all) and, of those, the smallest set whose probability reaches top_p."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def next_tokens(logits: torch.Tensor, sampling: Sampling, generator: Generators = None) -> torch.Tensor:
    """(B,) token ids from (B, vocab) logits. `generator`: one for the batch, or one per row (a row's
    draws then depend on its own seed only, not on what else shares its batch)."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    logits = logits.float() / sampling.temperature
    if sampling.top_k is not None:
        kth = torch.topk(logits, min(sampling.top_k, logits.size(-1))).values[:, [-1]]
        logits[logits < kth] = -float("inf")
    if sampling.top_p is not None and sampling.top_p < 1.0:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = F.softmax(ordered, dim=-1)
        # A token goes when the likelier ones already reach top_p (the likeliest always stays).
        drop = probs.cumsum(dim=-1) - probs >= sampling.top_p
        logits = logits.scatter(-1, order, ordered.masked_fill(drop, -float("inf")))
    probs = F.softmax(logits, dim=-1)
    if isinstance(generator, list):
        return torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generator)])
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)


@torch.no_grad()
def generate(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    generator: Generators = None,
    *,
    eot: int | None = None,
    stop: Callable[[list[int]], bool] | None = None,
    pad_side: str = "left",
) -> list[list[int]]:
    """The new tokens after each prompt (each a non-empty list of ids). A row ends at `eot` (not
    included) or once stop(its new tokens) is true; the batch ends when every row has (without
    eot and stop every row gets max_new_tokens, so ranks of a sharded model stay in lockstep).
    `model` is a GPT or a wrapper whose forward is GPT's (FSDP's hooks run on every call)."""
    if not prompts or not all(prompts):
        raise ValueError("every prompt needs at least one token")
    if pad_side not in ("left", "right"):
        raise ValueError(f"pad_side is left or right, not {pad_side!r}")
    block = model.config.block_size
    device = next(model.parameters()).device
    seqs = [list(p[-block:]) for p in prompts]  # the whole text so far, for the sliding window
    lengths = [len(p) for p in seqs]
    width = max(lengths)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    valid = torch.zeros(len(seqs), width, dtype=torch.bool)
    for r, p in enumerate(seqs):
        cols = slice(width - len(p), width) if pad_side == "left" else slice(0, len(p))
        ids[r, cols], valid[r, cols] = torch.tensor(p, dtype=torch.long), True
    last = torch.full((len(seqs),), width - 1) if pad_side == "left" else torch.tensor(lengths) - 1
    cache = KVCache(model.config.n_layer, len(seqs), min(width + max_new_tokens - 1, block), device)
    step = cache.step(None if bool(valid.all()) else valid.to(device), width)
    logits, _ = model(ids.to(device), logits_at=last.to(device), cache=step)
    new: list[list[int]] = [[] for _ in seqs]
    done = [False] * len(seqs)
    for i in range(max_new_tokens):
        chosen = next_tokens(logits[:, 0], sampling, generator)
        for r, token in enumerate(chosen.tolist()):
            seqs[r].append(token)
            if done[r]:
                continue
            if token == eot:
                done[r] = True
                continue
            new[r].append(token)
            done[r] = stop is not None and stop(new[r])
        if all(done) or i == max_new_tokens - 1:
            break
        if cache.room:
            logits, _ = model(chosen.unsqueeze(1), cache=cache.step(None, 1))
        else:
            logits = _window_logits(model, seqs, block, device)
    return new


def _window_logits(model, seqs: list[list[int]], block: int, device: torch.device) -> torch.Tensor:
    """Each row's next-token logits from its last `block` tokens, recomputed without a cache
    (right-padded: causal attention keeps the padding after a row's last token out of it)."""
    windows = [s[-block:] for s in seqs]
    ids = torch.zeros(len(windows), max(len(w) for w in windows), dtype=torch.long)
    for r, w in enumerate(windows):
        ids[r, : len(w)] = torch.tensor(w, dtype=torch.long)
    last = torch.tensor([len(w) - 1 for w in windows])
    logits, _ = model(ids.to(device), logits_at=last.to(device))
    return logits
