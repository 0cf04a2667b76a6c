"""Plain psycopg: a connection from Settings, and one line for a Postgres error a user can act
on. No SQLAlchemy: the CLI's read commands (:mod:`models.reads`) connect through here, and
:mod:`models.db` re-exports what it defined here before."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

import psycopg
from psycopg.rows import namedtuple_row

from core.errors import WebhooksError

if TYPE_CHECKING:
    from core.settings import Settings


class DatabaseUnavailable(WebhooksError):
    """Postgres could not be reached."""


# SQLSTATEs Postgres reports for the causes a user can fix (psycopg's ``sqlstate``).
_UNKNOWN_DATABASE = "3D000"
_AUTHENTICATION = ("28P01", "28000")
_UNDEFINED_TABLE = "42P01"
UPGRADE_HINT = "run `webhooks db upgrade`"

# A connection whose peer vanished without a reset (a host or a network gone, a failover)
# fails within about ten seconds, instead of after TCP's ~15 minutes of retransmissions, or
# never for a statement waiting on an answer with nothing unacknowledged: keepalive probes
# after 5 s idle, every 2 s, 3 unanswered; data unacknowledged for 10 s (ms). Well inside
# WEBHOOKS_RECORD_RETRY_SECONDS (30 s), so a success commit caught by a silent partition is
# tried again on a fresh connection, where a 30 s limit used the whole window on one try
# (issue 32's drill). A slow statement on a live server is not cut: its host answers the
# probes.
DEAD_PEER: dict[str, int] = {
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
    "tcp_user_timeout": 10_000,
}


def connect(settings: Settings) -> psycopg.Connection[Any]:
    """One connection as the engine's (:func:`models.db.make_engine`) are made: the same
    connect timeout and dead-peer limits; rows are named tuples (``row.id``)."""
    # libpq's parameters, as a dict of Any: psycopg types its keyword arguments.
    params: dict[str, Any] = {
        "connect_timeout": max(1, int(settings.db_connect_timeout)),
        **DEAD_PEER,
    }
    return psycopg.connect(settings.psycopg_dsn, row_factory=namedtuple_row, **params)


def where(database_url: str) -> str:
    """``host:port/database`` of a URL, without its user or password."""
    try:
        parts = urlsplit(database_url)
        port = parts.port
    except ValueError:
        return "the database in WEBHOOKS_DATABASE_URL"
    if not parts.scheme or (not parts.netloc and not parts.path):
        return "the database in WEBHOOKS_DATABASE_URL"
    host = parts.netloc.rpartition("@")[2]
    host = host[1:].partition("]")[0] if host.startswith("[") else host.partition(":")[0]
    return f"{host or 'localhost'}:{port or 5432}/{unquote(parts.path.removeprefix('/'))}"


def _cause(orig: psycopg.Error) -> str | None:
    """What a Postgres error says is wrong: "not_migrated", "unknown_database",
    "authentication", "refused", "unreachable" (any other connection failure), or None."""
    state = getattr(orig, "sqlstate", None)
    text = str(orig).lower()
    if state == _UNDEFINED_TABLE or isinstance(orig, psycopg.errors.UndefinedTable):
        return "not_migrated"
    if not isinstance(orig, psycopg.OperationalError):
        return None
    if state == _UNKNOWN_DATABASE or ("database" in text and "does not exist" in text):
        return "unknown_database"
    if (
        state in _AUTHENTICATION
        or "authentication failed" in text
        or "password" in text
        or ("role" in text and "does not exist" in text)
    ):
        return "authentication"
    return "refused" if "refused" in text else "unreachable"


def _orig(exc: BaseException) -> BaseException | None:
    """The driver's error under SQLAlchemy's wrapper (an exception can only be SQLAlchemy's
    when SQLAlchemy is imported: this module does not import it)."""
    wrapper = getattr(sys.modules.get("sqlalchemy.exc"), "DBAPIError", None)
    if isinstance(wrapper, type) and isinstance(exc, wrapper):
        orig: BaseException | None = getattr(exc, "orig", None)
        return orig
    return exc


def misconfigured(exc: BaseException) -> bool:
    """Whether ``exc`` says the settings are wrong (an unknown database, a failed
    authentication), not that Postgres is away for now: waiting changes nothing."""
    orig = _orig(exc)
    return isinstance(orig, psycopg.Error) and _cause(orig) in (
        "unknown_database",
        "authentication",
    )


def describe_db_error(exc: BaseException, database_url: str) -> str | None:
    """One line for an error of Postgres a user can act on: where (host:port/database, never
    the password) and the cause: refused, unknown database, authentication, not migrated, or
    unreachable with the driver's reason. None when ``exc`` is no such error."""
    orig = _orig(exc)
    if not isinstance(orig, psycopg.Error):
        return None
    place = f"Postgres at {where(database_url)}"
    cause = _cause(orig)
    if cause == "not_migrated":
        return f"{place} is not migrated (a table is missing): {UPGRADE_HINT}"
    if cause == "unknown_database":
        return f"{place}: unknown database (WEBHOOKS_DATABASE_URL): {UPGRADE_HINT} to create it"
    if cause == "authentication":
        return f"{place}: authentication failed (the user or password in WEBHOOKS_DATABASE_URL)"
    if cause == "refused":
        return f"{place}: connection refused (is Postgres running on that port?)"
    if cause is None:
        return None
    reason = str(orig).strip().splitlines()[-1][:160] if str(orig).strip() else type(orig).__name__
    return f"{place}: cannot connect ({reason})"
