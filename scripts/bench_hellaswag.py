"""HellaSwag scoring throughput (examples/s) at world 1 and 2 (or any list), random-init weights.

    .venv/bin/python scripts/bench_hellaswag.py [--model gpt2_124m] [--worlds 1 2] [--examples 48]
                                               [--batch-examples 8] [--parallel none] [--file hs.jsonl]

Without --file the examples are synthetic with HellaSwag-like lengths (a 48-token context and
four 24-token endings, from tiny-shakespeare text when the shared copy is here); --file scores the
first --examples of a real HellaSwag jsonl instead. Each world size runs real workers through
trainer.launch.workers (torchrun's engine, gloo on CPU); every worker scores its share with the same code
as training and `dtrain eval` (HellaSwagEval.evaluate), after one warm-up batch per rank.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.harness import on_every_rank  # noqa: E402

from trainer.config.compose import compose  # noqa: E402
from trainer.config.schema import to_dict  # noqa: E402
from trainer.evals.hellaswag import HellaSwagEval  # noqa: E402
from trainer.evals.hellaswag_file import read_examples  # noqa: E402
from trainer.launch.workers import run_workers  # noqa: E402
from trainer.model.gpt import build_model  # noqa: E402
from trainer.parallel import make_strategy  # noqa: E402
from trainer.tokenizers.gpt2 import gpt2_encoding  # noqa: E402

CORPUS = REPO.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
CTX_TOKENS, ENDING_TOKENS = 48, 24


def synthetic_file(path: Path, n: int, seed: int = 0) -> Path:
    enc = gpt2_encoding()
    if CORPUS.exists():
        ids = enc.encode_ordinary(CORPUS.read_text()[:400_000])
    else:
        rng0 = random.Random(seed)
        ids = [rng0.randrange(256, 20000) for _ in range(100_000)]
    rng = random.Random(seed)

    def span(k: int) -> str:
        start = rng.randrange(len(ids) - k)
        return enc.decode(ids[start : start + k]).strip()

    with open(path, "w") as f:
        for _ in range(n):
            row = {"ctx": span(CTX_TOKENS), "endings": [span(ENDING_TOKENS) for _ in range(4)],
                   "label": rng.randrange(4)}
            f.write(json.dumps(row) + "\n")
    return path


def bench_worker(cfg_dict: dict) -> list[dict]:
    """One worker: random-init model of cfg.model, wrapped for cfg.parallel; score this rank's share.
    Every rank returns all ranks' figures."""
    return on_every_rank(cfg_dict, _bench)


def _bench(cfg, rt) -> dict:
    torch.manual_seed(cfg.train.seed)
    strategy = make_strategy(cfg.parallel, cfg.train, rt, training=False)
    model = strategy.wrap(build_model(cfg.model))
    examples = read_examples(cfg.eval.hellaswag.path, cfg.eval.limit)
    B, block = cfg.eval.hellaswag.batch_examples, cfg.model.block_size
    warm = HellaSwagEval(examples[: B * rt.world], rt.rank, rt.world, B, block)
    warm.evaluate(strategy.inference_model(model), rt, strategy.autocast)
    hs = HellaSwagEval(examples, rt.rank, rt.world, B, block)
    rt.barrier()
    t0 = time.perf_counter()
    result = hs.evaluate(strategy.inference_model(model), rt, strategy.autocast)
    wall = time.perf_counter() - t0
    tokens = sum(min(len(ex.ctx) + len(e), block) for ex in hs.encoded for e in ex.endings)
    return {"world": rt.world, "n": result.n, "wall_s": wall, "examples_per_s": result.n / wall,
            "rank0_row_tokens": tokens, "threads": torch.get_num_threads(), "acc_norm": result.acc_norm}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2_124m")
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--examples", type=int, default=48)
    ap.add_argument("--batch-examples", type=int, default=8)
    ap.add_argument("--parallel", default="none", help="none | ddp | zero | fsdp (dp at world 1 only)")
    ap.add_argument("--file", help="a real HellaSwag jsonl (default: synthetic examples)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-hellaswag-") as tmp:
        tmp = Path(tmp)
        path = Path(args.file) if args.file else synthetic_file(tmp / "hs.jsonl", args.examples)
        rows = []
        for world in args.worlds:
            cfg = compose([f"model={args.model}", f"parallel={args.parallel}", "data=text",
                           f"eval.hellaswag.path={path}", f"eval.limit={args.examples}",
                           f"eval.hellaswag.batch_examples={args.batch_examples}", "train.device=cpu"])
            cfg_dict = to_dict(cfg)
            # world 1 scores in this process, as before; more workers start fresh through torchrun's engine
            result = run_workers(bench_worker, (cfg_dict,), cfg_dict["launch"], world, tmp / "logs")[0]
            rows.append(result)
            print(f"{args.model} parallel={args.parallel} world={world}: {result['n']} examples in "
                  f"{result['wall_s']:.1f} s = {result['examples_per_s']:.2f} examples/s "
                  f"({result['threads']} thread(s) per worker, batch {args.batch_examples} examples)",
                  flush=True)
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
