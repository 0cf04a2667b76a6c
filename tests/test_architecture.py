"""The house's rules, checked on the code's own imports (grimp reads them, lazy ones included).

Floors, from the ground up (docs/architecture.md says what each holds):

0. ``core``     settings, clock, durations, crypto, TTL arithmetic, logs, metrics, the
                provider contracts and the message contract;
1. ``models``   storage: Postgres (and the Redis state admission and the login throttle
                keep), every statement;
2. ``tasks``    the workers: Celery app, dispatcher, publisher, delivery steps, handlers,
                reconciliation;
3. ``ingest``   the receiver, the admin API and the console;
4. ``webhooks`` the CLI.

A module imports only from its own floor or below, and no two modules import each other,
directly or through others (a circle). Sizes: no module over 700 lines (migrations aside),
no function over 120.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parent.parent
FLOORS: dict[str, int] = {"core": 0, "models": 1, "tasks": 2, "ingest": 3, "webhooks": 4}
MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 120


def import_graph(packages: Iterable[str]) -> Mapping[str, set[tuple[str, int]]]:
    """Each module of ``packages`` -> the modules of ``packages`` it imports, with the line."""
    names = tuple(packages)
    graph = grimp.build_graph(*names, cache_dir=None)
    out: dict[str, set[tuple[str, int]]] = {}
    for module in graph.modules:
        edges: set[tuple[str, int]] = set()
        for imported in graph.find_modules_directly_imported_by(module):
            details = graph.get_import_details(importer=module, imported=imported)
            line = min((int(d["line_number"]) for d in details), default=0)
            edges.add((imported, line))
        out[module] = edges
    return out


def upward_imports(
    graph: Mapping[str, set[tuple[str, int]]], floors: Mapping[str, int]
) -> list[str]:
    """Every import from a lower floor to a higher one, as ``a:line -> b``."""
    found = []
    for module, edges in graph.items():
        mine = floors[module.split(".")[0]]
        for imported, line in edges:
            if floors[imported.split(".")[0]] > mine:
                found.append(f"{module}:{line} -> {imported}")
    return sorted(found)


def circles(graph: Mapping[str, set[tuple[str, int]]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan, iteratively).

    A package's ``__init__`` importing its own submodules is no circle unless a submodule
    imports the package's ``__init__`` back."""
    succ = {m: sorted({t for t, _ in e if t != m and t in graph}) for m, e in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    counter = 0
    for root in sorted(succ):
        if root in index:
            continue
        work = [(root, iter(succ[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        group.append(top)
                        if top == node:
                            break
                    if len(group) > 1:
                        groups.append(sorted(group))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(succ[child])))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return sorted(groups)


def oversized(paths: Iterable[Path]) -> list[str]:
    """Modules over MAX_MODULE_LINES and functions over MAX_FUNCTION_LINES."""
    found = []
    for path in paths:
        text = path.read_text()
        name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        lines = text.count("\n") + (0 if text.endswith("\n") else 1)
        if lines > MAX_MODULE_LINES:
            found.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    return found


def product_files() -> list[Path]:
    return sorted(
        p
        for package in FLOORS
        for p in (ROOT / package).rglob("*.py")
        if "migrations" not in p.relative_to(ROOT).parts
    )


@pytest.fixture(scope="module")
def graph() -> Mapping[str, set[tuple[str, int]]]:
    return import_graph(FLOORS)


def test_floors_only_look_down(graph: Mapping[str, set[tuple[str, int]]]) -> None:
    assert upward_imports(graph, FLOORS) == []


def test_no_import_circles(graph: Mapping[str, set[tuple[str, int]]]) -> None:
    assert circles(graph) == []


def test_no_module_or_function_too_long() -> None:
    assert oversized(product_files()) == []


def unexplained_lazy_imports(paths: Iterable[Path]) -> list[str]:
    """Imports inside functions outside the CLI (ruff's PLC0415 finds them; a ``noqa`` lets one
    stay) whose ``noqa`` gives no reason in parentheses."""
    found = []
    for path in paths:
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            at = line.find("noqa: PLC0415")
            if at >= 0 and not line[at + len("noqa: PLC0415") :].strip().startswith("("):
                found.append(f"{path.relative_to(ROOT)}:{number}")
    return found


def test_every_lazy_import_says_why() -> None:
    """A lazy import defers a heavy import on purpose (or imports after a setup that must
    come first), and says which; one that only dodged a circle has no reason to give."""
    assert unexplained_lazy_imports(product_files()) == []


def _write(root: Path, files: Mapping[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checks_catch_an_upward_import_a_circle_and_a_long_function(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same checks on a made-up house: a ground module that reaches up (lazily, as the
    old ``webhooks/crypto.py`` did), two modules in a circle, and a function too long."""
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    _write(
        tmp_path,
        {
            "archground/__init__.py": "",
            "archground/low.py": "def f():\n    from archtop import high\n    return high\n",
            "archtop/__init__.py": "",
            "archtop/high.py": "from archtop import other\n",
            "archtop/other.py": "import archtop.high\n",
            "archtop/long.py": f"def long():\n{body}\n",
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    made = import_graph(["archground", "archtop"])
    assert upward_imports(made, {"archground": 0, "archtop": 1}) == [
        "archground.low:2 -> archtop.high"
    ]
    assert circles(made) == [["archtop.high", "archtop.other"]]
    assert oversized([tmp_path / "archtop/long.py"]) == [
        f"{tmp_path / 'archtop/long.py'}:1 long: {MAX_FUNCTION_LINES + 1} lines"
    ]
