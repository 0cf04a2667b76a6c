"""Retention moves a held row once and never stalls accepts (issue 19, section 3).

In-process tests inject the clock (an explicit ``now``, standing for the database's) and
work in June-July 2025, days no other test writes to. The stall tests run the real drop
against a real concurrent transaction and a real accept on another connection.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core.settings import Settings
from models import discards, partitions, retention_expiry, transitions
from models.candidates import ReplayFilter
from models.retention import run_maintenance
from models.retention_expiry import LeaseWait, expire_partitions
from models.retention_layout import ensure_partitions
from tests.factories import MadeSource, make_source
from tests.retention_fixtures import (  # noqa: F401 (fixtures: this module's own database)
    retention_engine,
    retention_sessions,
    retention_settings,
)
from tests.retention_support import (
    DAY,
    LEASE,
    SEC,
    TTL,
    accept,
    claim,
    kill,
    new_source,
    retry_later,
    rows_of,
    succeed,
)

T0 = datetime(2025, 6, 2, 9, tzinfo=UTC)
EXPIRY_DAY = (T0 + TTL).date()
# Ten minutes into the day after the expiry's: that day is past, the first run drops it.
AFTER = partitions.day_bounds(EXPIRY_DAY)[1] + timedelta(minutes=10)
TABLES = ("receipts", "deliveries", "attempts")


def end_of_day(at: datetime) -> datetime:
    return partitions.day_bounds(at.astimezone(UTC).date())[1] - timedelta.resolution


def day_leaves(day: Any) -> set[str]:
    return {partitions.partition_name(t, day) for t in TABLES}


def attached(engine: Engine) -> set[str]:
    with engine.connect() as conn:
        return {p.name for p in partitions.list_partitions(conn)}


def expiries(engine: Engine, source: MadeSource) -> dict[str, datetime]:
    return {name: row.expires_at for name, row in rows_of(engine, source).items()}


# ------------------------------------------------------------------------------------------
# Move once
# ------------------------------------------------------------------------------------------


def test_held_rows_move_once_to_where_their_hold_ends_and_a_day_later_none_moves(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings, made: list[MadeSource]
) -> None:
    """A dead letter moves to dead-at plus the dead-letter retention, a retry due in three
    days to its due day, a pending delivery to the next day, each with its receipt, its
    siblings and their attempts. The next day's drop moves none of the first two again
    (before: every held row moved one day at a time, a dead letter about 30 times)."""
    source = new_source(sessions, settings, made, routes=[{"handler": "log"}, {"handler": "log"}])
    ensure_partitions(engine, settings, T0)
    ids = {name: accept(settings, source, name, T0)[1] for name in ("dead", "retry", "pending")}
    died = T0 + timedelta(hours=1)
    kill(sessions, ids["dead"][0], died)
    succeed(sessions, ids["dead"][1], died)  # a succeeded sibling goes with it
    due = AFTER + 3 * DAY
    retry_later(sessions, ids["retry"][0], T0 + SEC, due)
    succeed(sessions, ids["retry"][1], T0 + SEC)
    succeed(sessions, ids["pending"][1], T0 + SEC)

    first = run_maintenance(engine, settings, AFTER)

    assert day_leaves(EXPIRY_DAY) <= set(first.partitions_dropped)
    assert first.held_receipts == 3
    assert first.rows_moved == {"receipts": 3, "deliveries": 6, "attempts": 5}
    moved = expiries(engine, source)
    assert moved["dead"] == died + settings.dead_letter_retention
    assert moved["retry"] == end_of_day(due)
    assert moved["pending"] == end_of_day(AFTER + DAY)
    rows = rows_of(engine, source)
    assert rows["dead"].statuses == ("dead", "succeeded")
    assert rows["dead"].attempts == 2
    assert rows["dead"].has_payload
    # The dead letter's day, thirty days out, was laid out for it.
    assert partitions.partition_name("deliveries", moved["dead"].date()) in attached(engine)

    second = run_maintenance(engine, settings, AFTER + DAY + timedelta(hours=1))

    assert second.held_receipts == 0
    assert expiries(engine, source) == moved
    # The pending delivery's day is past two days later: still unfinished, it moves again;
    # the dead letter and the retry do not.
    third = run_maintenance(engine, settings, AFTER + 2 * DAY + timedelta(hours=1))
    assert third.held_receipts == 1
    assert expiries(engine, source) == {**moved, "pending": end_of_day(AFTER + 3 * DAY)}


# ------------------------------------------------------------------------------------------
# A live lease is a held row like the others
# ------------------------------------------------------------------------------------------


def test_live_lease_moves_once_its_worker_finishes_and_the_day_is_dropped_in_that_run(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings, made: list[MadeSource]
) -> None:
    """One delivery of the day runs under a live lease. The run moves the day's other held
    rows, waits for that worker only (holding no lock), and when the worker's retry has
    landed (its statement names the old expires_at: it must find its row), moves it too and
    drops the day in the same run (before: the whole day was postponed, run after run)."""
    source = new_source(sessions, settings, made)
    ensure_partitions(engine, settings, T0)
    (leased,) = accept(settings, source, "leased", T0)[1]
    (dead,) = accept(settings, source, "dead", T0)[1]
    kill(sessions, dead, T0 + SEC)
    running = claim(sessions, leased, AFTER - timedelta(minutes=1))
    seen: list[tuple[datetime, str]] = []

    def worker_finishes(_: float) -> None:
        # While the run waits: the dead letter has moved already, the leased row has not.
        now = rows_of(engine, source)
        seen.append((now["leased"].expires_at, now["dead"].expires_at.isoformat()))
        with sessions() as session, session.begin():
            transitions.retry_later(
                session,
                running,
                now=AFTER + SEC,
                next_attempt_at=AFTER + timedelta(hours=1),
                error_class="E",
                error="e",
            )

    expiry = expire_partitions(
        engine, settings, AFTER, wait=LeaseWait(sleep=worker_finishes, monotonic=lambda: 0.0)
    )

    assert seen == [(T0 + TTL, (T0 + SEC + settings.dead_letter_retention).isoformat())]
    assert expiry.holds.postponed == []
    assert day_leaves(EXPIRY_DAY) <= set(expiry.dropped)
    row = rows_of(engine, source)["leased"]
    assert (row.statuses, row.attempts) == (("retrying",), 1)  # the worker's outcome stands
    assert row.expires_at == end_of_day(AFTER + DAY)
    assert row.has_payload


def test_lease_that_never_ends_leaves_only_its_day_and_moves_the_rest(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings, made: list[MadeSource]
) -> None:
    """A worker that never finishes (claimed again and again): the wait ends after the
    longest lease, the day's other held rows have moved all the same, and only that day is
    left for the next run."""
    source = new_source(sessions, settings, made)
    ensure_partitions(engine, settings, T0)
    (leased,) = accept(settings, source, "stuck", T0)[1]
    (dead,) = accept(settings, source, "dead", T0)[1]
    kill(sessions, dead, T0 + SEC)
    claim(sessions, leased, AFTER - timedelta(minutes=1))
    clock = [0.0]

    def sleep(seconds: float) -> None:
        clock[0] += seconds * 1000  # the monotonic clock runs past the lease at once

    expiry = expire_partitions(
        engine, settings, AFTER, wait=LeaseWait(sleep=sleep, monotonic=lambda: clock[0])
    )

    assert expiry.holds.postponed == [EXPIRY_DAY.isoformat()]
    assert not day_leaves(EXPIRY_DAY) & set(expiry.dropped)
    rows = rows_of(engine, source)
    assert rows["stuck"].expires_at == T0 + TTL  # not moved under its worker
    assert rows["dead"].expires_at == T0 + SEC + settings.dead_letter_retention
    # Done: its worker finished; the next run moves nothing else and drops the day.
    with sessions() as session, session.begin():
        found = transitions.claim(
            session, leased, now=AFTER + LEASE, lease=LEASE, max_redeliveries=3, worker="t"
        )
        assert found is not None
        transitions.succeed(session, found, now=AFTER + LEASE + SEC)
    expiry = expire_partitions(engine, settings, AFTER + LEASE + 2 * SEC)
    assert day_leaves(EXPIRY_DAY) <= set(expiry.dropped)
    assert "stuck" not in rows_of(engine, source)


# ------------------------------------------------------------------------------------------
# No stall: accepts never wait for retention
# ------------------------------------------------------------------------------------------


def waiting_backend(engine: Engine, like: str, within: float = 20.0) -> bool:
    """Whether a backend runs a statement matching ``like`` and waits on a lock."""
    end = datetime.now(UTC) + timedelta(seconds=within)
    with engine.connect() as conn:
        while datetime.now(UTC) < end:
            found = conn.execute(
                text(
                    "SELECT 1 FROM pg_stat_activity WHERE datname = current_database()"
                    " AND wait_event_type = 'Lock' AND query ILIKE :q"
                ),
                {"q": like},
            ).first()
            if found is not None:
                return True
            conn.rollback()
            threading.Event().wait(0.05)  # polling a real backend, not moving time
    return False


def accept_in_thread(
    settings: Settings, source: MadeSource, event_id: str, now: datetime
) -> tuple[threading.Thread, list[str]]:
    result: list[str] = []
    thread = threading.Thread(
        target=lambda: result.append(accept(settings, source, event_id, now)[0]), daemon=True
    )
    thread.start()
    return thread, result


def test_the_drop_waits_for_a_reader_while_accepts_go_through(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings, made: list[MadeSource]
) -> None:
    """A long transaction has read the expired day. The drop waits for it (DETACH
    CONCURRENTLY) while an accept on another connection is answered at once; before, the
    drop queued ACCESS EXCLUSIVE on the day and every accept (which opened every receipts
    partition) queued behind it until the reader ended."""
    source = new_source(sessions, settings, made)
    ensure_partitions(engine, settings, T0)
    (done,) = accept(settings, source, "done", T0)[1]
    succeed(sessions, done, T0 + SEC)
    lo, hi = partitions.day_bounds(EXPIRY_DAY)
    reader = psycopg.connect(settings.psycopg_dsn)
    result: list[retention_expiry.Expiry] = []
    try:
        reader.execute(
            "SELECT count(*) FROM receipts WHERE expires_at >= %s AND expires_at < %s", (lo, hi)
        )
        dropper = threading.Thread(
            target=lambda: result.append(expire_partitions(engine, settings, AFTER)), daemon=True
        )
        dropper.start()
        assert waiting_backend(engine, "%DETACH PARTITION%")
        thread, outcome = accept_in_thread(settings, source, "during_the_drop", AFTER)
        thread.join(timeout=10)
        assert outcome == ["accepted"]
    finally:
        reader.rollback()
        reader.close()
    dropper.join(timeout=60)
    (expiry,) = result
    assert day_leaves(EXPIRY_DAY) <= set(expiry.dropped)
    assert set(rows_of(engine, source)) == {"during_the_drop"}


def test_laying_out_a_day_never_waits_for_an_open_accept(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings, made: list[MadeSource]
) -> None:
    """Retention lays out the day a dead letter moves to (up to 30 days ahead) while the
    receiver runs: an accept's open transaction (ROW EXCLUSIVE on the parents) must not
    make it wait, nor queue later accepts behind it (CREATE TABLE ... PARTITION OF took
    ACCESS EXCLUSIVE on the parent and failed on its lock timeout here)."""
    day = (T0 + 150 * DAY).date()  # past every day the layout reaches
    writer = psycopg.connect(settings.psycopg_dsn)
    try:
        writer.execute("LOCK TABLE receipts, deliveries, attempts IN ROW EXCLUSIVE MODE")
        with engine.begin() as conn:
            partitions.lock_layout(conn)
            conn.execute(text("SET LOCAL lock_timeout = '2s'"))
            created = partitions.create_day(conn, day)
    finally:
        writer.rollback()
        writer.close()
    assert set(created) == day_leaves(day)
    with engine.connect() as conn:
        bounds = {p.name: (p.lower, p.upper) for p in partitions.list_partitions(conn)}
    assert bounds[partitions.partition_name("receipts", day)] == partitions.day_bounds(day)


# ------------------------------------------------------------------------------------------
# Pruning
# ------------------------------------------------------------------------------------------


def accept_plan(settings: Settings, source: MadeSource, now: datetime) -> str:
    """The plans of the statements the accept function runs, as auto_explain prints them."""
    notices: list[str] = []
    with psycopg.connect(settings.psycopg_dsn, autocommit=True) as conn:
        conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
        conn.execute("LOAD 'auto_explain'")
        conn.execute("SET auto_explain.log_min_duration = 0")
        conn.execute("SET auto_explain.log_nested_statements = on")
        conn.execute("SET auto_explain.log_analyze = on")
        conn.execute("SET auto_explain.log_level = 'notice'")
        conn.execute("SET client_min_messages = 'notice'")
        conn.execute(
            "SELECT * FROM webhooks_accept(%s, %s, 'evt_plan', 'test.event', NULL,"
            " %s, %s, '\\x00', NULL, '\\x00', interval '1 s', interval '4 days', NULL)",
            (source.id, source.secret_id, now + TTL, now),
        )
    return "\n".join(notices)


def test_accept_opens_no_receipts_partition_older_than_yesterday(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings, made: list[MadeSource]
) -> None:
    """Days a stopped maintenance left behind: the accept's live-receipt check prunes them
    (before, it opened every receipts partition, the one being dropped included)."""
    source = new_source(sessions, settings, made)
    ensure_partitions(engine, settings, T0)
    now = T0 + 3 * DAY
    plan = accept_plan(settings, source, now)
    old_days = [(T0 + n * DAY).date() for n in range(-1, 2)]
    assert plan
    for day in old_days:
        assert partitions.partition_name("receipts", day) not in plan, day
    assert partitions.partition_name("receipts", (now - DAY).date()) in plan


# ------------------------------------------------------------------------------------------
# Delete mode: a postponed receipt keeps its siblings
# ------------------------------------------------------------------------------------------


def test_delete_mode_receipt_postponed_by_a_lease_keeps_its_succeeded_siblings(
    delete_mode: tuple[Settings, Engine, sessionmaker[Session]],
) -> None:
    """One event, two routes: one delivery succeeded, the other runs under a live lease.
    The receipt is left for a later run, whole: the succeeded sibling and its attempt stay
    (before: the batched delete removed them, an event with half its work forgotten)."""
    settings, engine, sessions = delete_mode
    source = make_source(sessions, settings, routes=[{"handler": "log"}, {"handler": "log"}])
    ensure_partitions(engine, settings, T0)
    done, leased = accept(settings, source, "siblings", T0)[1]
    succeed(sessions, done, T0 + SEC)
    now = T0 + TTL + timedelta(hours=1)
    running = claim(sessions, leased, now - timedelta(minutes=1))

    report = run_maintenance(engine, settings, now)

    assert report.held_receipts == 0
    assert len(report.postponed) == 1
    row = rows_of(engine, source)["siblings"]
    assert (row.statuses, row.attempts, row.expires_at) == (
        ("succeeded", "processing"),
        2,
        T0 + TTL,
    )
    with sessions() as session, session.begin():
        transitions.succeed(session, running, now=now + SEC)
    report = run_maintenance(engine, settings, now + timedelta(minutes=10))
    assert report.rows_deleted["deliveries"] == 2
    assert "siblings" not in rows_of(engine, source)


# ------------------------------------------------------------------------------------------
# Audit: a discard by filter names what it discarded
# ------------------------------------------------------------------------------------------


@pytest.fixture
def audit_ids(engine: Engine) -> Iterator[list[int]]:
    ids: list[int] = []
    yield ids
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM audit_log WHERE id = ANY(:ids)"), {"ids": ids})


def test_discard_by_filter_records_the_delivery_ids_it_discarded(
    engine: Engine,
    sessions: sessionmaker[Session],
    settings: Settings,
    made: list[MadeSource],
    audit_ids: list[int],
) -> None:
    source = new_source(sessions, settings, made)
    ensure_partitions(engine, settings, None)
    dead = [accept(settings, source, f"evt_d{n}", None)[1][0] for n in range(3)]
    (alive,) = accept(settings, source, "evt_pending", None)[1]
    for delivery in dead:
        kill(sessions, delivery, datetime.now(UTC))
    request = discards.DiscardRequest(
        operator="carol",
        reason="integration removed",
        via="cli",
        filter_as_given={"source": source.public_id},
        flt=ReplayFilter(source=source.public_id),
    )
    with sessions() as session, session.begin():
        result = discards.execute_discard(
            session, discards.plan_discard(session, request), now=None
        )
    audit_ids.append(result.audit_id)

    with engine.connect() as conn:
        recorded = conn.execute(
            text("SELECT delivery_id FROM audit_discarded WHERE audit_id = :a ORDER BY 1"),
            {"a": result.audit_id},
        ).scalars()
        target, count = conn.execute(
            text("SELECT target, count FROM audit_log WHERE id = :a"), {"a": result.audit_id}
        ).one()
        assert list(recorded) == sorted(dead)
    assert alive not in dead
    assert (target, count) == ({"source": source.public_id}, 3)
