"""Shared CLI plumbing: one Settings per invocation, clean errors, JSON output."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property, wraps
from typing import Any, ParamSpec, TypeVar

import typer
from rich.console import Console
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from webhooks.clock import Clock, SystemClock
from webhooks.logs import configure_logging
from webhooks.settings import Settings, SettingsError, load_settings

P = ParamSpec("P")
R = TypeVar("R")

console = Console()
err_console = Console(stderr=True)


class CliError(Exception):
    """A user-facing error: printed without a traceback, exit code 1."""


@dataclass
class Env:
    settings: Settings
    clock: Clock = field(default_factory=SystemClock)

    @cached_property
    def engine(self) -> Engine:
        from models.db import make_engine  # noqa: PLC0415

        return make_engine(self.settings, pool_size=2)

    @cached_property
    def sessions(self) -> sessionmaker[Session]:
        from models.db import make_sessionmaker  # noqa: PLC0415

        return make_sessionmaker(self.engine)

    @contextmanager
    def session(self) -> Iterator[Session]:
        with self.sessions() as session, session.begin():
            yield session


def env() -> Env:
    try:
        settings = load_settings()
    except SettingsError as exc:
        raise CliError(str(exc)) from None
    # Commands print their results on stdout (--json must stay parseable): logs go to stderr.
    configure_logging("WARNING", json=settings.log_json)
    return Env(settings)


def handle_errors(func: Callable[P, R]) -> Callable[P, R]:
    """Turn expected errors into a one-line message and exit code 1 (no traceback, no secret)."""

    @wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        from models.db import DatabaseUnavailable  # noqa: PLC0415

        try:
            return func(*args, **kwargs)
        except (CliError, SettingsError, DatabaseUnavailable, ValueError) as exc:
            err_console.print(f"[red]error:[/red] {exc}", highlight=False)
            raise typer.Exit(1) from None

    return wrapper


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, default=str, indent=2) + "\n")
