import math

import torch
from omegaconf import OmegaConf

from trainer.config.compose import compose
from trainer.config.schema import ModelConfig
from trainer.config.shape import parameter_count
from trainer.model.config import GPTConfig
from trainer.model.decode import Sampling, generate
from trainer.model.gpt import GPT
from trainer.model.kv_cache import KVCache
from trainer.model.layers import apply_rotary, rotary_tables
from trainer.optim.build import param_groups
from trainer.optim.schedule import lr_at


def test_gpt2_124m_parameter_count_and_hf_names():
    model = GPT(GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50257))
    assert model.num_params() == 124_439_808
    names = dict(model.named_parameters())
    for name in ["transformer.wte.weight", "transformer.wpe.weight", "transformer.h.0.ln_1.weight",
                 "transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_proj.bias",
                 "transformer.h.11.mlp.c_fc.weight", "transformer.h.11.mlp.c_proj.weight",
                 "transformer.ln_f.bias"]:
        assert name in names
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    assert "lm_head.weight" in model.state_dict()


def test_gpt2_shapes_of_the_model_group():
    from trainer.config.compose import compose

    expected = {"gpt2_124m": 124_439_808, "gpt2_350m": 354_823_168, "gpt2_774m": 774_030_080,
                "gpt2_1558m": 1_557_611_200}
    for name, count in expected.items():
        m = compose([f"model={name}"]).model
        # parameter count from the shapes alone (building 1.5B params would take minutes)
        d, L, V, P = m.n_embd, m.n_layer, m.vocab_size, m.block_size
        per_block = 12 * d * d + 13 * d
        assert V * d + P * d + L * per_block + 2 * d == count, name


def test_init_std_and_residual_scaling():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=8, n_head=4, n_embd=256, block_size=64, vocab_size=1000))
    assert abs(model.transformer.h[0].attn.c_attn.weight.std().item() - 0.02) < 2e-3
    expected = 0.02 / math.sqrt(2 * 8)
    assert abs(model.transformer.h[0].mlp.c_proj.weight.std().item() - expected) < 1e-3
    assert abs(model.transformer.h[0].attn.c_proj.weight.std().item() - expected) < 1e-3
    assert model.transformer.h[0].attn.c_attn.bias.abs().sum() == 0


def test_vocab_padding_and_causality():
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=50257, pad_vocab_multiple=64))
    assert model.transformer.wte.weight.shape[0] == 50304
    idx = torch.randint(0, 50257, (2, 16))
    logits, _ = model(idx)
    assert logits.shape == (2, 16, 50257)  # padded rows never reach the caller
    changed = idx.clone()
    changed[:, 10:] = 7
    logits2, _ = model(changed)
    assert torch.allclose(logits[:, :10], logits2[:, :10], atol=1e-6)  # the future does not leak
    _, loss = model(idx, idx)
    assert loss.ndim == 0 and math.isfinite(loss.item())


def test_weight_decay_groups_and_schedule():
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=100))
    decay, no_decay = param_groups(model.parameters(), 0.1)
    assert all(p.dim() == 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert sum(p.numel() for g in (decay, no_decay) for p in g["params"]) == model.num_params()
    cfg = OmegaConf.create({"lr": 6e-4, "min_lr": 6e-5, "warmup_steps": 10})
    assert abs(lr_at(0, cfg, 100) - 6e-5) < 1e-12
    assert lr_at(9, cfg, 100) == 6e-4
    assert abs(lr_at(55, cfg, 100) - (6e-5 + 0.5 * (6e-4 - 6e-5))) < 1e-12
    assert lr_at(100, cfg, 100) == 6e-5
    lrs = [lr_at(s, cfg, 100) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_generate_extends_the_context():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=16, block_size=8, vocab_size=50))
    [out] = generate(model, [[0, 0, 0]], 12, Sampling(temperature=1.0, top_k=50), torch.Generator().manual_seed(1))
    assert len(out) == 12 and max(out) < 50  # past the block size of 8: a sliding window


LLAMA = dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, block_size=32, vocab_size=100, bias=False,
             norm="rmsnorm", pos="rope", mlp="swiglu", mlp_multiple_of=32, tie_embeddings=False)


def test_llama_block_shapes_parameters_and_flops():
    model = GPT(GPTConfig(**LLAMA))
    c = model.config
    assert c.hidden == 192  # Llama's rule: 8/3 x 64 = 170, rounded up to a multiple of 32
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes["transformer.h.0.attn.c_attn.weight"] == (64 + 2 * 2 * 16, 64)  # q, then 2 kv heads of k and v
    assert shapes["transformer.h.0.mlp.c_fc.weight"] == (2 * 192, 64)  # [gate | up]
    assert shapes["transformer.h.0.mlp.c_proj.weight"] == (64, 192)
    assert "transformer.wpe.weight" not in shapes and not any(n.endswith(".bias") for n in shapes)
    assert model.lm_head.weight is not model.transformer.wte.weight  # untied
    per_block = 64 * 128 + 64 * 64 + 3 * 64 * 192 + 2 * 64  # attention, MLP, two RMSNorm weights
    assert model.num_params() == 2 * 100 * 64 + 2 * per_block + 64
    # FLOPs: the token embedding is a lookup, the head a matmul, attention 12 x layers x width x T
    assert model.flops_per_token(32) == 6 * (100 * 64 + 2 * per_block + 64) + 12 * 2 * 64 * 32
    gpt2 = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=100))
    assert gpt2.flops_per_token(16) == 6 * (gpt2.num_params() - 16 * 32) + 12 * 2 * 32 * 16


def test_parameter_roles_cover_both_families():
    for config in (GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=100),
                   GPTConfig(**{**LLAMA, "qk_norm": True})):
        model = GPT(config)
        roles = {n: GPT.param_role(n, p) for n, p in model.named_parameters()}
        hidden = {n for n, r in roles.items() if r == "hidden"}
        assert hidden == {n for n, p in model.named_parameters() if n.startswith("transformer.h.") and p.dim() == 2}
        assert roles["transformer.wte.weight"] == "embedding"
        assert all(roles[n] == "norm" for n in roles if "norm" in n or ".ln_" in n and n.endswith("weight"))
        assert all(r == "bias" for n, r in roles.items() if n.endswith(".bias"))
    assert roles["lm_head.weight"] == "head" and roles["transformer.h.0.attn.q_norm.weight"] == "norm"


def test_grouped_kv_heads_equal_repeated_full_heads():
    """GQA with 2 kv heads is full attention whose k and v heads are each used twice."""
    torch.manual_seed(0)
    gqa = GPT(GPTConfig(**LLAMA)).eval()
    full = GPT(GPTConfig(**{**LLAMA, "n_kv_head": 4})).eval()
    state = dict(gqa.state_dict())
    for i in range(2):
        w = state[f"transformer.h.{i}.attn.c_attn.weight"]
        q, k, v = w.split([64, 32, 32])
        heads = lambda t: t.view(2, 16, 64).repeat_interleave(2, dim=0).reshape(64, 64)
        state[f"transformer.h.{i}.attn.c_attn.weight"] = torch.cat([q, heads(k), heads(v)])
    full.load_state_dict(state)
    idx = torch.randint(0, 100, (2, 32))
    assert torch.allclose(gqa(idx)[0], full(idx)[0], atol=1e-5)


def test_rope_scores_depend_on_relative_position_and_the_future_does_not_leak():
    torch.manual_seed(0)
    for extra in ({}, {"qk_norm": True}, {"mlp": "relu2", "norm": "layernorm", "bias": True}):
        model = GPT(GPTConfig(**{**LLAMA, **extra})).eval()
        idx = torch.randint(0, 100, (1, 32))
        changed = idx.clone()
        changed[:, 20:] = 7
        assert torch.allclose(model(idx)[0][:, :20], model(changed)[0][:, :20], atol=1e-6)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    def score(i, j):
        cq, sq = rotary_tables(torch.tensor([i]), 16, 10000.0)
        ck, sk = rotary_tables(torch.tensor([j]), 16, 10000.0)
        return (apply_rotary(q, cq, sq) * apply_rotary(k, ck, sk)).sum()
    assert torch.allclose(score(5, 2), score(13, 10), atol=1e-5)  # only i - j matters
    assert not torch.allclose(score(5, 2), score(5, 3), atol=1e-3)


def test_head_dim_apart_from_the_width_builds_trains_and_decodes():
    """model.head_dim=32 on a 64-wide stream of 4 heads (Qwen3's shape: q is 128 wide): the
    projections' shapes, the count without a model, Muon's q/k/v parts and the FLOPs follow it; a few
    AdamW steps lower the loss; the KV cache decodes what the full forward computes."""
    cfg = {**LLAMA, "head_dim": 32, "qk_norm": True}
    torch.manual_seed(0)
    model = GPT(GPTConfig(**cfg))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes["transformer.h.0.attn.c_attn.weight"] == (4 * 32 + 2 * 2 * 32, 64)  # q, then k and v of 2 heads
    assert shapes["transformer.h.0.attn.c_proj.weight"] == (64, 4 * 32)
    assert shapes["transformer.h.0.attn.q_norm.weight"] == (32,)
    assert parameter_count(OmegaConf.merge(OmegaConf.structured(ModelConfig), cfg)) == model.num_params()
    assert model.matrix_parts("transformer.h.0.attn.c_attn.weight", 256) == (128, 64, 64)
    assert model.flops_per_token(32) == 6 * (model.num_params() - 100 * 64) + 12 * 2 * 128 * 32
    idx = torch.randint(0, 100, (4, 32), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        _, loss = model(idx, idx.roll(-1, dims=1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses
    model.eval()
    with torch.no_grad():
        full, _ = model(idx[:1])
        cache = KVCache(2, 1, 32, torch.device("cpu"))
        prefill, _ = model(idx[:1, :20], cache=cache.step(None, 20))
        step, _ = model(idx[:1, 20:21], cache=cache.step(None, 1))
    torch.testing.assert_close(prefill, full[:, :20], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(step[0, 0], full[0, 20], rtol=1e-4, atol=1e-4)


def test_qwen3_presets_have_the_published_counts():
    """Hand counts of the published shapes: Qwen3-30B-A3B (30.5B, 3.3B active: 48 layers of 4096-wide
    q, two 512-wide k/v, o, QK-norm, two norms, a router and 128 experts of 3 x 768 x 2048, plus the
    untied 151936 x 2048 embedding and head) and Qwen3-0.6B (0.6B, tied)."""
    attn = 2048 * (4096 + 2 * 512) + 4096 * 2048 + 2 * 128 + 2 * 2048
    layer, active = attn + 128 * 2048 + 128 * 3 * 768 * 2048, attn + 128 * 2048 + 8 * 3 * 768 * 2048
    outer = 2 * 151936 * 2048 + 2048
    moe = compose(["model=qwen3_30b_a3b"]).model
    assert parameter_count(moe) == 48 * layer + outer == 30_532_122_624
    with torch.device("meta"):
        assert GPT(GPTConfig.from_cfg(moe)).active_params() == 48 * active + outer == 3_353_032_704
    dense = 1024 * (2048 + 2 * 1024) + 2048 * 1024 + 3 * 1024 * 3072 + 2 * 128 + 2 * 1024
    assert parameter_count(compose(["model=qwen3_0_6b"]).model) == 28 * dense + 151936 * 1024 + 1024 == 596_049_920
