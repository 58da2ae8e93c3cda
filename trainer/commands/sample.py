"""`dtrain sample RUN_DIR [--prompt TEXT] [--tokens N] [--temperature T] [--top-k K] [--seed S]`.

Loads the newest checkpoint's model (or `--step N`'s) in this one process, on CUDA when there is
one, and prints the prompt with its continuation.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from trainer.commands.export import ArgParser, parse_step
from trainer.errors import UserError


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"invalid value {text!r} (must be > 0)")
        return value

    return parse


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r} (a whole number)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"invalid value {text!r} (0 or more)")
    return value


def generate_text(model, prompt: str, tokens: int, temperature: float, top_k: int | None, seed: int) -> str:
    from trainer.data.tokenizer import gpt2_encoding

    enc = gpt2_encoding()
    device = next(model.parameters()).device
    ids = enc.encode_ordinary(prompt) or [enc.eot_token]
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(idx, tokens, temperature=temperature, top_k=top_k, generator=gen)
    return enc.decode([t for t in out[0].tolist() if t < enc.n_vocab])


def cmd_sample(argv: list[str]) -> None:
    parser = ArgParser(prog="dtrain sample", description="Generate text from a trained run's checkpoint.")
    parser.add_argument("run_dir", help="a run directory (its newest checkpoint) or a checkpoint folder")
    parser.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    parser.add_argument("--tokens", type=_positive(int), default=200, help="tokens to generate (default 200)")
    parser.add_argument("--temperature", type=_positive(float), default=1.0,
                        help="sampling temperature (default 1)")
    parser.add_argument("--top-k", type=_non_negative_int, default=50,
                        help="sample among the k likeliest (0 = all; default 50)")
    parser.add_argument("--seed", type=int, default=1337, help="random seed (default 1337)")
    parser.add_argument("--step", type=parse_step, help="the checkpoint at this step (default: newest)")
    parser.add_argument("--device", default="auto", help="auto (CUDA when there is one), cpu, cuda, cuda:N")
    args = parser.parse_args(argv)

    from trainer.checkpoint.weights import model_from_run
    from trainer.runtime import pick_device

    try:
        device = pick_device(args.device, 0)
    except RuntimeError:
        raise UserError(
            f"dtrain sample: --device {args.device!r} is not a device; use auto, cpu, cuda or cuda:N"
        ) from None
    model, _ = model_from_run(Path(args.run_dir).expanduser(), step=args.step, device=device)
    with torch.no_grad():
        text = generate_text(model, args.prompt, args.tokens, args.temperature, args.top_k or None, args.seed)
    print(text)
