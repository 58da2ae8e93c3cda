"""The paths the prose names exist (issue 46): every `trainer/PKG/MODULE.py` (with or without `:NN`),
every package `trainer/PKG/`, every dotted module `trainer.PKG.MODULE` (and a module-level name after
it), every `tests/...` and `scripts/...` file, and every `PKG/MODULE.py` that names a module of trainer's
packages, as README.md and docs/*.md write them and as the docstrings and comments under trainer/,
tests/ and scripts/ write them. A module moved or renamed leaves no reader at an old name.

Placeholders are spelled in capitals in a path (`optim/NAME.py`: the recipe of a file a user adds) or
in angle brackets (`trainer.commands.<name>`), and are not paths. In-process and quick: nothing here runs
dtrain or imports a module it checks."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from functools import cache
from pathlib import Path

from helpers.dtrain import REPO

TRAINER = REPO / "trainer"
PACKAGES = sorted(p.name for p in TRAINER.iterdir() if (p / "__init__.py").is_file())
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SOURCES = sorted(p for folder in ("trainer", "tests", "scripts") for p in (REPO / folder).rglob("*.py"))
# Where a name is not a path in this tree, and why.
NOT_IN_THE_TREE = {
    "trainer/conf",  # conf/ as the wheel ships it (pyproject.toml's package data), not a folder here
}

_WORD = r"[A-Za-z0-9_]+"
_PART = r"[A-Za-z0-9_-]+(?:\.[A-Za-z0-9]+)*"  # a file or folder name: `indexed-job.yaml`
# trainer/PKG/MODULE.py, trainer/PKG/, tests/..., scripts/... (a `:NN` after a file is its line)
ROOTED = re.compile(rf"(?<![\w./-])((?:trainer|tests|scripts)(?:/{_PART})*/?)(?::(\d+))?")
# PKG/MODULE.py where PKG is one of trainer's packages (the docs' usual way to name a module)
PACKAGE_RELATIVE = re.compile(rf"(?<![\w./-])((?:{'|'.join(PACKAGES)})(?:/{_WORD})+\.py\b)(?::(\d+))?")
# trainer.PKG.MODULE, trainer.PKG.MODULE.NAME
# and the tests' own: helpers.MODULE.NAME, a name in conftest (not `conftest.py`, a file)
DOTTED = re.compile(rf"(?<![\w./-])((?:trainer|helpers|conftest)(?:\.(?!py\b){_WORD})+)")
# where a dotted name's first part lives: a package's folder or a module's file
DOTTED_ROOTS = {"trainer": TRAINER, "helpers": REPO / "tests" / "helpers", "conftest": REPO / "tests" / "conftest.py"}


def is_placeholder(name: str) -> bool:
    """NAME or X in a path written as a pattern (`optim/NAME.py`), not a file."""
    return any(re.fullmatch(r"[A-Z][A-Z0-9_]*", part) for part in re.split(r"[/.]", name))


def prose(text: str, markdown: bool) -> str:
    """What a reader reads in a file: a page whole, a module's docstrings and comments."""
    if markdown:
        return text
    pieces = [token.string for token in tokenize.generate_tokens(io.StringIO(text).readline)
              if token.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            pieces.append(ast.get_docstring(node, clean=False) or "")
    return "\n".join(pieces)


@cache
def top_level_names(module: Path) -> frozenset[str]:
    """What a module defines (not what it imports: prose names a thing where it lives)."""
    names = set()
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name)}
    return frozenset(names)


def missing_path(name: str, line: str | None) -> str | None:
    """Why `name` (a path from the repository's root) is stale, or None when it exists."""
    target = REPO / name.rstrip("/")
    if name.endswith("/") and not target.is_dir():
        return "no such folder"
    if not target.exists():
        return "no such file or folder"
    if line and target.is_file() and int(line) > len(target.read_text().splitlines()):
        return f"the file has no line {line}"
    return None


def missing_module(dotted: str) -> str | None:
    """Why `trainer.PKG.MODULE[.NAME]` is stale: its modules must exist, and the first part that is not a
    module must be a name the module defines at its top level."""
    parts = dotted.split(".")
    folder = DOTTED_ROOTS[parts[0]]
    if folder.suffix == ".py":
        return None if parts[1] in top_level_names(folder) else f"{parts[0]} defines no {parts[1]}"
    for i, part in enumerate(parts[1:], start=1):
        if (folder / part / "__init__.py").is_file():
            folder = folder / part
        elif (folder / f"{part}.py").is_file():
            module = folder / f"{part}.py"
            rest = parts[i + 1:]
            if rest and rest[0] not in top_level_names(module):
                return f"{'.'.join(parts[:i + 1])} defines no {rest[0]}"
            return None
        else:
            names = top_level_names(folder / "__init__.py")
            if part in names or is_placeholder(part):  # trainer.PKG.MODULE: no module is in capitals
                return None
            return f"no module {'.'.join(parts[:i + 1])}"
    return None


def stale_names(text: str) -> list[str]:
    """Each stale name in `text` with the reason."""
    found = []
    for pattern, prefix in ((ROOTED, ""), (PACKAGE_RELATIVE, "trainer/")):
        for match in pattern.finditer(text):
            name, line = match[1], match[2]
            if is_placeholder(name) or name.rstrip("/") in NOT_IN_THE_TREE:
                continue
            if (why := missing_path(prefix + name, line)) is not None:
                found.append(f"{match[0]}: {why}")
    for match in DOTTED.finditer(text):
        if (why := missing_module(match[1])) is not None:  # capitals here are a module's constants
            found.append(f"{match[1]}: {why}")
    return found


def test_every_path_named_in_prose_exists():
    stale = {path.relative_to(REPO).as_posix(): names for path in PAGES + SOURCES
             if (names := stale_names(prose(path.read_text(), markdown=path.suffix == ".md")))}
    assert not stale, "named but not in the tree:\n" + "\n".join(f"  {path}: {names}" for path, names in stale.items())


def test_the_path_checks_can_fail():
    text = """See trainer/tokenizers/gpt2.py and trainer/optim/ (its recipe: optim/NAME.py, trainer/x/NAME.py).
    Stale: trainer/data/gone.py, trainer/nowhere/, data/gone_too.py, trainer/cli.py:99999,
    tests/unit/test_gone.py, trainer.data.gone, trainer.config.vocab.NOT_DEFINED_HERE, trainer.nope,
    trainer.PKG.MODULE, conftest.NOT_A_FIXTURE, helpers.gone, helpers.runs.NOT_HERE.
    Fine: trainer/cli.py:1, trainer.config.vocab.TOKENIZER_VOCAB_SIZE, trainer.commands.<name>,
    model/gpt.py, trainer.parallel.STRATEGIES, conftest.py's data_dir, conftest.data_dir,
    helpers.runs.REFERENCE_BATCH."""
    assert [name.split(":")[0] for name in stale_names(text)] == [
        "trainer/data/gone.py", "trainer/nowhere/", "trainer/cli.py", "tests/unit/test_gone.py",
        "data/gone_too.py", "trainer.data.gone", "trainer.config.vocab.NOT_DEFINED_HERE", "trainer.nope",
        "conftest.NOT_A_FIXTURE", "helpers.gone", "helpers.runs.NOT_HERE"]
    # a docstring and a comment are read, a string literal in code is not
    source = '"""trainer/gone_a.py"""\nx = "trainer/gone_b.py"  # trainer/gone_c.py\n'
    assert [name.split(":")[0] for name in stale_names(prose(source, markdown=False))] == [
        "trainer/gone_c.py", "trainer/gone_a.py"]
