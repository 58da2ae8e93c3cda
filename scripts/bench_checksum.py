#!/usr/bin/env python
"""What checkpoint checksums cost: save time vs checksum time, load time vs verify time (one process, CPU).

    .venv/bin/python scripts/bench_checksum.py [--model gpt2_124m] [--algos crc32,sha256,blake2b]
                                               [--repeats 2] [--dir /tmp/dtrain-bench-checksum]

Builds the model with its full AdamW state (one optimizer step on zero gradients), then, `repeats`
times: a DCP save of model + optimizer state (what Checkpointer.save writes), each algorithm's
checksum of the files right after (while they are in the page cache, as the save does), a DCP
load into a fresh model and optimizer, and the verification a restore runs before loading (with
the default algorithm). Prints the best time of each and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed.checkpoint as dcp

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from trainer.checkpoint.integrity import (  # noqa: E402
    ALGORITHMS,
    CHECKSUM_ALGO,
    checksum_files,
    marker_record,
    verify_checkpoint_files,
)
from trainer.checkpoint.layout import MARKER, latest_checkpoint  # noqa: E402
from trainer.checkpoint.manager import Checkpointer  # noqa: E402
from trainer.checkpoint.verify import SafeReader  # noqa: E402
from trainer.config.compose import compose  # noqa: E402
from trainer.config.schema import batch_plan  # noqa: E402
from trainer.fit.run import TrainState  # noqa: E402
from trainer.io import write_durable  # noqa: E402
from trainer.model.gpt import build_model  # noqa: E402
from trainer.optim.build import build_optimizer  # noqa: E402
from trainer.parallel import make_strategy  # noqa: E402
from trainer.process.runtime import Runtime  # noqa: E402


def build(cfg, rt):
    torch.manual_seed(0)
    strategy = make_strategy(cfg.parallel, cfg.train, rt)
    model = strategy.wrap(build_model(cfg.model))
    optimizer = build_optimizer(model, cfg.optim, strategy)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()  # allocates AdamW's state (exp_avg, exp_avg_sq) for every parameter
    optimizer.zero_grad(set_to_none=True)
    return strategy, model, optimizer


class _Loader:
    def state_dict(self):
        return {"epoch": 0, "shard_pos": 0, "token_offset": 0}


def checkpointer_saves(cfg, rt, strategy, model, optimizer, run_dir: Path) -> tuple[float, float]:
    """The real Checkpointer.save: (how long it blocks the training thread with checksums hashed in
    the background, how long until the checkpoint is published with its checksums)."""
    run = SimpleNamespace(strategy=strategy, model=model, optimizer=optimizer, train_loader=_Loader(),
                          state=TrainState(step=1, tokens=0), plan=batch_plan(cfg, 1))
    checkpointer = Checkpointer(cfg, rt, run_dir)
    start = time.perf_counter()
    checkpointer.save(run, wait=False)
    stall = time.perf_counter() - start
    checkpointer.close()
    published = time.perf_counter() - start
    assert latest_checkpoint(run_dir) is not None and verify_checkpoint_files(latest_checkpoint(run_dir))
    return stall, published


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt2_124m")
    parser.add_argument("--algos", default=",".join(ALGORITHMS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", default="/tmp/dtrain-bench-checksum")
    args = parser.parse_args()
    cfg = compose([f"model={args.model}", "parallel=none", "train.device=cpu"])
    rt = Runtime(rank=0, local_rank=0, world=1, local_world=1, device=torch.device("cpu"), distributed=False)
    strategy, model, optimizer = build(cfg, rt)
    tensors = {"model": strategy.model_state_dict(model), "optim": strategy.optimizer_state_dict(model, optimizer)}
    fresh_strategy, fresh_model, fresh_optimizer = build(cfg, rt)
    algos = args.algos.split(",")
    best: dict[str, float] = {}

    def keep_best(key: str, seconds: float) -> None:
        best[key] = min(best.get(key, float("inf")), seconds)

    folder = Path(args.dir)
    try:
        for _ in range(args.repeats):
            shutil.rmtree(folder, ignore_errors=True)
            keep_best("save", timed(lambda: dcp.save(tensors, checkpoint_id=folder)))
            names = sorted(p.name for p in folder.iterdir())
            for algo in algos:
                keep_best(algo, timed(lambda a=algo, n=names: checksum_files(folder, n, a)))
            record = marker_record(folder, 1, 1, 1, checksum_files(folder, names))
            write_durable(folder / MARKER, json.dumps(record))
            template = {
                "model": fresh_strategy.model_state_dict(fresh_model),
                "optim": fresh_strategy.optimizer_state_template(fresh_model, fresh_optimizer),
            }
            keep_best("load", timed(lambda t=template: dcp.load(t, storage_reader=SafeReader(folder))))
            keep_best("verify", timed(lambda: verify_checkpoint_files(folder)))
            size = sum(p.stat().st_size for p in folder.iterdir())
            shutil.rmtree(folder, ignore_errors=True)
            stall, published = checkpointer_saves(cfg, rt, strategy, model, optimizer, folder)
            keep_best("stall", stall)
            keep_best("published", published)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"\n{args.model} ({params:.1f}M params + AdamW state, {size / 2**20:,.0f} MiB on disk), "
          f"{os.cpu_count()} CPU cores, best of {args.repeats}\n")
    print("| step | seconds | vs save |")
    print("|---|---|---|")
    print(f"| DCP save | {best['save']:.2f} | 1 |")
    for algo in algos:
        mark = " (default)" if algo == CHECKSUM_ALGO else ""
        print(f"| checksum {algo}{mark} | {best[algo]:.3f} | {best[algo] / best['save']:.1%} |")
    print(f"| Checkpointer.save: training thread blocked (checksums in the background) | {best['stall']:.2f} | "
          f"{best['stall'] / best['save']:.0%} |")
    print(f"| Checkpointer.save: published with checksums | {best['published']:.2f} | "
          f"{best['published'] / best['save']:.0%} |")
    print(f"\n| step | seconds | vs load |\n|---|---|---|\n| DCP load | {best['load']:.2f} | 1 |")
    print(f"| verify ({CHECKSUM_ALGO}) | {best['verify']:.3f} | {best['verify'] / best['load']:.1%} |")


if __name__ == "__main__":
    main()
