"""The console's read paths made fast for issue 21's benchmark (bench/bench_console.py), checked
for the rows they return on the real database: the events list by delivery status answers the
same rows in the same order whichever way it runs (from the deliveries when the status is
rare, walking the receipts when it is common), across partitions and cursor pages; the
dead-letter preview freezes exactly the ids the replay plan by filter selects, with its first
rows as the sample. The console's browser tests (tests/test_console.py) check that a
confirmation replays exactly what the preview counted.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from models import console, queries
from models.queries import EventFilter, ReplayFilter
from tests.conftest import ADMIN_DSN, make_settings
from tests.factories import MadeSource
from tests.operators_support import accept, kill, ops_settings, source_with, succeed
from webhooks.settings import Settings


@pytest.fixture(scope="module")
def ops() -> Settings:
    return ops_settings()


def _pages(session: Session, source: str, status: str, limit: int) -> list[int]:
    """Every page, following the cursor as the console does (received_at, id of the last)."""
    seen: list[int] = []
    before = None
    while True:
        rows = queries.list_events(
            session, EventFilter(source, None, status, limit=limit, before=before)
        )
        seen += [r.id for r in rows]
        if len(rows) < limit:
            return seen
        before = (rows[-1].received_at, rows[-1].id)


def _mixed(
    ops: Settings, sessions: sessionmaker[Session], source: MadeSource
) -> tuple[list[int], list[int]]:
    """15 events on two routes over three expiry partitions, received out of id order: both
    deliveries dead, one dead and one succeeded, or both succeeded. Returns the receipts
    having a dead delivery and those having a succeeded one, newest first."""
    base = datetime.now(UTC) - timedelta(hours=1)
    received: list[tuple[datetime, int, str]] = []
    for i in range(15):
        # Every third event arrived earlier than the one accepted before it.
        at = base - timedelta(minutes=i * 7 + (30 if i % 3 == 0 else 0))
        pair = accept(ops, source, event_type="mix.event", now=at, ttl=timedelta(days=2 + i % 3))
        with sessions() as session:
            receipt = session.execute(
                text("SELECT receipt_id FROM deliveries WHERE id = :d"), {"d": pair[0]}
            ).scalar_one()
        dead = pair if i % 3 == 0 else pair[:1] if i % 3 == 1 else []
        kill(sessions, dead)
        succeed(sessions, [d for d in pair if d not in dead])
        received.append((at, receipt, "both" if i % 3 == 0 else "one" if i % 3 == 1 else "none"))
    newest = sorted(received, reverse=True)
    return (
        [r for _, r, k in newest if k in ("both", "one")],
        [r for _, r, k in newest if k in ("one", "none")],
    )


def test_events_by_status_are_the_same_rows_in_the_same_order_either_way(
    ops: Settings, sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    source = source_with(sessions, ops, "log", "log")
    with_dead, with_succeeded = _mixed(ops, sessions, source)
    assert len(with_dead) == 10
    assert len(with_succeeded) == 10
    for status, expected in (("dead", with_dead), ("succeeded", with_succeeded)):
        with sessions() as session:
            # Few rows: the query starts from the deliveries (ix_deliveries_source_status).
            rare = _pages(session, source.public_id, status, limit=3)
            first = queries.list_events(session, EventFilter(source.public_id, None, status))
        # A receipt whose two deliveries are both dead is listed once, newest first.
        assert rare == expected, status
        assert [r.id for r in first] == expected
        assert all(r.deliveries.get(status, 0) >= 1 for r in first)
        # Above the threshold it walks the receipts newest first with an EXISTS.
        monkeypatch.setattr(queries, "RARE_STATUS_ROWS", 0)
        with sessions() as session:
            common = _pages(session, source.public_id, status, limit=3)
        monkeypatch.undo()
        assert common == expected, status


def test_events_by_a_rare_status_keep_the_other_filters(
    ops: Settings, sessions: sessionmaker[Session]
) -> None:
    source = source_with(sessions, ops, "log")
    other = source_with(sessions, ops, "log")
    now = datetime.now(UTC)
    kept = accept(ops, source, event_type="keep.me", now=now - timedelta(minutes=5))
    typed_out = accept(ops, source, event_type="drop.me", now=now - timedelta(minutes=4))
    too_old = accept(ops, source, event_type="keep.me", now=now - timedelta(hours=3))
    elsewhere = accept(ops, other, event_type="keep.me", now=now - timedelta(minutes=3))
    kill(sessions, kept + typed_out + too_old + elsewhere)
    with sessions() as session:
        rows = queries.list_events(
            session,
            EventFilter(
                source.public_id, "keep.*", "dead", since=now - timedelta(hours=1), until=now
            ),
        )
        receipt = session.execute(
            text("SELECT receipt_id FROM deliveries WHERE id = :d"), {"d": kept[0]}
        ).scalar_one()
    assert [r.id for r in rows] == [receipt]
    assert rows[0].source == source.public_id


def test_the_preview_freezes_the_ids_the_filter_selects_and_samples_the_first(
    ops: Settings, sessions: sessionmaker[Session]
) -> None:
    source = source_with(sessions, ops, "log")
    now = datetime.now(UTC)
    dead = [
        d
        for i in range(13)
        for d in accept(ops, source, event_type="pre.view", now=now - timedelta(minutes=i))
    ]
    other_type = accept(ops, source, event_type="not.this", now=now)
    alive = accept(ops, source, event_type="pre.view", now=now)
    kill(sessions, dead + other_type)
    flt = ReplayFilter(source.public_id, "pre.*", "dead", since=now - timedelta(hours=1))
    with sessions() as session:
        shown = console.preview(session, flt, limit=1000)
        planned = queries.candidates_by_filter(session, flt, limit=1000)
        by_source = console.preview(session, ReplayFilter(source.public_id), limit=1000)
        capped = console.preview(session, ReplayFilter(source.public_id), limit=5)
    assert shown.ids == tuple(c.delivery_id for c in planned) == tuple(sorted(dead))
    assert shown.count == 13
    assert shown.sample == tuple(planned[:10])
    assert alive[0] not in shown.ids
    assert by_source.ids == tuple(sorted(dead + other_type))
    assert capped.ids == tuple(sorted(dead + other_type))[:5]
    with sessions() as session, pytest.raises(queries.QueryError):
        console.preview(session, ReplayFilter(source.public_id, status="pending"), limit=10)


_PARTITION_INDEXES = text(
    """
    SELECT count(*) FILTER (WHERE c.relkind = 'I'), count(*) FILTER (WHERE c.relkind = 'i'),
           (SELECT count(*) FROM pg_inherits i JOIN pg_class p ON p.oid = i.inhrelid
            WHERE i.inhparent = 'deliveries'::regclass)
    FROM pg_class c
    WHERE c.relname = 'ix_deliveries_source_status'
       OR c.oid IN (SELECT i.inhrelid FROM pg_inherits i
                    WHERE i.inhparent = 'ix_deliveries_source_status'::regclass)
    """
)


def test_migration_0015_indexes_every_partition_and_downgrades() -> None:
    """0015 puts ix_deliveries_source_status on the partitioned parent, so on every
    partition; downgrading to 0014 removes it and upgrading again restores it."""
    from alembic import command  # noqa: PLC0415

    from models.db import alembic_config, make_engine, upgrade  # noqa: PLC0415

    name = f"webhooks_m15_{uuid.uuid4().hex[:8]}"
    settings = make_settings(database_url=f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}")
    try:
        upgrade(settings)
        engine = make_engine(settings, pool_size=1)
        try:
            with engine.connect() as conn:
                parent, children, partitions = conn.execute(_PARTITION_INDEXES).one()
            assert (parent, children) == (1, partitions)
            assert partitions > 0
            command.downgrade(alembic_config(settings), "0014")
            with engine.connect() as conn:
                gone = conn.execute(
                    text("SELECT to_regclass('ix_deliveries_source_status')")
                ).scalar_one()
            assert gone is None
            upgrade(settings)
            with engine.connect() as conn:
                assert conn.execute(_PARTITION_INDEXES).one() == (1, partitions, partitions)
        finally:
            engine.dispose()
    finally:
        with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
