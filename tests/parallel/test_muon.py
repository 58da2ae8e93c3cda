"""optim=muon (Muon on the blocks' hidden matrices, AdamW on the rest) in every parallel mode: the
split by role for both block families, parity with one process within 1e-5 (ddp, zero, zero_torch,
fsdp at world 2 and 4), a trajectory that is not AdamW's, SIGTERM then kill -9 of one run and a bitwise
resume under zero and fsdp, and resharded resumes (fsdp world 2 -> one process, zero -> fsdp).

Muon's weight decay is on (0.1), so fsdp's decay applied to each shard is checked too. Every run
trains 16 steps of 256 tokens and saves a checkpoint every 4, so a mode's parity run is
also the uninterrupted reference of its resume tests.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import assert_continues_bitwise, one_process_optimizer
from helpers.dtrain import run_dtrain, tiny_args, train_losses
from helpers.processes import (
    STOP_LINE,
    finish,
    kill_group,
    logged,
    logged_steps,
    past_a_checkpoint,
    start_dtrain,
    wait_for,
)
from helpers.runs import MUON_BATCH, ONE_PROCESS, REFERENCE_STEPS, assert_matches_one_process, on_reference_steps

from trainer.config.compose import compose
from trainer.model.gpt import build_model
from trainer.optim.build import parts, split_params
from trainer.optim.muon import NS_COEFFICIENTS, BatchedMuon, newton_schulz
from trainer.parallel.muon_owners import assign_owners
from trainer.plan.memory import estimate

STEPS, INTERVAL = REFERENCE_STEPS, 4  # MUON_BATCH saves a checkpoint every 4 steps
CASES = {
    "ddp_w2": on_reference_steps("ddp"),
    "ddp_w4": ["parallel=ddp", "world=4", "train.micro_batch_size=2"],
    "zero_w2": on_reference_steps("zero"),
    "zero_w4": ["parallel=zero", "world=4", "train.micro_batch_size=2"],
    "zero_torch_w2": on_reference_steps("zero_torch"),
    "zero_torch_w4": ["parallel=zero_torch", "world=4", "train.micro_batch_size=1"],
    "fsdp_w2": on_reference_steps("fsdp"),
    "fsdp_w4": ["parallel=fsdp", "world=4", "train.micro_batch_size=2"],
    # owners inside each replica's shard group (2 x 2 at world 4)
    "hsdp_2x2": on_reference_steps("hsdp"),
}


def muon_args(data_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    return tiny_args(data_dir, run_dir, *MUON_BATCH, *extra)


@pytest.fixture(scope="module")
def runs(shared_run):
    """name ("reference" or a case) -> (run dir, stdout) of the session's uninterrupted Muon run."""
    return lambda name: shared_run(*MUON_BATCH, *(ONE_PROCESS if name == "reference" else CASES[name]))


def config(*overrides: str):
    return compose(["model=tiny", "optim=muon", *overrides])


@pytest.mark.parametrize("model, n_muon", [("tiny", 2 * 4), ("llama_tiny", 2 * 4)])
def test_the_split_is_by_role(model, n_muon):
    """Muon takes the blocks' 2-D matrices (the fused q/k/v, the output projection, the MLP's two:
    tests/unit/test_muon_batched.py checks the parts it orthogonalizes them as),
    AdamW the embeddings, the output head, norms and biases, for GPT-2's and the Llama-shaped blocks."""
    cfg = config(f"model={model}")
    net = build_model(cfg.model)
    muon, adamw = split_params(net, cfg.optim)
    assert len(muon) == n_muon and all(p.dim() == 2 and n.startswith("transformer.h.") for n, p in muon)
    names = {n for n, _ in adamw}
    assert "transformer.wte.weight" in names
    assert ("lm_head.weight" in names) == (model == "llama_tiny")  # GPT-2's head is the tied embedding
    assert all(p.dim() == 1 or not n.startswith("transformer.h.") for n, p in adamw)
    assert len(muon) + len(adamw) == len(list(net.parameters()))
    optimizer = one_process_optimizer(net, cfg)
    kinds = [type(p).__name__ for p in parts(optimizer)]
    assert kinds == ["BatchedMuon", "AdamW"]
    assert parts(optimizer)[0].ns_dtype == torch.float32  # ns_dtype=auto on CPU
    assert split_params(net, config(f"model={model}", "optim=adamw").optim)[0] == []


def test_bfloat16_newton_schulz_is_the_stock_iteration():
    cfg = config("optim.muon.ns_dtype=bfloat16")
    optimizer = one_process_optimizer(build_model(cfg.model), cfg)
    assert type(parts(optimizer)[0]) is BatchedMuon and parts(optimizer)[0].ns_dtype == torch.bfloat16
    from torch.optim._muon import _zeropower_via_newtonschulz  # private: checked here only
    x = torch.randn(48, 96, generator=torch.Generator().manual_seed(0))
    stock = _zeropower_via_newtonschulz(x, NS_COEFFICIENTS, 5, 1e-7).float()
    for dtype, tolerance in ((torch.bfloat16, 0.02), (torch.float32, 0.02)):  # bfloat16's precision
        ours = newton_schulz(x[None], NS_COEFFICIENTS, 5, 1e-7, dtype)[0].float()
        assert ours.shape == x.shape and (ours - stock).abs().max() < tolerance


def test_owners_are_balanced_by_size():
    owners = assign_owners([100, 10, 60, 50, 40], 2)
    load = [sum(n for n, o in zip([100, 10, 60, 50, 40], owners) if o == r) for r in range(2)]
    assert owners == [0, 1, 1, 1, 0] and load == [140, 120]
    assert assign_owners([5, 5], 4) == [0, 1]


@pytest.mark.slow
def test_reference_learns_and_is_not_adamw(runs, adamw_reference):
    """AdamW's trajectory: the session's one-process reference of the same batches (conftest)."""
    losses, adamw = train_losses(runs("reference")[0]), adamw_reference
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] < losses[1] - 0.3, losses
    assert max(abs(losses[step] - adamw[step]) for step in losses) > 1e-2, (losses, adamw)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_every_mode_matches_one_process(case, runs):
    assert_matches_one_process(train_losses(runs("reference")[0]), train_losses(runs(case)[0]), STEPS, case)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["zero_w2", "fsdp_w2"])
def test_sigterm_then_kill_9_then_the_same_command_is_bitwise(case, data_dir, runs, tmp_path):
    """Owners' momenta (zero, fsdp) come back whole from the checkpoint, whichever way the run
    stopped: SIGTERM (it saves where it is), then kill -9 of the continuation (no save: it goes on
    from the newest checkpoint), then the same command to the end, equal to the uninterrupted run."""
    reference, _ = runs(case)
    run_dir, first, second = tmp_path / "run", tmp_path / "sigterm.log", tmp_path / "killed.log"
    args = muon_args(data_dir, run_dir, *CASES[case])

    proc = start_dtrain(args, first)
    wait_for(lambda: logged(run_dir, at_least=2), proc, first)
    os.kill(proc.pid, signal.SIGTERM)
    out = finish(proc, first)
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    [(_, stopped, _, _)] = STOP_LINE.findall(out)
    assert 2 <= int(stopped) < STEPS, out[-3000:]

    proc = start_dtrain(args, second)  # continues from the SIGTERM's checkpoint, then is killed
    wait_for(lambda: past_a_checkpoint(run_dir), proc, second)  # a step past the SIGTERM's checkpoint
    kill_group(proc)
    assert f"(step {stopped})" in second.read_text(), second.read_text()[-3000:]
    assert max(logged_steps(run_dir)) < STEPS
    assert_continues_bitwise(args, run_dir, reference)


@pytest.mark.slow
@pytest.mark.parametrize("source, target", [
    ("fsdp_w2", ["parallel=none", "train.micro_batch_size=8"]),
    ("zero_w2", CASES["fsdp_w4"]),
    ("hsdp_2x2", CASES["fsdp_w2"]),  # both replicas' owners saved the same momenta: stored once
])
def test_resharded_resume_continues_the_trajectory(source, target, data_dir, runs, tmp_path):
    origin, _ = runs(source)
    run_dir = tmp_path / "resharded"
    ckpt = origin / "checkpoints" / f"step_{2 * INTERVAL:06d}"  # (checkpoint.keep=3 keeps 8, 12, 16)
    run_dtrain(muon_args(data_dir, run_dir, *target, f"resume={ckpt}"), check=True)
    want, got = train_losses(origin), train_losses(run_dir)
    assert sorted(got) == list(range(2 * INTERVAL + 1, STEPS + 1))
    assert max(abs(got[s] - want[s]) for s in got) < 1e-5, (got, want)


def test_first_line_shows_the_split(runs):
    words = " ".join(runs("reference")[1].split())  # the console wraps the long first line
    assert "device=cpu optim=muon (Muon 0.10M params in 8 matrices, AdamW 0.04M in 20 tensors) |" in words, words


def test_the_plan_counts_one_momentum_per_hidden_matrix():
    """Muon keeps one buffer per hidden matrix where AdamW keeps two; the sharded modes keep each
    matrix whole on its owner (zero) and a zeroed work copy beside it (fsdp)."""
    adamw, muon = config("optim=adamw"), config()
    shapes = [p.shape for _, p in split_params(build_model(muon.model), muon.optim)[0]]
    steps = 4 * len(shapes)  # AdamW's step counter per tensor; Muon has none
    hidden = sum(s.numel() for s in shapes)
    assert estimate(adamw, "none", 1, 1, "cpu").optim - estimate(muon, "none", 1, 1, "cpu").optim == 4 * hidden + steps
    owners = assign_owners([s.numel() for s in shapes], 2)
    busiest = max(sum(s.numel() for s, o in zip(shapes, owners) if o == r) for r in range(2))
    zero_gap = estimate(adamw, "zero", 2, 1, "cpu").optim - estimate(muon, "zero", 2, 1, "cpu").optim
    fsdp_gap = estimate(adamw, "fsdp", 2, 1, "cpu").optim - estimate(muon, "fsdp", 2, 1, "cpu").optim
    rows = sum(-(-s[0] // 2) * s[1] for s in shapes)  # AdamW's two buffers of rank 0's rows
    assert zero_gap == 4 * (2 * rows - busiest) + steps and fsdp_gap == 4 * (2 * rows - 2 * busiest) + steps
