"""`dtrain plan`: estimated per-rank memory of every parallel mode, and the largest micro batch that fits.

    dtrain plan model=gpt2_124m parallel=fsdp world=8 train.micro_batch_size=16 --device-memory 80GiB
    dtrain plan --device cuda model=gpt2_124m train.compile=true      # a GPU run, planned from any host
    dtrain plan model=llama3_70b world=64 parallel=fsdp parallel.tp=8 train.device=cuda   # a mesh

The estimate (trainer/plan/memory.py) is for the config the overrides compose (train.compile,
train.activation_checkpointing and train.loss_chunks included); the mode asked for is marked, with a
line saying whether one sequence of the model's whole context fits it with activation checkpointing.
The sharded modes' model state is read from their real DTensor shards (trainer/plan/shards.py) at
the mesh parallel.dp_replicate / parallel.tp / world give.
A line above the table counts the parameters: all of them (what the memory figures hold) and, for a
mixture of experts, the active ones (top_k of the routed experts, what FLOPs per token and MFU count).
--device picks the device the run will use (default: train.device, where auto is this host's).
Without --device-memory the budget is the visible GPU's memory (an 80 GiB H100's when planning
for CUDA on a host without one), or for a CPU run the machine's RAM shared by the workers of one node.
"""

from __future__ import annotations

from trainer.commands.args import ArgParser
from trainer.config.compose import compose
from trainer.config.validation import validate
from trainer.plan.sizes import parse_size
from trainer.process.collector import collector_paused

_SIZE_MISSING = object()  # --device-memory given without a size


def _parse(argv: list[str]) -> tuple[list[str], int | None, str | None]:
    parser = ArgParser(prog="dtrain plan", description=__doc__,
                       usage="%(prog)s [key=value overrides ...] [--device cpu|cuda] "
                             "[--device-memory SIZE, e.g. 80GiB]")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="Hydra overrides, as for dtrain train")
    # nargs="?": a missing size is this command's own message, not argparse's "expected one argument"
    parser.add_argument("--device-memory", nargs="?", const=_SIZE_MISSING, type=parse_size, metavar="SIZE",
                        help="memory budget per rank, e.g. 80GiB (default: the GPU's, or host RAM / workers)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="the device the run will train on (default: train.device; auto = this host's)")
    args = parser.parse_args(argv)
    if args.device_memory is _SIZE_MISSING:
        parser.error("--device-memory needs a size, e.g. --device-memory 80GiB")
    for override in args.overrides:
        if "=" not in override:
            parser.error(f"expected a key=value override, got {override!r}")
    return args.overrides, args.device_memory, args.device


def cmd_plan(argv: list[str]) -> None:
    overrides, memory, device = _parse(argv)
    cfg = compose(overrides)
    validate(cfg)
    # the table needs torch (the strategies, the meta model's shards): imported once the arguments
    # and the config have passed, so that a mistake in either is one line at once
    with collector_paused():
        from trainer.plan.table import print_plan

    print_plan(cfg, memory, device)
