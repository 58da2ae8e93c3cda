"""The `dtrain train` command line as Hydra will read it, looked at before Hydra does: its own
flags (where configs come from: --config-dir, --config-path, --config-name; what it prints: --help,
--cfg, --info), the key=value overrides beside them, and `sweep.seeds=N`. A flag Hydra would refuse
with its usage page or a traceback is one line here. Hydra itself is trainer/config/compose.py's."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from trainer.config.schema import CONF_DIR
from trainer.errors import UserError

CONFIG_NAME = "config"
# Hydra's own command-line flags, passed through untouched (the rest are key=value overrides).
HYDRA_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
                          "--config-dir", "-cd", "--experimental-rerun", "--info", "-i"}
HYDRA_FLAGS = {"--multirun", "-m", "--resolve", "--help", "-h", "--hydra-help", "--version",
               "--shell-completion", "-sc"}
# Flags that only print something (help, the config): nothing is checked or run.
INFORMATIONAL_FLAGS = ("--help", "-h", "--hydra-help", "--version", "--info", "-i", "--cfg", "-c",
                       "--shell-completion", "-sc")
HELP_FLAGS = ("--help", "-h", "--hydra-help")
# The words Hydra's --cfg must and --info may take (its argparse choices), and the flags of which
# Hydra runs one per command (anything else is its ValueError traceback).
FLAG_CHOICES = {"--cfg": ("job", "hydra", "all"),
                "--info": ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")}
FLAG_NAMES = {"-c": "--cfg", "-i": "--info", "--multirun": "-m", "--shell-completion": "-sc"}
ONE_OF_FLAGS = ("-m", "--cfg", "--info", "-sc")


@dataclasses.dataclass(frozen=True)
class ConfigSource:
    """Where the configs come from, as Hydra's flags say: the primary config folder (--config-path;
    dtrain's conf/ by default), the primary config's name (--config-name) and folders searched
    beside it (--config-dir), each absolute."""

    config_path: Path = CONF_DIR
    config_name: str = CONFIG_NAME
    config_dirs: tuple[Path, ...] = ()

    def hydra_flags(self) -> list[str]:
        """The same source as flags for `hydra.main`, paths absolute (a relative --config-path would
        be taken relative to dtrain's installed module, not to where the command was typed)."""
        flags = [f"--config-path={self.config_path}"] if self.config_path != CONF_DIR else []
        flags += [f"--config-name={self.config_name}"] if self.config_name != CONFIG_NAME else []
        return flags + [f"--config-dir={d}" for d in self.config_dirs]


SOURCE_FLAGS = {"--config-path": "config_path", "-cp": "config_path", "--config-name": "config_name",
                "-cn": "config_name", "--config-dir": "config_dirs", "-cd": "config_dirs"}


def config_source(args: list[str]) -> ConfigSource:
    """The ConfigSource Hydra's flags among args ask for; a folder that is not there is one line."""
    found: dict = {"config_dirs": ()}
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag not in SOURCE_FLAGS or (not eq and i + 1 >= len(args)):
            continue
        value = value if eq else args[i + 1]
        field = SOURCE_FLAGS[flag]
        if field == "config_name":
            found[field] = value
            continue
        folder = Path(value).expanduser().absolute()
        if not folder.is_dir():
            raise UserError(f"{flag} {value}: no such folder ({folder}); give a folder of Hydra configs")
        found[field] = found["config_dirs"] + (folder,) if field == "config_dirs" else folder
    return ConfigSource(**found)


def hydra_args(args: list[str]) -> list[str]:
    """args with Hydra's source flags replaced by their absolute form (ConfigSource.hydra_flags),
    and a bare --info written --info=all (what it means), so that no override moved beside it is
    taken for its word."""
    kept, skip = [], False
    for i, arg in enumerate(args):
        if skip:
            skip = False
        elif arg in SOURCE_FLAGS:
            skip = True
        elif arg in ("--info", "-i") and (i + 1 == len(args) or args[i + 1].startswith("-")):
            kept.append("--info=all")
        elif arg.partition("=")[0] not in SOURCE_FLAGS:
            kept.append(arg)
    return [*config_source(args).hydra_flags(), *kept]


def split_args(args: list[str]) -> tuple[list[str], bool]:
    """The key=value overrides among args, and whether this is a multirun (-m)."""
    overrides, multirun, skip = [], False, False
    for i, arg in enumerate(args):
        if skip:
            skip = False
        elif arg in HYDRA_FLAGS_WITH_VALUE:
            # --info's word is optional (argparse's nargs="?"): a flag after it is not its value
            skip = arg not in ("--info", "-i") or (i + 1 < len(args) and not args[i + 1].startswith("-"))
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


def check_hydra_flags(args: list[str]) -> None:
    """What Hydra's own argument parsing would refuse with its usage page or a ValueError traceback,
    as one line: a --cfg or --info word that is not one of Hydra's (an override written right after
    --info is taken for its word), two of -m/--cfg/--info/-sc, --resolve without --cfg or --help."""
    given = []
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        flag = FLAG_NAMES.get(flag, flag)
        given.append(flag)
        if flag not in FLAG_CHOICES:
            continue
        following = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("-") else None
        word = value if eq else following
        if word is None and flag == "--info":
            continue  # --info alone is --info all
        choices = FLAG_CHOICES[flag]
        if word not in choices:
            typed = f"{arg} {word}" if word is not None and not eq else arg
            overrides = " ".join(a for a in args if "=" in a and not a.startswith("-"))
            raise UserError(f"{typed}: {flag} takes one of {', '.join(choices)} before the overrides; "
                            f"e.g. dtrain train {flag} {choices[0]} {overrides}".rstrip())
    if any(flag in HELP_FLAGS for flag in given):
        return  # Hydra prints the help whatever else is given
    if "--resolve" in given and "--cfg" not in given:
        raise UserError("--resolve resolves what --cfg prints; give it with --cfg (dtrain train --cfg job --resolve)")
    several = [flag for flag in ONE_OF_FLAGS if flag in given]
    if len(several) > 1:
        hint = " (a point's config: drop -m and give each key one value)" if "-m" in several else ""
        raise UserError(f"{' and '.join(several)}: Hydra does one of {', '.join(ONE_OF_FLAGS)} per command; "
                        f"give one of them{hint}")


SEEDS_KEY = "sweep.seeds"


def expand_seeds(args: list[str], multirun: bool) -> list[str]:
    """`sweep.seeds=N` as the axis it stands for, `train.seed=0,...,N-1`, in its place (the seeds
    of one recipe are then consecutive points, and a re-run of the command finds the same points).
    Refused in one line outside a sweep, beside another train.seed, or not a whole number >= 1."""
    given = [a for a in args if a.partition("=")[0].lstrip("+") == SEEDS_KEY]
    if not given:
        return args
    value = given[-1].partition("=")[2]
    if not multirun:
        raise UserError(f"{given[-1]} makes a sweep of seeds: add -m (dtrain train -m {given[-1]} ...)")
    if any(a.partition("=")[0].lstrip("+~") == "train.seed" for a in args):
        raise UserError(f"{given[-1]} and train.seed= both set the seed: give one of them")
    if not value.isdigit() or int(value) < 1:
        raise UserError(f"{SEEDS_KEY}={value} must be a whole number of seeds, at least 1 (e.g. {SEEDS_KEY}=3)")
    at = args.index(given[0])
    rest = [a for a in args if a not in given]
    axis = "train.seed=" + ",".join(str(seed) for seed in range(int(value)))
    return [*rest[:at], axis, *rest[at:]]
