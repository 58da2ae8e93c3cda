import math

import torch
from omegaconf import OmegaConf

from trainer.model import GPT, GPTConfig
from trainer.optim import lr_at, param_groups


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
    from trainer.compose import compose

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
    decay, no_decay = param_groups(model, 0.1)
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
    out = model.generate(torch.zeros(1, 3, dtype=torch.long), 12, generator=torch.Generator().manual_seed(1))
    assert out.shape == (1, 15) and out.max() < 50
