"""The KV cache (trainer/model/kv_cache.py, decode.py): greedy decoding with it is token for token
decoding without it (the whole prefix recomputed per token), for GPT-2's blocks and the Llama-shaped
ones (rotary positions, grouped KV heads), batched with left- or right-padded prompts of different
lengths, and past the block size; training's forward is the cache's first forward; sampling
controls (temperature, top-k, top-p, per-row seeds)."""

from __future__ import annotations

import pytest
import torch

from trainer.config.compose import compose
from trainer.model.decode import Sampling, generate, next_tokens
from trainer.model.gpt import build_model
from trainer.model.kv_cache import KVCache

PROMPT_LENGTHS = (1, 3, 7, 20, 45)


@pytest.fixture(scope="module", params=["tiny", "llama_tiny"])
def model(request):
    torch.manual_seed(0)
    m = build_model(compose([f"model={request.param}"]).model).eval()
    # Random weights give nearly flat logits; sharper ones make argmax ties (where float noise
    # could pick either) unlikely, as in a trained model.
    with torch.no_grad():
        m.lm_head.weight.mul_(8)
    return m


def prompts(n: int, vocab: int = 50257, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for length in PROMPT_LENGTHS[:n]]


@torch.no_grad()
def greedy_without_cache(model, prompt: list[int], new_tokens: int) -> list[int]:
    """The reference: every token from a full forward over the last block_size tokens."""
    seq = list(prompt)
    for _ in range(new_tokens):
        logits, _ = model(torch.tensor([seq[-model.config.block_size:]]))
        seq.append(int(logits[0, -1].argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("pad_side", ["left", "right"])
@pytest.mark.parametrize("new_tokens", [1, 9, 40])
def test_greedy_with_cache_is_greedy_without(model, pad_side, new_tokens):
    batch = prompts(len(PROMPT_LENGTHS))
    cached = generate(model, batch, new_tokens, pad_side=pad_side)
    for prompt, out in zip(batch, cached):
        assert out == greedy_without_cache(model, prompt, new_tokens)
    # Alone, each prompt decodes the same as in the padded batch.
    assert [generate(model, [p], new_tokens)[0] for p in batch[:3]] == cached[:3]


def test_past_the_block_size_the_window_slides(model):
    block = model.config.block_size
    batch = [prompts(1, seed=s)[0] * (block - 10) for s in (2, 3)]  # one row at block - 10, one cropped
    batch[1] = batch[1] + batch[1][:15]
    out = generate(model, batch, 25)
    assert out == [greedy_without_cache(model, p, 25) for p in batch]


@torch.no_grad()
def test_training_forward_is_the_cache_prefill_and_decode_matches_it(model):
    idx = torch.tensor(prompts(5)[-1:])  # one row of 45 tokens
    full, _ = model(idx)
    # No padding: the first cached forward runs training's kernels on the same inputs, bit for bit.
    whole, _ = model(idx, cache=KVCache(model.config.n_layer, 1, 60, torch.device("cpu")).step(None, 45))
    assert torch.equal(whole, full)
    cache = KVCache(model.config.n_layer, 1, 60, torch.device("cpu"))
    prefill, _ = model(idx[:, :30], cache=cache.step(None, 30))
    torch.testing.assert_close(prefill, full[:, :30], rtol=1e-4, atol=1e-4)
    for t in range(30, 45):
        step, _ = model(idx[:, t: t + 1], cache=cache.step(None, 1))
        torch.testing.assert_close(step[0, 0], full[0, t], rtol=1e-4, atol=1e-4)
    chunk_cache = KVCache(model.config.n_layer, 1, 60, torch.device("cpu"))
    model(idx[:, :20], cache=chunk_cache.step(None, 20))
    chunk, _ = model(idx[:, 20:45], cache=chunk_cache.step(None, 25))  # several new slots after a prefix
    torch.testing.assert_close(chunk, full[:, 20:45], rtol=1e-4, atol=1e-4)


def test_cache_is_sized_to_the_request_and_refuses_overflow():
    cache = KVCache(2, 3, 10, torch.device("cpu"))
    cache.step(None, 8)
    with pytest.raises(ValueError, match="holds 10 positions"):
        cache.step(None, 3)


def test_sampling_controls(model):
    batch = prompts(3)
    greedy = generate(model, batch, 12)
    assert generate(model, batch, 12, Sampling(temperature=1.0, top_k=1), torch.Generator().manual_seed(0)) == greedy
    assert generate(model, batch, 12, Sampling(temperature=0.7, top_p=1e-9), torch.Generator().manual_seed(0)) == greedy
    hot = Sampling(temperature=1.5, top_k=200, top_p=0.95)
    one = generate(model, batch, 12, hot, torch.Generator().manual_seed(5))
    assert one == generate(model, batch, 12, hot, torch.Generator().manual_seed(5))  # the seed decides
    assert one != generate(model, batch, 12, hot, torch.Generator().manual_seed(6))
    assert one != greedy
    # One generator per row: a row's tokens depend on its seed, not on the rest of its batch.
    per_row = generate(model, batch, 12, hot, [torch.Generator().manual_seed(s) for s in (7, 8, 9)])
    assert per_row[1] == generate(model, batch[1:2], 12, hot, [torch.Generator().manual_seed(8)])[0]


def test_top_k_and_top_p_keep_the_likeliest():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).log_softmax(-1)
    draws = {int(next_tokens(logits.clone(), Sampling(1.0, top_k=2), torch.Generator().manual_seed(s)))
             for s in range(200)}
    assert draws == {0, 1}
    # probabilities ~0.64, 0.24, 0.09, ...: 0.8 needs the first two
    draws = {int(next_tokens(logits.clone(), Sampling(1.0, top_p=0.8), torch.Generator().manual_seed(s)))
             for s in range(200)}
    assert draws == {0, 1}


def test_stop_and_end_of_text(model):
    [prompt] = prompts(1)
    full = generate(model, [prompt], 10)[0]
    assert generate(model, [prompt], 10, stop=lambda new: len(new) >= 4)[0] == full[:4]
    assert generate(model, [prompt], 10, eot=full[2])[0] == full[: full.index(full[2])]
