"""Hydra composition for every command: the overrides of a command line (trainer/config/command_line.py
reads Hydra's flags beside them), the points of a sweep, the default run and sweep folders, and the
composed config, with Hydra's errors turned into one line. Only Hydra's public API (`hydra.compose`,
`initialize_config_dir`, the override parser); a single run is then run from that one composition
as Hydra's job (run_as_hydra_job), a sweep through `hydra.main`
(run_hydra_app), which reads the same flags. No torch here: a bad config is reported before torch
would have finished importing."""

from __future__ import annotations

import contextlib
import difflib
import itertools
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import hydra
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra._internal.callbacks import Callbacks
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import configure_log, run_job
from hydra.errors import CompactHydraException, OverrideParseException
from hydra.types import HydraContext, RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from trainer.config.command_line import CONFIG_NAME, ConfigSource, config_source, hydra_args
from trainer.config.dataset_names import HF_NAME_RESOLVER, TEXT_NAME_RESOLVER, hf_dataset_name, text_dataset_name
from trainer.config.keys import apply_renamed_keys, run_identity, sweep_identity
from trainer.config.schema import INIT_FROM_REQUIRED, Config, schema_keys
from trainer.errors import UserError

JOB_NAME = "dtrain"
_NOTICED: set[str] = set()  # renamed-key notices this process printed (compose)
# The resolvers of the default run directory and sweep folder (conf/config.yaml:
# outputs/${dtrain_run_name:}, multirun/${dtrain_sweep_name:}).
RUN_NAME_RESOLVER = "dtrain_run_name"
SWEEP_NAME_RESOLVER = "dtrain_sweep_name"


def swept_keys(overrides: list[str]) -> list[str]:
    """The keys a multirun's overrides sweep (`optim.lr=1e-3,3e-3`, `range(...)`, `choice(...)`)."""
    return [override.get_key_element() for override in parse_overrides(overrides) if override.is_sweep_override()]


def hydra_error_text(err: Exception) -> str:
    """Hydra's multi-line errors as one line (its list of available options included)."""
    text = str(err)
    if "Available options in" in text:
        head, options = text.split("Available options in", 1)
        # the options, without the config search path Hydra lists after them
        options = options.split("Config search path:", 1)[0]
        names = [w.strip() for w in options.split("\n")[1:] if w.strip()]
        return f"{head.strip().splitlines()[-1]}; available: {', '.join(names)}"
    text = text.split("Config search path:", 1)[0]  # Hydra's list of every folder it searched
    parts = [line.strip().rstrip(".") for line in text.splitlines() if line.strip()]
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
    close = closest_key(key, schema_keys())
    hint = f"did you mean {close}? " if close else ""
    return UserError(f"bad config: {key} is not a config key; {hint}`dtrain train --cfg job` lists every key")


def closest_key(key: str, keys: list[str]) -> str | None:
    """The schema key a typo most likely meant: in the same section, a name spelled out where the
    schema abbreviates it (`optim.learning_rate` -> `optim.lr`, the initials of its words) or the
    other way round; then the closest spelling in that section; then the closest key anywhere."""
    section, _, leaf = key.rpartition(".")
    siblings = {k.rpartition(".")[2]: k for k in keys if k.rpartition(".")[0] == section}

    def initials(name: str) -> str:
        return "".join(word[0] for word in name.split("_") if word)

    for name, full in siblings.items():
        if "_" in leaf + name and initials(leaf) in (name, initials(name)) or initials(name) == leaf:
            return full
    near = difflib.get_close_matches(leaf, list(siblings), n=1)
    if near:
        return siblings[near[0]]
    anywhere = difflib.get_close_matches(key, keys, n=1)
    return anywhere[0] if anywhere else None


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


class OneLineJobError(CompactHydraException):
    """A job's failure that Hydra records and prints as this one line, without a traceback."""


def register_hydra() -> None:
    """The schema and dtrain's resolvers, before anything composes (hydra.main included)."""
    ConfigStore.instance().store(name="dtrain_schema", node=Config)
    if not OmegaConf.has_resolver(RUN_NAME_RESOLVER):
        OmegaConf.register_new_resolver(RUN_NAME_RESOLVER, lambda *, _root_: default_run_name(_root_))
    if not OmegaConf.has_resolver(SWEEP_NAME_RESOLVER):
        OmegaConf.register_new_resolver(SWEEP_NAME_RESOLVER, lambda *, _root_: default_sweep_name(_root_))
    if not OmegaConf.has_resolver(HF_NAME_RESOLVER):  # conf/data/hf.yaml's data.name
        OmegaConf.register_new_resolver(HF_NAME_RESOLVER, hf_dataset_name)
    if not OmegaConf.has_resolver(TEXT_NAME_RESOLVER):  # conf/data/text.yaml's data.name
        OmegaConf.register_new_resolver(TEXT_NAME_RESOLVER, text_dataset_name)


def default_run_name(root: DictConfig) -> str:
    """The run's name from its trajectory keys (keys.py's run_identity), as the run will record
    them: its paths anchored (anchor_paths), whatever folder the command is typed in."""
    job = OmegaConf.create(OmegaConf.to_container(OmegaConf.masked_copy(root, [k for k in root if k != "hydra"]),
                                                  resolve=True))
    anchor_paths(job, chdir=bool(OmegaConf.select(root, "hydra.job.chdir", default=False)))
    return run_identity(OmegaConf.to_container(job))


def default_sweep_name(root: DictConfig) -> str:
    """The sweep's name from its overrides as typed (hydra.overrides.task, where a multirun keeps
    them with their sweep values: trainer/launch/sweep.py's pin_sweep_dir resolves the folder so)
    and the primary config's name (keys.py's sweep_identity)."""
    task = [str(o) for o in OmegaConf.select(root, "hydra.overrides.task", default=None) or []]
    config_name = OmegaConf.select(root, "hydra.job.config_name", default=None) or CONFIG_NAME
    return sweep_identity(task, swept_keys(task), config_name)


def compose(overrides: list[str], return_hydra_config: bool = False,
            source: ConfigSource = ConfigSource()) -> DictConfig:
    """The config `dtrain train` composes for these overrides from `source` (for every check, for
    prepare and plan), through Hydra's public compose API. --config-dir folders are searched as
    `hydra.main` searches them: after the primary folder, before the schema, ahead of the
    command line's own `hydra.searchpath` entries."""
    register_hydra()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(source.config_path), version_base="1.3", job_name=JOB_NAME):
            cfg = hydra_compose(source.config_name, overrides=_with_search_path(overrides, source),
                                return_hydra_config=return_hydra_config)
    except Exception as err:
        raise _user_error(err, overrides) from None
    finally:
        GlobalHydra.instance().clear()
    check_schema_keys(cfg)
    for notice in apply_renamed_keys(cfg):
        if notice not in _NOTICED:  # once per command, not once per sweep point
            _NOTICED.add(notice)
            print(f"dtrain: {notice}", file=sys.stderr)
    return cfg


def _with_search_path(overrides: list[str], source: ConfigSource) -> list[str]:
    if not source.config_dirs:
        return overrides
    given = [o for o in overrides if o.partition("=")[0] == "hydra.searchpath"]
    entries = [f"file://{d}" for d in source.config_dirs]
    if given:
        try:
            entries += list(OverridesParser.create().parse_overrides(given[-1:])[0].value())
        except Exception as err:
            raise UserError(f"bad override: {hydra_error_text(err)}") from None
    listed = ",".join("'" + str(e).replace("'", "\\'") + "'" for e in entries)
    return [o for o in overrides if o not in given] + [f"hydra.searchpath=[{listed}]"]


# Paths the job itself reads, anchored too when hydra.job.chdir=true runs it inside its run
# directory (without it they are read from the folder the command was typed in, and kept as typed:
# data.dir and data.source name the run's folder, and the runs before recorded them so).
CHDIR_PATHS = ("data.dir", "data.source", "eval.hellaswag.path", "resume")


def anchor_paths(cfg: DictConfig, launch_dir: Path | None = None, chdir: bool = False) -> None:
    """model.init_from and tokenizer.path (and .checkpoint) made absolute against the folder the command was typed in
    (`launch_dir`; the current folder by default): the run records them so, the same command from
    another folder is the same run, and workers that start elsewhere read the same source. With
    `chdir` (hydra.job.chdir=true) CHDIR_PATHS as well, which the job would otherwise look up in
    its run directory. URLs and resume=auto/never stay as they are."""
    base = launch_dir or Path.cwd()
    # what is not a path: a recipe's REQUIRED sentinel (left for validation's error line), resume's words
    not_paths = {"model.init_from": (INIT_FROM_REQUIRED,), "resume": ("auto", "never")}
    for key in ("model.init_from", "tokenizer.path", "tokenizer.checkpoint", "data.tokenizer.path",
                *(CHDIR_PATHS if chdir else ())):
        value = OmegaConf.select(cfg, key, default=None)
        if value and value not in not_paths.get(key, ()) and "://" not in str(value):
            OmegaConf.update(cfg, key, str(base / Path(str(value)).expanduser()), merge=False)


def parse_overrides(overrides: list[str]) -> list:
    """Hydra's parsed overrides; a syntax error is one line."""
    try:
        return OverridesParser.create().parse_overrides(overrides)
    except Exception as err:
        unquoted = unquoted_non_ascii(overrides)
        if isinstance(err, OverrideParseException) and unquoted:
            raise quote_hint(unquoted) from None
        raise UserError(f"bad override: {hydra_error_text(err)}") from None


def sweep_points(overrides: list[str]) -> list[list[str]]:
    """Every point of a multirun's basic sweep (`a=1,2 b=x,y` -> four override lists), in the
    order Hydra's basic sweeper runs them (the last override varies fastest)."""
    axes: dict[str, list[str]] = {}  # a key given twice keeps its place and takes the last value, as Hydra's
    for override in parse_overrides(overrides):
        key = override.get_key_element()
        if override.is_sweep_override() and not override.is_discrete_sweep():
            raise UserError(f"{key}: a {override.value_type.name} sweep needs a sweeper plugin "
                            "(hparams_search=...); the basic sweep takes lists: key=a,b,c or range(...)")
        values = (list(override.sweep_string_iterator()) if override.is_sweep_override()
                  else [override.get_value_element_as_str()])
        axes[key] = [f"{key}={value}" for value in values]
    return [list(point) for point in itertools.product(*axes.values())]


@contextlib.contextmanager
def env_flag(name: str, value: str) -> Iterator[None]:
    """An environment variable set for the life of a `with` block, restored after."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def run_hydra_app(args: list[str], task: Callable[[DictConfig], object]) -> None:
    """hydra.main over args, calling task(cfg) for the run or each sweep point (`--config-path` in
    args wins over dtrain's conf/, as in any Hydra app)."""
    register_hydra()
    args = hydra_args(args)
    source = config_source(args)
    # Hydra reads its arguments from sys.argv; the program stays this process's own (workers spawned
    # meanwhile carry it), and the command line is as typed again afterwards
    typed = sys.argv
    sys.argv = [typed[0] if typed else "dtrain", *args]
    try:
        hydra.main(config_path=str(source.config_path), config_name=source.config_name, version_base="1.3")(task)()
    finally:
        sys.argv = typed


def hydra_job(cfg: DictConfig) -> tuple[Path, DictConfig | None]:
    """Inside run_hydra_app's task: the job's output folder, and Hydra's config when the job is one
    point of a sweep (None for a single run). `cfg`, hydra.main's composition, gets its paths
    anchored as the checks' were, in the folder the command was typed in (Hydra's runtime.cwd:
    hydra.job.chdir=true has moved this process into the output folder by now)."""
    hydra_cfg = HydraConfig.get()
    anchor_paths(cfg, Path(hydra_cfg.runtime.cwd), chdir=hydra_cfg.job.chdir)
    return Path(hydra_cfg.runtime.output_dir), hydra_cfg if hydra_cfg.mode == RunMode.MULTIRUN else None


def hydra_context(cfg: DictConfig, source: ConfigSource) -> HydraContext:
    """What Hydra's job runner (`hydra.core.utils.run_job`) takes beside a composed config, as Hydra
    hands it to its launchers: the config loader of `source` and the config's hydra.callbacks.
    (`Callbacks` is the one class here from Hydra's _internal: HydraContext is typed with it and
    Hydra makes it no other way.)"""
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(source.config_path), version_base="1.3", job_name=JOB_NAME):
            loader = GlobalHydra.instance().config_loader()
    finally:
        GlobalHydra.instance().clear()
    return HydraContext(config_loader=loader, callbacks=Callbacks(cfg))


def run_as_hydra_job(cfg: DictConfig, source: ConfigSource, job: Callable[[DictConfig], object]):
    """job(cfg without its hydra section) as Hydra runs a job, from this composed config (what a
    Hydra launcher does with each config it is given): the run directory made, hydra.job.chdir
    honoured, `.hydra/` (config.yaml, hydra.yaml, overrides.yaml) and dtrain.log (hydra.job_logging)
    written, hydra.callbacks told. The job's exception is raised here as it is, not printed by
    Hydra with 'Error executing job with overrides' above the one `error:` line; an error of
    Hydra's own (a write it could not make) comes through whole for write_errors_as_user_errors."""
    configure_log(cfg.hydra.hydra_logging, cfg.hydra.verbose)  # as hydra.main sets up Hydra's own logger
    context = hydra_context(cfg, source)
    context.callbacks.on_run_start(config=cfg, config_name=cfg.hydra.job.config_name)
    outcome: list = []  # what `job` returned, or the exception it raised

    def task(job_cfg: DictConfig) -> None:
        try:
            outcome.append(job(job_cfg))
        except BaseException as err:  # Stopped and KeyboardInterrupt too: they end the command
            outcome.append(err)

    ret = run_job(task, cfg, job_dir_key="hydra.run.dir", job_subdir_key=None, hydra_context=context)
    context.callbacks.on_run_end(config=cfg, config_name=cfg.hydra.job.config_name, job_return=ret)
    if outcome and isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0] if outcome else None
