"""The argv front of the `dtrain` subcommands (eval, sample, export, report, plan).

An argparse parser whose mistakes are one line naming the problem and the usage (a UserError: the
CLI prints it and exits with code 2), and the value parsers the commands share. Standard library
only, so any command can import it before anything heavy.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from trainer.errors import UserError


class ArgParser(argparse.ArgumentParser):
    """argparse for one `dtrain` command: `--help` prints the usage and the command's description
    (exit 0); a wrong flag, a missing argument or a bad value raises UserError in one line.

    Positionals and flags may come in any order (`dtrain plan model=tiny --device-memory 8GiB
    world=2`), so a command can take `key=value` overrides as a positional with nargs="*".

    One grammar for every command: each flag may also be written as `name=value`, the way config
    keys are (`dtrain sample RUN tokens=50 top_k=10` is `--tokens 50 --top-k 10`; a switch takes
    `name=true|false`). Only a flag's own name is rewritten, so dotted config keys pass through.
    """

    def __init__(self, prog: str, description: str, usage: str | None = None):
        super().__init__(prog=prog, description=description, usage=usage,
                         formatter_class=argparse.RawDescriptionHelpFormatter)

    def usage_line(self) -> str:
        """The usage on one line, without the `usage:` prefix."""
        return " ".join(self.format_usage().split()).removeprefix("usage: ")

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{self.prog}: {message}; usage: {self.usage_line()}")

    def parse_args(self, args: Sequence[str] | None = None, namespace=None) -> argparse.Namespace:
        # Intermixed: plain argparse stops filling a nargs="*" positional at the first flag, so
        # overrides after a flag would be "unrecognized".
        parsed, extras = self.parse_known_intermixed_args(self._flags_from_key_values(args), namespace)
        if extras:
            extra = extras[0]
            if extra.startswith("-"):
                self.error(f"unknown flag {extra!r}")
            self.error(f"unexpected argument {extra!r}")
        return parsed

    def _flags_from_key_values(self, args: Sequence[str] | None) -> list[str] | None:
        """`name=value` -> `--name value` for this parser's own flags (`top_k` is `--top-k`)."""
        if args is None:
            return None
        flags = {opt: action for action in self._actions for opt in action.option_strings if opt.startswith("--")}
        out: list[str] = []
        for arg in args:
            name, eq, value = arg.partition("=")
            flag = "--" + name.replace("_", "-")
            action = flags.get(flag) if eq and not arg.startswith("-") else None
            if action is None or flag == "--help":
                out.append(arg)
            elif action.nargs == 0:  # a switch: store_true and friends
                if value.lower() not in SWITCH_VALUES:
                    self.error(f"{name}={value!r}: a switch takes {'/'.join(SWITCH_VALUES)}")
                if SWITCH_VALUES[value.lower()]:
                    out.append(flag)
            else:
                out.append(f"{flag}={value}")  # one token: a value that starts with '-' stays a value
        return out


SWITCH_VALUES = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}


def folder_to_write(text: str) -> Path:
    """An output folder (--out DIR): an empty name is refused, since it would be the current folder
    and the outputs would land among the user's own files."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty folder name would write into the current folder; "
                                         "name a folder, e.g. --out DIR")
    return Path(text).expanduser()


def utf8_text(text: str) -> str:
    """Text that encodes as UTF-8 (--prompt). Bytes that are not UTF-8 reach Python as lone
    surrogates (PEP 383), which no tokenizer encodes: one line naming the first such byte."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        char = text[err.start]
        byte = f"byte 0x{ord(char) - 0xDC00:02x}" if 0xDC80 <= ord(char) <= 0xDCFF else f"code point U+{ord(char):04X}"
        raise argparse.ArgumentTypeError(
            f"not UTF-8 text ({byte} at character {err.start + 1}); give it in UTF-8 (the terminal's "
            "encoding, LANG / LC_ALL, decides how typed text arrives)") from None
    return text


def _read(text: str, kind: Callable[[str], int | float], what: str = "") -> int | float:
    """text as `kind`, or argparse's error naming `what` was expected."""
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}{what}") from None


def _refuse(text: str, why: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(f"invalid value {text!r} ({why})")


def non_negative_int(text: str) -> int:
    """A whole number, 0 or more (a checkpoint step, --top-k)."""
    value = _read(text, int, " (a whole number)")
    if value < 0:
        raise _refuse(text, "0 or more")
    return value


def whole_number_in(low: int, high: int, why: str) -> Callable[[str], int]:
    """A parser for whole numbers from `low` to `high`; `why` says why the bound is there."""

    def parse(text: str) -> int:
        value = _read(text, int, " (a whole number)")
        if not low <= value <= high:
            raise _refuse(text, f"from {low} to {high}: {why}")
        return value

    return parse


def positive(kind: Callable[[str], int | float]) -> Callable[[str], int | float]:
    """A parser for values of `kind` (int, float) above 0."""

    def parse(text: str) -> int | float:
        value = _read(text, kind)
        if not value > 0:
            raise _refuse(text, "must be > 0")
        return value

    return parse


def non_negative_float(text: str) -> float:
    """A number, 0 or more (--temperature: 0 is greedy)."""
    value = _read(text, float, " (a number)")
    if not value >= 0 or value == float("inf"):
        raise _refuse(text, "0 or more")
    return value


def probability(text: str) -> float:
    """A number above 0, at most 1 (--top-p)."""
    value = _read(text, float, " (a number)")
    if not 0 < value <= 1:
        raise _refuse(text, "above 0, at most 1")
    return value
