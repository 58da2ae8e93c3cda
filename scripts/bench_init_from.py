#!/usr/bin/env python
"""What `model.init_from` costs: loading a Hugging Face GPT-2 (124M) folder into our model (CPU).

    .venv/bin/python scripts/bench_init_from.py [--repeats 3] [--dir /tmp/dtrain-bench-init-from]

Makes the folder once with transformers (GPT2LMHeadModel(GPT2Config()) with random weights, saved
by save_pretrained: model.safetensors + config.json, as `huggingface-cli download gpt2` gives), then
`repeats` times builds a fresh parallel=none model and times only the load into it
(trainer.weights.init_from.start_from_weights: the safetensors reads, the transposes, the copy),
with the preflight check (header and shapes, no torch) timed apart. Prints each time and the best.
Needs transformers (the test extra) and safetensors.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from trainer.config.compose import compose  # noqa: E402
from trainer.model.gpt import build_model  # noqa: E402
from trainer.parallel import make_strategy  # noqa: E402
from trainer.process.runtime import Runtime  # noqa: E402
from trainer.weights.init_from import start_from_weights  # noqa: E402
from trainer.weights.init_source import check_init_source  # noqa: E402


def make_folder(folder: Path) -> None:
    if (folder / "model.safetensors").is_file():
        return
    import transformers  # only the benchmark's fixture needs it (a test-only dependency)

    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config()).save_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/dtrain-bench-init-from")
    args = parser.parse_args()
    folder = Path(args.dir) / "gpt2"
    make_folder(folder)
    cfg = compose(["model=gpt2_124m", "train.device=cpu", f"model.init_from={folder}"])
    rt = Runtime(rank=0, local_rank=0, world=1, local_world=1, device=torch.device("cpu"), distributed=False)
    size = (folder / "model.safetensors").stat().st_size
    print(f"{folder}: {size / 2**20:,.0f} MiB, torch {torch.__version__}, {torch.get_num_threads()} threads")
    checks, loads = [], []
    for i in range(args.repeats):
        t0 = time.perf_counter()
        check_init_source(cfg.model.init_from, cfg.model)
        checks.append(time.perf_counter() - t0)
        strategy = make_strategy(cfg.parallel, cfg.train, rt)
        model = strategy.wrap(build_model(cfg.model))
        run = SimpleNamespace(rt=rt, strategy=strategy, model=model, cfg=cfg)
        t0 = time.perf_counter()
        start_from_weights(run, cfg.model.init_from, None)
        loads.append(time.perf_counter() - t0)
        print(f"repeat {i + 1}: preflight check {checks[-1] * 1e3:.1f} ms, load {loads[-1]:.2f} s")
    print(f"best: preflight check {min(checks) * 1e3:.1f} ms, load {min(loads):.2f} s "
          f"({size / 2**20 / min(loads):,.0f} MiB/s)")


if __name__ == "__main__":
    main()
