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


# psycopg converts a statement's placeholders once and caches the result, but only for a
# statement of at most 4,096 bytes (psycopg._queries.MAX_CACHED_STATEMENT_LENGTH): the
# worker's claim and success statements, indented for reading, were 4.2-4.5 KiB and were
# converted again on every run (~6% of a forwarding worker's CPU, py-spy). Compacted, they
# are ~3 KiB.
_TOKENS = re.compile(
    r"(?P<quoted>'(?:[^']|'')*'|\"(?:[^\"]|\"\")*\")"
    r"|(?P<comment>--[^\n]*|/\*.*?\*/)"
    r"|(?P<space>\s+)"
    r"|(?P<other>[^'\"\s-]+|-)",
    re.DOTALL,
)


def compact(sql: str) -> str:
    """``sql`` without its comments and with each run of whitespace outside quotes made one
    space; unchanged where it uses what this does not parse (escape strings ``E'..'``, dollar
    quoting)."""
    if re.search(r"\bE'|\$", sql, re.IGNORECASE):
        return sql
    out: list[str] = []
    for token in _TOKENS.finditer(sql):
        kind = token.lastgroup
        if kind in ("space", "comment"):
            if out and out[-1] != " ":
                out.append(" ")
        else:
            out.append(token.group())
    return "".join(out).strip()


def placeholders(sql: str) -> str:
    """``:name`` (this package's notation) -> psycopg's ``%(name)s``; ``::`` casts untouched;
    compacted (:func:`compact`)."""
    return re.sub(r"(?<![:\w]):([a-z_]+)", r"%(\1)s", compact(sql).replace(":now", NOW))


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
