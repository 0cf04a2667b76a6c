"""Engines, sessions and migrations. Engines are built from Settings at the entry point."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from alembic import command
from alembic.config import Config
from psycopg import sql
from sqlalchemy import Engine, create_engine
from sqlalchemy.orm import Session, sessionmaker

from webhooks.settings import Settings


class DatabaseUnavailable(Exception):
    """Postgres could not be reached."""


def make_engine(
    settings: Settings, *, pool_size: int | None = None, pre_ping: bool = True
) -> Engine:
    """``pre_ping``: a round trip per checkout to replace connections that died while pooled.
    The worker turns it off and recovers from a dead connection itself (tasks.deliver); its
    other statements (sweeper, maintenance) are then discarded once by SQLAlchemy's
    disconnect handling and run again on the next beat."""
    return create_engine(
        settings.database_url,
        pool_size=pool_size or settings.db_pool_size,
        max_overflow=5,
        pool_pre_ping=pre_ping,
        # Error messages never carry bound parameters (bodies, secrets, event data).
        hide_parameters=True,
        connect_args={"connect_timeout": max(1, int(settings.db_connect_timeout))},
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
        raise DatabaseUnavailable(f"cannot reach Postgres: {exc.__class__.__name__}") from None


def alembic_config(settings: Settings) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", "models:migrations")
    cfg.set_main_option("sqlalchemy.url", settings.database_url.replace("%", "%%"))
    cfg.attributes["settings"] = settings
    return cfg


def upgrade(settings: Settings, revision: str = "head") -> None:
    """Create the database when missing, migrate it, and lay out the receipt partitions."""
    from models import partitions  # noqa: PLC0415  (partitions imports this module)

    ensure_database(settings)
    command.upgrade(alembic_config(settings), revision)
    engine = make_engine(settings, pool_size=1)
    try:
        partitions.bootstrap(engine, settings)
    finally:
        engine.dispose()
