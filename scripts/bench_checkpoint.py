#!/usr/bin/env python
"""Checkpoint save / load time and size per parallel mode, and the training stall of an async save.

    .venv/bin/python scripts/bench_checkpoint.py [--model gpt2_124m] [--modes none,ddp,zero,fsdp]
                                                 [--world 2] [--dir /tmp/dtrain-bench-ckpt]

For each mode it builds the model and strategy on `world` workers (one for a mode whose workers
do not train one model together, like `none`), started fresh through trainer.launch.workers like every
benchmark, gives the optimizer its full AdamW state with one step on zero gradients (no training),
then times, with the real Checkpointer: a synchronous save, an async save (the stall: how long
`save()` blocks the training thread; and the time until it is published), and a restore into a
fresh model and optimizer. Times are rank 0's wall clock between barriers. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.harness import on_every_rank  # noqa: E402

from trainer.checkpoint.layout import latest_checkpoint  # noqa: E402
from trainer.checkpoint.manager import Checkpointer  # noqa: E402
from trainer.config.batch import batch_plan  # noqa: E402
from trainer.config.compose import compose  # noqa: E402
from trainer.config.schema import from_dict, to_dict  # noqa: E402
from trainer.fit.run import TrainState  # noqa: E402
from trainer.launch.workers import run_workers  # noqa: E402
from trainer.model.gpt import build_model  # noqa: E402
from trainer.optim.build import build_optimizer  # noqa: E402
from trainer.parallel import make_strategy, strategy_class  # noqa: E402


class _Loader:
    def state_dict(self):
        return {"epoch": 0, "shard_pos": 0, "token_offset": 0}

    def load_state_dict(self, state):
        pass


def _build(cfg, rt):
    torch.manual_seed(0)
    strategy = make_strategy(cfg.parallel, cfg.train, rt)
    model = strategy.wrap(build_model(cfg.model))
    optimizer = build_optimizer(model, cfg.optim, strategy)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()  # allocates AdamW's state (exp_avg, exp_avg_sq) for every parameter
    optimizer.zero_grad(set_to_none=True)
    return SimpleNamespace(strategy=strategy, model=model, optimizer=optimizer, train_loader=_Loader(),
                           state=TrainState(step=1, tokens=0), plan=batch_plan(cfg, 1))


def _timed(rt, fn) -> float:
    rt.barrier()
    start = time.perf_counter()
    fn()
    rt.barrier()
    return time.perf_counter() - start


def checkpoint_worker(sync_cfg: dict, async_cfg: dict, run_dir: str) -> list[dict]:
    """Time the saves and the restore on this rank; every rank returns all ranks' figures."""
    return on_every_rank(sync_cfg, _measure, from_dict(async_cfg), Path(run_dir))


def _measure(sync_cfg, rt, async_cfg, run_dir: Path) -> dict:
    results = {}
    for cfg in (sync_cfg, async_cfg):
        run = _build(cfg, rt)
        async_save = cfg.checkpoint.async_save
        run.state.step = 1 + int(async_save)
        checkpointer = Checkpointer(cfg, rt, run_dir)
        if async_save:
            rt.barrier()
            start = time.perf_counter()
            checkpointer.save(run)
            results["async_stall_s"] = time.perf_counter() - start
            checkpointer.close()
            rt.barrier()
            results["async_total_s"] = time.perf_counter() - start
        else:
            results["save_s"] = _timed(rt, lambda: checkpointer.save(run))  # noqa: B023
        checkpointer.close()
    fresh = _build(async_cfg, rt)
    results["load_s"] = _timed(rt, lambda: Checkpointer(async_cfg, rt, run_dir).restore(fresh))
    if rt.is_main:
        ckpt = latest_checkpoint(run_dir)
        results["size_mb"] = sum(p.stat().st_size for p in ckpt.iterdir()) / 2**20
        results["params_m"] = sum(p.numel() for p in run.strategy.unwrap(run.model).parameters()) / 1e6
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt2_124m")
    parser.add_argument("--modes", default="none,ddp,zero,fsdp")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--dir", default="/tmp/dtrain-bench-ckpt")
    args = parser.parse_args()
    root = Path(args.dir)
    rows = []
    # a mode whose workers do not train one model together (none, dp) runs one worker
    points = [(m, args.world if strategy_class(m).syncs_replicas else 1) for m in args.modes.split(",")]
    for mode, world in points:
        cfgs = [to_dict(compose([f"model={args.model}", f"parallel={mode}", f"world={world}", "train.device=cpu",
                                 f"checkpoint.async_save={async_save}", "checkpoint.keep=1"]))
                for async_save in ("false", "true")]
        shutil.rmtree(root / mode, ignore_errors=True)
        try:
            with tempfile.TemporaryDirectory(prefix="dtrain-bench-ckpt-") as logs:
                ranks = run_workers(checkpoint_worker, (*cfgs, str(root / mode)), cfgs[0]["launch"], world,
                                    Path(logs), fresh_processes=True)
        finally:
            shutil.rmtree(root / mode, ignore_errors=True)
        result = ranks[0]
        rows.append((mode, world, result))
        print(f"{mode} world {world}: {result}", file=sys.stderr, flush=True)
    print(f"\n{args.model} ({rows[0][2]['params_m']:.1f}M params), {os.cpu_count()} CPU cores, "
          f"checkpoints under {root}\n")
    print("| mode | world | size (MiB) | sync save (s) | async save: stall (s) | async save: published (s) "
          "| load (s) |")
    print("|---|---|---|---|---|---|---|")
    for mode, world, r in rows:
        print(f"| {mode} | {world} | {r['size_mb']:,.0f} | {r['save_s']:.2f} | {r['async_stall_s']:.2f} | "
              f"{r['async_total_s']:.2f} | {r['load_s']:.2f} |")


if __name__ == "__main__":
    main()
