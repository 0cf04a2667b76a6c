"""The suite's own layout: helpers and fixtures shared by several test modules live in helper
modules (``tests/*.py`` not named ``test_*``, or ``tests/conftest.py``), never imported from
another test module (which would run that module's fixtures and tests a second way), and no
test name is defined twice, in one module or in two (the later one would hide the first, or
a report would name two different tests alike). Pure: reads the test files' syntax trees."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent
TEST_MODULES = sorted(TESTS.glob("test_*.py"))


def _imported_modules(tree: ast.Module) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found


def _test_names(tree: ast.Module) -> list[str]:
    names = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.append(node.name)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            names += [
                f"{node.name}.{item.name}"
                for item in node.body
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
            ]
    # A helper named test_... that says it is none (``test_env.__test__ = False``).
    not_tests = {
        target.value.id
        for node in tree.body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Attribute)
        and target.attr == "__test__"
        and isinstance(target.value, ast.Name)
    }
    return [n for n in names if n.rsplit(".", 1)[-1].startswith("test") and n not in not_tests]


def test_the_suite_has_test_modules_to_check() -> None:
    assert len(TEST_MODULES) > 50


def test_no_test_module_imports_from_another_test_module() -> None:
    offenders = {
        path.name: sorted(
            m for m in _imported_modules(ast.parse(path.read_text())) if m.startswith("tests.test_")
        )
        for path in TEST_MODULES
    }
    assert {name: found for name, found in offenders.items() if found} == {}


def test_no_test_is_defined_twice_in_one_module_or_in_two() -> None:
    where: dict[str, list[str]] = defaultdict(list)
    for path in TEST_MODULES:
        for name in _test_names(ast.parse(path.read_text())):
            where[name].append(path.name)
    assert {name: files for name, files in where.items() if len(files) > 1} == {}


def test_helper_modules_define_no_tests() -> None:
    helpers = [p for p in TESTS.glob("*.py") if not p.name.startswith("test_")]
    assert {p.name: _test_names(ast.parse(p.read_text())) for p in helpers} == {
        p.name: [] for p in helpers
    }
