"""The project's names and entry points the benchmarks use, found in the code they measure:
this tree, or (a run of ``--against REV``) a git worktree of a revision from before or after
a move (issue 31 moved ``webhooks.*`` to ``core.*``, the message contract of ``tasks.config``
to ``core.messages``, the accept statement of ``ingest.store`` to ``models.accept``,
``ingest.publisher`` to ``tasks.publisher``).

``from compat import Settings`` looks the name up when it is first imported (nothing else
is imported, so a bench needs only its own names to exist): at its path in this tree first,
then at its older paths, in the code of ``BENCH_CODE`` (this tree if unset), and checks that
the module found lives there: the editable install maps ``core`` & co. to this tree, so a
name looked up in an older revision that lacks its new module would otherwise come from this
tree, silently mixing the two. When a name moves again, put its new path first below.

Subprocesses take module paths instead (``target("receiver", code)``: the first candidate
whose module exists in ``code``)."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the types: this tree's paths
    from core.crypto import SecretBox
    from core.messages import DELIVER_TASK, DELIVERIES_QUEUE, Dispatch, message
    from core.settings import Settings, load_settings
    from core.ttl import expires_at
    from models.accept import ACCEPT_MANY_SQL, NewReceipt, accept_many_params, decide_many
    from models.admission import Admission
    from models.catalog import create_source
    from models.db import make_engine, make_sessionmaker, upgrade
    from models.route_catalog import add_route
    from tasks.config import create_app
    from tasks.publisher import Publisher
    from tasks.runtime import build_runtime
    from tasks.sweeper import sweep_once

__all__ = [
    "ACCEPT_MANY_SQL",
    "CODE",
    "DELIVERIES_QUEUE",
    "DELIVER_TASK",
    "ROOT",
    "Admission",
    "Dispatch",
    "NewReceipt",
    "Publisher",
    "SecretBox",
    "Settings",
    "accept_many_params",
    "add_route",
    "build_runtime",
    "cli",
    "create_app",
    "create_source",
    "decide_many",
    "expires_at",
    "load_settings",
    "make_engine",
    "make_sessionmaker",
    "message",
    "sweep_once",
    "target",
    "upgrade",
]

ROOT = Path(__file__).resolve().parent.parent
CODE = Path(os.environ.get("BENCH_CODE", ROOT)).resolve()
if sys.path[0] != str(CODE):
    sys.path.insert(0, str(CODE))

# Each name's modules, newest first.
PATHS: dict[str, tuple[str, ...]] = {
    "Settings": ("core.settings", "webhooks.settings"),
    "load_settings": ("core.settings", "webhooks.settings"),
    "SecretBox": ("core.crypto", "webhooks.crypto"),
    "expires_at": ("core.ttl", "webhooks.ttl"),
    "DELIVERIES_QUEUE": ("core.messages", "tasks.config"),
    "Dispatch": ("core.messages", "tasks.config"),
    "DELIVER_TASK": ("core.messages", "tasks.config"),
    "message": ("core.messages", "tasks.config"),
    "Admission": ("models.admission",),
    "build_runtime": ("tasks.runtime",),
    "sweep_once": ("tasks.sweeper",),
    "create_app": ("tasks.config",),
    "Publisher": ("tasks.publisher", "ingest.publisher"),
    "ACCEPT_MANY_SQL": ("models.accept", "ingest.store"),
    "NewReceipt": ("models.accept", "ingest.store"),
    "accept_many_params": ("models.accept", "ingest.store"),
    "decide_many": ("models.accept", "ingest.store"),
    "create_source": ("models.catalog",),
    "add_route": ("models.route_catalog", "models.catalog"),
    "make_engine": ("models.db",),
    "make_sessionmaker": ("models.db",),
    "upgrade": ("models.db",),
}

# What subprocesses run (``module`` or ``module:attribute``), newest first.
TARGETS: dict[str, tuple[str, ...]] = {
    "receiver": ("ingest.app:app_from_env",),  # uvicorn --factory
    "worker": ("tasks",),  # celery -A
    "cli": ("webhooks.cli",),  # the ``webhooks`` command's module
}


def has_module(code: Path, module: str) -> bool:
    """``module`` is a file (or package) of ``code``, without importing anything."""
    base = code.joinpath(*module.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def target(kind: str, code: Path = CODE) -> str:
    """The first of ``TARGETS[kind]`` whose module exists in ``code``."""
    for candidate in TARGETS[kind]:
        if has_module(code, candidate.partition(":")[0]):
            return candidate
    raise LookupError(f"none of {TARGETS[kind]} in {code}")


def cli(code: Path = CODE) -> list[str]:
    """The ``webhooks`` command for ``code`` (run it with PYTHONPATH = ``code``): the venv's
    script imports its module from the first path, so ``code``'s must exist."""
    target("cli", code)
    return [str(Path(sys.executable).parent / "webhooks")]


def __getattr__(name: str) -> Any:
    if name not in PATHS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    for path in PATHS[name]:
        if not has_module(CODE, path):
            continue
        module = importlib.import_module(path)
        where = Path(module.__file__ or "").resolve()
        if not where.is_relative_to(CODE):
            raise ImportError(f"{path} came from {where}, not from {CODE}")
        if hasattr(module, name):
            value = getattr(module, name)
            globals()[name] = value
            return value
    raise ImportError(f"{name} is in none of {PATHS[name]} in {CODE}")
