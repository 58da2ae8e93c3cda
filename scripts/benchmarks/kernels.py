"""bench-gpu's kernel rows (issue 50): each setting of train.loss_kernel, model.attention and
train.float8 against its group's baseline on the same model, batch and data, trained the same steps
(100 on a GPU): tokens/s, MFU, the allocator's peak, and the loss gap after those steps. Each group
ends with a `pick` row: the fastest setting whose loss is within LOSS_GAP of the baseline's, what the
group's `auto` should resolve to on this device and shape.

    loss       gpt2_124m, micro batch 32 x 1024: plain (baseline), chunked (4 pieces), fused (liger-kernel)
    attention  gpt2_124m and llama_135m, 32 x 1024: auto (SDPA's choice: baseline), flash, cudnn,
               efficient, math
    float8     gpt2_124m, llama_135m and llama3_1b, 4 x 2048: off (baseline), tensorwise, rowwise, auto

A setting the device cannot run (fused or cudnn on a CPU, float8 before sm89) is its one-line refusal
in the row, as a run would print it.
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from benchmarks.harness import step_bookkeeping, sync
from benchmarks.memory import PeakMemory
from trainer.errors import UserError
from trainer.fit.run import Run
from trainer.preflight.torch_checks import check_attention

GiB = 1024**3
LOSS_GAP = 0.01  # the bar: a setting whose loss after the steps is within 1% of the baseline's
STEPS = {"full": 100, "tiny": 4}
WARMUP = {"full": 10, "tiny": 1}  # untimed first steps (compilation, autotuning)


class Group(NamedTuple):
    name: str
    models: tuple[str, ...]
    batch: int
    seq: int
    settings: tuple[str, ...]  # overrides, the baseline first


ATTENTION = tuple(f"model.attention={b}" for b in ("auto", "flash", "cudnn", "efficient", "math"))
LOSS = ("train.loss_kernel=plain", "train.loss_kernel=chunked train.loss_chunks=4", "train.loss_kernel=fused")
FLOAT8 = tuple(f"train.float8={s}" for s in ("off", "tensorwise", "rowwise", "auto"))
GROUPS = {
    "full": (Group("loss", ("gpt2_124m",), 32, 1024, LOSS),
             Group("attention", ("gpt2_124m", "llama_135m"), 32, 1024, ATTENTION),
             Group("float8", ("gpt2_124m", "llama_135m", "llama3_1b"), 4, 2048, FLOAT8)),
    "tiny": (Group("loss", ("tiny",), 4, 64, LOSS),
             Group("attention", ("tiny", "llama_tiny"), 4, 64, ATTENTION),
             Group("float8", ("tiny", "llama_tiny"), 4, 64, FLOAT8)),
}


def kernel_rows(bench) -> None:
    """Every group's rows on `bench` (scripts/bench_gpu.py Bench: its config, budget and rows)."""
    for group in GROUPS[bench.size]:
        for model in group.models:
            _group_rows(bench, group, model)


def _group_rows(bench, group: Group, model: str) -> None:
    """One model's rows of a group, the baseline first, then its `pick` row."""
    measured: dict[str, dict | None] = {}
    for setting in group.settings:
        case = f"{model} B={group.batch}x{group.seq} {setting}"
        bench.guarded("kernels", case, lambda s=setting, c=case: measured.update(
            {s: _measure_row(bench, group, model, s, c, measured.get(group.settings[0]))}))
    bench.row("kernels", f"{model} {group.name} pick", _pick(group, {s: f for s, f in measured.items() if f}))


def _measure_row(bench, group: Group, model: str, setting: str, case: str, baseline: dict | None) -> dict | None:
    extra = setting.split()
    if group.seq > 1024 and model.startswith("gpt2"):
        extra.append(f"model.block_size={group.seq}")  # GPT-2's learned positions end at 1024
    cfg = bench.cfg(model, group.batch, f"train.seq_len={group.seq}", *extra)
    try:
        check_attention(cfg, bench.rt.device)  # the refusals a run would print, as its row
        fig = measure(bench, cfg)
    except UserError as e:
        bench.row("kernels", case, f"refused: {e}")
        return None
    gap = (fig["loss"] - baseline["loss"]) / baseline["loss"] if baseline else 0.0
    fig["loss_gap"] = gap
    mfu = f", MFU {fig['mfu']:.1%}" if fig["mfu"] is not None else ""
    against = (f"baseline {baseline['tokens_per_s']:,.0f} tok/s, {baseline['peak_bytes'] / GiB:.2f} GiB, "
               f"loss {baseline['loss']:.4f}" if baseline else "baseline")
    bench.row("kernels", case,
              f"{fig['tokens_per_s']:,.0f} tok/s{mfu}, {fig['peak_bytes'] / GiB:.2f} GiB, loss {fig['loss']:.4f} "
              f"({gap:+.2%}) after {fig['steps']} steps; ran {_kernels(fig['kernels'])}", against,
              f"{fig['tokens_per_s'] / baseline['tokens_per_s']:.3f}x" if baseline else "1.000x", figures=fig)
    return fig


def measure(bench, cfg) -> dict:
    """Train `cfg` STEPS steps from its seed; time the steps after WARMUP. Raises the run's UserError
    for a setting the device cannot run (Run resolves the loss kernel and float8 as a run would)."""
    steps, warmup = STEPS[bench.size], WARMUP[bench.size]
    with tempfile.TemporaryDirectory(prefix="dtrain-bench-kernels-") as run_dir:
        peak = PeakMemory(bench.rt.device)
        peak.start()
        run = Run(cfg, bench.rt, Path(run_dir))
        steplog, metrics = step_bookkeeping(run, Path(run_dir))
        loss = math.nan
        for step in range(steps):
            if step == warmup:
                sync(bench.rt.device)
                t0 = time.perf_counter()
            loss, *rest = run.train_step(step)
            steplog.after_step(loss, *rest)
        sync(bench.rt.device)
        seconds = (time.perf_counter() - t0) / (steps - warmup)
        metrics.close()
        tokens = cfg.train.micro_batch_size * cfg.train.seq_len
        return dict(tokens_per_s=tokens / seconds, ms=seconds * 1e3, peak_bytes=peak.peak_growth(),
                    loss=float(loss), steps=steps, kernels=run.kernels,
                    mfu=run.flops_per_token * tokens / seconds / bench.peak_flops if bench.peak_flops else None)


def _kernels(kernels: dict) -> str:
    return ", ".join(f"{key} {value}" for key, value in kernels.items())


def _pick(group: Group, measured: dict[str, dict]) -> str:
    """The fastest setting within LOSS_GAP of the baseline's loss (what `auto` should resolve to)."""
    fit = {s: f for s, f in measured.items() if abs(f["loss_gap"]) <= LOSS_GAP}
    if not fit:
        return "nothing measured"
    best = max(fit, key=lambda s: fit[s]["tokens_per_s"])
    return f"{best} ({fit[best]['tokens_per_s']:,.0f} tok/s; {len(measured)} of {len(group.settings)} measured)"
