"""`dtrain` entry point: dispatch to a command, and the one error boundary.

A UserError anywhere below ends as one `error:` line and exit code 2 (no traceback); a worker that
failed for another reason ends as its report and exit code 1. Each command lives in its own module
under trainer/commands/ and is imported only when it runs, so `dtrain --help` and the checks of a
command never pay for another command's imports (torch above all).
"""

from __future__ import annotations

import faulthandler
import gc
import importlib
import platform
import sys
from importlib.metadata import PackageNotFoundError, version

from rich.console import Console
from rich.markup import escape

import trainer
from trainer.errors import Stopped, UserError, WorkerFailed
from trainer.process.collector import collector_paused
from trainer.process.streams import survive_closed_readers

# name -> one-line help. Each command is trainer.commands.<name>.cmd_<name>(argv).
COMMANDS = {
    "train": "train a model (Hydra overrides; -m for a sweep, --cfg job to print)",
    "prepare": "tokenize a dataset into token shards: dtrain prepare data=NAME",
    "tokenizer": "train a BPE on a dataset: dtrain tokenizer train data=NAME tokenizer.vocab_size=N tokenizer.path=OUT",
    "sample": "generate text from a trained run: dtrain sample RUN_DIR",
    "eval": "HellaSwag accuracy of a run's checkpoint: dtrain eval RUN_DIR (--tasks T1,T2: lm-eval-harness)",
    "export": "write a Hugging Face model folder (GPT-2, Llama or Qwen3): weights, config, tokenizer",
    "report": "plots and a summary table of runs or a sweep dir",
    "plan": "estimate per-rank memory and the largest micro batch that fits",
}


def fail(message: str, code: int = 2) -> None:
    # escaped: messages name things like 'dtrain[plot]' that rich would take for markup
    Console(stderr=True).print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    sys.exit(code)


def usage() -> str:
    lines = ["usage: dtrain COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<9} {help_text}" for name, help_text in COMMANDS.items()]
    lines += ["", "Config overrides are Hydra's key=value syntax, e.g. dtrain train model=tiny world=2 "
              "parallel=ddp optim.lr=3e-4.", "`dtrain COMMAND --help` describes each command; "
              "`dtrain train --help` lists config groups and options; `dtrain --version` names the versions."]
    return "\n".join(lines)


def version_line() -> str:
    """dtrain's version and what it runs on, read from the installed packages' metadata (no import
    of torch: `dtrain --version` answers at once)."""

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return (f"dtrain {trainer.__version__} (torch {installed('torch')}, hydra-core {installed('hydra-core')}, "
            f"python {platform.python_version()})")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return
    if argv[0] in ("--version", "-V", "version") or (argv[0] == "train" and "--version" in argv[1:]):
        print(version_line())  # `dtrain train --version` too: dtrain's version, not Hydra's
        return
    name = argv[0]
    if name not in COMMANDS:
        fail(f"unknown command {name!r}; commands: {', '.join(COMMANDS)} (see dtrain --help)")
    try:
        # the command's module, and so its dependencies, only when that command runs
        with collector_paused():
            command = getattr(importlib.import_module(f"trainer.commands.{name}"), f"cmd_{name}")
        command(argv[1:])
    except UserError as err:
        fail(str(err))
    except WorkerFailed as err:
        fail(str(err), code=1)
    except Stopped as stop:  # the worker (rank 0) already printed what it saved
        sys.exit(stop.exit_code)
    except KeyboardInterrupt:
        fail("interrupted", code=130)


def run() -> None:
    """The `dtrain` command (and `python -m trainer`): main(), then out of the interpreter without
    its final garbage collections over every object torch and the run left behind (about 0.3 s of
    each command's exit). Freezing them moves them out of the collector's reach: nothing is lost,
    since Python does not promise to finalize objects still alive at exit, and files, logs and
    atexit handlers are closed and run as usual. A crash in native code (a segfault in a collective,
    an abort) prints every thread's Python stack first, so that it can be told where it happened."""
    faulthandler.enable()
    survive_closed_readers()  # `dtrain ... | head`: a reader that leaves ends nothing (trainer.process.streams)
    try:
        main()
    finally:
        gc.freeze()
