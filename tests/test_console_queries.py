"""The console's read paths made fast for issue 21's benchmark (bench/bench_console.py), checked
for the rows they return on the real database: the events list by delivery status answers the
same rows in the same order whichever way it runs (walking one source's deliveries newest
first by created_at when the status is rare, walking the receipts when it is common), across
partitions and cursor pages, also when deliveries were created after their receipts (the walk
relies only on created_at >= received_at, which both accept functions keep: checked here); the
dead-letter preview freezes exactly the ids the replay plan by filter selects, with its first
rows as the sample. The console's browser tests (tests/test_console.py) check that a
confirmation replays exactly what the preview counted.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import event, text
from sqlalchemy.orm import Session, sessionmaker

from core.settings import Settings
from core.ttl import expires_at
from models import candidates, console, event_walk, queries
from models.accept import ACCEPT_MANY_SQL, NewReceipt, accept_many_params, accept_sync
from models.candidates import ReplayFilter
from models.queries import EventFilter
from tests.conftest import ADMIN_DSN, make_settings
from tests.factories import MadeSource, accept_event
from tests.operators_support import accept, kill, ops_settings, source_with, succeed


@pytest.fixture(scope="module")
def ops() -> Settings:
    return ops_settings()


def _pages(
    session: Session, source: str | None, status: str, limit: int, event_type: str | None = None
) -> list[int]:
    """Every page, following the cursor as the console does (received_at, id of the last)."""
    seen: list[int] = []
    before = None
    while True:
        rows = queries.list_events(
            session, EventFilter(source, event_type, status, limit=limit, before=before)
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
            # Few rows: the query walks the deliveries newest first by created_at
            # (ix_deliveries_source_dead); limit 3 takes several batches per page.
            rare = _pages(session, source.public_id, status, limit=3)
            first = queries.list_events(session, EventFilter(source.public_id, None, status))
        # A receipt whose two deliveries are both dead is listed once, newest first.
        assert rare == expected, status
        assert [r.id for r in first] == expected
        assert all(r.deliveries.get(status, 0) >= 1 for r in first)
        # Above the threshold it walks the receipts newest first with an EXISTS.
        with sessions() as session:
            # No source: every key of the status probed and sorted (any source's mix.event).
            anywhere = _pages(session, None, status, limit=3, event_type="mix.event")
        monkeypatch.setattr(event_walk, "RARE_STATUS_ROWS", 0)
        with sessions() as session:
            common = _pages(session, source.public_id, status, limit=3)
            common_anywhere = _pages(session, None, status, limit=3, event_type="mix.event")
        monkeypatch.undo()
        assert common == expected, status
        assert anywhere == common_anywhere, status
        assert [r for r in anywhere if r in expected] == expected, status


@contextmanager
def _walks(session: Session) -> Iterator[list[str]]:
    """Collects the walk's statements run meanwhile (one per batch read from the index)."""
    seen: list[str] = []

    def grab(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if "walk_created_at" in statement:
            seen.append(statement)

    bind = session.get_bind()
    event.listen(bind, "before_cursor_execute", grab)
    try:
        yield seen
    finally:
        event.remove(bind, "before_cursor_execute", grab)


def test_events_by_a_rare_status_stay_exact_when_deliveries_are_created_later(
    ops: Settings, sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The walk by created_at relies only on no delivery being created before its receipt was
    received. Deliveries created up to hours after their receipts, in an order unrelated to
    the receipts' (as a route added later would create them), only make it walk further: the
    same rows in the same order as the receipts walked with an EXISTS, on every page."""
    source = source_with(sessions, ops, "log", "log")
    with_dead, with_succeeded = _mixed(ops, sessions, source)
    with sessions() as session, session.begin():
        moved = session.execute(
            text(
                "UPDATE deliveries d SET created_at = r.received_at"
                " + interval '1 hour' * ((r.id * 7) % 5) + interval '1 minute' * (d.id % 3)"
                " FROM receipts r WHERE r.id = d.receipt_id AND r.expires_at = d.expires_at"
                " AND d.source_id = :s"
            ),
            {"s": source.id},
        ).rowcount
        walk_order = session.execute(
            text(
                "SELECT receipt_id FROM deliveries WHERE source_id = :s AND status = 'dead'"
                " GROUP BY receipt_id ORDER BY max(created_at) DESC"
            ),
            {"s": source.id},
        ).scalars()
        walked_first = list(walk_order)
    assert moved == 30
    # The walk meets the receipts in another order than the page's (else this proves nothing).
    assert sorted(walked_first) == sorted(with_dead)
    assert walked_first != with_dead
    for status, expected in (("dead", with_dead), ("succeeded", with_succeeded)):
        for limit in (1, 2, 3, 50):
            with sessions() as session:
                walked = _pages(session, source.public_id, status, limit=limit)
            assert walked == expected, (status, limit)
        monkeypatch.setattr(event_walk, "RARE_STATUS_ROWS", 0)
        with sessions() as session:
            assert _pages(session, source.public_id, status, limit=4) == expected, status
        monkeypatch.undo()


def test_the_first_page_of_a_rare_status_reads_one_batch_of_the_newest_deliveries(
    ops: Settings, sessions: sessionmaker[Session]
) -> None:
    """30 dead events: a page of 5 is one statement over the 10 newest deliveries
    (WALK_FIRST_BATCH x 5), not a probe of all 30 receipts; a type filter only every third
    event passes takes one more batch; ``since`` ends the walk once it is passed."""
    source = source_with(sessions, ops, "log")
    base = datetime.now(UTC) - timedelta(hours=2)
    dead: list[int] = []
    for i in range(30):
        kind = "walk.kept" if i % 3 == 0 else "walk.other"
        dead += accept(ops, source, event_type=kind, now=base - timedelta(minutes=i))
    kill(sessions, dead)
    with sessions() as session:
        receipts = [
            session.execute(
                text("SELECT receipt_id FROM deliveries WHERE id = :d"), {"d": d}
            ).scalar_one()
            for d in dead
        ]
        with _walks(session) as walks:
            page = queries.list_events(
                session, EventFilter(source.public_id, None, "dead", limit=5)
            )
        assert len(walks) == 1
        assert [r.id for r in page] == receipts[:5]
        with _walks(session) as walks:
            kept = queries.list_events(
                session, EventFilter(source.public_id, "walk.kept", "dead", limit=5)
            )
        assert len(walks) == 2  # the 10 newest hold 4 kept events, the next 40 the fifth
        assert [r.id for r in kept] == receipts[0:15:3]
        flt = EventFilter(
            source.public_id, None, "dead", since=base - timedelta(minutes=2, seconds=30), limit=5
        )
        with _walks(session) as walks:
            since = queries.list_events(session, flt)
        assert len(walks) == 1  # the first batch already walked past ``since``
        assert [r.id for r in since] == receipts[:3]


def test_both_accept_functions_never_create_a_delivery_before_its_receipt(
    ops: Settings, sessions: sessionmaker[Session]
) -> None:
    """What the walk by created_at relies on: webhooks_accept and webhooks_accept_many stamp
    each delivery's created_at with its receipt's received_at, on the database's clock (no
    instant pinned) as with a pinned one."""
    source = source_with(sessions, ops, "log", "log")
    pinned = datetime.now(UTC) - timedelta(minutes=10)
    accept_event(ops, source, now=pinned)

    def arrival(received_at: datetime | None) -> NewReceipt:
        body = f'{{"n": "{uuid.uuid4().hex}"}}'.encode()
        ttl = timedelta(days=2)
        return NewReceipt(
            source_id=source.id, secret_id=source.secret_id, event_id=uuid.uuid4().hex,
            event_type="clock.check", occurred_at=None,
            expires_at=expires_at(None, received_at or datetime.now(UTC), ttl),
            received_at=received_at, digest=hashlib.sha256(body).digest(),
            content_type="application/json", payload=body, ttl=ttl,
        )  # fmt: skip

    with psycopg.connect(ops.psycopg_dsn, autocommit=True) as conn:
        assert accept_sync(conn, arrival(None), ops.publish_grace).status == "accepted"
        for instant in (None, pinned + timedelta(minutes=1)):
            batch = [arrival(instant) for _ in range(3)]
            rows = conn.execute(ACCEPT_MANY_SQL, accept_many_params(batch, ops.publish_grace))
            assert all(row[1] and row[2] is not None for row in rows.fetchall())
    with sessions() as session:
        total, equal = session.execute(
            text(
                "SELECT count(*), count(*) FILTER (WHERE d.created_at = r.received_at)"
                " FROM deliveries d JOIN receipts r"
                " ON r.id = d.receipt_id AND r.expires_at = d.expires_at WHERE d.source_id = :s"
            ),
            {"s": source.id},
        ).one()
    assert total == 2 * (1 + 1 + 3 + 3)
    assert equal == total


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
        planned = candidates.candidates_by_filter(session, flt, limit=1000)
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


_PARTITION_INDEXES = """
    SELECT count(*) FILTER (WHERE c.relkind = 'I'), count(*) FILTER (WHERE c.relkind = 'i'),
           (SELECT count(*) FROM pg_inherits i JOIN pg_class p ON p.oid = i.inhrelid
            WHERE i.inhparent = 'deliveries'::regclass)
    FROM pg_class c
    WHERE c.relname = '{name}'
       OR c.oid IN (SELECT i.inhrelid FROM pg_inherits i
                    WHERE i.inhparent = '{name}'::regclass)
    """


@pytest.mark.parametrize(
    ("revision", "index"),
    [("0015", "ix_deliveries_source_status"), ("0016", "ix_deliveries_source_dead")],
)
def test_console_migrations_index_every_partition_and_downgrade(revision: str, index: str) -> None:
    """0015 and 0016 put their index on the partitioned parent, so on every partition;
    downgrading to the revision before removes it and upgrading again restores it."""
    from alembic import command  # noqa: PLC0415

    from models.db import alembic_config, make_engine, upgrade  # noqa: PLC0415

    name = f"webhooks_m{revision[2:]}_{uuid.uuid4().hex[:8]}"
    settings = make_settings(database_url=f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}")
    counts = text(_PARTITION_INDEXES.format(name=index))
    try:
        upgrade(settings)
        engine = make_engine(settings, pool_size=1)
        try:
            with engine.connect() as conn:
                parent, children, partitions = conn.execute(counts).one()
            assert (parent, children) == (1, partitions)
            assert partitions > 0
            command.downgrade(alembic_config(settings), f"{int(revision) - 1:04d}")
            with engine.connect() as conn:
                gone = conn.execute(text(f"SELECT to_regclass('{index}')")).scalar_one()
            assert gone is None
            upgrade(settings)
            with engine.connect() as conn:
                assert conn.execute(counts).one() == (1, partitions, partitions)
        finally:
            engine.dispose()
    finally:
        with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
