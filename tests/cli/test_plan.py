"""`dtrain plan`: the memory estimate against real peaks, the largest batch that fits, bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers.dtrain import REPO, dtrain_env, run_dtrain

from trainer.config.compose import compose
from trainer.config.schema import to_dict
from trainer.plan.memory import estimate, largest_micro_batch
from trainer.plan.sizes import parse_size

# Two model sizes whose peaks differ in make-up: tiny (3.3M params, nearly all embedding; the
# language-model head's activations dominate) and an 8-layer 128-wide model (blocks count too).
SIZES = {
    "tiny": ["model=tiny", "train.micro_batch_size=4", "train.seq_len=128"],
    "8x128": ["model=cpu_small", "model.n_layer=8", "model.n_embd=128", "model.pad_vocab_multiple=64",
              "train.micro_batch_size=4", "train.seq_len=256"],
    # Llama's blocks: a SwiGLU MLP (three matrices), grouped KV heads, rotary positions, an untied head
    "llama_8x128": ["model=llama_cpu_small", "model.n_layer=8", "model.pad_vocab_multiple=64",
                    "train.micro_batch_size=4", "train.seq_len=256"],
}
# a real peak: fresh worker processes started by torchrun's engine, 3 product training steps
MEASURE = """
import json, sys
from pathlib import Path
from scripts.benchmarks.workers import peak_worker
from trainer.launch.workers import run_workers
if __name__ == "__main__":
    cfg, world, run_dir = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    print("RESULT", json.dumps(run_workers(peak_worker, (cfg, 3), cfg["launch"], world, Path(run_dir) / "logs",
                                                fresh_processes=True)))
"""


@pytest.fixture(scope="module")
def data_dir(gpt2_data_dir):
    """The session corpus in GPT-2's vocabulary for this module: its figures are those of models whose
    tied 50,257-row embedding holds much of the state."""
    return gpt2_data_dir


def assert_user_error(proc, needle):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], proc.stderr


def config(data_dir, overrides, mode="none", world=1):
    return compose([*overrides, "data=text", "data.name=corpus", f"data.dir={data_dir}", f"parallel={mode}",
                    f"world={world}", "train.sample_tokens=0"])


def measured_peak(cfg, world, tmp_path) -> int:
    args = [sys.executable, "-c", MEASURE, json.dumps(to_dict(cfg)), str(world), str(tmp_path)]
    proc = subprocess.run(args, cwd=REPO, env=dtrain_env(), capture_output=True, text=True, timeout=300)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = json.loads(line[0].split(" ", 1)[1])
    assert all(r["peak_exact"] for r in ranks)  # VmHWM could be reset: a true peak of this run
    return max(r["peak_bytes"] for r in ranks)


@pytest.mark.slow
@pytest.mark.parametrize("size,mode,world", [("tiny", "none", 1), ("8x128", "none", 1), ("8x128", "fsdp", 2),
                                                   ("llama_8x128", "none", 1), ("llama_8x128", "fsdp", 2)])
def test_estimate_within_15_percent_of_measured_peak(size, mode, world, data_dir, tmp_path):
    cfg = config(data_dir, SIZES[size], mode, world)
    peak = measured_peak(cfg, world, tmp_path)
    est = estimate(cfg, mode, world, cfg.train.micro_batch_size).total
    assert abs(est / peak - 1) <= 0.15, f"{size} {mode} w{world}: estimate {est / 2**20:.0f} MiB, " \
                                        f"measured {peak / 2**20:.0f} MiB"


def test_state_bytes_per_mode(data_dir):
    cfg = config(data_dir, SIZES["8x128"])
    full = estimate(cfg, "none", 1, 4)
    tensors = 2 + 12 * 8 + 2  # embeddings, 12 per block, final LayerNorm: one AdamW step counter each
    assert full.grads == full.params and full.optim == 2 * full.params + 4 * tensors
    fsdp = estimate(cfg, "fsdp", 4, 4)
    assert fsdp.params <= full.params / 4 * 1.01 and fsdp.optim <= full.optim / 4 * 1.01
    zero = estimate(cfg, "zero", 2, 4)
    assert zero.params == full.params and full.optim / 2 <= zero.optim <= full.optim / 2 * 1.01
    assert estimate(cfg, "ddp", 2, 4).total > full.total  # DDP's buckets keep gradients alive
    # whole parameters per rank: the one with the tied embedding keeps most of the state (0.8 here)
    zero_torch = estimate(cfg, "zero_torch", 2, 4)
    assert zero_torch.params == full.params and full.optim / 2 < zero_torch.optim < full.optim
    checkpointed = config(data_dir, [*SIZES["8x128"], "train.activation_checkpointing=true"])
    assert estimate(checkpointed, "none", 1, 4).activations < full.activations


def test_largest_micro_batch_is_the_boundary(data_dir):
    cfg = config(data_dir, SIZES["tiny"])
    budget = parse_size("2GiB")
    best = largest_micro_batch(cfg, "ddp", 2, budget)
    assert best >= 1
    assert estimate(cfg, "ddp", 2, best).total <= budget < estimate(cfg, "ddp", 2, best + 1).total
    assert largest_micro_batch(cfg, "ddp", 2, parse_size("10MiB")) == 0


@pytest.mark.parametrize("batch", [1, 3, 6])
def test_a_budget_of_exactly_a_batchs_estimate_fits_that_batch(data_dir, batch):
    cfg = config(data_dir, SIZES["tiny"])
    exact = estimate(cfg, "ddp", 2, batch).total  # "fits" is at most the budget, the boundary included
    assert largest_micro_batch(cfg, "ddp", 2, exact) == batch
    assert largest_micro_batch(cfg, "ddp", 2, exact - 1) == batch - 1


@pytest.mark.parametrize("text,expected", [("80GiB", 80 * 2**30), ("40 GB", 40 * 10**9), ("512MiB", 2**29),
                                           ("1.5e9", 1_500_000_000)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


def test_plan_command_prints_every_mode():
    proc = run_dtrain(["plan", "model=tiny", "parallel=fsdp", "world=4", "train.micro_batch_size=4",
                       "--device-memory", "8GiB"])
    assert proc.returncode == 0, proc.stderr
    rows = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("│")]
    assert rows == ["none", "dp", "ddp", "zero", "zero_torch", "fsdp", "hsdp"], proc.stdout  # least to most sharded
    for mode in ("none", "dp", "ddp", "zero", "zero_torch", "fsdp *", "hsdp"):
        assert f" {mode} " in proc.stdout, proc.stdout
    assert "max micro batch" in proc.stdout and "8.00 GiB" in proc.stdout
    out = " ".join(proc.stdout.split())
    # each mode's description whole, though its module doc wraps it over two lines
    assert "with parallel.tp > 1, one model split over the tensor-parallel ranks" in out, out
    assert "ZeroRedundancyOptimizer (each rank keeps the optimizer's state for whole parameters)." in out, out


@pytest.mark.parametrize("args,needle", [
    (["parallel.mode=tp"], "parallel.mode"),
    (["parallel=tp"], "parallel/tp"),
    (["--device-memory", "lots"], "cannot read memory size"),
    (["--device-memory=80QB"], "cannot read memory size"),
    (["--device-memory"], "needs a size"),
    (["--fast"], "unknown flag"),
])
def test_bad_input_is_one_line(args, needle):
    assert_user_error(run_dtrain(["plan", "model=tiny", *args]), needle)


def test_plan_device_cuda_runs_without_a_gpu():
    env = {**dtrain_env(), "CUDA_VISIBLE_DEVICES": ""}
    gpt2_32 = ["model=gpt2_124m", "model.pad_vocab_multiple=64", "train.micro_batch_size=32", "train.seq_len=1024"]
    proc = run_dtrain(["plan", "--device", "cuda", *gpt2_32, "train.compile=true"], env=env)
    assert proc.returncode == 0, proc.stderr
    out = " ".join(proc.stdout.split())
    assert "cuda compiled" in out and "80 GiB H100 assumed" in out, proc.stdout
    rows = [line.split("│") for line in proc.stdout.splitlines() if line.startswith("│")]
    none_row = next(r for r in rows if r[1].strip().startswith("none"))
    peak = none_row[8].split()
    assert peak[1] == "GiB" and 20 < float(peak[0]) < 24, none_row  # 20.7 GiB of tensors + the CUDA context


@pytest.mark.parametrize("mesh", [
    [],
    ["parallel.tp=8"],
], ids=["fsdp64", "fsdp8xtp8"])
def test_plan_of_70b_on_64_gpus_reads_the_shards_and_answers_the_whole_context(mesh):
    env = {**dtrain_env(), "CUDA_VISIBLE_DEVICES": ""}
    proc = run_dtrain(["plan", "model=llama3_70b", "world=64", "parallel=fsdp", *mesh, "train.device=cuda"], env=env)
    assert proc.returncode == 0, proc.stderr
    out = " ".join(proc.stdout.split())
    assert "fsdp: params, grads and optimizer read from the DTensor shards of its own wrap" in out, out
    assert "micro batch 1 x seq 8192, activation checkpointing on" in out and "in 80.00 GiB" in out, out
    fsdp_row = next(line.split("│") for line in proc.stdout.splitlines() if line.startswith("│ fsdp *"))
    # 70.55B fp32 parameters over 64 ranks; under tp=8 the embedding and head (2 x 1.05B) are whole
    # on every tensor-parallel rank (a replicated head), so FSDP splits them over its 8 ranks only.
    assert fsdp_row[3].split() == (["4.96", "GiB"] if mesh else ["4.11", "GiB"])
    if mesh:
        assert "does not fit" not in out and "ddp: parallel=ddp cannot split layers" in out, out
