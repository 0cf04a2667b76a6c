"""Helpers of the retention tests (tests/test_retention_holds.py, test_retention_moves.py and
test_retention.py): sources removed after each test, accepting and moving deliveries on an
injected clock, each receipt's rows, a partition-mode database of their own and a second
one in retention's delete mode.

Its fixtures (``made``, ``delete_mode``, ``retention_database``) reach the test modules as a
plugin registered in ``tests/conftest.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core.settings import Settings
from models import transitions
from models.db import make_engine, make_sessionmaker, upgrade
from models.transitions import Claim
from tests.conftest import ADMIN_DSN, TEST_DB, make_settings
from tests.conftest import test_env as subprocess_env
from tests.factories import MadeSource, accept_event, make_source
from tests.leakcheck import remember

DAY = timedelta(days=1)
SEC = timedelta(seconds=1)
LEASE = timedelta(minutes=5)
TTL = timedelta(days=4)


@pytest.fixture
def made(sessions: sessionmaker[Session]) -> Iterator[list[MadeSource]]:
    created: list[MadeSource] = []
    yield created
    forget(sessions, created)


def forget(sessions: sessionmaker[Session], sources: list[MadeSource]) -> None:
    ids = [s.id for s in sources]
    if not ids:
        return
    with sessions() as session, session.begin():
        session.execute(
            text(
                "DELETE FROM attempts WHERE delivery_id IN "
                "(SELECT id FROM deliveries WHERE source_id = ANY(:ids))"
            ),
            {"ids": ids},
        )
        for table in ("deliveries", "receipts", "conflicts"):
            session.execute(text(f"DELETE FROM {table} WHERE source_id = ANY(:ids)"), {"ids": ids})
        session.execute(
            text("DELETE FROM audit_log WHERE target->>'source' = ANY(:p)"),
            {"p": [s.public_id for s in sources]},
        )
        session.execute(text("DELETE FROM sources WHERE id = ANY(:ids)"), {"ids": ids})


def new_source(
    sessions: sessionmaker[Session], settings: Settings, made: list[MadeSource], **kw: Any
) -> MadeSource:
    source = make_source(sessions, settings, **kw)
    made.append(source)
    remember(source.secret)
    return source


def accept(
    settings: Settings, source: MadeSource, event_id: str, now: datetime | None, **kw: Any
) -> tuple[str, tuple[int, ...]]:
    body = {"id": event_id, "type": "test.event", "data": {"n": 1}}
    _, outcome = accept_event(
        settings, source, event_id=event_id, body=body, now=now, ttl=TTL, **kw
    )
    return outcome.status, outcome.delivery_ids


def claim(sessions: sessionmaker[Session], delivery_id: int, now: datetime) -> Claim:
    with sessions() as session, session.begin():
        found = transitions.claim(
            session, delivery_id, now=now, lease=LEASE, max_redeliveries=3, worker="test"
        )
    assert found is not None
    return found


def succeed(sessions: sessionmaker[Session], delivery_id: int, at: datetime) -> None:
    found = claim(sessions, delivery_id, at)
    with sessions() as session, session.begin():
        transitions.succeed(session, found, now=at)


def kill(sessions: sessionmaker[Session], delivery_id: int, at: datetime) -> None:
    found = claim(sessions, delivery_id, at)
    with sessions() as session, session.begin():
        transitions.kill(session, found, now=at, reason="permanent", error_class="E", error="e")


def retry_later(
    sessions: sessionmaker[Session], delivery_id: int, at: datetime, due: datetime
) -> None:
    found = claim(sessions, delivery_id, at)
    with sessions() as session, session.begin():
        transitions.retry_later(
            session, found, now=at, next_attempt_at=due, error_class="E", error="e"
        )


@dataclass(frozen=True)
class Row:
    event_id: str
    expires_at: datetime
    has_payload: bool
    statuses: tuple[str, ...]
    attempts: int


def rows_of(engine: Engine, source: MadeSource) -> dict[str, Row]:
    """Each receipt of the source with its deliveries' states and attempt count."""
    with engine.connect() as conn:
        found = conn.execute(
            text(
                """
                SELECT r.event_id, r.expires_at, r.payload IS NOT NULL,
                       coalesce(array_agg(d.status ORDER BY d.route_id)
                                FILTER (WHERE d.id IS NOT NULL), '{}'),
                       (SELECT count(*) FROM attempts a JOIN deliveries d2
                          ON a.delivery_id = d2.id AND a.expires_at = d2.expires_at
                        WHERE d2.receipt_id = r.id AND d2.expires_at = r.expires_at)
                FROM receipts r
                LEFT JOIN deliveries d ON d.receipt_id = r.id AND d.expires_at = r.expires_at
                WHERE r.source_id = :s
                GROUP BY r.id, r.event_id, r.expires_at, r.payload
                """
            ),
            {"s": source.id},
        ).all()
    return {r[0]: Row(r[0], r[1], bool(r[2]), tuple(r[3]), int(r[4])) for r in found}


DELETE_DB = f"{TEST_DB}_holds_delete"
RETENTION_DB = f"{TEST_DB}_retention"


def database_url(name: str) -> str:
    return f"postgresql://postgres@127.0.0.1:5432/{name}"


# The retention modules' own database (:func:`retention_database`), for settings made there.
RETENTION_URL = database_url(RETENTION_DB)


@contextmanager
def own_database(
    name: str, pool_size: int = 2, **overrides: object
) -> Iterator[tuple[Settings, Engine, sessionmaker[Session]]]:
    """A database of its own, laid out by upgrade (``overrides``: the settings'), dropped
    after."""
    settings = make_settings(database_url=database_url(name), **overrides)
    drop_database(name)
    upgrade(settings)
    engine = make_engine(settings, pool_size=pool_size)
    try:
        yield settings, engine, make_sessionmaker(engine)
    finally:
        engine.dispose()
        drop_database(name)


def delete_mode_database(
    name: str, batch: int
) -> AbstractContextManager[tuple[Settings, Engine, sessionmaker[Session]]]:
    """A database of its own laid out by upgrade in delete retention mode, dropped after."""
    return own_database(name, retention_mode="delete", delete_batch_size=batch)


@pytest.fixture(scope="session")
def retention_database() -> Iterator[tuple[Settings, Engine, sessionmaker[Session]]]:
    """The partition-mode database of the retention modules that ask for it (in place of the
    suite's shared one, through module fixtures named ``settings``, ``engine`` and
    ``sessions``), made once per test process.

    Their maintenance runs decide on every day and row of the database they run on: on the
    shared one, with the real clock (or a pinned one), they also moved and dropped what the
    process's other test modules had left (their sources' longest TTL sized every layout;
    a delivery of theirs still under a lease made a run wait for it in real time, up to
    ``processing_ttl``). Here they see only their own."""
    with own_database(RETENTION_DB, pool_size=5) as made:
        yield made


def env_for(settings: Settings, **overrides: str) -> dict[str, str]:
    """The environment of a pipeline subprocess working on ``settings``' database."""
    return subprocess_env(WEBHOOKS_DATABASE_URL=settings.psycopg_dsn, **overrides)


@pytest.fixture(scope="module")
def delete_mode() -> Iterator[tuple[Settings, Engine, sessionmaker[Session]]]:
    with delete_mode_database(DELETE_DB, batch=2) as made:
        yield made


def drop_database(name: str) -> None:
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,)
        )
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
