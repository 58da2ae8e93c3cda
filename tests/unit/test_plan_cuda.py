"""The plan's estimate of a CUDA run, made on a host without a GPU: every measured peak within 5%,
and the estimate follows train.compile, train.activation_checkpointing and train.loss_chunks (the
command itself, `dtrain plan --device cuda`: tests/cli/test_plan.py)."""

from __future__ import annotations

import pytest

from trainer.config.compose import compose
from trainer.plan.memory import estimate

GiB = 1024**3
GPT2_32 = ["model=gpt2_124m", "model.pad_vocab_multiple=64", "train.micro_batch_size=32", "train.seq_len=1024"]
# torch.cuda.max_memory_allocated of dtrain's step, bf16, seq 1024, parallel=none, one H100 80GB HBM3,
# torch 2.11.0+cu130: `make bench-gpu` of 2026-11-26 (scripts/bench_gpu.py's memory and choices rows)
MEASURED = {
    ("gpt2_124m", 16, ()): 17_228_676_096,
    ("gpt2_124m", 32, ()): 32_593_067_008,
    ("llama_135m", 16, ()): 23_597_929_984,
    ("llama_135m", 32, ()): 45_262_272_000,
    ("gpt2_124m", 16, ("train.compile=true",)): 12_229_544_960,
    ("gpt2_124m", 32, ("train.compile=true",)): 22_705_157_120,
    ("llama_135m", 16, ("train.compile=true",)): 17_117_147_648,
    ("llama_135m", 32, ("train.compile=true",)): 32_327_070_208,
    ("gpt2_124m", 32, ("train.compile=true", "train.loss_chunks=4")): 16_246_297_600,
}


def cuda_estimate(*overrides, mode="none", world=1):
    cfg = compose([*overrides, f"parallel={mode}", f"world={world}"])
    return estimate(cfg, mode, world, cfg.train.micro_batch_size, "cuda")


@pytest.mark.parametrize(("model", "micro_batch", "settings"), list(MEASURED), ids=lambda v: str(v))
def test_every_measured_peak_within_5_percent(model, micro_batch, settings):
    """The issue asks for 15%; every measured case is within 2.5%, so a 5% bound catches a drift."""
    est = cuda_estimate(f"model={model}", "model.pad_vocab_multiple=64", f"train.micro_batch_size={micro_batch}",
                        "train.seq_len=1024", *settings).allocated
    measured = MEASURED[(model, micro_batch, settings)]
    assert abs(est / measured - 1) <= 0.05, f"estimate {est / GiB:.2f} GiB, measured {measured / GiB:.2f} GiB"


@pytest.mark.parametrize("model", ["gpt2_124m", "llama_135m"])
@pytest.mark.parametrize("micro_batch", [16, 32])
def test_compile_checkpointing_and_loss_chunks_each_lower_the_estimate(model, micro_batch):
    base = [f"model={model}", "model.pad_vocab_multiple=64", f"train.micro_batch_size={micro_batch}",
            "train.seq_len=1024"]
    eager = cuda_estimate(*base).allocated
    compiled = cuda_estimate(*base, "train.compile=true").allocated
    assert compiled < 0.8 * eager  # fused elementwise ops and the fused loss keep far less
    assert cuda_estimate(*base, "train.activation_checkpointing=true").allocated < eager
    assert cuda_estimate(*base, "train.compile=true", "train.activation_checkpointing=true").allocated < compiled
    assert cuda_estimate(*base, "train.compile=true", "train.loss_chunks=8").allocated < compiled
    # twice the batch: close to twice the activations (the model state stays)
    assert cuda_estimate(*base[:2], f"train.micro_batch_size={2 * micro_batch}", "train.seq_len=1024",
                         "train.compile=true").allocated > 1.8 * compiled - 4 * GiB


def test_cpu_estimate_follows_loss_chunks_but_not_compile():
    base = ["model=cpu_small", "train.micro_batch_size=8", "train.seq_len=256"]
    cpu = compose(base)
    same = compose([*base, "train.compile=true"])
    assert estimate(cpu, "none", 1, 8, "cpu").total == estimate(same, "none", 1, 8, "cpu").total
    chunked = compose([*base, "train.loss_chunks=4"])
    assert estimate(chunked, "none", 1, 8, "cpu").activations < estimate(cpu, "none", 1, 8, "cpu").activations
