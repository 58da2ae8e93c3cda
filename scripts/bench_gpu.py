#!/usr/bin/env python
"""`make bench-gpu`: dtrain's GPU figures in one table, in one process, within a time budget.

    python scripts/bench_gpu.py [--budget-s 450] [--json out.json] [key=value overrides ...]
    PYTHONPATH=<site-packages>:. python scripts/bench_gpu.py        # dtrain not pip-installed
    python scripts/bench_gpu.py --device cpu --tiny                  # the same code on tiny CPU models

Rows (one that no longer fits the budget is listed as skipped; cheap ones first):

* throughput: dtrain's own step (`Run.train_step` + the loop's bookkeeping) against a bare loop
  (scripts/benchmarks/bare.py: the same GPT, fused AdamW, bf16 autocast, torch.compile, TF32:
  build-nanogpt's loop) in alternating blocks, gpt2_124m and llama_135m at micro batch 16, 32 and
  64 x 1024: tokens/s, MFU (the model's FLOPs per token over the device's dense bf16 peak, H100
  989 TFLOP/s), ms per step, and the share of it the GPU was busy (CUDA kernel time from
  torch.profiler over a few steps, over the unprofiled wall time), and the host time of the
  compiled forward's call (dynamo's "Torch-Compiled Region" in the same profile).
* muon, lion: optim=muon's and optim=lion's step against AdamW's (gpt2_124m, micro batch 32).
* mixture: `data=mix` over two datasets (--mix; shakespeare and tinyshakespeare, 0.7/0.3, prepared
  when missing: every sequence read from its own source's memmap) against the one-dataset step
  (gpt2_124m, micro batch 32).
* memory: torch.cuda.max_memory_allocated of dtrain's step (before the bare loop exists) beside
  `dtrain plan`'s estimate of it (trainer/plan/memory.py), both models, micro batch 16 and 32, compile
  on and off.
* modes: every parallel mode at world 1 (a one-process NCCL group) for a few steps.
* choices: the settings whose defaults this benchmark chooses, each against dtrain's default step
  of the same model and micro batch: `train.compile_mode=reduce-overhead` (CUDA graphs) and
  `train.loss_chunks=4` (ms per step, allocator peak, loss after the same steps).
* watch (scripts/benchmarks/watch.py): what the on-by-default watching costs: a straggler-sampled
  step (under the profiler) against an unsampled one, and NCCL's flight recorder on against off
  (parallel=ddp at world 1, fresh processes each).
* kernels (scripts/benchmarks/kernels.py, last: the longest): train.loss_kernel plain/chunked/fused,
  model.attention's SDPA kernels, train.float8 off/tensorwise/rowwise/auto on gpt2_124m, llama_135m
  and llama3_1b, each trained 100 steps against its group's baseline (tokens/s, MFU, peak memory, the
  loss gap), and per group the setting its `auto` should resolve to. Its own budget is best:
  `--sections kernels --budget-s 550`.

Without a CUDA device (and no --device cpu) it prints one line and exits 2: nothing was measured.
The data: tiny-shakespeare when ../shared/data has it, else the default dataset, prepared on
first use (on a machine without network, prepare it first and pass data.dir=...).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "scripts"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench import LOCAL_TINYSHAKESPEARE, prepare_data  # noqa: E402
from benchmarks.bare import BareLoop  # noqa: E402
from benchmarks.harness import step_bookkeeping, sync  # noqa: E402
from benchmarks.kernels import kernel_rows  # noqa: E402
from benchmarks.memory import PeakMemory  # noqa: E402
from benchmarks.watch import flight_recorder, straggler_sample  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from trainer.config.compose import compose  # noqa: E402
from trainer.config.schema import PARALLEL_MODES  # noqa: E402
from trainer.data.shard_reader import open_split  # noqa: E402
from trainer.fit.run import Run  # noqa: E402
from trainer.observe.flops import device_peak_flops  # noqa: E402
from trainer.plan.memory import estimate  # noqa: E402
from trainer.process.runtime import Runtime, init_runtime  # noqa: E402

GiB = 1024**3
MODELS = {"full": ("gpt2_124m", "llama_135m"), "tiny": ("tiny", "llama_tiny")}
BATCHES = {"full": (16, 32, 64), "tiny": (2, 4, 8)}
SEQ = {"full": 1024, "tiny": 64}
# The settings whose defaults this benchmark chooses (trainer/config/schema.py TrainConfig), tried one at a time.
CHOICES = ("train.compile_mode=reduce-overhead", "train.loss_chunks=4")
SECTIONS = ("memory", "modes", "throughput", "muon", "lion", "mixture", "choices", "watch", "kernels")
# The mixture row's sources (--mix): the default dataset and tinyshakespeare, prepared when missing.
MIX = "shakespeare:0.7,tinyshakespeare:0.3"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny models, short sequences, no compile (a smoke run)")
    p.add_argument("--budget-s", type=float, default=400.0,
                   help="seconds for the rows: a row starts only when one like it still fits")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured steps first (compilation happens here)")
    p.add_argument("--rounds", type=int, default=3, help="alternations of dtrain and the bare loop")
    p.add_argument("--block", type=int, default=5, help="steps per block")
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"which rows, comma-separated (default all: {','.join(SECTIONS)})")
    p.add_argument("--batches", default=None,
                   help="the micro batches of the throughput rows, comma-separated (default 16,32,64; tiny 2,4,8)")
    p.add_argument("--mix", default=MIX,
                   help=f"the mixture row's sources in data.dir, NAME:WEIGHT,... (default {MIX}; a "
                        "conf/data preset is prepared when missing, any other name must be prepared)")
    p.add_argument("overrides", nargs="*", help="dtrain config overrides (key=value), e.g. data.dir=...")
    args = p.parse_args(argv)
    args.sections = set(args.sections.split(","))
    if not args.sections <= set(SECTIONS):
        p.error(f"--sections: unknown {', '.join(sorted(args.sections - set(SECTIONS)))}; choose from {SECTIONS}")
    return args


class Bench:
    def __init__(self, args, rt: Runtime):
        self.args, self.rt = args, rt
        self.size = "tiny" if args.tiny else "full"
        self.compile = not args.tiny  # compiling on a CPU smoke run costs minutes and shows nothing
        self.deadline = time.monotonic() + args.budget_s
        self.peak_flops = device_peak_flops(rt.device) if rt.device.type == "cuda" else None
        self.rows: list[dict] = []
        self.adamw_ms: dict[tuple, float] = {}
        self.default_peak: dict[tuple, int] = {}

    def cfg(self, model: str, batch: int, *extra: str, data: list[str] | None = None):
        """The benchmark's config; `data` replaces its dataset and the user's data overrides but data.dir."""
        user = list(self.args.overrides)
        if data is None:
            data = []
            if not any(o.startswith("data") for o in user) and LOCAL_TINYSHAKESPEARE.exists():
                data = ["data=tinyshakespeare", f"data.source={LOCAL_TINYSHAKESPEARE}"]
        else:
            user = [o for o in user if not o.startswith("data") or o.startswith("data.dir=")]
        return compose([f"model={model}", "model.pad_vocab_multiple=64", f"train.micro_batch_size={batch}",
                        f"train.seq_len={SEQ[self.size]}", "train.grad_accum_steps=1",
                        f"train.device={self.args.device}",
                        "train.max_steps=100000", "train.sample_tokens=0", "train.val_interval=0",
                        "train.val_tokens=0", "train.progress=false", "optim.warmup_steps=10",
                        f"train.compile={str(self.compile).lower()}", *data, *user, *extra])

    def row(self, section: str, case: str, dtrain: str, other: str = "-", ratio: str = "-", **figures) -> None:
        self.rows.append(dict(section=section, case=case, dtrain=dtrain, other=other, ratio=ratio, **figures))
        # each row as it lands (and in --json): a run stopped at its time limit keeps what it measured
        print(f"bench-gpu row | {section} | {case} | {dtrain} | {other} | {ratio}", flush=True)
        if self.args.json:
            self.args.json.write_text(json.dumps({"rows": self.rows}, indent=1, default=str))

    def guarded(self, section: str, case: str, measure, expected_s: float = 0.0) -> None:
        """Run one row's measurement unless the budget is spent or too short for what a row like
        it took before (`expected_s`); a failure is a row, not the end."""
        if section not in self.args.sections:
            return
        left = self.deadline - time.monotonic()
        if left <= 0 or left < expected_s:
            self.row(section, case, f"skipped: {max(0.0, left):.0f} s of the budget left")
            return
        try:
            measure()
        except Exception as e:  # noqa: BLE001 - one failing case must not lose the other rows
            self.row(section, case, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
        finally:
            gc.collect()
            if self.rt.device.type == "cuda":
                torch.cuda.empty_cache()
            torch._dynamo.reset()  # each case compiles for its own shapes (no dynamic-shape kernels)

    # --- the rows ------------------------------------------------------------------------------
    def run(self) -> list[dict]:
        """The cheap rows first (eager memory, modes), then the compiled throughput rows in order of
        interest (micro batch 32, Muon, 16, 64), each only when a row like it still fits."""
        models, batches = MODELS[self.size], BATCHES[self.size]
        mid = batches[1]
        chosen = [int(b) for b in self.args.batches.split(",")] if self.args.batches else batches
        for model in models:
            for batch in batches[:2]:
                self.guarded("memory", f"{model} B={batch} eager", lambda m=model, b=batch: self.memory(m, b))
        plain, self.rt = self.rt, init_runtime(self.args.device, True, 300, None)  # one-process NCCL (gloo)
        for mode in PARALLEL_MODES:
            self.guarded("modes", f"{mode} world 1", lambda m=mode: self.mode(m, models[0], batches[0]))
        self.rt.shutdown()  # its group goes before the process exits (NCCL warns of a leak otherwise)
        self.rt = plain  # dtrain's none against the bare loop: no process group for either
        took = 0.0
        for batch in sorted(chosen, key=lambda b: (b != mid, b)):  # the middle batch first, then by size
            for model in models:
                t0 = time.monotonic()
                self.guarded("throughput", f"{model} B={batch}", lambda m=model, b=batch: self.throughput(m, b), took)
                took = max(took, time.monotonic() - t0)
            if batch == mid:
                for section, variant in (("muon", lambda: ["optim=muon"]), ("lion", lambda: ["optim=lion"]),
                                         ("mixture", self.mixture_data)):
                    self.guarded(section, f"{models[0]} B={mid}",
                                 lambda s=section, v=variant: self.variant(s, models[0], mid, v()), took / 2)
                for choice in (c for c in CHOICES if self.compile or "compile_mode" not in c):  # needs compile
                    self.guarded("choices", f"{models[0]} B={mid} {choice}",
                                 lambda c=choice: self.choice(models[0], mid, c), took / 2)
                self.guarded("watch", f"{models[0]} B={mid} straggler sample",
                             lambda: straggler_sample(self, models[0], mid), took / 2)
                self.guarded("watch", f"{models[0]} B={batches[0]} flight recorder",
                             lambda: flight_recorder(self, models[0], batches[0]), took / 2)
        if "kernels" in self.args.sections:
            kernel_rows(self)
        return self.rows

    def throughput(self, model: str, batch: int) -> None:
        cfg = self.cfg(model, batch)
        with tempfile.TemporaryDirectory(prefix="dtrain-bench-gpu-") as run_dir:
            peak = PeakMemory(self.rt.device)
            peak.start()
            run = Run(cfg, self.rt, Path(run_dir))
            steplog, metrics = step_bookkeeping(run, Path(run_dir))
            counter = {"dtrain": 0, "bare": 0}

            def dtrain_steps(n):
                for _ in range(n):
                    steplog.after_step(*run.train_step(counter["dtrain"]))
                    counter["dtrain"] += 1

            dtrain_steps(self.args.warmup)
            sync(self.rt.device)
            measured_peak = peak.peak_growth()  # dtrain alone, before the bare loop exists
            bare = BareLoop(cfg, self.rt, np.concatenate(open_split(cfg.data, "train")), 1)

            def bare_steps(n):
                for _ in range(n):
                    bare.step(counter["bare"])
                    counter["bare"] += 1

            loops = {"dtrain": dtrain_steps, "bare": bare_steps}
            bare_steps(self.args.warmup)
            seconds = self.alternate(loops)
            profiled = {name: self.profile(fn) for name, fn in loops.items()}
            metrics.close()
            flops_per_token = run.flops_per_token
        tokens = batch * cfg.train.seq_len
        fig = {}
        for name in loops:
            s = statistics.median(seconds[name])
            kernel_s, forward_host_s = profiled[name]
            fig[name] = dict(ms=s * 1e3, tokens_per_s=tokens / s,
                             mfu=flops_per_token * tokens / s / self.peak_flops if self.peak_flops else None,
                             gpu_busy=kernel_s / s if kernel_s is not None else None,
                             forward_host_ms=forward_host_s * 1e3 if forward_host_s is not None else None)
        self.adamw_ms[(model, batch)] = fig["dtrain"]["ms"]
        self.default_peak[(model, batch)] = measured_peak
        ratio = fig["dtrain"]["tokens_per_s"] / fig["bare"]["tokens_per_s"]
        self.row("throughput", f"{model} B={batch}", _speed(fig["dtrain"]), _speed(fig["bare"]), f"{ratio:.3f}x",
                 figures=fig)
        if self.compile and batch in BATCHES[self.size][:2]:  # the eager rows: the memory section
            self.memory_row(cfg, model, batch, "compiled" if self.compile else "eager", measured_peak)

    def alternate(self, loops: dict) -> dict[str, list[float]]:
        """Seconds per step of each loop, block by block, the order alternating each round."""
        seconds = {name: [] for name in loops}
        for r in range(self.args.rounds):
            for name in (list(loops) if r % 2 == 0 else list(loops)[::-1]):
                sync(self.rt.device)
                t0 = time.perf_counter()
                loops[name](self.args.block)
                sync(self.rt.device)
                seconds[name].append((time.perf_counter() - t0) / self.args.block)
        return seconds

    def profile(self, steps, n: int = 3) -> tuple[float | None, float | None]:
        """Per step over `n` profiled steps: CUDA kernel time (None off CUDA) and the host time of
        the compiled forward's call (dynamo's "Torch-Compiled Region"; None when nothing is compiled)."""
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.rt.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        sync(self.rt.device)
        with torch.profiler.profile(activities=activities) as prof:
            steps(n)
            sync(self.rt.device)
        events = prof.events()
        kernels = [e.time_range.elapsed_us() for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        compiled = [e.time_range.elapsed_us() for e in events if e.name.startswith("Torch-Compiled Region")]
        return (sum(kernels) / 1e6 / n if kernels else None, sum(compiled) / 1e6 / n if compiled else None)

    def mixture_data(self) -> list[str]:
        """data=mix over --mix's sources in the user's data.dir, a conf/data preset prepared first as
        `dtrain prepare` would (tinyshakespeare from ../shared when it is there)."""
        where = [o for o in self.args.overrides if o.startswith("data.dir=")]
        sources = dict(item.split(":") for item in self.args.mix.split(","))
        for name in sources:
            if (REPO / "conf" / "data" / f"{name}.yaml").exists():
                local = [f"data.source={LOCAL_TINYSHAKESPEARE}"] if name == "tinyshakespeare" and \
                    LOCAL_TINYSHAKESPEARE.exists() else []
                prepare_data(compose([f"data={name}", *local, *where]))
        mix = "{" + ", ".join(f"{name}: {weight}" for name, weight in sources.items()) + "}"
        return ["data=mix", f"data.mix={mix}", *where]

    def variant(self, section: str, model: str, batch: int, overrides: list[str]) -> None:
        """dtrain's step with another optimizer or dataset, against its default step (the
        throughput row of the same model and micro batch: AdamW on one dataset)."""
        optim = [o for o in overrides if o.startswith("optim=")]
        cfg = self.cfg(model, batch, *optim, data=[o for o in overrides if o not in optim] or None)
        with tempfile.TemporaryDirectory(prefix="dtrain-bench-gpu-") as run_dir:
            run = Run(cfg, self.rt, Path(run_dir))
            steplog, metrics = step_bookkeeping(run, Path(run_dir))

            def steps(n, start=[0]):  # noqa: B006 - the step counter lives across calls
                for _ in range(n):
                    steplog.after_step(*run.train_step(start[0]))
                    start[0] += 1

            steps(self.args.warmup)
            ms = statistics.median(self.alternate({section: steps})[section]) * 1e3
            metrics.close()
        default = self.adamw_ms.get((model, batch))
        self.row(section, f"{model} B={batch} {' '.join(overrides)}", f"{ms:.1f} ms/step",
                 f"adamw, one dataset {default:.1f} ms/step" if default else "-",
                 f"{ms / default:.3f}x" if default else "-", figures=dict(ms=ms, default_ms=default))

    def choice(self, model: str, batch: int, override: str) -> None:
        """dtrain's step with one setting changed, against its default step (the throughput row)."""
        cfg = self.cfg(model, batch, override)
        with tempfile.TemporaryDirectory(prefix="dtrain-bench-gpu-") as run_dir:
            peak = PeakMemory(self.rt.device)
            peak.start()
            run = Run(cfg, self.rt, Path(run_dir))
            steplog, metrics = step_bookkeeping(run, Path(run_dir))
            done = [0]

            def steps(n):
                for _ in range(n):
                    loss, *rest = run.train_step(done[0])
                    steplog.after_step(loss, *rest)
                    done[0] += 1
                    done.append(loss)

            steps(self.args.warmup + 2)  # CUDA graphs record after warm-up runs of their own
            sync(self.rt.device)
            measured_peak = peak.peak_growth()
            ms = statistics.median(self.alternate({override: steps})[override]) * 1e3
            loss = float(done[-1])
            metrics.close()
        base_ms, base_peak = self.adamw_ms.get((model, batch)), self.default_peak.get((model, batch))
        other = f"default {base_ms:.1f} ms/step, {base_peak / GiB:.2f} GiB" if base_ms and base_peak else "-"
        self.row("choices", f"{model} B={batch} {override}",
                 f"{ms:.1f} ms/step, {measured_peak / GiB:.2f} GiB, loss {loss:.4f} at step {done[0]}", other,
                 f"{ms / base_ms:.3f}x" if base_ms else "-",
                 figures=dict(ms=ms, peak_bytes=measured_peak, loss=loss, steps=done[0],
                              default_ms=base_ms, default_peak_bytes=base_peak))

    def memory(self, model: str, batch: int) -> None:
        cfg = self.cfg(model, batch, "train.compile=false")
        with tempfile.TemporaryDirectory(prefix="dtrain-bench-gpu-") as run_dir:
            peak = PeakMemory(self.rt.device)
            peak.start()
            run = Run(cfg, self.rt, Path(run_dir))
            for step in range(self.args.warmup):
                loss, _, _ = run.train_step(step)
            float(loss)
            measured = peak.peak_growth()
            del run
        self.memory_row(cfg, model, batch, "eager", measured)

    def memory_row(self, cfg, model: str, batch: int, how: str, measured: int) -> None:
        est = estimate(cfg, "none", 1, batch, self.rt.device.type)
        planned = est.allocated if self.rt.device.type == "cuda" else est.total
        what = "max_memory_allocated" if self.rt.device.type == "cuda" else "RSS growth"
        self.row("memory", f"{model} B={batch} {how}", f"{measured / GiB:.2f} GiB {what}",
                 f"plan {planned / GiB:.2f} GiB", f"{planned / measured:.3f}x" if measured > 0 else "-",
                 figures=dict(measured_bytes=measured, plan_bytes=planned))

    def mode(self, mode: str, model: str, batch: int) -> None:
        cfg = self.cfg(model, batch, f"parallel={mode}", "world=1", "train.compile=false")
        with tempfile.TemporaryDirectory(prefix="dtrain-bench-gpu-") as run_dir:
            run = Run(cfg, self.rt, Path(run_dir))
            for step in range(2):
                run.train_step(step)
            sync(self.rt.device)
            t0 = time.perf_counter()
            for step in range(2, 5):
                loss, _, _ = run.train_step(step)
            loss = float(loss)
            seconds = (time.perf_counter() - t0) / 3
            del run
        backend = "nccl" if self.rt.device.type == "cuda" else "gloo"
        self.row("modes", f"{mode} world 1 ({backend})", f"{batch * cfg.train.seq_len / seconds:,.0f} tok/s",
                 f"loss {loss:.3f}", "ok", figures=dict(seconds_per_step=seconds, loss=loss))


def _speed(f: dict) -> str:
    text = f"{f['tokens_per_s']:,.0f} tok/s, {f['ms']:.1f} ms"
    if f["mfu"] is not None:
        text += f", MFU {f['mfu']:.1%}"
    if f["gpu_busy"] is not None:
        text += f", GPU busy {f['gpu_busy']:.0%}"
    if f["forward_host_ms"] is not None:
        text += f", compiled forward's host {f['forward_host_ms']:.1f} ms"
    return text


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"bench-gpu: no CUDA device visible (torch {torch.__version__}); nothing measured "
              "(--device cpu --tiny runs the same code on a CPU)", file=sys.stderr)
        return 2
    started = time.monotonic()
    bench = Bench(args, init_runtime(args.device, False, 300, None))
    prepare_data(bench.cfg(MODELS[bench.size][0], 1))
    rows = bench.run()
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    title = (f"dtrain on {device}, torch {torch.__version__}, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, "
             f"seq {SEQ[bench.size]}, {'compiled' if bench.compile else 'eager'}, "
             f"{time.monotonic() - started:.0f} s")
    table = Table(title=title)
    for col in ("section", "case", "dtrain", "bare loop / reference", "ratio"):
        table.add_column(col, justify="right" if col == "ratio" else "left")
    for r in rows:
        table.add_row(r["section"], r["case"], r["dtrain"], r["other"], r["ratio"])
    Console(width=200).print(table)
    if args.json:
        args.json.write_text(json.dumps({"title": title, "rows": rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
