"""Shared CLI plumbing: where the configuration comes from, one Settings per invocation, clean
errors, JSON output."""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time
from functools import cached_property, wraps
from pathlib import Path
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from core.clock import Clock, SystemClock
from core.errors import WebhooksError

# What a command needs (settings, the database, logging) is imported when it runs, not here,
# and so in every module of this package: each `webhooks` process pays for what it imports,
# `webhooks --help` imports neither pydantic nor SQLAlchemy, and `providers list` no SQLAlchemy.
if TYPE_CHECKING:
    import psycopg
    from sqlalchemy import Engine
    from sqlalchemy.orm import Session, sessionmaker

    from core.settings import Settings

P = ParamSpec("P")
R = TypeVar("R")

console = Console()
err_console = Console(stderr=True)


ENV_FILE_VAR = "WEBHOOKS_ENV_FILE"


class CliError(WebhooksError):
    """A user-facing error: printed without a traceback, exit code 1; ``doc`` names the docs
    topic (core/docs.py) that explains it, where the command's own would not."""

    def __init__(self, message: str, *, doc: str | None = None) -> None:
        super().__init__(message)
        self.doc = doc


@dataclass
class Options:
    """The top-level command's options (``webhooks --env-file PATH ...``)."""

    env_file: Path | None = None
    # The database of this invocation (set by :func:`env`), for one-line database errors.
    database_url: str | None = None


OPTIONS = Options()


@dataclass(frozen=True)
class ConfigSource:
    """The env file the settings were read from (besides the environment), and where the
    search looked."""

    path: Path | None
    how: str
    looked: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.path is not None:
            return f"settings read from the environment and {self.path} ({self.how})"
        return (
            "settings read from the environment only: no "
            + ", no ".join(self.looked)
            + f"; pass --env-file PATH or set {ENV_FILE_VAR}"
        )


def project_root() -> Path | None:
    """The source tree this package runs from (an editable install, ``make install``), if any."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() else None


def find_env_file(
    explicit: Path | None, environ: Mapping[str, str], cwd: Path, root: Path | None
) -> ConfigSource:
    """``--env-file``, else ``WEBHOOKS_ENV_FILE``, else the project's ``.env``, else the current
    directory's: the first that is given or exists. A file named explicitly must exist."""
    for given, how in ((explicit, "--env-file"), (environ.get(ENV_FILE_VAR), ENV_FILE_VAR)):
        if given:
            path = Path(given).expanduser()
            path = path if path.is_absolute() else cwd / path
            if not path.is_file():
                raise CliError(f"{how} {given}: no such file", doc="settings")
            return ConfigSource(path.resolve(), how)
    candidates = [(root / ".env", "project root")] if root is not None else []
    candidates.append((cwd / ".env", "current directory"))
    looked = []
    for path, how in candidates:
        if path.is_file():
            return ConfigSource(path.resolve(), how)
        looked.append(f"{path} ({how})")
    return ConfigSource(None, "", tuple(dict.fromkeys(looked)))


def export_env_file(path: Path, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The file's ``WEBHOOKS_*`` values that the environment does not set (the environment wins,
    as in pydantic-settings); the caller puts them in ``os.environ`` so that processes started
    from here (``webhooks serve``'s app factory, ``webhooks run``'s children) read the same."""
    from dotenv import dotenv_values  # pydantic-settings' own parser

    present = {key.upper() for key in (os.environ if environ is None else environ)}
    return {
        key: value
        for key, value in dotenv_values(path).items()
        if value is not None and key.upper().startswith("WEBHOOKS_") and key.upper() not in present
    }


@dataclass
class Env:
    settings: Settings
    clock: Clock = field(default_factory=SystemClock)
    config: ConfigSource = field(default_factory=lambda: ConfigSource(None, ""))
    # The settings taken from config.path (the environment set the others).
    from_file: frozenset[str] = frozenset()

    @cached_property
    def engine(self) -> Engine:
        from models.db import make_engine

        return make_engine(self.settings, pool_size=2)

    @cached_property
    def sessions(self) -> sessionmaker[Session]:
        from models.db import make_sessionmaker

        return make_sessionmaker(self.engine)

    @contextmanager
    def session(self) -> Iterator[Session]:
        if not self.keys_checked:
            self.check_keys()
        with self.sessions() as session, session.begin():
            yield session

    keys_checked: bool = False

    @contextmanager
    def reads(self) -> Iterator[psycopg.Connection[Any]]:
        """One plain psycopg connection in one transaction, for :mod:`models.reads` (the read
        commands: no SQLAlchemy), after the same key check as :meth:`session`."""
        from models import pg, reads

        with pg.connect(self.settings) as conn:
            if not self.keys_checked:
                from core.crypto import SecretBox

                secret = self.settings.secret_key.get_secret_value()
                reads.check_stored_keys(
                    conn, SecretBox(secret, legacy=self.settings.secret_key_legacy)
                )
                self.keys_checked = True
            yield conn

    def check_keys(self) -> None:
        """Before the first session: WEBHOOKS_SECRET_KEY must decrypt the stored secrets
        (:class:`core.crypto.KeyMismatch`, one line, otherwise). ``secrets rekey``, the
        way out of a mismatch, uses :attr:`sessions` and is not checked."""
        from core.crypto import SecretBox
        from models.catalog import check_stored_keys

        box = SecretBox(
            self.settings.secret_key.get_secret_value(), legacy=self.settings.secret_key_legacy
        )
        with self.sessions() as session:
            check_stored_keys(session, box)
        self.keys_checked = True


def env() -> Env:
    """Settings from the environment and the env file :func:`find_env_file` picks."""
    from core.logs import configure_logging
    from core.settings import SettingsError, load_settings

    source = find_env_file(OPTIONS.env_file, os.environ, Path.cwd(), project_root())
    exported: dict[str, str] = {}
    if source.path is not None:
        exported = export_env_file(source.path)
        os.environ.update(exported)
        os.environ[ENV_FILE_VAR] = str(source.path)
    try:
        # The file is already in the environment; not reading ./.env keeps one source of truth.
        settings = load_settings(_env_file=None)
    except SettingsError as exc:
        message = str(exc).replace("Field required", "required, not set")
        raise CliError(f"{message}; {source.describe()}", doc="settings") from None
    # Commands print their results on stdout (--json must stay parseable): logs go to stderr.
    # Lazily: structlog is loaded by the first line logged, and most commands log none.
    configure_logging("WARNING", json=settings.log_json, lazy=True)
    OPTIONS.database_url = settings.database_url
    return Env(settings, config=source, from_file=frozenset(k.upper() for k in exported))


def say_error(message: str) -> None:
    """``error: ...`` on stderr, on one line whatever the terminal's width."""
    err_console.print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)


def cli_command() -> str:
    """How to type this CLI: ``webhooks`` when that is on PATH and is this installation, else
    the full path of this installation's script (``make install`` does not change PATH)."""
    script = Path(sys.executable).parent / "webhooks"
    on_path = shutil.which("webhooks")
    if on_path is not None and Path(on_path).resolve() == script.resolve():
        return "webhooks"
    return str(script) if script.exists() else "webhooks"


def handle_errors(func: Callable[P, R]) -> Callable[P, R]:
    """Turn expected errors into a one-line message and exit code 1 (no traceback, no secret)."""

    @wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return func(*args, **kwargs)
        except Exception as exc:
            if isinstance(exc, (CliError, ValueError, *_loaded(_USER_ERRORS))):
                say_error(with_docs(str(exc), docs_topic(func, exc)))
                raise typer.Exit(1) from None
            if not isinstance(exc, _loaded(_DATABASE_ERRORS)):
                raise
            message = database_error(exc)
            if message is None:
                raise
            say_error(message)
            raise typer.Exit(1) from None

    return wrapper


# The docs section an error of a command points to (core/docs.py), by the command's module,
# or by the error's class where that says more than the command does.
_MODULE_DOCS = {
    "replay": "dead-letters",
    "reconcile": "reconciliation",
    "sources": "sources",
    "source_secrets": "sources",
    "routes": "routes",
    "providers": "sources",
    "retention": "retention",
}
_ERROR_DOCS = {"SettingsError": "settings", "KeyMismatch": "security", "FilterError": "filters"}


def docs_topic(func: Callable[..., object], exc: BaseException) -> str | None:
    """The docs topic of an error ``func`` (a command) raised; None where none explains it."""
    by_error = getattr(exc, "doc", None) or _ERROR_DOCS.get(type(exc).__name__)
    if by_error is not None:
        return by_error
    if func.__name__.startswith("dead_"):
        return "dead-letters"
    return _MODULE_DOCS.get(func.__module__.rsplit(".", 1)[-1])


def with_docs(message: str, topic: str | None) -> str:
    """``message`` with the docs section that explains it, on the same line."""
    if topic is None:
        return message
    from core.docs import see  # noqa: PLC0415 (only on an error)

    return f"{message} ({see(topic)})"


# The errors :func:`handle_errors` turns into one line, by module and name: printed as they are
# (settings, database unavailable, key mismatch), or as :func:`database_error` words them.
_USER_ERRORS = (
    ("core.settings", "SettingsError"),
    ("models.pg", "DatabaseUnavailable"),
    ("core.crypto", "KeyMismatch"),
)
_DATABASE_ERRORS = (("sqlalchemy.exc", "DBAPIError"), ("psycopg", "Error"))


def _loaded(names: tuple[tuple[str, str], ...]) -> tuple[type[BaseException], ...]:
    """The classes among ``names`` whose module is imported. An exception can only be an
    instance of a class that exists, so checking these alone is the same as importing every
    module first, which would make each command import psycopg and SQLAlchemy to start."""
    found = (getattr(sys.modules.get(module), name, None) for module, name in names)
    return tuple(cls for cls in found if isinstance(cls, type))


def database_error(exc: BaseException) -> str | None:
    """One line for a Postgres error a user can fix (refused, unknown database, authentication,
    not migrated), naming host:port/database; None for any other error."""
    from models.pg import describe_db_error

    url = OPTIONS.database_url or os.environ.get("WEBHOOKS_DATABASE_URL", "")
    return describe_db_error(exc, url)


def json_default(value: object) -> str:
    """Times as the API writes them: ISO 8601, UTC as ``Z`` (``2026-11-30T20:14:19.519799Z``)."""
    if isinstance(value, datetime):
        if value.tzinfo is None:
            return value.isoformat()
        return value.astimezone(UTC).isoformat().removesuffix("+00:00") + "Z"
    if isinstance(value, date | time):
        return value.isoformat()
    return str(value)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, default=json_default, indent=2) + "\n")
