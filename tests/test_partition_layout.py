"""The partition layout follows the sources that exist, never every installed provider
(issue 24): every accept's live-receipt probe opens each day laid out from yesterday on, so a
provider nobody uses (Adyen's 30-day retry window) must not stretch the layout, and empty days
laid out beyond what the sources need are detached and dropped without ever losing a row.

Each test gets its own database (the shared one holds other tests' sources, whose TTLs size its
layout), and works at pinned instants in 2031, days nothing else writes to.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta

import psycopg
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core.settings import Settings
from core.ttl import MAX_EVENT_TIME_LEAD, TtlOverrides, dedup_terms, known_providers
from models import partitions
from models.db import make_engine, make_sessionmaker, upgrade
from models.retention import run_maintenance
from models.retention_layout import ensure_partitions, longest_ttl, trim_layout
from tests.conftest import ADMIN_DSN, make_settings
from tests.factories import MadeSource, accept_event, make_source, source_ttl
from tests.leakcheck import remember

T = datetime(2031, 3, 10, 12, tzinfo=UTC)
DAY = timedelta(days=1)
BODY = b'{"id": "evt_racing"}'


def _drop_database(name: str) -> None:
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,)
        )
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')


@pytest.fixture
def own() -> Iterator[tuple[Settings, Engine, sessionmaker[Session]]]:
    name = f"webhooks_test_layout_{uuid.uuid4().hex[:10]}"
    settings = make_settings(database_url=f"postgresql://postgres@127.0.0.1:5432/{name}")
    _drop_database(name)
    upgrade(settings)
    engine = make_engine(settings, pool_size=3)
    try:
        yield settings, engine, make_sessionmaker(engine)
    finally:
        engine.dispose()
        _drop_database(name)


def days_laid_out(engine: Engine, since: date) -> dict[date, set[str]]:
    """Each day from ``since`` on, with the tables that have a leaf for it."""
    with engine.connect() as conn:
        found = partitions.list_partitions(conn)
    days: dict[date, set[str]] = {}
    for p in found:
        if p.lower is not None and p.lower.date() >= since:
            days.setdefault(p.lower.date(), set()).add(p.table)
    return days


def source(
    sessions: sessionmaker[Session], settings: Settings, provider: str, **kwargs: object
) -> MadeSource:
    made = make_source(sessions, settings, provider=provider, **kwargs)
    remember(made.secret)
    return made


def test_the_layout_grows_with_sources_not_with_installed_providers(
    own: tuple[Settings, Engine, sessionmaker[Session]],
) -> None:
    settings, engine, sessions = own
    ahead = timedelta(days=settings.partition_ahead_days)
    longest_provider = max(
        dedup_terms(p, TtlOverrides(), settings).total for p in known_providers()
    )
    assert longest_provider > timedelta(days=30)  # Adyen is installed: the case of issue 24

    # No source yet: the layout covers the event-time lead and the days ahead, nothing more.
    assert longest_ttl(engine, settings) == timedelta(0)
    ensure_partitions(engine, settings, T)
    days = days_laid_out(engine, T.date())
    assert max(days) == (T + MAX_EVENT_TIME_LEAD + ahead).date()
    assert all(tables == {"receipts", "deliveries", "attempts"} for tables in days.values())

    # A Standard Webhooks source (about 6 days): its TTL, not Adyen's 30 days, sizes it.
    standard = source(sessions, settings, "standard")
    ttl = source_ttl(sessions, settings, standard.id)
    assert timedelta(days=5) < ttl < timedelta(days=10)
    assert longest_ttl(engine, settings) == ttl
    ensure_partitions(engine, settings, T)
    last = max(days_laid_out(engine, T.date()))
    assert last == (T + ttl + MAX_EVENT_TIME_LEAD + ahead).date()
    assert last < (T + longest_provider).date()  # the days every accept would have probed

    # An Adyen source is what stretches it, and only then.
    adyen = source(sessions, settings, "adyen", secret=secrets.token_hex(32))
    adyen_ttl = source_ttl(sessions, settings, adyen.id)
    assert longest_ttl(engine, settings) == adyen_ttl
    ensure_partitions(engine, settings, T)
    assert (
        max(days_laid_out(engine, T.date())) == (T + adyen_ttl + MAX_EVENT_TIME_LEAD + ahead).date()
    )


def test_a_raised_ttl_sizes_the_layout_by_what_receipts_are_written_with(
    own: tuple[Settings, Engine, sessionmaker[Session]],
) -> None:
    """A source whose terms no longer cover its retry window writes receipts with the raised
    TTL (core.ttl.effective_ttl): the layout must reach that far, not the terms' sum."""
    settings, engine, sessions = own
    source(sessions, settings, "stripe", ttl=TtlOverrides(retry_window=timedelta(hours=1)))
    shrunk = make_settings(
        database_url=settings.database_url,
        queue_lag_budget=timedelta(0),
        manual_replay_grace=timedelta(0),
    )
    terms = dedup_terms("stripe", TtlOverrides(retry_window=timedelta(hours=1)), shrunk)
    raised = timedelta(days=3) + shrunk.clock_skew_allowance
    assert terms.total < raised
    assert longest_ttl(engine, shrunk) == raised


def test_maintenance_drops_empty_days_ahead_and_keeps_every_receipt(
    own: tuple[Settings, Engine, sessionmaker[Session]],
) -> None:
    settings, engine, sessions = own
    standard = source(sessions, settings, "standard")
    ttl = source_ttl(sessions, settings, standard.id)
    ahead = timedelta(days=settings.partition_ahead_days)
    last = (T + ttl + MAX_EVENT_TIME_LEAD + ahead).date()
    # The layout as the provider floor made it (a database laid out before this change).
    longest_provider = max(
        dedup_terms(p, TtlOverrides(), settings).total for p in known_providers()
    )
    old_last = (T + longest_provider + MAX_EVENT_TIME_LEAD + ahead).date()
    with engine.begin() as conn:
        partitions.lock_layout(conn)
        day = T.date()
        while day <= old_last:
            partitions.create_day(conn, day)
            day += DAY
    # A receipt far ahead, in a day no source needs laid out any more (a TTL since lowered).
    far_ttl = timedelta(days=20)
    far_id, outcome = accept_event(settings, standard, now=T, ttl=far_ttl)
    assert outcome.status == "accepted"
    far_day = (T + far_ttl).date()
    assert far_day > last
    # And one of today's ordinary receipts.
    near_id, outcome = accept_event(settings, standard, now=T, ttl=ttl)
    assert outcome.status == "accepted"

    report = run_maintenance(engine, settings, T)

    days = days_laid_out(engine, T.date())
    expected = {T.date() + DAY * i for i in range((last - T.date()).days + 1)} | {far_day}
    assert set(days) == expected
    assert all(tables == {"receipts", "deliveries", "attempts"} for tables in days.values())
    trimmed = {last + DAY * i for i in range(1, (old_last - last).days + 1)} - {far_day}
    assert len(trimmed) > 15
    assert len(report.partitions_trimmed) == 3 * len(trimmed)
    assert report.partitions_through == far_day
    # Both receipts still deduplicate, the far one until its last instant.
    for event_id, at in ((near_id, T + ttl - timedelta(seconds=1)), (far_id, T + far_ttl / 2)):
        _, again = accept_event(settings, standard, event_id=event_id, now=at, ttl=ttl)
        assert again.status == "duplicate", event_id
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT count(*) FROM receipts WHERE source_id = :s"), {"s": standard.id}
        ).scalar_one()
    assert rows == 2
    # Idempotent: nothing more to drop.
    assert trim_layout(engine, settings, T) == []


def test_a_receipt_written_while_its_empty_day_is_detached_keeps_the_day(
    own: tuple[Settings, Engine, sessionmaker[Session]],
) -> None:
    """The race the detach-then-look-again order exists for: the day looks empty, an accept
    writes into it before the detach completes; the day goes back, with the row, and the
    event still deduplicates."""
    settings, engine, sessions = own
    standard = source(sessions, settings, "standard")
    ttl = source_ttl(sessions, settings, standard.id)
    ensure_partitions(engine, settings, T)
    far = (T + timedelta(days=30)).date()
    with engine.begin() as conn:
        partitions.lock_layout(conn)
        partitions.create_day(conn, far)
    lo, _ = partitions.day_bounds(far)
    expires = lo + timedelta(hours=6)

    # An uncommitted receipt in the far day: invisible to the first look, waited for by the
    # detach (which waits for every transaction using the parent).
    writer = psycopg.connect(settings.psycopg_dsn)
    writer.execute(
        "INSERT INTO receipts (source_id, event_id, expires_at, event_type, received_at,"
        " body_digest) VALUES (%s, 'evt_racing', %s, 't', %s, %s)",
        (standard.id, expires, T, hashlib.sha256(BODY).digest()),
    )
    result: list[list[str]] = []
    trimmer = threading.Thread(target=lambda: result.append(trim_layout(engine, settings, T)))
    trimmer.start()
    try:
        deadline = time.monotonic() + 30
        with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
            while time.monotonic() < deadline:
                waiting = admin.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = %s"
                    " AND query LIKE '%%DETACH PARTITION%%' AND wait_event_type = 'Lock'",
                    (engine.url.database,),
                ).fetchone()
                if waiting and waiting[0]:
                    break
                time.sleep(0.05)
            else:
                pytest.fail("the detach never waited for the writing transaction")
        writer.commit()
    finally:
        writer.close()
        trimmer.join(timeout=60)
    assert result, "trim_layout did not finish"
    assert not any(name.endswith(far.strftime("p%Y%m%d")) for name in result[0])
    assert far in days_laid_out(engine, far)
    assert days_laid_out(engine, far)[far] == {"receipts", "deliveries", "attempts"}
    _, again = accept_event(
        settings, standard, event_id="evt_racing", body=BODY, now=T + timedelta(days=29), ttl=ttl
    )
    assert again.status == "duplicate"
