#!/usr/bin/env python
"""dtrain's benchmark: throughput, step-time split and memory per rank for each parallel mode.

    python scripts/bench.py --model tiny --modes none,ddp,zero,fsdp --worlds 1,2 --steps 5 \\
        --micro-batch 8 --seq-len 128 [key=value config overrides ...]
    python scripts/bench.py --vs-bare --model tiny --modes none,ddp --worlds 1,2
    python scripts/bench.py --tokenize

Every configuration runs in fresh worker processes started through torchrun's engine
(elastic_launch, c10d rendezvous on localhost:0), building the same `Run` as `dtrain train`
(scripts/benchmarks/workers.py says what each column measures). `--model cpu16m` is a ~16M-parameter CPU
model (4 layers, 256 wide, block 256, vocabulary padded to 50304). Without data overrides the
benchmark trains on tiny-shakespeare when a local copy is found, else on the default dataset.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.bare import vs_bare_worker  # noqa: E402
from benchmarks.tokenize_speed import benchmark_tokenize  # noqa: E402
from benchmarks.workers import bench_worker  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from trainer.config.compose import compose  # noqa: E402
from trainer.config.schema import PARALLEL_MODES, to_dict  # noqa: E402
from trainer.config.validation import validate  # noqa: E402
from trainer.data.layout import MANIFEST, dataset_dir  # noqa: E402
from trainer.errors import UserError  # noqa: E402
from trainer.launch.workers import run_workers  # noqa: E402
from trainer.parallel import strategy_class  # noqa: E402
from trainer.plan.memory import estimate  # noqa: E402
from trainer.prepare.pipeline import is_prepared, prepare  # noqa: E402

MODEL_ALIASES = {
    # ~16M parameters: the larger CPU model of the benchmark figures (FACTS.md)
    "cpu16m": ["model=cpu_small", "model.n_layer=4", "model.n_head=4", "model.n_embd=256",
               "model.block_size=256", "model.pad_vocab_multiple=64", "model.name=cpu16m"],
}
LOCAL_TINYSHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
MiB = 1024**2
console = Console(width=max(Console().width, 170))  # the table is wide; logs are not terminals


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="conf/model group name, or cpu16m (default tiny)")
    p.add_argument("--modes", default="none,ddp,zero,fsdp",
                   help="comma list of parallel modes, each at every --worlds, or MODE@WORLD pairs")
    p.add_argument("--worlds", default="1,2", help="comma list of world sizes")
    p.add_argument("--steps", type=int, default=5, help="measured optimizer steps per phase")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps first")
    p.add_argument("--repeat", type=int, default=1,
                   help="measure each configuration this many times (fresh workers each) and show the "
                        "median by tokens/s, with the range")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vs-bare", action="store_true", help="dtrain's step against a bare PyTorch loop")
    p.add_argument("--rounds", type=int, default=8,
                   help="--vs-bare: alternations of the two loops (the ratio is the median over rounds)")
    p.add_argument("--block", type=int, default=5, help="--vs-bare: steps per block")
    p.add_argument("--tokenize", action="store_true",
                   help="dtrain prepare's tokenizer against tiktoken's batch encoder")
    p.add_argument("--tokenize-mb", type=float, default=50.0,
                   help="--tokenize: megabytes of text (the pool's ~0.3 s start is timed too)")
    p.add_argument("--num-proc", type=int, default=None,
                   help="--tokenize: processes / threads (default: all cores)")
    p.add_argument("--json", type=Path, default=None, help="also write the raw figures here")
    p.add_argument("overrides", nargs="*", help="dtrain config overrides (key=value)")
    args = p.parse_args(argv)
    for o in args.overrides:
        if "=" not in o:
            p.error(f"config overrides are key=value, got {o!r}")
    return args


def base_overrides(args) -> list[str]:
    model = MODEL_ALIASES.get(args.model, [f"model={args.model}"])
    data = []
    if not any(o.split("=", 1)[0] == "data" or o.startswith("data.") for o in args.overrides):
        if LOCAL_TINYSHAKESPEARE.exists():
            data = ["data=tinyshakespeare", f"data.source={LOCAL_TINYSHAKESPEARE}"]
    return [*model, *data, f"train.micro_batch_size={args.micro_batch}", f"train.seq_len={args.seq_len}",
            "train.max_steps=1000", "train.sample_tokens=0", "train.progress=false", "train.val_interval=0",
            *args.overrides]


def compose_point(args, mode: str, world: int):
    cfg = compose([*base_overrides(args), f"parallel={mode}", f"world={world}"])
    validate(cfg)
    return cfg


def points(args) -> list[tuple[str, int]]:
    """(mode, world) pairs: every mode at every world (a mode whose workers do not train one model
    together, none and dp, only at world 1), or exactly the pairs given as MODE@WORLD in --modes."""
    try:
        worlds = [int(w) for w in args.worlds.split(",") if w.strip()]
    except ValueError:
        raise UserError(f"--worlds {args.worlds!r} must be a comma list of integers") from None
    out = []
    for item in (m.strip() for m in args.modes.split(",") if m.strip()):
        mode, _, at = item.partition("@")
        if mode not in PARALLEL_MODES:
            raise UserError(f"unknown mode {mode!r}; choose from {', '.join(PARALLEL_MODES)}")
        if at:
            if not at.isdigit() or int(at) < 1:
                raise UserError(f"--modes {item!r}: the world after @ must be a positive integer")
            out.append((mode, int(at)))
        else:
            out += [(mode, w) for w in worlds if w == 1 or strategy_class(mode).syncs_replicas]
    return out


def launch(cfg, world: int, entrypoint, extra: tuple) -> list[dict]:
    """Run entrypoint(cfg_dict, *extra) on `world` fresh workers; all ranks' figures."""
    cfg_dict = to_dict(cfg)
    with tempfile.TemporaryDirectory(prefix="dtrain-bench-") as run_dir:
        return run_workers(entrypoint, (cfg_dict, *extra), cfg_dict["launch"], world, Path(run_dir) / "logs",
                           fresh_processes=True)


def prepare_data(cfg) -> None:
    """As `dtrain train` does: prepare a dataset that has no shards yet, or one set to auto_prepare."""
    if not (dataset_dir(cfg.data) / MANIFEST).exists() or (cfg.data.auto_prepare and not is_prepared(cfg.data)):
        console.print(f"preparing dataset {cfg.data.name} ...")
        prepare(cfg.data)


def mib(n: float) -> str:
    return f"{n / MiB:,.1f}"


def ms(s: float) -> str:
    return f"{s * 1e3:,.1f}"


# ----------------------------------------------------------------------------------- the table
def run_table(args) -> list[dict]:
    rows = []
    for mode, world in points(args):
        cfg = compose_point(args, mode, world)
        prepare_data(cfg)
        runs = []
        for i in range(max(1, args.repeat)):
            console.print(f"[dim]measuring {cfg.model.name} parallel={mode} world={world} "
                          f"({i + 1}/{max(1, args.repeat)}) ...[/]")
            runs.append(summarize(cfg, mode, world, launch(cfg, world, bench_worker, (args.steps, args.warmup))))
        runs.sort(key=lambda r: r["tokens_per_s"])
        row = dict(runs[len(runs) // 2])
        row["tokens_per_s_range"] = [runs[0]["tokens_per_s"], runs[-1]["tokens_per_s"]]
        row["repeats"] = [{k: v for k, v in r.items() if k != "ranks"} for r in runs]
        rows.append(row)
    render_table(args, rows)
    render_goals(rows)
    return rows


def summarize(cfg, mode: str, world: int, ranks: list[dict]) -> dict:
    def mean(key):
        return sum(r[key] for r in ranks) / len(ranks)

    def worst(key):
        return max(r[key] for r in ranks)

    r0 = ranks[0]
    est = estimate(cfg, mode, world, cfg.train.micro_batch_size)
    return {
        "model": cfg.model.name, "mode": mode, "world": world, "threads": r0["threads"],
        "micro_batch": cfg.train.micro_batch_size, "seq_len": cfg.train.seq_len, "n_params": r0["n_params"],
        "tokens_per_s": r0["tokens"] / worst("elapsed_s"),
        "step_s": mean("step_s"), "compute_s": mean("compute_s"), "comm_s": mean("comm_s"),
        "optim_s": mean("optim_s"), "data_s": mean("data_s"),
        "peak_bytes": worst("peak_bytes"), "peak_exact": all(r["peak_exact"] for r in ranks),
        "param_bytes": worst("param_bytes"), "grad_bytes": worst("grad_bytes"),
        "optim_bytes": worst("optim_bytes"), "full_param_bytes": r0["full_param_bytes"],
        "full_optim_bytes": worst("full_optim_bytes"),
        "optim_share": worst("optim_bytes") / max(1, worst("full_optim_bytes")),
        "plan_bytes": est.total, "plan": est.as_dict(), "ranks": ranks,
    }


def tokens_cell(r: dict) -> str:
    lo, hi = r.get("tokens_per_s_range", (r["tokens_per_s"],) * 2)
    return f"{r['tokens_per_s']:,.0f}" + (f" ({lo:,.0f}-{hi:,.0f})" if hi > lo else "")


def render_table(args, rows: list[dict]) -> None:
    if not rows:
        return
    r = rows[0]
    table = Table(title=f"dtrain bench: {r['model']} ({r['n_params'] / 1e6:.2f}M params), micro batch "
                  f"{r['micro_batch']} x seq {r['seq_len']} per rank, {args.steps} steps"
                  + (f", median of {args.repeat} runs (range)" if args.repeat > 1 else ""))
    for col in ("mode", "world", "thr/rank", "tok/s", "step ms", "compute", "comm exp.", "optim", "data wait",
                "peak MiB/rank", "plan est.", "params MiB", "grads MiB", "optim MiB", "optim %"):
        table.add_column(col, justify="left" if col == "mode" else "right", no_wrap=True)
    for r in rows:
        table.add_row(
            r["mode"], str(r["world"]), str(r["threads"] or "-"), tokens_cell(r),
            ms(r["step_s"]), ms(r["compute_s"]), ms(r["comm_s"]), ms(r["optim_s"]),
            f"{ms(r['data_s'])} ({r['data_s'] / r['step_s']:.2%})",
            mib(r["peak_bytes"]) + ("" if r["peak_exact"] else "*"),
            f"{mib(r['plan_bytes'])} ({r['plan_bytes'] / max(1, r['peak_bytes']) - 1:+.0%})",
            mib(r["param_bytes"]), mib(r["grad_bytes"]), mib(r["optim_bytes"]), f"{r['optim_share']:.1%}",
        )
    console.print(table)
    console.print(
        "[dim]step ms = data wait + forward/backward (synced) + optim, per optimizer step, mean over ranks; "
        "compute = the same micro-steps on an unwrapped replica; "
        "comm exp. = synced forward/backward - compute; "
        "optim = clip + step (ZeRO's all-gather, FSDP's norm all-reduce included). peak = "
        + ("CUDA max_memory_allocated growth" if rows[0]["threads"] is None else
           "resident-set (VmHWM) growth of the worker from just before the model is built")
        + ", worst rank; plan est. = `dtrain plan`'s estimate of that peak. params/grads/optim = bytes this "
        "rank holds (grads right after the last backward); optim % = the worst rank's optimizer state as a "
        "share of the full, unsharded state.[/]"
    )


def plain_single_process(mode: str) -> bool:
    """A mode that trains in one process on one device (the baseline that scaling is measured against)."""
    kind = strategy_class(mode)
    return not (kind.syncs_replicas or kind.one_process_many_devices)


def render_goals(rows: list[dict]) -> None:
    by = {(r["mode"], r["world"]): r for r in rows}
    lines = []
    single = next((r for (mode, world), r in by.items() if world == 1 and plain_single_process(mode)), None)
    for (mode, world), r in sorted(by.items()):
        if world == 1:
            continue
        kind = strategy_class(mode)
        label = f"{mode.upper()} world {world}"
        if kind.syncs_replicas and not (kind.shards_parameters or kind.shards_optimizer_state) and single:
            ratio = r["tokens_per_s"] / single["tokens_per_s"]
            lines.append(f"{label} ({r['threads']} thread/rank) vs one process "
                         f"({single['threads']} threads): {ratio:.3f}x tokens/s (goal >= 0.9) "
                         f"{'ok' if ratio >= 0.9 else 'MISSED'}")
        if kind.shards_optimizer_state and not kind.shards_parameters:
            share = r["optim_share"]
            lines.append(f"{label}: optimizer state per rank (worst) = {share:.3f} of the full state "
                         f"(goal <= {1 / world:.3f} x 1.02 = {1.02 / world:.3f}) "
                         f"{'ok' if share <= 1.02 / world else 'MISSED'}")
        if kind.shards_parameters:
            held = r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"]
            share = held / (r["full_param_bytes"] * 2 + r["full_optim_bytes"])
            lines.append(f"{label}: params+grads+optimizer per rank (worst) = {share:.3f} of the full "
                         f"(goal <= {1.05 / world:.3f}) {'ok' if share <= 1.05 / world else 'MISSED'}")
    for r in rows:
        if r["step_s"] > 0 and r["data_s"] / r["step_s"] >= 0.01:
            lines.append(f"data wait {r['mode']} w{r['world']}: {r['data_s'] / r['step_s']:.2%} of the step "
                         "(goal < 1%) MISSED")
    if lines:
        console.print("\n".join(lines))


# --------------------------------------------------------------------------------- vs bare loop
def run_vs_bare(args) -> list[dict]:
    table = Table(title=f"dtrain step vs bare PyTorch loop ({args.rounds} rounds x {args.block} steps each, "
                  "alternating in the same process)")
    for col in ("model", "mode", "world", "thr/rank", "dtrain tok/s", "bare tok/s", "ratio (median, range)"):
        table.add_column(col, justify="left" if col in ("model", "mode") else "right")
    rows = []
    for mode, world in points(args):
        cfg = compose_point(args, mode, world)
        prepare_data(cfg)
        console.print(f"[dim]dtrain vs bare: {cfg.model.name} parallel={mode} world={world} ...[/]")
        ranks = launch(cfg, world, vs_bare_worker, (args.rounds, args.block, args.warmup))
        tokens = ranks[0]["tokens_per_block"]
        # A round lasts as long as its slowest rank.
        dtrain_s = [max(r["dtrain_s"][i] for r in ranks) for i in range(args.rounds)]
        bare_s = [max(r["bare_s"][i] for r in ranks) for i in range(args.rounds)]
        ratios = sorted(b / d for d, b in zip(dtrain_s, bare_s))
        ratio = statistics.median(ratios)
        dtrain = tokens * args.rounds / sum(dtrain_s)
        bare = tokens * args.rounds / sum(bare_s)
        row = {"model": cfg.model.name, "mode": mode, "world": world, "threads": ranks[0]["threads"],
               "dtrain_tokens_per_s": dtrain, "bare_tokens_per_s": bare, "ratio": ratio,
               "round_ratios": ratios, "ranks": ranks}
        rows.append(row)
        table.add_row(row["model"], mode, str(world), str(row["threads"] or "-"), f"{dtrain:,.0f}",
                      f"{bare:,.0f}", f"{ratio:.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f})"
                      + ("" if ratio >= 0.97 else " (goal 0.97)"))
    console.print(table)
    return rows


# ------------------------------------------------------------------------------------ tokenizer
def tokenize_texts(megabytes: float) -> list[str]:
    """Documents of ~64 KB cut from tiny-shakespeare (or generated text), repeated to `megabytes`."""
    if LOCAL_TINYSHAKESPEARE.exists():
        text = LOCAL_TINYSHAKESPEARE.read_text()
    else:
        rng = random.Random(0)
        words = "the king hath spoken and my lord shall come to the court of rome where all cry".split()
        text = "\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(20000))
    paragraphs = text.split("\n\n")
    docs, cur, size = [], [], 0
    for para in paragraphs:
        cur.append(para)
        size += len(para) + 2
        if size >= 1 << 16:
            docs.append("\n\n".join(cur))
            cur, size = [], 0
    if cur:
        docs.append("\n\n".join(cur))
    out, total = [], 0
    target = int(megabytes * 1e6)
    while total < target:
        for d in docs:
            out.append(d)
            total += len(d)
            if total >= target:
                break
    return out


def run_tokenize(args) -> dict:
    texts = tokenize_texts(args.tokenize_mb)
    benchmark_tokenize(texts[:4], args.num_proc)  # load the encoding, warm the pool path
    r = benchmark_tokenize(texts, args.num_proc)
    table = Table(title=f"tokenizing {r['chars'] / 1e6:.1f}M characters in {len(texts)} documents, "
                  f"{r['num_proc']} processes / threads")
    for col in ("encoder", "seconds", "tokens/s"):
        table.add_column(col, justify="left" if col == "encoder" else "right")
    table.add_row("tiktoken encode_ordinary_batch (threads)", f"{r['tiktoken_batch_s']:.2f}",
                  f"{r['tiktoken_tokens_per_s']:,.0f}")
    table.add_row("dtrain prepare (process pool)", f"{r['pool_s']:.2f}", f"{r['pool_tokens_per_s']:,.0f}")
    console.print(table)
    console.print(f"ratio {r['ratio']:.3f} (goal >= 0.9) {'ok' if r['ratio'] >= 0.9 else 'MISSED'}; "
                  f"same tokens: {r['tokens_match']}")
    return r


def machine_state() -> dict:
    """1-minute load average and CPU time (s) stolen by the hypervisor so far: how quiet it was."""
    state = {"load_1min": None, "steal_s": None}
    try:
        with open("/proc/loadavg") as f:
            state["load_1min"] = float(f.read().split()[0])
        with open("/proc/stat") as f:
            fields = f.readline().split()
        state["steal_s"] = int(fields[8]) / os.sysconf("SC_CLK_TCK") if len(fields) > 8 else None
    except (OSError, ValueError):
        pass
    return state


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    start, t0 = machine_state(), time.perf_counter()
    console.print(f"[dim]load average (1 min) at start: {start['load_1min']}; {os.cpu_count()} cores[/]")
    out: dict = {"argv": sys.argv[1:], "load_at_start": start["load_1min"],
                 "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    try:
        if args.tokenize:
            out["tokenize"] = run_tokenize(args)
        if args.vs_bare:
            out["vs_bare"] = run_vs_bare(args)
        if not (args.tokenize or args.vs_bare):
            out["table"] = run_table(args)
    except UserError as err:
        console.print(f"[bold red]error:[/] {err}")
        return 2
    end, wall = machine_state(), time.perf_counter() - t0
    out["load_at_end"] = end["load_1min"]
    if start["steal_s"] is not None and end["steal_s"] is not None:
        out["steal_fraction"] = (end["steal_s"] - start["steal_s"]) / (wall * (os.cpu_count() or 1))
    console.print(f"[dim]{wall:.0f} s; load average (1 min) at end: {end['load_1min']}"
                  + (f"; CPU time stolen by the hypervisor: {out['steal_fraction']:.1%}" if "steal_fraction" in out
                     else "") + "[/]")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
