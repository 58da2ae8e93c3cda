"""`dtrain` entry point: subcommands, config composition, and one-line errors for bad input."""

from __future__ import annotations

import atexit
import importlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

from rich.console import Console

from trainer.errors import UserError

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"

# name -> ("module:function", one-line help). Each function takes the remaining argv.
COMMANDS = {
    "train": ("trainer.cli:cmd_train", "train a model (Hydra overrides; -m for a sweep, --cfg job to print)"),
    "prepare": ("trainer.cli:cmd_prepare", "tokenize a dataset into token shards: dtrain prepare data=NAME"),
    "sample": ("trainer.commands.sample:cmd_sample", "generate text from a trained run: dtrain sample RUN_DIR"),
    "eval": ("trainer.commands.eval:cmd_eval", "HellaSwag accuracy of a run's checkpoint: dtrain eval RUN_DIR"),
    "export": ("trainer.commands.export:cmd_export", "write model.safetensors + config.json (HF GPT-2 names)"),
    "report": ("trainer.commands.report:cmd_report", "plots and a summary table of runs or a sweep dir"),
    "plan": ("trainer.commands.plan:cmd_plan", "estimate per-rank memory and the largest micro batch that fits"),
}

# Hydra's own command-line flags, passed through untouched (the rest are key=value overrides).
HYDRA_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
                          "--config-dir", "-cd", "--experimental-rerun", "--info", "-i"}
HYDRA_FLAGS = {"--multirun", "-m", "--resolve", "--help", "-h", "--hydra-help", "--version",
               "--shell-completion", "-sc"}


def fail(message: str, code: int = 2) -> None:
    from rich.markup import escape

    # escaped: messages name things like 'dtrain[plot]' that rich would take for markup
    Console(stderr=True).print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    sys.exit(code)


def usage() -> str:
    lines = ["usage: dtrain COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<9} {help_text}" for name, (_, help_text) in COMMANDS.items()]
    lines += ["", "Config overrides are Hydra's key=value syntax, e.g. dtrain train model=tiny world=2 "
              "parallel=ddp optim.lr=3e-4.", "`dtrain train --help` lists config groups and options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return
    if argv[0] not in COMMANDS:
        fail(f"unknown command {argv[0]!r}; commands: {', '.join(COMMANDS)} (see dtrain --help)")
    module, func = COMMANDS[argv[0]][0].split(":")
    try:
        getattr(importlib.import_module(module), func)(argv[1:])
    except UserError as err:
        fail(str(err))
    except KeyboardInterrupt:
        fail("interrupted", code=130)


# --- config composition ------------------------------------------------------------------------
def split_args(args: list[str]) -> tuple[list[str], bool]:
    """The key=value overrides among args, and whether this is a multirun (-m)."""
    overrides, multirun, skip = [], False, False
    for arg in args:
        if skip:
            skip = False
        elif arg in HYDRA_FLAGS_WITH_VALUE:
            skip = True
        elif arg.split("=", 1)[0] in HYDRA_FLAGS_WITH_VALUE:
            pass
        elif arg in HYDRA_FLAGS:
            multirun = multirun or arg in ("-m", "--multirun")
        elif arg.startswith("-"):
            raise UserError(f"unknown flag {arg!r}; dtrain train takes key=value overrides and Hydra's flags")
        else:
            overrides.append(arg)
    return overrides, multirun


def _one_line(err: Exception) -> str:
    text = str(err)
    if "Available options in" in text:
        head, options = text.split("Available options in", 1)
        names = [w.strip() for w in options.split("\n")[1:] if w.strip()]
        return f"{head.strip().splitlines()[-1]}; available: {', '.join(names)}"
    parts = [line.strip() for line in text.splitlines() if line.strip()]
    cause = err.__cause__
    if cause is not None and str(cause).strip():
        parts.append(str(cause).strip().splitlines()[0])
    return "; ".join(dict.fromkeys(parts))


def compose(overrides: list[str], return_hydra_config: bool = False):
    """Compose the config the way `dtrain train` would, turning Hydra's errors into UserError."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf.errors import OmegaConfBaseException

    from trainer.config import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="dtrain"):
            return hydra_compose("config", overrides=overrides, return_hydra_config=return_hydra_config)
    except (OmegaConfBaseException, ValueError) as err:
        raise UserError(f"bad config: {_one_line(err)}; see `dtrain train --cfg job`") from None
    except Exception as err:
        if type(err).__module__.startswith("hydra"):
            raise UserError(f"bad config: {_one_line(err)}; see `dtrain train --help`") from None
        raise
    finally:
        GlobalHydra.instance().clear()


def _sweep_points(overrides: list[str]) -> list[list[str]]:
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as err:
        raise UserError(f"bad override: {_one_line(err)}") from None
    batches = BasicSweeper.split_arguments(parsed, max_batch_size=None)
    return [point for batch in batches for point in batch]


def check_train_args(args: list[str]) -> None:
    """Compose and validate every run the command would start, before Hydra writes anything."""
    from hydra.types import RunMode  # noqa: F401  (hydra must import cleanly before we compose)

    from trainer.config import validate
    from trainer.rundir import check_run_dir

    overrides, multirun = split_args(args)
    points = _sweep_points(overrides) if multirun else [overrides]
    for point in points:
        cfg = compose(point, return_hydra_config=not multirun)
        validate(cfg)
        if not multirun and "RANK" not in os.environ:
            check_run_dir(Path(cfg.hydra.run.dir), cfg.resume)


# --- dtrain train -----------------------------------------------------------------------------
def cmd_train(args: list[str]) -> None:
    import hydra

    from trainer.config import register_configs

    informational = any(a in ("--help", "-h", "--hydra-help", "--version", "--info", "-i") for a in args)
    sweep_dir = None
    if not informational:
        from trainer.sweep import pin_sweep_dir, plugin_hint

        with plugin_hint():
            check_train_args(args)
        args, sweep_dir = pin_sweep_dir(args)  # multirun: where the points go, known up front
    if "RANK" in os.environ and os.environ["RANK"] != "0":
        # Under plain torchrun only rank 0 writes the run directory; the config that counts is
        # rank 0's, broadcast when the process group is up.
        scratch = tempfile.mkdtemp(prefix="dtrain-rank")
        atexit.register(shutil.rmtree, scratch, ignore_errors=True)
        args = args + [
            f"hydra.run.dir={scratch}",
            "hydra.output_subdir=null",
            "hydra/job_logging=disabled",
            "hydra/hydra_logging=disabled",
        ]
    register_configs()
    sys.argv = ["dtrain"] + args
    try:
        hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")(train_job)()
    finally:
        if sweep_dir is not None:  # the sweep's table, also when a point failed or it was interrupted
            from trainer.sweep import finish_sweep

            finish_sweep(sweep_dir)


def train_job(cfg) -> float:
    """Hydra's task function: one training run (one point of a sweep). Returns best val loss."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from trainer.launch import WorkerFailed

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    if multirun:  # status file, summary.jsonl, skip finished / resume unfinished points
        from trainer.sweep import run_point

        return run_point(cfg, hydra_cfg, lambda: run_training(cfg, run_dir))
    try:
        result = run_training(cfg, run_dir)
    except (UserError, WorkerFailed) as err:
        fail(str(err), code=2 if isinstance(err, UserError) else 1)
    return result["best_val_loss"]


def run_training(cfg, run_dir: Path) -> dict:
    from trainer.config import requested_world, to_dict, validate
    from trainer.env import under_torchrun
    from trainer.launch import run_workers
    from trainer.preflight import preflight
    from trainer.worker import worker_main

    validate(cfg)
    world = requested_world(cfg)
    cfg_dict = to_dict(cfg)
    if under_torchrun():
        return worker_main(cfg_dict, str(run_dir), preflight_done=False)
    preflight(cfg, run_dir, world)
    return run_workers(worker_main, (cfg_dict, str(run_dir)), cfg_dict["launch"], world, run_dir / "logs")


# --- dtrain prepare ---------------------------------------------------------------------------
def cmd_prepare(args: list[str]) -> None:
    from trainer.data.prepare import prepare

    force = "--force" in args
    overrides = [a for a in args if a != "--force"]
    for arg in overrides:
        if arg.startswith("-"):
            raise UserError(f"unknown flag {arg!r}; usage: dtrain prepare data=NAME [data.source=...] [--force]")
    cfg = compose(overrides)
    manifest = prepare(cfg.data, force=force)
    Console().print(f"[green]prepared[/] {cfg.data.name}: {manifest}")
