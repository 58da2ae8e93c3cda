"""Generation speed with the KV cache against decoding without it: each new token's forward over the
whole text so far (its last block_size tokens), as `dtrain sample` did before the cache, with the
output head at every position ("before": GPT.generate then) and with it at the last position only
(how much of the gain is the cache itself).

    .venv/bin/python scripts/bench_sample.py [--models cpu_small gpt2_124m] [--tokens 256] [--batch 1]
                                             [--threads N] [--repeats 3]

Random-init weights (seed 0), one prompt of 8 tokens (or --batch of them), greedy, so both paths
must give the same tokens (the table says whether they did). The clock covers the decoding only;
the best of --repeats counts (the machine may be shared).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from trainer.config.compose import compose  # noqa: E402
from trainer.model.decode import generate  # noqa: E402
from trainer.model.gpt import build_model  # noqa: E402


@torch.no_grad()
def without_cache(model, prompts: list[list[int]], new_tokens: int, last_only: bool = False) -> list[list[int]]:
    """Greedy decoding with no cache: every step re-reads each row's last block_size tokens."""
    block = model.config.block_size
    seqs = [list(p) for p in prompts]
    for _ in range(new_tokens):
        ids = torch.tensor([s[-block:] for s in seqs], dtype=torch.long)  # equal lengths: no padding
        at = torch.full((len(seqs),), ids.size(1) - 1) if last_only else None
        logits, _ = model(ids, logits_at=at)
        for seq, token in zip(seqs, logits[:, -1].argmax(dim=-1).tolist()):
            seq.append(token)
    return [s[len(p):] for s, p in zip(seqs, prompts)]


def without_cache_last_only(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    return without_cache(model, prompts, new_tokens, last_only=True)


def best_time(decode, model, prompts, tokens: int, repeats: int) -> tuple[float, list[list[int]]]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = decode(model, prompts, tokens)
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["cpu_small", "gpt2_124m"])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    table = Table(title=f"greedy decoding of {args.tokens} tokens, batch {args.batch}, CPU, {args.threads} thread(s)")
    for col in ("model", "block", "before s", "no cache, last logits s", "KV cache s", "tokens/s (cache)",
                "vs before", "vs last logits", "same tokens"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for name in args.models:
        torch.manual_seed(0)
        model = build_model(compose([f"model={name}"]).model).eval()
        gen = torch.Generator().manual_seed(1)
        prompts = torch.randint(0, 50257, (args.batch, 8), generator=gen).tolist()
        generate(model, prompts, 4), without_cache(model, prompts, 4)  # warm-up: first-call allocations
        t_cache, out_cache = best_time(generate, model, prompts, args.tokens, args.repeats)
        t_before, out_before = best_time(without_cache, model, prompts, args.tokens, args.repeats)
        t_last, out_last = best_time(without_cache_last_only, model, prompts, args.tokens, args.repeats)
        table.add_row(name, str(model.config.block_size), f"{t_before:.2f}", f"{t_last:.2f}", f"{t_cache:.2f}",
                      f"{args.batch * args.tokens / t_cache:,.0f}", f"{t_before / t_cache:.1f}x",
                      f"{t_last / t_cache:.1f}x", "yes" if out_cache == out_before == out_last else "NO")
    Console(width=max(Console().width, 110)).print(table)


if __name__ == "__main__":
    main()
