"""The package layout holds (issue 35): the root of trainer/ keeps five modules, a package's
__init__.py imports nothing (so one module never drags in its neighbours, and the checking path
stays torch-free), and Hydra is used in one module only (trainer/config/compose.py)."""

from __future__ import annotations

import ast
from pathlib import Path

TRAINER = Path(__file__).resolve().parents[2] / "trainer"
ROOT_MODULES = {"__init__.py", "__main__.py", "cli.py", "errors.py", "io.py"}
# parallel/__init__.py is the registry of modes (STRATEGIES), found by importing the mode modules
REGISTRIES = {"parallel"}


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def test_the_root_keeps_five_modules_beside_the_packages():
    assert {p.name for p in TRAINER.glob("*.py")} == ROOT_MODULES


def test_a_packages_init_imports_nothing():
    for init in TRAINER.glob("*/__init__.py"):
        if init.parent.name not in REGISTRIES:
            assert imports(init) <= {"__future__"}, f"{init.relative_to(TRAINER.parent)} imports {imports(init)}"


def test_hydra_is_used_in_one_module():
    users = sorted(str(p.relative_to(TRAINER.parent)) for p in TRAINER.rglob("*.py")
                   if any(name == "hydra" or name.startswith("hydra.") for name in imports(p)))
    assert users == ["trainer/config/compose.py"], users


def test_no_test_module_imports_another_or_conftest():
    """Shared code lives in tests/helpers/ (issue 35 item 7); fixtures come from conftest.py by name."""
    tests = TRAINER.parent / "tests"
    for path in tests.rglob("test_*.py"):
        wrong = {name for name in imports(path) if name.split(".")[0].startswith("test_") or name == "conftest"}
        assert not wrong, f"{path.relative_to(tests)} imports {sorted(wrong)}"
