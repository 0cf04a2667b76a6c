"""Engines, sessions and migrations. Engines are built from Settings at the entry point."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import psycopg
from psycopg import sql
from sqlalchemy import Engine, create_engine
from sqlalchemy.orm import Session, sessionmaker

from core.settings import Settings
from models.pg import (
    DEAD_PEER,
    UPGRADE_HINT,
    DatabaseUnavailable,
    describe_db_error,
    misconfigured,
    where,
)

if TYPE_CHECKING:
    # Alembic (a tenth of a second to import) only when migrating: every CLI command and
    # process that opens a session imports this module.
    from alembic.config import Config


# Defined in models.pg (plain psycopg, no SQLAlchemy: the CLI's reads), importable from here.
__all__ = [
    "DEAD_PEER",
    "UPGRADE_HINT",
    "DatabaseUnavailable",
    "describe_db_error",
    "misconfigured",
    "where",
]


def make_engine(
    settings: Settings, *, pool_size: int | None = None, pre_ping: bool = True
) -> Engine:
    """``pre_ping``: a round trip per checkout to replace connections that died while pooled.
    The worker turns it off and recovers from a dead connection itself (tasks.pipeline); its
    other statements (sweeper, maintenance) are then discarded once by SQLAlchemy's
    disconnect handling and run again on the next beat."""
    return create_engine(
        settings.database_url,
        pool_size=pool_size or settings.db_pool_size,
        max_overflow=5,
        pool_pre_ping=pre_ping,
        # Error messages never carry bound parameters (bodies, secrets, event data).
        hide_parameters=True,
        connect_args={"connect_timeout": max(1, int(settings.db_connect_timeout)), **DEAD_PEER},
    )


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def session_scope(factory: sessionmaker[Session]) -> Iterator[Session]:
    """One transaction: commit on success, roll back on error."""
    with factory() as session, session.begin():
        yield session


def ensure_database(settings: Settings) -> bool:
    """Create the configured database if it does not exist. Returns True when created."""
    name = settings.database_name()
    admin_dsn = settings.psycopg_dsn.rsplit("/", 1)[0] + "/postgres"
    try:
        with psycopg.connect(admin_dsn, autocommit=True, connect_timeout=5) as conn:
            exists = conn.execute(
                "SELECT 1 FROM pg_database WHERE datname = %s", (name,)
            ).fetchone()
            if exists:
                return False
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            return True
    except psycopg.errors.DuplicateDatabase:
        return False
    except psycopg.OperationalError as exc:
        message = describe_db_error(exc, settings.database_url)
        fallback = f"cannot reach Postgres: {type(exc).__name__}"
        raise DatabaseUnavailable(message or fallback) from None


def alembic_config(settings: Settings) -> Config:
    from alembic.config import Config  # noqa: PLC0415 (alembic, see above)

    cfg = Config()
    cfg.set_main_option("script_location", "models:migrations")
    cfg.set_main_option("sqlalchemy.url", settings.database_url.replace("%", "%%"))
    cfg.attributes["settings"] = settings
    return cfg


def migrations_behind(settings: Settings, engine: Engine) -> tuple[str | None, str] | None:
    """(the database's revision, the code's head) when the database lacks a migration this
    code has (none at all: None first), else None: at head, or ahead of this code (a newer
    release migrated it; the older code reads only what it knew, so it runs)."""
    from alembic.runtime.migration import MigrationContext  # noqa: PLC0415 (alembic: only the revision check)
    from alembic.script import ScriptDirectory  # noqa: PLC0415 (likewise)

    scripts = ScriptDirectory.from_config(alembic_config(settings))
    head = scripts.get_current_head()
    assert head is not None
    with engine.connect() as conn:
        current = MigrationContext.configure(conn).get_current_revision()
    if current == head:
        return None
    known = {script.revision for script in scripts.walk_revisions()}
    if current is not None and current not in known:
        return None  # ahead: a revision this code does not have
    return current, head


def upgrade(settings: Settings, revision: str = "head") -> None:
    """Create the database when missing, migrate it, lay out the receipt partitions, and (at
    head) bind every stored secret to its place under the newest key (``models.keys.rekey``)."""
    from alembic import command  # noqa: PLC0415 (alembic: only an upgrade)

    # Secrets are sealed for their place from 0019 on: an upgrade binds the stored ones.
    from core.crypto import SecretBox  # noqa: PLC0415 (scrypt and Fernet: only an upgrade)
    from models.keys import rekey  # noqa: PLC0415 (likewise)

    # The ORM schema (through models.partitions): only an upgrade needs it.
    from models.retention_layout import ensure_partitions  # noqa: PLC0415 (the ORM schema: only an upgrade)

    ensure_database(settings)
    command.upgrade(alembic_config(settings), revision)
    engine = make_engine(settings, pool_size=1)
    try:
        # None: the database's clock decides which days are already past.
        ensure_partitions(engine, settings, None)
        if revision == "head":
            box = SecretBox(
                settings.secret_key.get_secret_value(), legacy=settings.secret_key_legacy
            )
            rekey(make_sessionmaker(engine), box)
    finally:
        engine.dispose()
