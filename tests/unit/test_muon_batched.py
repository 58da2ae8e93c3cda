"""Muon's batched step (trainer/optim/muon.py): the same numbers as Newton-Schulz applied to each part on
its own, the split of fused weights into the matrices they hold (GPT-2's q, k, v; Llama's grouped
KV heads and SwiGLU's gate and up), the per-shape lr rule against torch's, the step masked by a
device-side verdict, checkpoints of the stock optimizer loading, and the number of ops one step
launches for gpt2_124m's 48 hidden matrices.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers.checkpoints import one_process_optimizer
from torch.profiler import ProfilerActivity, profile

from trainer.config.compose import compose
from trainer.model.gpt import build_model
from trainer.optim.build import muon_parts, parts, split_params
from trainer.optim.muon import NS_COEFFICIENTS, BatchedMuon, lr_ratio

# gpt2_124m's blocks (12 layers, so its 48 hidden matrices) at a width a test can afford: the stacks
# and the number of ops depend on the count and the equalities of the shapes, not their size.
GPT2_SHAPED = ["model=gpt2_124m", "model.n_embd=64", "model.n_head=4", "model.vocab_size=512"]
LLAMA_SHAPED = ["model=llama_135m", "model.n_layer=3", "model.n_embd=96", "model.n_head=6", "model.n_kv_head=2",
                "model.vocab_size=512"]


def reference_step(named, parts_of, momenta, group):
    """Muon one matrix at a time, as the first Float32Muon did (with each part of a fused
    weight a matrix of its own): 2-D matmuls, float32."""
    a, b, c = NS_COEFFICIENTS
    lr, beta = group["lr"], group["momentum"]
    for name, param in named:
        buffer = momenta.setdefault(name, torch.zeros_like(param))
        buffer.lerp_(param.grad, 1 - beta)
        update = param.grad.lerp(buffer, beta) if group["nesterov"] else buffer
        param.mul_(1 - lr * group["weight_decay"])
        start = 0
        for rows in parts_of[param]:
            x = update[start: start + rows]
            wide = x.shape[0] <= x.shape[1]
            x = x if wide else x.T
            x = x / x.norm().clamp(min=1e-7)
            for _ in range(group["ns_steps"]):
                gram = x @ x.T
                x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
            x = x if wide else x.T
            param[start: start + rows].add_(x, alpha=-lr * lr_ratio(group["adjust_lr_fn"], rows, x.shape[1]))
            start += rows


def model_and_muon(overrides, *extra):
    cfg = compose([*overrides, "optim=muon", *extra])
    torch.manual_seed(0)
    net = build_model(cfg.model)
    optimizer = one_process_optimizer(net, cfg)
    return cfg, net, optimizer


def backward(net, seed: int):
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(seed))
    net(tokens, tokens)[1].backward()


@pytest.mark.parametrize("shape", [GPT2_SHAPED, LLAMA_SHAPED], ids=["gpt2", "llama_gqa_swiglu"])
@pytest.mark.parametrize("extra", [["optim.muon.weight_decay=0.1"],
                                   ["optim.muon.nesterov=false", "optim.muon.adjust_lr=match_rms_adamw"]],
                         ids=["nesterov_decay", "plain_match_rms"])
def test_the_batched_step_is_newton_schulz_on_each_part(shape, extra):
    shape = [*shape, "model.n_layer=3"]
    cfg, net, optimizer = model_and_muon(shape, *extra)
    muon = parts(optimizer)[0]
    assert type(muon) is BatchedMuon and muon.ns_dtype == torch.float32
    reference = copy.deepcopy(net)
    named = split_params(reference, cfg.optim)[0]
    parts_of, momenta = muon_parts(reference, named), {}
    for step in range(3):
        backward(net, step)
        backward(reference, step)
        muon.step()
        with torch.no_grad():
            reference_step(named, parts_of, momenta, muon.param_groups[0])
        net.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
    ours = dict(split_params(net, cfg.optim)[0])
    for name, param in named:
        assert (ours[name] - param).abs().max() < 1e-6, name
        assert (muon.state[ours[name]]["momentum_buffer"] - momenta[name]).abs().max() < 1e-6, name


def test_fused_weights_split_into_the_matrices_they_hold():
    gpt2 = build_model(compose([*GPT2_SHAPED, "model.n_layer=1"]).model)
    assert gpt2.matrix_parts("transformer.h.0.attn.c_attn.weight", 192) == (64, 64, 64)
    for name, rows in (("attn.c_proj", 64), ("mlp.c_fc", 256), ("mlp.c_proj", 64)):
        assert gpt2.matrix_parts(f"transformer.h.0.{name}.weight", rows) == (rows,)
    llama = build_model(compose(LLAMA_SHAPED).model)
    hidden = llama.config.hidden
    assert llama.matrix_parts("transformer.h.2.attn.c_attn.weight", 96 + 2 * 32) == (96, 32, 32)  # 2 KV heads of 16
    assert llama.matrix_parts("transformer.h.2.mlp.c_fc.weight", 2 * hidden) == (hidden, hidden)
    assert llama.matrix_parts("transformer.h.2.mlp.c_proj.weight", 96) == (96,)
    # The stacks: q with the output projections, k and v together, gate and up with the down
    # projection (transposed: wide is cheaper), one Newton-Schulz batch per shape.
    _, _, optimizer = model_and_muon(LLAMA_SHAPED)
    muon = parts(optimizer)[0]
    for param in muon.param_groups[0]["params"]:
        param.grad = torch.zeros_like(param)
    muon.step()
    families, batches = muon._layouts[0]
    assert sorted(len(batch.entries) for batch in batches.values()) == [1, 2, 2]
    assert sorted(batches) == [(32, 96), (96, 96), (96, hidden)]
    assert sum(len(f.params) for f in families) == 4 * 3


def test_the_lr_rule_is_torchs():
    adjust = pytest.importorskip("torch.optim._muon")._adjust_lr  # private: checked here only
    for rule in ("original", "match_rms_adamw"):
        for shape in ((768, 768), (3072, 768), (768, 3072), (32, 96)):
            assert math.isclose(lr_ratio(rule, *shape), adjust(1.0, rule, torch.Size(shape)), rel_tol=1e-12)
    with pytest.raises(ValueError, match="unknown Muon lr rule"):
        lr_ratio("spectral", 2, 2)


def test_found_inf_skips_the_step_without_a_sync():
    """found_inf=1 leaves weights and momenta bitwise as they were, NaN gradients and all; found_inf=0
    is the plain step."""
    _, net, optimizer = model_and_muon(GPT2_SHAPED, "model.n_layer=2", "optim.muon.weight_decay=0.1")
    muon = parts(optimizer)[0]
    backward(net, 0)
    muon.step()
    params = muon.param_groups[0]["params"]
    before = [p.detach().clone() for p in params]
    momenta = [muon.state[p]["momentum_buffer"].clone() for p in params]
    for p in params:
        p.grad = torch.full_like(p, math.nan)
    muon.step(found_inf=torch.ones(()))
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert all(torch.equal(muon.state[p]["momentum_buffer"], m) for p, m in zip(params, momenta))
    twin = copy.deepcopy(muon.state_dict())
    grads = [torch.randn_like(p) for p in params]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    muon.step(found_inf=torch.zeros(()))
    masked = [p.detach().clone() for p in params]
    for p, b, g in zip(params, before, grads):
        p.detach().copy_(b)
        p.grad = g.clone()
    muon.load_state_dict(twin)
    muon.step()
    assert all(torch.equal(p, m) for p, m in zip(params, masked))


def test_a_stock_muon_checkpoint_loads():
    """Today's checkpoints hold torch.optim.Muon's state (a momentum_buffer per parameter): it loads,
    and the state dict keeps that form."""
    _, net, optimizer = model_and_muon(GPT2_SHAPED, "model.n_layer=2")
    muon = parts(optimizer)[0]
    params = muon.param_groups[0]["params"]
    stock = torch.optim.Muon(params, lr=0.02)
    backward(net, 0)
    stock.step()
    muon.load_state_dict(stock.state_dict())
    muon.step()  # the loaded momenta become the stacks' views (and step on)
    saved = muon.state_dict()
    assert sorted(saved["state"]) == list(range(len(params)))
    for i, p in enumerate(params):
        buffer = saved["state"][i]["momentum_buffer"]
        assert buffer.shape == p.shape
        expected = stock.state[p]["momentum_buffer"].lerp(p.grad, 1 - 0.95)
        assert torch.equal(buffer, expected)


def aten_ops(step) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return sum(1 for event in prof.events() if event.name.startswith("aten::"))


def test_one_muon_step_launches_five_times_fewer_ops_for_gpt2_124m():
    """gpt2_124m's 48 hidden matrices (12 blocks): Muon's part of an optimizer step against the
    same step one matrix at a time, and the issue's measure (a step with optim=muon minus one with
    optim=adamw: 3,408 aten ops before the stacks)."""
    torch.set_num_threads(1)
    cfg, net, optimizer = model_and_muon(GPT2_SHAPED)
    muon = parts(optimizer)[0]
    named = split_params(net, cfg.optim)[0]
    assert len(named) == 48
    backward(net, 0)
    optimizer.step()  # the first step builds the stacks
    batched = aten_ops(muon.step)
    with torch.no_grad():
        one_at_a_time = aten_ops(lambda: reference_step(named, muon_parts(net, named), {}, muon.param_groups[0]))
    assert batched * 5 <= one_at_a_time, (batched, one_at_a_time)
    with_muon = aten_ops(optimizer.step)
    _, adamw_net, adamw = model_and_muon(GPT2_SHAPED, "optim=adamw")
    backward(adamw_net, 0)
    adamw.step()
    assert with_muon - aten_ops(adamw.step) <= 3408 / 5, (with_muon, batched, one_at_a_time)
