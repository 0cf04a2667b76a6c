"""The application's own database role: what the pipeline connects as, instead of a superuser.

:func:`ensure_app_role` is run once per deployment, as a superuser (the compose ``migrate``
step): it creates a LOGIN role with no SUPERUSER, CREATEDB or CREATEROLE, and makes it the
owner of the application database, of its schema, and of every object already in that schema.
Migrations then run as that role, so it owns the tables it needs to change at run time: the
receiver and beat create and drop daily partitions of ``receipts``/``deliveries``/``attempts``
(``models.partitions``), which Postgres allows only to the parent table's owner.

Idempotent: on an existing role the attributes are asserted again and the password replaced.
A role name that is not a plain lower-case identifier, a reserved name, or an existing role
with superuser rights is refused before anything changes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Final

import psycopg
from psycopg import sql

from core.errors import WebhooksError
from core.settings import Settings
from models.db import DatabaseUnavailable, ensure_database

# Lower-case, unquoted-identifier form: the name then reads the same in SQL, URLs and logs.
ROLE_NAME: Final = re.compile(r"[a-z_][a-z0-9_]{0,62}")
_RESERVED: Final = frozenset({"postgres", "public", "none", "current_user", "session_user"})
ATTRIBUTES: Final = "LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS"


class RoleError(WebhooksError, ValueError):
    """The role cannot be set up as asked; the message says why (never the password)."""


@dataclass(frozen=True)
class RoleReport:
    role: str
    database: str
    schema: str
    created: bool  # False: the role existed and was brought back to the required attributes
    reassigned: int  # objects of the schema whose owner changed to the role


def check_role_name(name: str) -> str:
    if not ROLE_NAME.fullmatch(name):
        raise RoleError(
            f"invalid role name {name!r}: use 1-63 lower-case letters, digits and underscores, "
            "not starting with a digit"
        )
    if name.startswith("pg_") or name in _RESERVED:
        raise RoleError(f"role name {name!r} is reserved")
    return name


def check_password(password: str | None, variable: str) -> str:
    if not password:
        raise RoleError(f"set the role's password in the environment variable {variable}")
    if len(password) < 16:
        raise RoleError(f"the password in {variable} is too short: use at least 16 characters")
    return password


# Every relation, function and type of the schema not yet owned by the role. Tables first:
# ALTER TABLE also moves their indexes and identity/serial sequences (which refuse a direct
# ALTER SEQUENCE ... OWNER); partitions are tables of their own and are listed one by one.
_OWNED_ELSEWHERE = """
SELECT kind, name FROM (
    SELECT CASE c.relkind WHEN 'S' THEN 'SEQUENCE' WHEN 'v' THEN 'VIEW'
                          WHEN 'm' THEN 'MATERIALIZED VIEW' ELSE 'TABLE' END AS kind,
           c.relname::text AS name, c.relkind IN ('r', 'p') AS first
    FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
    WHERE n.nspname = %(schema)s AND c.relowner <> %(role)s::regrole
      AND c.relkind IN ('r', 'p', 'S', 'v', 'm')
      AND NOT (c.relkind = 'S' AND EXISTS (
          SELECT 1 FROM pg_depend d
          WHERE d.objid = c.oid AND d.classid = 'pg_class'::regclass AND d.deptype IN ('a', 'i')))
    UNION ALL
    SELECT 'FUNCTION', p.oid::regprocedure::text, false
    FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
    WHERE n.nspname = %(schema)s AND p.proowner <> %(role)s::regrole
    UNION ALL
    SELECT 'TYPE', t.typname::text, false
    FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace
    WHERE n.nspname = %(schema)s AND t.typowner <> %(role)s::regrole AND t.typtype IN ('e', 'd')
) o ORDER BY first DESC, kind, name
"""


_QUIET: Final = {
    "log_statement": "none",
    "log_min_duration_statement": "-1",
    "log_min_error_statement": "panic",
}


def _preflight(conn: psycopg.Connection[Any], name: str) -> str:
    """Refuse unless we are a superuser and ``name`` is not one; returns the current schema."""
    me = conn.execute(
        "SELECT rolsuper, current_schema() FROM pg_roles WHERE rolname = current_user"
    ).fetchone()
    if me is None or not me[0]:
        raise RoleError(
            "the database URL must connect as a superuser to create the application role"
        )
    existing = conn.execute("SELECT rolsuper FROM pg_roles WHERE rolname = %s", (name,)).fetchone()
    if existing is not None and existing[0]:
        raise RoleError(
            f"role {name!r} exists and is a superuser: choose another name for the "
            "application's role"
        )
    return str(me[1] or "public")


def ensure_app_role(settings: Settings, name: str, password: str) -> RoleReport:
    """Create (or re-assert) the application role and hand it the application database.

    ``settings.database_url`` must connect as a superuser. One transaction: a failure leaves
    the role and the owners as they were.
    """
    check_role_name(name)
    admin_dsn = settings.psycopg_dsn.rsplit("/", 1)[0] + "/postgres"
    try:
        with psycopg.connect(admin_dsn, connect_timeout=5) as conn:
            _preflight(conn, name)  # before the database is created: bad input changes nothing
        ensure_database(settings)
        database = settings.database_name()
        with psycopg.connect(settings.psycopg_dsn, connect_timeout=5) as conn, conn.transaction():
            schema = _preflight(conn, name)
            row = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (name,)).fetchone()
            # The statement carries the password: keep it out of the server's log, whatever
            # the server logs (superuser settings, for this transaction only).
            for setting, value in _QUIET.items():
                conn.execute(
                    sql.SQL("SET LOCAL {} = {}").format(sql.Identifier(setting), sql.Literal(value))
                )
            role = sql.Identifier(name)
            verb = "CREATE" if row is None else "ALTER"
            conn.execute(
                sql.SQL("{} ROLE {} WITH {} PASSWORD {}").format(
                    sql.SQL(verb), role, sql.SQL(ATTRIBUTES), sql.Literal(password)
                )
            )
            conn.execute(
                sql.SQL("ALTER DATABASE {} OWNER TO {}").format(sql.Identifier(database), role)
            )
            conn.execute(
                sql.SQL("ALTER SCHEMA {} OWNER TO {}").format(sql.Identifier(schema), role)
            )
            objects = conn.execute(_OWNED_ELSEWHERE, {"schema": schema, "role": name}).fetchall()
            for kind, obj in objects:
                target = (
                    sql.SQL(obj)  # regprocedure text: already quoted, with its argument types
                    if kind == "FUNCTION"
                    else sql.Identifier(schema, obj)
                )
                conn.execute(sql.SQL("ALTER {} {} OWNER TO {}").format(sql.SQL(kind), target, role))
    except psycopg.OperationalError as exc:
        raise DatabaseUnavailable(f"cannot reach Postgres: {exc.__class__.__name__}") from None
    except psycopg.Error as exc:  # the server's own reason; it never quotes the statement
        raise RoleError(f"cannot set up role {name!r}: {exc.diag.message_primary}") from None
    return RoleReport(name, database, schema, row is None, len(objects))
