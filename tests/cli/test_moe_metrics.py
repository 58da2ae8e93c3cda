"""A mixture-of-experts run's figures (trainer/fit/experts.py): the aux loss and each MoE layer's expert
load in metrics.jsonl and the step lines, checked against what the model computes, `dtrain report`'s
experts.png, and a dense run's records without any of it."""

from __future__ import annotations

import re

import pytest
import torch
from helpers.dtrain import read_metrics, run_dtrain, tiny_args
from helpers.runs import ONE_PROCESS as REFERENCE_ONE_PROCESS
from helpers.runs import REFERENCE_BATCH

from trainer.config.compose import compose
from trainer.fit.experts import ExpertStats, load_shares
from trainer.model.config import GPTConfig
from trainer.model.gpt import build_model
from trainer.plan.meta import meta_model
from trainer.plan.params import parameter_counts
from trainer.process.runtime import Runtime

MOE = "model=qwen3_moe_tiny"
ONE_PROCESS = Runtime(rank=0, local_rank=0, world=1, local_world=1, device=torch.device("cpu"), distributed=False)


def moe_run(data_dir, run_dir, *extra):
    proc = run_dtrain(tiny_args(data_dir, run_dir, MOE, "train.max_steps=4", "train.log_interval=2", *extra),
                      check=True)
    return proc, [r for r in read_metrics(run_dir) if "loss" in r and "summary" not in r]


@pytest.fixture(scope="module")
def moe(data_dir, module_tmp):
    """One 4-step qwen3_moe_tiny run, logged at steps 1, 2 and 4 (2 accumulated micro-steps a step)."""
    run_dir = module_tmp.mktemp("moe") / "run"
    proc, records = moe_run(data_dir, run_dir, "train.grad_accum_steps=2")
    return run_dir, proc, records


@pytest.mark.slow
def test_each_record_counts_every_routed_token_of_its_interval_per_layer(moe):
    run_dir, proc, records = moe
    cfg = compose([MOE])
    k, experts = cfg.model.moe.top_k, cfg.model.moe.num_experts
    moe_blocks = [str(i) for i in range(cfg.model.n_layer) if (i + 1) % cfg.model.moe.every == 0]
    assert [r["step"] for r in records] == [1, 2, 4]
    previous = 0
    for record in records:
        assert set(record["expert_load"]) == set(moe_blocks)
        routed = (record["tokens"] - previous) * k  # every token of the interval, top_k slots each
        previous = record["tokens"]
        for layer in record["expert_load"].values():
            assert len(layer["tokens"]) == experts and sum(layer["tokens"]) == routed  # dropless
            low, high = load_shares(layer["tokens"])
            assert (layer["min"], layer["max"]) == (round(low, 4), round(high, 4))
        assert record["expert_load_min"] == pytest.approx(min(v["min"] for v in record["expert_load"].values()),
                                                          abs=1e-4)
        assert record["expert_load_max"] == pytest.approx(max(v["max"] for v in record["expert_load"].values()),
                                                          abs=1e-4)
        assert record["dropped_tokens"] == 0.0
        assert record["aux_loss"] > 0
    # the step line: `loss ... | aux 0.1234 | load 0.71-1.34 | lr ...`
    last = records[-1]
    line = re.search(r"step 4/4 \| loss [\d.]+ \| aux ([\d.]+) \| load ([\d.]+)-([\d.]+) \| lr", proc.stdout)
    assert line, proc.stdout
    assert float(line[1]) == pytest.approx(last["aux_loss"], abs=1e-4)
    assert (float(line[2]), float(line[3])) == pytest.approx((last["expert_load_min"], last["expert_load_max"]),
                                                            abs=0.01)


@pytest.mark.slow
def test_the_logged_aux_loss_is_what_the_model_adds_to_its_training_loss(moe, data_dir, tmp_path):
    """The same first step with aux_loss_coef 0: the cross-entropy is the same (same weights, same
    batches), so the two losses differ by coef x the aux loss the model computed."""
    _, _, records = moe
    coef = compose([MOE]).model.moe.aux_loss_coef
    assert coef > 0
    _, without = moe_run(data_dir, tmp_path / "no_aux", "train.grad_accum_steps=2", "train.max_steps=1",
                         "model.moe.aux_loss_coef=0")
    assert without[0]["step"] == records[0]["step"] == 1
    assert records[0]["loss"] - without[0]["loss"] == pytest.approx(coef * records[0]["aux_loss"], rel=1e-3, abs=1e-6)


def test_expert_stats_average_the_layers_aux_losses_and_sum_loads_over_micro_steps():
    """In process, on the real block: the step's aux loss is the mean over micro-steps of the layers'
    mean aux loss, and the load the sum of their expert_load, as the modules report them."""
    torch.manual_seed(0)
    cfg = compose([MOE]).model
    model = build_model(cfg)
    stats = ExpertStats.of(model, ONE_PROCESS)
    assert stats is not None and [mlp for _, mlp in stats.layers] == model.moe_layers()
    aux, load = [], []
    for _ in range(3):
        x = torch.randint(0, 1000, (2, 16))
        model(x, x)
        stats.after_micro_step()
        aux.append(sum(float(mlp.aux_loss.detach()) for _, mlp in stats.layers) / len(stats.layers))
        load.append([mlp.expert_load.tolist() for _, mlp in stats.layers])
    assert stats.step_aux(3).item() == pytest.approx(sum(aux) / 3, rel=1e-6)
    summed = stats.take_load()
    for n, (i, _) in enumerate(stats.layers):
        assert summed[i] == [sum(step[n][e] for step in load) for e in range(len(load[0][n]))]
    assert stats.take_load() == {i: [0] for i, _ in stats.layers}  # the interval starts anew


def test_a_dense_model_has_no_expert_stats():
    cfg = compose(["model=tiny"]).model
    assert ExpertStats.of(build_model(cfg), ONE_PROCESS) is None


def test_load_shares_are_each_extreme_over_the_mean():
    assert load_shares([10, 10, 10, 10]) == (1.0, 1.0)
    assert load_shares([0, 10, 20, 10]) == (0.0, 2.0)


@pytest.mark.slow
def test_report_draws_the_expert_load(moe, tmp_path):
    run_dir, _, _ = moe
    out = tmp_path / "figures"
    proc = run_dtrain(["report", str(run_dir), "--out", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert {p.name for p in out.glob("*.png")} == {"loss.png", "lr.png", "tokens_per_s.png", "experts.png"}
    import matplotlib.image

    assert matplotlib.image.imread(out / "experts.png").shape[:2] == (550, 1400)


@pytest.mark.slow
def test_a_dense_run_logs_the_fields_it_always_did(shared_run):
    run_dir, stdout = shared_run(*REFERENCE_BATCH, *REFERENCE_ONE_PROCESS)
    train = [r for r in read_metrics(run_dir) if "loss" in r and "summary" not in r]
    assert train and all(set(r) == {"step", "tokens", "loss", "lr", "grad_norm", "tokens_per_s", "skipped", "time"}
                         for r in train)
    assert " aux " not in stdout and " load " not in stdout


def test_the_plan_counts_active_parameters_by_hand():
    """A tiny MoE: the routed experts count top_k / E in the active parameters, every other weight
    (attention, norms, router, shared experts, embedding and head) in full."""
    cfg = compose([MOE]).model
    model = meta_model(GPTConfig.from_cfg(cfg))
    counts = parameter_counts(model, 64)
    m = cfg.moe
    moe_layers_n = sum((i + 1) % m.every == 0 for i in range(cfg.n_layer))
    hidden = GPTConfig.from_cfg(cfg).expert_hidden
    routed = moe_layers_n * m.num_experts * 3 * cfg.n_embd * hidden  # gate, up, down per expert
    assert counts.total == sum(p.numel() for p in model.parameters())
    assert counts.active == counts.total - routed + routed * m.top_k // m.num_experts
    assert counts.flops_per_token < 6 * counts.total  # FLOPs on the active ones


@pytest.mark.slow
def test_two_ranks_count_the_load_and_aux_loss_as_one_process_does(data_dir, tmp_path):
    """The same global batch on one process (4 micro-steps) and on DDP world 2 (2 each): the load summed
    over the ranks is the one process's count, expert by expert, and the aux loss its mean."""
    batch = ["train.total_batch_size=512", "train.micro_batch_size=2", "train.max_steps=2", "train.log_interval=1"]
    _, one = moe_run(data_dir, tmp_path / "one", "parallel=none", *batch)
    _, two = moe_run(data_dir, tmp_path / "two", "parallel=ddp", "world=2", *batch)
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2]
    for a, b in zip(one, two, strict=True):
        assert a["expert_load"] == b["expert_load"]
        assert a["aux_loss"] == pytest.approx(b["aux_loss"], abs=1e-5)
