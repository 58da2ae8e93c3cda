"""The mixture-of-experts block (trainer/model/moe.py): routing against a hand computation, the
grouped experts against a per-expert loop, and a whole MoE forward/backward against each token sent
through its k experts explicitly."""

import math

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from trainer.config.model_checks import check_block
from trainer.config.schema import ModelConfig, MoEConfig
from trainer.errors import ConfigError
from trainer.model.config import GPTConfig
from trainer.model.gpt import GPT
from trainer.model.moe import GroupedExperts, MoEFeedForward, load_balancing_loss

torch.set_num_threads(1)


def moe_config(**moe) -> GPTConfig:
    return GPTConfig(n_head=4, n_kv_head=2, bias=False, norm="rmsnorm", pos="rope", mlp="swiglu",
                     mlp_multiple_of=32, qk_norm=True, tie_embeddings=False, vocab_size=97,
                     moe=MoEConfig(**{"num_experts": 4, "top_k": 2, "expert_hidden": 16, **moe}))


def test_routing_matches_a_hand_computation():
    layer = MoEFeedForward(moe_config(num_experts=3))
    d = layer.router.weight.shape[1]
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0], layer.router.weight[1, 1], layer.router.weight[2, 0] = 1.0, 1.0, -1.0
    # token a: logits (1, 0, -1); token b: logits (0, 2, 0)
    flat = torch.zeros(2, d)
    flat[0, 0], flat[1, 1] = 1.0, 2.0
    probs, weights, chosen = layer.route(flat)
    ea = [math.exp(1), 1.0, math.exp(-1)]
    eb = [1.0, math.exp(2), 1.0]
    pa = [v / sum(ea) for v in ea]
    pb = [v / sum(eb) for v in eb]
    assert chosen[0].tolist() == [0, 1]
    assert chosen[1].tolist()[0] == 1 and chosen[1].tolist()[1] in (0, 2)  # a tie: either is top-k
    assert weights[0].tolist() == pytest.approx([pa[0] / (pa[0] + pa[1]), pa[1] / (pa[0] + pa[1])], rel=1e-6)
    assert weights[1].tolist() == pytest.approx([pb[1] / (pb[1] + pb[0]), pb[0] / (pb[1] + pb[0])], rel=1e-6)
    layer.norm_topk_prob = False
    assert layer.route(flat)[1][0].tolist() == pytest.approx(pa[:2], rel=1e-6)
    # aux loss: E x sum_e (slots choosing e per token, 2 tokens) x (mean probability of e)
    x = flat.view(1, 2, d)
    layer(x)
    counts = torch.bincount(chosen.reshape(-1), minlength=3).float()
    mean_p = [(pa[e] + pb[e]) / 2 for e in range(3)]
    expected = 3 * sum(counts[e].item() / 2 * mean_p[e] for e in range(3))
    assert layer.aux_loss.item() == pytest.approx(expected, rel=1e-6)
    assert layer.aux_loss.requires_grad
    assert layer.expert_load.dtype == torch.int64 and layer.expert_load.tolist() == counts.long().tolist()


def loop_reference(experts: GroupedExperts, tokens, counts):
    out, start = [], 0
    for e, n in enumerate(counts.tolist()):
        rows = tokens[start:start + n]
        gate, up = (rows @ experts.c_fc[e].T).split(experts.hidden, dim=-1)
        out.append((F.silu(gate) * up) @ experts.c_proj[e].T)
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 0, 0, 0], [0, 7, 0, 0]])
def test_grouped_experts_equal_a_per_expert_loop(grouped, counts):
    torch.manual_seed(0)
    experts = GroupedExperts(4, 32, 16)
    torch.nn.init.normal_(experts.c_fc, std=0.2)
    torch.nn.init.normal_(experts.c_proj, std=0.2)
    experts.use_grouped_mm = grouped
    counts = torch.tensor(counts)
    tokens = torch.randn(int(counts.sum()), 32, requires_grad=True)
    out = experts(tokens, counts)
    assert out.shape == tokens.shape
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (tokens, experts.c_fc, experts.c_proj), grad, allow_unused=True)
    ref = loop_reference(experts, tokens, counts) if counts.sum() else tokens * 0
    want = torch.autograd.grad(ref, (tokens, experts.c_fc, experts.c_proj), grad, allow_unused=True)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    for g, w in zip(got, want):
        if w is None or g is None:  # no rows: zero gradients either way
            assert not (g if g is not None else w).any()
        else:
            torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)


def test_moe_block_equals_each_token_through_its_experts():
    torch.manual_seed(1)
    layer = MoEFeedForward(moe_config(num_shared_experts=1))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(2, 5, 64, requires_grad=True)
    y = layer(x)
    flat = x.reshape(-1, 64)
    probs = (flat @ layer.router.weight.T).softmax(-1)
    w, idx = probs.topk(2, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    rows = []
    for t in range(flat.shape[0]):
        acc = 0
        for j in range(2):
            e = idx[t, j]
            gate, up = (layer.experts.c_fc[e] @ flat[t]).split(16)
            acc = acc + w[t, j] * (layer.experts.c_proj[e] @ (F.silu(gate) * up))
        gate, up = (layer.shared.c_fc.weight @ flat[t]).split(16)
        rows.append(acc + layer.shared.c_proj.weight @ (F.silu(gate) * up))
    ref = torch.stack(rows).view(2, 5, 64)
    torch.testing.assert_close(y, ref, atol=1e-6, rtol=1e-6)
    g = torch.randn_like(y)
    params = [x, *layer.parameters()]
    for a, b in zip(torch.autograd.grad(y, params, g), torch.autograd.grad(ref, params, g)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)  # fp32 sums in another order


def test_moe_every_and_the_aux_loss_in_training_only():
    torch.manual_seed(0)
    model = GPT(moe_config(every=2, aux_loss_coef=0.5))
    kinds = [type(block.mlp).__name__ for block in model.transformer.h]
    assert kinds == ["MLP", "MoEFeedForward"]
    idx = torch.randint(0, 97, (2, 8))
    model.train()
    _, train_loss = model(idx, idx)
    aux = model.transformer.h[1].mlp.aux_loss
    model.eval()
    _, eval_loss = model(idx, idx)
    torch.testing.assert_close(train_loss, eval_loss + 0.5 * aux)
    assert model.active_params() < model.num_params()


@pytest.mark.parametrize("override, words", [
    ({"top_k": 9}, "model.moe.top_k=9 must be between 1"),
    ({"top_k": 0}, "model.moe.top_k=0 must be between 1"),
    ({"every": 0}, "model.moe.every=0"),
    ({"num_shared_experts": -1}, "model.moe.num_shared_experts=-1 is negative"),
    ({"mlp": "gelu"}, "but model.mlp=gelu"),
])
def test_bad_moe_keys_are_one_config_error(override, words):
    m = OmegaConf.structured(ModelConfig(n_head=4, mlp="swiglu", vocab_size=97))
    m.moe.num_experts = 8
    for key, value in override.items():
        (m if key == "mlp" else m.moe)[key] = value
    with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
        check_block(m)


def test_the_aux_loss_is_hugging_faces_for_one_layer():
    """transformers' Qwen3-MoE load_balancing_loss_func on one layer's router logits is the layer's
    aux_loss (the model's is their mean over layers, as Hugging Face's pools the layers)."""
    qwen3_moe = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    torch.manual_seed(0)
    logits = torch.randn(40, 8)
    probs = logits.softmax(-1)
    chosen = probs.topk(2, dim=-1).indices
    want = qwen3_moe.load_balancing_loss_func((logits,), num_experts=8, top_k=2)
    torch.testing.assert_close(load_balancing_loss(probs, chosen, 8), want)
