"""How this package's hand-written statements run: ``:name`` parameters, ``:now`` as the
database's clock unless a test pinned one (:data:`NOW`), on a SQLAlchemy session
(:func:`sql_text`) or straight through psycopg on the hot path (:func:`placeholders`,
:func:`fetchone`)."""

from __future__ import annotations

import re
from typing import Any

import psycopg
from sqlalchemy import text
from sqlalchemy.orm import Session

# The instant a statement decides at: the database's clock unless a test pinned one.
NOW = "coalesce(CAST(:now AS timestamptz), now())"


def placeholders(sql: str) -> str:
    """``:name`` (this package's notation) -> psycopg's ``%(name)s``; ``::`` casts untouched."""
    return re.sub(r"(?<![:\w]):([a-z_]+)", r"%(\1)s", sql.replace(":now", NOW))


# Where a hot-path statement runs: a session (its own connection and transaction), or a
# psycopg connection the caller manages (the worker's autocommit statements).
Target = Session | psycopg.Connection[Any]


def fetchone(target: Target, sql: str, params: dict[str, Any]) -> tuple[Any, ...] | None:
    """Run a hot-path statement through psycopg directly: on a worker, SQLAlchemy's result
    machinery cost more CPU than the statements themselves (tuple rows, no per-result column
    metadata). On a session it runs in the session's transaction, so handler writes made
    through the same session commit or roll back with it; on a bare psycopg connection in
    autocommit it is its own transaction (one round trip, commit included)."""
    if isinstance(target, Session):
        raw = target.connection().connection.driver_connection
        assert raw is not None
    else:
        raw = target
    row: tuple[Any, ...] | None = raw.execute(sql, params).fetchone()
    return row


def sql_text(statement: str) -> Any:
    """A statement of this package for a SQLAlchemy session (``:now`` as :data:`NOW`)."""
    return text(statement.replace(":now", NOW))
