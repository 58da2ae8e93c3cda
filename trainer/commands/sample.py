"""`dtrain sample RUN_DIR [--prompt TEXT] [--tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S]`.

Loads the newest checkpoint's model (or `--step N`'s) in this one process, on CUDA when there is
one, and prints the prompt with its continuation, decoded with the KV cache (trainer/model/decode.py).
The text goes through the run's own tokenizer: the copy its checkpoint holds, checked against the
fingerprint it records (trainer/checkpoint/tokenizer_copy.py), so a tokenizer folder moved or
rewritten since changes nothing; `--tokenizer DIR` names the folder for a checkpoint without a copy.
"""

from __future__ import annotations

from pathlib import Path

from trainer.checkpoint.tokenizer_copy import TOKENIZER_HELP
from trainer.commands.args import (
    ArgParser,
    non_negative_float,
    non_negative_int,
    probability,
    utf8_text,
    whole_number_in,
)
from trainer.config.schema import MAX_SAMPLE_TOKENS, MAX_SEED
from trainer.errors import UserError
from trainer.evals.generate import generate_text
from trainer.process.runtime import pick_device
from trainer.weights.from_checkpoint import checkpoint_of, model_from_run, tokenizer_of


def cmd_sample(argv: list[str]) -> None:
    parser = ArgParser(prog="dtrain sample", description=__doc__)
    parser.add_argument("run_dir", metavar="RUN_DIR",
                        help="a run directory (its newest checkpoint) or a checkpoint folder")
    parser.add_argument("--prompt", metavar="TEXT", type=utf8_text, default="\n",
                        help="text to continue, in UTF-8 (default: a newline)")
    parser.add_argument("--tokens", metavar="N", default=200,
                        type=whole_number_in(1, MAX_SAMPLE_TOKENS, "past the block size each token re-reads the "
                                             "whole window; continue a long text in several samples"),
                        help=f"tokens to generate (default 200, at most {MAX_SAMPLE_TOKENS:,})")
    parser.add_argument("--temperature", metavar="T", type=non_negative_float, default=1.0,
                        help="sampling temperature (0 = greedy; default 1)")
    parser.add_argument("--top-k", metavar="K", type=non_negative_int, default=50,
                        help="sample among the k likeliest (0 = all; default 50)")
    parser.add_argument("--top-p", metavar="P", type=probability, default=1.0,
                        help="then among the fewest whose probability reaches P (default 1: all)")
    parser.add_argument("--seed", metavar="S", default=1337,
                        type=whole_number_in(0, MAX_SEED, "what torch's generators take"),
                        help="random seed (default 1337; 0 to 2**64 - 1)")
    parser.add_argument("--step", metavar="N", type=non_negative_int,
                        help="the checkpoint at this step (default: newest)")
    parser.add_argument("--device", metavar="DEVICE", default="auto",
                        help="auto (CUDA when there is one), cpu, cuda, cuda:N")
    parser.add_argument("--tokenizer", metavar="DIR", help=TOKENIZER_HELP)
    args = parser.parse_args(argv)

    try:
        device = pick_device(args.device, 0)
    except RuntimeError:
        raise UserError(
            f"dtrain sample: --device {args.device!r} is not a device; use auto, cpu, cuda or cuda:N"
        ) from None
    ckpt = checkpoint_of(Path(args.run_dir).expanduser(), args.step)
    tokenizer = tokenizer_of(ckpt, args.tokenizer)  # the run's own, before the weights are read
    model, _ = model_from_run(ckpt, device=device)
    text = generate_text(model, args.prompt, args.tokens, device=device, seed=args.seed,
                         temperature=args.temperature, top_k=args.top_k or None,
                         top_p=args.top_p, tokenizer=tokenizer)
    print(text)
