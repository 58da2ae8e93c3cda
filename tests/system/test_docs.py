"""The documents agree with the code: docs/architecture.md's import layers are import-linter's
contracts in pyproject.toml, every module under trainer/ is on its map, every relative link in
README.md and docs/*.md leads to a file (and heading) that exists, every `make` target they name
exists, and the README stays short. In-process and quick: nothing here runs dtrain."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers.dtrain import REPO

DOCS = REPO / "docs"
ARCHITECTURE = DOCS / "architecture.md"
README_MAX_BYTES = 15_360
PAGES = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]


def section(text: str, heading: str) -> str:
    """The text under `## heading` up to the next heading of that level or above."""
    match = re.search(rf"^## {re.escape(heading)}\s*$(.*?)(?=^#{{1,2}} |\Z)", text, re.M | re.S)
    assert match, f"docs/architecture.md has no '## {heading}' section"
    return match[1]


def code_blocks(text: str) -> list[list[str]]:
    """The indented (4-space) code blocks of a markdown text, each as its lines less the indent."""
    blocks, current, previous_blank = [], None, True
    for line in text.split("\n"):
        blank = not line.strip()
        if not blank and line.startswith("    ") and (current is not None or previous_blank):
            current = (current or []) + [line]
        elif blank and current is not None:
            current.append("")
        elif current is not None:
            blocks.append(current)
            current = None
        previous_blank = blank
    if current is not None:
        blocks.append(current)
    return [dedent(block) for block in blocks]


def dedent(block: list[str]) -> list[str]:
    while block and not block[-1].strip():
        block = block[:-1]
    width = min(len(line) - len(line.lstrip(" ")) for line in block if line.strip())
    return [line[width:] for line in block]


def module_name(name: str) -> str:
    """`checkpoint/` or `checkpoint/layout` as the docs write it -> `trainer.checkpoint(.layout)`."""
    return "trainer." + name.strip().rstrip("/").replace("/", ".")


def contracts() -> list[dict]:
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11's TOML reader")
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def contract_layers(contract: dict) -> list[tuple[str, frozenset[str]]]:
    """Each layer as (separator, modules): ':' independent siblings, '|' siblings that may import
    one another; names made absolute when the contract has a container."""
    containers = contract.get("containers") or [""]
    assert len(containers) == 1, "the docs show one set of layers; one container at most"
    prefix = f"{containers[0]}." if containers[0] else ""
    layers = []
    for layer in contract["layers"]:
        separators = set(re.findall(r"[:|]", layer))
        assert len(separators) <= 1, f"a layer mixing ':' and '|' is not shown by the docs: {layer!r}"
        names = frozenset(prefix + n.strip() for n in re.split(r"[:|]", layer))
        layers.append((separators.pop() if separators else "", names))
    return layers


def documented_layers(block: list[str]) -> list[tuple[str, frozenset[str]]]:
    """architecture.md's layer block: one layer per line, ', ' between independent siblings and
    ' | ' between siblings that may import one another."""
    layers = []
    for line in block:
        separators = {"|" if "|" in line else "", ":" if "," in line else ""} - {""}
        assert len(separators) <= 1, f"docs/architecture.md mixes ',' and '|' in one layer: {line!r}"
        names = frozenset(module_name(n) for n in re.split(r"[,|]", line) if n.strip())
        layers.append((separators.pop() if separators else "", names))
    return layers


def name_list(block: list[str]) -> frozenset[str]:
    return frozenset(module_name(n) for n in " ".join(block).split(",") if n.strip())


def test_architecture_shows_the_import_layers_import_linter_enforces():
    blocks = code_blocks(section(ARCHITECTURE.read_text(), "Layers"))
    assert blocks, "docs/architecture.md's Layers section shows no layer block"
    layer_contracts = [c for c in contracts() if c["type"] == "layers"]
    assert len(layer_contracts) == 1, "one layers contract, shown as one block"
    shown, enforced = documented_layers(blocks[0]), contract_layers(layer_contracts[0])
    assert shown == enforced, (
        "docs/architecture.md's layers differ from pyproject.toml's [tool.importlinter] layers contract: "
        f"shown {[sorted(names) for _, names in shown]}, enforced {[sorted(names) for _, names in enforced]}")
    # Every other contract (independence, forbidden) is one name list, in any order.
    shown = [name_list(block) for block in blocks[1:]]
    for contract in contracts():
        if contract["type"] == "independence":
            assert frozenset(contract["modules"]) in shown, f"contract {contract['name']!r} is not shown"
        elif contract["type"] == "forbidden":
            assert frozenset(contract["source_modules"]) in shown, f"contract {contract['name']!r} is not shown"
    assert len(shown) == len([c for c in contracts() if c["type"] != "layers"]), (
        "docs/architecture.md shows a contract pyproject.toml does not have")


def documented_modules(text: str) -> set[str]:
    """The module tree of an 'Every module' section: a `name/` line opens a package at its
    indentation, a `name.py` line two spaces in is a module of that package; deeper lines continue
    a description."""
    (tree, *_) = code_blocks(section(text, "Every module"))
    found, packages = set(), []  # packages: (indent, name) from the root down
    for line in tree:
        if not line.strip():
            continue
        indent, token = len(line) - len(line.lstrip(" ")), line.split()[0]
        child_indent = packages[-1][0] + 2 if packages else 0
        if indent > child_indent or not (token.endswith("/") or token.endswith(".py")):
            continue  # a description's continuation, indented under the description
        packages = [(i, n) for i, n in packages if i < indent]
        if token.endswith("/"):
            packages.append((indent, token.rstrip("/")))
        else:
            found.add("/".join([n for _, n in packages] + [token]))
    return found


def test_every_trainer_module_is_on_the_architecture_map():
    actual = {p.relative_to(REPO).as_posix() for p in (REPO / "trainer").rglob("*.py")
              if p.name != "__init__.py" and "__pycache__" not in p.parts}
    documented = documented_modules(ARCHITECTURE.read_text())
    assert not actual - documented, f"modules named nowhere in docs/architecture.md: {sorted(actual - documented)}"
    assert not documented - actual, f"docs/architecture.md names modules that are gone: {sorted(documented - actual)}"


def test_the_architecture_checks_can_fail():
    """The parsers above see a difference: a layer moved, a module dropped."""
    layers = documented_layers(["cli", "commands/", "launch, loop"])
    assert layers == [("", frozenset({"trainer.cli"})), ("", frozenset({"trainer.commands"})),
                      (":", frozenset({"trainer.launch", "trainer.loop"}))]
    assert layers != documented_layers(["commands/", "cli", "launch, loop"])
    assert layers != documented_layers(["cli", "commands/", "launch | loop"])
    assert contract_layers({"layers": ["trainer.a : trainer.b", "trainer.c"]}) == [
        (":", frozenset({"trainer.a", "trainer.b"})), ("", frozenset({"trainer.c"}))]
    assert contract_layers({"containers": ["trainer"], "layers": ["a | b"]}) == [
        ("|", frozenset({"trainer.a", "trainer.b"}))]
    tree = ("## Every module\n\n    trainer/\n      cli.py     the entry point\n                 loop.py is not a"
            " module here\n      checkpoint/\n        space.py room\n      io.py      files\n")
    assert documented_modules(tree) == {"trainer/cli.py", "trainer/checkpoint/space.py", "trainer/io.py"}


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+)$", page.read_text(), re.M):
        base = slug(heading)
        seen[base if base not in seen else f"{base}-{seen[base]}"] = 0
        seen[base] = seen.get(base, 0) + 1
    return set(seen)


def links(page: Path) -> list[str]:
    text = re.sub(r"`[^`\n]*`", "", page.read_text())  # a code span is no link
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and anchor not in anchors(file):
            broken.append(f"{target} (no such heading in {file.relative_to(REPO)})")
    assert not broken, f"{page.relative_to(REPO)}: {broken}"


def test_the_link_checks_can_fail(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Top\n\n## A `code` heading: yes (really)\n\n[a](page.md#top) [b](missing.md) `[c](nope.md)`\n")
    assert anchors(page) == {"top", "a-code-heading-yes-really"}
    assert links(page) == ["page.md#top", "missing.md"]
    assert slug("Muon (`optim=muon`)") == "muon-optimmuon"


def make_targets() -> set[str]:
    return set(re.findall(r"^([a-zA-Z][\w-]*):", (REPO / "Makefile").read_text(), re.M))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_make_target_named_exists(page):
    text = page.read_text()
    code = re.findall(r"`([^`\n]*)`", text) + [ln.strip() for ln in text.split("\n") if ln.startswith("    ")]
    named = {m for snippet in code for m in re.findall(r"(?:^|[;&|] *)make ([a-z][\w-]*)", snippet)}
    assert not named - make_targets(), f"{page.relative_to(REPO)} names make targets that do not exist"


@pytest.mark.parametrize("page", [REPO / "README.md", DOCS / "configuration.md"], ids=lambda p: p.name)
def test_the_group_table_names_every_option_of_every_group(page):
    """Issue 45, finding 18: configuration.md's table lacked `mix`, `lion` and the `tokenizer` group."""
    rows = {m[1]: m[2] for m in re.finditer(r"^\| `(\w+)` \| (.*) \|$", page.read_text(), re.M)}
    groups = {d.name for d in (REPO / "conf").iterdir() if d.is_dir() and d.name != "hydra"}
    assert set(rows) == groups, f"{page.name}'s group table: {sorted(rows)}; conf/ has {sorted(groups)}"
    for group, options in rows.items():
        missing = [f.stem for f in (REPO / "conf" / group).glob("*.yaml") if f"`{f.stem}`" not in options]
        assert not missing, f"{page.name}: the `{group}` row lacks {missing}"


def test_readme_quick_start_is_the_two_commands_and_fits_its_size():
    readme = (REPO / "README.md").read_text()
    quick = readme[readme.index("## Quick start"):readme.index("## Commands")]
    assert "    make train " in quick and "    make test " in quick
    assert {"train", "test", "test-all", "test-compat"} <= make_targets()
    size = len(readme.encode())
    assert size <= README_MAX_BYTES, f"README.md is {size:,} bytes; move detail to docs/ (at most {README_MAX_BYTES:,})"
