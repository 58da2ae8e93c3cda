#!/usr/bin/env python
"""Checkpoint save / load time and size per parallel mode, and the training stall of an async save.

    .venv/bin/python scripts/bench_checkpoint.py [--model gpt2_124m] [--modes none,ddp,zero,fsdp]
                                                 [--world 2] [--dir /tmp/dtrain-bench-ckpt]

For each mode it builds the model and strategy on `world` gloo workers (one for `none`), gives the
optimizer its full AdamW state with one step on zero gradients (no training), then times, with
the real Checkpointer: a synchronous save, an async save (the stall: how long `save()` blocks the
training thread; and the time until it is published), and a restore into a fresh model and
optimizer. Times are rank 0's wall clock between barriers. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


class _Loader:
    def state_dict(self):
        return {"epoch": 0, "shard_pos": 0, "token_offset": 0}

    def load_state_dict(self, state):
        pass


def _build(cfg, rt):
    from trainer.loop import TrainState
    from trainer.model import build_model
    from trainer.parallel import make_strategy

    torch.manual_seed(0)
    strategy = make_strategy(cfg.parallel, cfg.train, rt)
    model = strategy.wrap(build_model(cfg.model))
    optimizer = strategy.build_optimizer(model, cfg.optim)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()  # allocates AdamW's state (exp_avg, exp_avg_sq) for every parameter
    optimizer.zero_grad(set_to_none=True)
    return SimpleNamespace(strategy=strategy, model=model, optimizer=optimizer, train_loader=_Loader(),
                           state=TrainState(step=1, tokens=0), plan=SimpleNamespace(total_batch_size=0))


def _timed(rt, fn) -> float:
    rt.barrier()
    start = time.perf_counter()
    fn()
    rt.barrier()
    return time.perf_counter() - start


def _worker(rank: int, world: int, port: int, mode: str, model: str, root: str, queue) -> None:
    from trainer.checkpoint.layout import latest_checkpoint
    from trainer.checkpoint.manager import Checkpointer
    from trainer.cli import compose
    from trainer.runtime import Runtime

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    distributed = mode in ("ddp", "zero", "fsdp")
    if distributed:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    rt = Runtime(rank, rank, world, world, torch.device("cpu"), distributed)
    run_dir = Path(root) / mode
    results = {}
    for async_save in (False, True):
        cfg = compose([f"model={model}", f"parallel={mode}", "train.device=cpu",
                       f"checkpoint.async_save={str(async_save).lower()}", "checkpoint.keep=1"])
        run = _build(cfg, rt)
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
    fresh = _build(cfg, rt)
    results["load_s"] = _timed(rt, lambda: Checkpointer(cfg, rt, run_dir).restore(fresh))
    if rank == 0:
        ckpt = latest_checkpoint(run_dir)
        results["size_mb"] = sum(p.stat().st_size for p in ckpt.iterdir()) / 2**20
        results["params_m"] = sum(p.numel() for p in run.strategy.unwrap(run.model).parameters()) / 1e6
        queue.put(results)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt2_124m")
    parser.add_argument("--modes", default="none,ddp,zero,fsdp")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--dir", default="/tmp/dtrain-bench-ckpt")
    args = parser.parse_args()
    root = Path(args.dir)
    ctx = mp.get_context("spawn")
    rows = []
    for mode in args.modes.split(","):
        world = 1 if mode == "none" else args.world
        shutil.rmtree(root / mode, ignore_errors=True)
        queue = ctx.SimpleQueue()
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, world, port, mode, args.model, str(root), queue))
                 for r in range(world)]
        for proc in procs:
            proc.start()
        result = queue.get()
        for proc in procs:
            proc.join()
        shutil.rmtree(root / mode, ignore_errors=True)
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
