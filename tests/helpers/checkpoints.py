"""What a run leaves on disk and the weights in it: a tiny run checkpointed in this process by the
real Checkpointer, loss records, weight comparisons, damaged and copied runs, a Hugging Face
folder and a model loaded from one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers.dtrain import run_dtrain
from trainer.checkpoint.finite import nonfinite_tensors
from trainer.checkpoint.layout import checkpoint_step, latest_checkpoint, list_checkpoints
from trainer.checkpoint.manager import Checkpointer
from trainer.config.batch import batch_plan
from trainer.config.compose import compose
from trainer.fit.run import TrainState
from trainer.model.gpt import build_model
from trainer.optim.build import build_optimizer
from trainer.parallel import make_strategy
from trainer.process.runtime import Runtime
from trainer.weights.from_checkpoint import model_from_run
from trainer.weights.init_from import start_from_weights
from trainer.weights.init_source import check_init_source

ONE_CPU_PROCESS = Runtime(rank=0, local_rank=0, world=1, local_world=1, device=torch.device("cpu"),
                          distributed=False)


class _LoaderAtStart:
    """What the Checkpointer records of a data loader that has not moved."""

    def state_dict(self):
        return {"epoch": 0, "shard_pos": 0, "token_offset": 0}


def one_process_optimizer(model: torch.nn.Module, cfg):
    """cfg.optim's optimizer for `model` as parallel=none runs it in one CPU process."""
    return build_optimizer(model, cfg.optim, make_strategy(cfg.parallel, cfg.train, ONE_CPU_PROCESS))


def checkpointed_tiny_run(run_dir: Path, overrides: list[str], steps: int, tokens_per_step: int):
    """A tiny GPT trained `steps` AdamW steps on random tokens in this process and checkpointed by
    the real Checkpointer into run_dir; returns (the composed config, the live model)."""
    cfg = compose(["model=tiny", "train.device=cpu", *overrides])
    torch.manual_seed(0)
    strategy = make_strategy(cfg.parallel, cfg.train, ONE_CPU_PROCESS)
    model = strategy.wrap(build_model(cfg.model))
    optimizer = build_optimizer(model, cfg.optim, strategy)
    for _ in range(steps):
        x = torch.randint(0, 50257, (2, 16))
        model(x, torch.roll(x, -1, 1))[1].backward()
        strategy.optimizer_step(optimizer)
    run = SimpleNamespace(strategy=strategy, model=model, optimizer=optimizer, train_loader=_LoaderAtStart(),
                          state=TrainState(step=steps, tokens=tokens_per_step * steps), plan=batch_plan(cfg, 1))
    checkpointer = Checkpointer(cfg, ONE_CPU_PROCESS, run_dir)
    checkpointer.save(run)
    checkpointer.close()
    return cfg, model


def loss_records(run_dir: Path) -> list[tuple[int, float, float]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"]) for r in records if "loss" in r]


def same_weights(a: Path, b: Path) -> bool:
    ma, _ = model_from_run(a)
    mb, _ = model_from_run(b)
    return all(torch.equal(x, y) for x, y in zip(ma.state_dict().values(), mb.state_dict().values()))


def copy_whole_run(reference: Path, dest: Path) -> Path:
    """A run dir with the reference's metrics, config record and all its checkpoints, made to look
    like a 9-step run (RESUMED) killed after its step-8 checkpoint: the same command continues
    it with resume=auto. Returns checkpoints/."""
    dest.mkdir(parents=True, exist_ok=True)
    lines = (reference / "metrics.jsonl").read_text().splitlines(keepends=True)
    (dest / "metrics.jsonl").write_text("".join(line for line in lines if '"summary"' not in line))
    record = json.loads((reference / "resolved_config.json").read_text())
    record["train"]["max_steps"] = 9
    (dest / "resolved_config.json").write_text(json.dumps(record, indent=2, sort_keys=True))
    shutil.copytree(reference / "checkpoints", dest / "checkpoints")
    return dest / "checkpoints"


def crashed_copy(reference: Path, dest: Path, step: int) -> None:
    """A run dir as a kill -9 soon after its step-`step` checkpoint would leave the reference run:
    its config record, its metrics up to that step (no summary), its checkpoints up to that one. The
    same command continues it from there, and must end as the reference did."""
    dest.mkdir(parents=True)
    shutil.copy(reference / "resolved_config.json", dest / "resolved_config.json")
    records = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    (dest / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records
                                                if r["step"] <= step and "summary" not in r))
    for ckpt in list_checkpoints(reference / "checkpoints"):
        if int(ckpt.name.removeprefix("step_")) <= step:
            shutil.copytree(ckpt, dest / "checkpoints" / ckpt.name)


def flip(file: Path, offset: int, count: int = 64) -> None:
    """Invert `count` real bytes of a file in place (its size stays the same)."""
    with file.open("r+b") as f:
        f.seek(offset)
        data = f.read(count)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))


def snapshot(run_dir) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def _no_constants(token: str):
    raise ValueError(f"metrics.jsonl holds the non-JSON constant {token}")


def strict_metrics(run_dir: Path) -> list[dict]:
    """Every line through a strict JSON parser (bare NaN / Infinity refused)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line, parse_constant=_no_constants) for line in lines]


def steps_of(run_dir: Path) -> list[int]:
    return [int(p.name.removeprefix("step_")) for p in list_checkpoints(run_dir / "checkpoints")]


def assert_finite_checkpoints(run_dir: Path) -> None:
    for ckpt in list_checkpoints(run_dir / "checkpoints"):
        model, _ = model_from_run(ckpt)
        assert nonfinite_tensors(model.state_dict()) == [], ckpt


VOCAB = 50257


def perturbed(model):
    """Norm weights and biases away from their 1 / 0 init, so a mix-up between them shows."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def make_hf_folder(folder: Path, seed: int = 0, zero_biases: bool = False) -> Path:
    """A GPT2LMHeadModel with random weights (biases and LayerNorms too), saved by save_pretrained."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=128, vocab_size=VOCAB)
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.zeros_like(p) if zero_biases else torch.randn_like(p) * 0.1)
            elif ".ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    return folder


def loaded_model(spec: str | Path, *overrides: str, model: str = "tiny"):
    """A fresh GPT of the `model` group (parallel=none) with model.init_from's weights loaded the way
    training does."""
    cfg = compose([f"model={model}", "train.device=cpu", f"model.init_from={spec}", *overrides])
    check_init_source(cfg.model.init_from, cfg.model)
    rt = Runtime(rank=0, local_rank=0, world=1, local_world=1, device=torch.device("cpu"), distributed=False)
    strategy = make_strategy(cfg.parallel, cfg.train, rt)
    model = strategy.wrap(build_model(cfg.model))
    start_from_weights(SimpleNamespace(rt=rt, strategy=strategy, model=model, cfg=cfg), cfg.model.init_from, None)
    return model.eval()


def assert_continues_bitwise(args: list[str], run_dir: Path, reference: Path) -> None:
    """The same command `args` after its run was killed: it names the newest checkpoint it resumes
    from and ends with the uninterrupted `reference` run's losses, grad norms and weights."""
    killed_at = f"step_{checkpoint_step(latest_checkpoint(run_dir)):06d}"
    again = run_dtrain(args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert killed_at in again.stderr, again.stderr[-3000:]
    assert loss_records(run_dir) == loss_records(reference)
    assert same_weights(run_dir, reference)


def assert_continues_within(source: Path, step: int, args: list[str], run_dir: Path, tolerance: float = 1e-5) -> None:
    """`args` (another layout, the same global batch) resumed from `source`'s step-`step` checkpoint
    into `run_dir`: the rest of the run tracks `source`'s uninterrupted losses within `tolerance`."""
    ckpt = source / "checkpoints" / f"step_{step:06d}"
    run_dtrain([*args, f"resume={ckpt}"], check=True)
    want = {s: loss for s, loss, _ in loss_records(source)}
    got = {s: loss for s, loss, _ in loss_records(run_dir)}
    assert sorted(got) == [s for s in sorted(want) if s > step]
    worst = max(abs(got[s] - want[s]) for s in got)
    assert worst < tolerance, f"max |loss - uninterrupted {source.name}| = {worst:.3g}"
