"""Hydra composition for every command: the overrides of a command line, the points of a sweep, and
the composed config, with Hydra's errors turned into one line. No torch here: a bad config is
reported before torch would have finished importing."""

from __future__ import annotations

import difflib
from pathlib import Path

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra._internal.hydra import Hydra
from hydra._internal.utils import create_config_search_path
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import OverrideParseException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from trainer.config import CONF_DIR, INIT_FROM_REQUIRED, Config, register_configs, schema_keys
from trainer.errors import UserError

CONFIG_NAME = "config"
JOB_NAME = "dtrain"
# Hydra's own command-line flags, passed through untouched (the rest are key=value overrides).
HYDRA_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
                          "--config-dir", "-cd", "--experimental-rerun", "--info", "-i"}
HYDRA_FLAGS = {"--multirun", "-m", "--resolve", "--help", "-h", "--hydra-help", "--version",
               "--shell-completion", "-sc"}
# Flags that only print something (help, the config): nothing is checked or run.
INFORMATIONAL_FLAGS = ("--help", "-h", "--hydra-help", "--version", "--info", "-i", "--cfg", "-c",
                       "--shell-completion", "-sc")


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


def is_informational(args: list[str]) -> bool:
    return any(a in INFORMATIONAL_FLAGS or a.split("=", 1)[0] in ("--cfg", "-c", "--info") for a in args)


def hydra_error_text(err: Exception) -> str:
    """Hydra's multi-line errors as one line (its list of available options included)."""
    text = str(err)
    if "Available options in" in text:
        head, options = text.split("Available options in", 1)
        # the options, without the config search path Hydra lists after them
        options = options.split("Config search path:", 1)[0]
        names = [w.strip() for w in options.split("\n")[1:] if w.strip()]
        return f"{head.strip().splitlines()[-1]}; available: {', '.join(names)}"
    parts = [line.strip() for line in text.splitlines() if line.strip()]
    cause = err.__cause__
    if cause is not None and str(cause).strip():
        parts.append(str(cause).strip().splitlines()[0])
    return "; ".join(dict.fromkeys(parts))


def unquoted_non_ascii(overrides: list[str]) -> str | None:
    """The first override whose value has non-ASCII characters outside quotes: Hydra's override
    lexer takes them only in a quoted string, and otherwise fails with a bare
    `LexerNoViableAltException` and a caret."""
    for override in overrides:
        key, sep, value = override.partition("=")
        if sep and not value.isascii() and not (len(value) > 1 and value[0] in "'\"" and value[-1] == value[0]):
            return override
    return None


def quote_hint(override: str) -> UserError:
    key, _, value = override.partition("=")
    return UserError(
        f"{override} has non-ASCII characters, which Hydra's override syntax takes only in quotes; "
        f"quote the value: '{key}=\"{value}\"' (the single quotes keep the double ones from the shell)"
    )


def unknown_key_error(key: str) -> UserError:
    """The one line for a key the schema does not have, however it was given (`key=`, `+key=`,
    `++key=`): Hydra's own advice for `key=` would be `+key=`, which the schema refuses as well."""
    close = difflib.get_close_matches(key, schema_keys(), n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    return UserError(f"bad config: {key} is not a config key; {hint}`dtrain train --cfg job` lists every key")


def check_schema_keys(cfg: DictConfig) -> None:
    """Every key of the composed config (its hydra section aside) is one of the schema's: `+key=`
    adds a key Hydra's struct mode would otherwise refuse."""
    job = OmegaConf.to_container(cfg, resolve=False)
    job.pop("hydra", None)
    try:
        OmegaConf.merge(OmegaConf.structured(Config), job)
    except ConfigKeyError as err:
        raise unknown_key_error(err.full_key) from None


def _user_error(err: Exception, overrides: list[str]) -> Exception:
    """Hydra's and OmegaConf's errors are the user's config: a UserError; anything else stays."""
    cause = err.__cause__
    if str(err).startswith("Could not override") and isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        return unknown_key_error(cause.full_key)  # `key=` of a key the schema does not have
    unquoted = unquoted_non_ascii(overrides)
    if isinstance(err, OverrideParseException) and unquoted:
        return quote_hint(unquoted)
    if isinstance(err, (OmegaConfBaseException, ValueError)):
        return UserError(f"bad config: {hydra_error_text(err)}; see `dtrain train --cfg job`")
    if type(err).__module__.startswith("hydra"):
        return UserError(f"bad config: {hydra_error_text(err)}; see `dtrain train --help`")
    return err


def compose(overrides: list[str], return_hydra_config: bool = False) -> DictConfig:
    """The config `dtrain train` would compose for these overrides (for prepare, plan, checks)."""
    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name=JOB_NAME):
            cfg = hydra_compose(CONFIG_NAME, overrides=overrides, return_hydra_config=return_hydra_config)
    except Exception as err:
        raise _user_error(err, overrides) from None
    finally:
        GlobalHydra.instance().clear()
    check_schema_keys(cfg)
    return cfg


def compose_run(overrides: list[str]) -> tuple[Hydra, DictConfig]:
    """Hydra, set up as `hydra.main` sets it up, and the one composed config of a single run
    (the hydra section included), ready for Hydra's own run_job."""
    register_configs()
    GlobalHydra.instance().clear()
    hydra = Hydra.create_main_hydra2(JOB_NAME, create_config_search_path(str(CONF_DIR)))
    try:
        cfg = hydra.compose_config(CONFIG_NAME, overrides, run_mode=RunMode.RUN, with_log_configuration=True)
    except Exception as err:
        raise _user_error(err, overrides) from None
    check_schema_keys(cfg)
    cfg.hydra.mode = RunMode.RUN
    anchor_paths(cfg)
    return hydra, cfg


def anchor_paths(cfg: DictConfig) -> None:
    """model.init_from made absolute where the command was typed: the run records it so, the same
    command from another folder is the same run, and workers that start elsewhere read the same source."""
    # a recipe's REQUIRED sentinel is left as it is, for validation's error line
    if cfg.model.init_from and cfg.model.init_from != INIT_FROM_REQUIRED:
        cfg.model.init_from = str(Path(cfg.model.init_from).expanduser().absolute())


def sweep_points(overrides: list[str]) -> list[list[str]]:
    """Every point of a multirun's basic sweep (`a=1,2 b=x,y` -> four override lists)."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as err:
        unquoted = unquoted_non_ascii(overrides)
        if isinstance(err, OverrideParseException) and unquoted:
            raise quote_hint(unquoted) from None
        raise UserError(f"bad override: {hydra_error_text(err)}") from None
    batches = BasicSweeper.split_arguments(parsed, max_batch_size=None)
    return [point for batch in batches for point in batch]
