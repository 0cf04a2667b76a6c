"""Retention (issue 5): dedup boundary, partitions ahead and behind, batched delete, payloads.

Every time is injected. Partition-mode tests run on the retention modules' own database
(tests/retention_support.py), and work in February-March 2024, days no other retention test
writes to, so dropping "the past" there never touches another test's live rows. Delete-mode
tests get their own database, laid out by ``upgrade`` in delete mode. Receivers started here
publish to Redis DB 12, so flushing it (and parallel suites) disturbs nobody's broker.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import re
import subprocess
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from typing import Any

import httpx
import orjson
import psycopg
import pytest
import redis
from prometheus_client import REGISTRY
from sqlalchemy import Engine, event, text
from sqlalchemy.orm import Session, sessionmaker

from core.clock import FrozenClock
from core.settings import Settings
from core.ttl import MAX_EVENT_TIME_LEAD, TtlOverrides, expires_at
from ingest.app import create_app
from models import partitions, requeue, transitions
from models.accept import NewReceipt, accept_sync
from models.retention import delete_expired, drop_payloads, run_maintenance
from models.retention_expiry import drop_expired_partitions
from models.retention_holds import hold_end
from models.retention_layout import ensure_partitions, longest_ttl
from models.transitions import Claim
from tasks.capacity import record_expired
from tests.conftest import BIN, REDIS, TEST_DB, make_settings
from tests.conftest import test_env as subprocess_env
from tests.factories import MadeSource, accept_event, make_source, source_ttl
from tests.leakcheck import remember
from tests.processes import receiver
from tests.retention_fixtures import (  # noqa: F401 (fixtures: this module's own database)
    retention_engine,
    retention_sessions,
    retention_settings,
)
from tests.retention_support import RETENTION_URL, delete_mode_database, forget
from tests.signing import sign

D = datetime(2024, 2, 10, tzinfo=UTC)  # a midnight
US = timedelta(microseconds=1)
SEC = timedelta(seconds=1)
PRIVATE_BROKER = f"{REDIS}/12"
LEASE = timedelta(minutes=5)


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------


def new_source(
    sessions: sessionmaker[Session],
    settings: Settings,
    made: list[MadeSource],
    provider: str = "stripe",
    **kwargs: Any,
) -> MadeSource:
    source = make_source(sessions, settings, provider=provider, **kwargs)
    made.append(source)
    remember(source.secret)
    return source


def accept_at(
    settings: Settings,
    source: MadeSource,
    event_id: str,
    now: datetime,
    *,
    ttl: timedelta,
    occurred_at: datetime | None = None,
    body: dict[str, Any] | None = None,
    event_type: str = "test.event",
) -> str:
    """The receiver's own accept transaction at an injected time; returns its status."""
    _, outcome = accept_event(
        settings,
        source,
        event_id=event_id,
        event_type=event_type,
        body=body if body is not None else {"id": event_id, "n": 1},
        occurred_at=occurred_at,
        now=now,
        ttl=ttl,
    )
    return outcome.status


def receipts_of(engine: Engine, source: MadeSource, event_id: str | None = None) -> list[Any]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                text(
                    "SELECT event_id, expires_at, payload, payload_dropped_at, id FROM receipts"
                    " WHERE source_id = :s AND (CAST(:e AS text) IS NULL OR event_id = :e)"
                    " ORDER BY expires_at"
                ),
                {"s": source.id, "e": event_id},
            ).all()
        )


def count(engine: Engine, table: str, source: MadeSource) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                text(f"SELECT count(*) FROM {table} WHERE source_id = :s"), {"s": source.id}
            ).scalar_one()
        )


def layout(engine: Engine) -> dict[str, partitions.Partition]:
    with engine.connect() as conn:
        return {p.name: p for p in partitions.list_partitions(conn)}


def day_names(day: date) -> list[str]:
    return [partitions.partition_name(t, day) for t in ("receipts", "deliveries", "attempts")]


def claim(sessions: sessionmaker[Session], delivery_id: int, now: datetime) -> Claim:
    with sessions() as session, session.begin():
        found = transitions.claim(
            session, delivery_id, now=now, lease=LEASE, max_redeliveries=3, worker="test"
        )
    assert found is not None
    return found


def succeed(
    sessions: sessionmaker[Session], delivery_id: int, claimed_at: datetime, at: datetime
) -> None:
    found = claim(sessions, delivery_id, claimed_at)
    with sessions() as session, session.begin():
        transitions.succeed(session, found, now=at)


def kill(sessions: sessionmaker[Session], delivery_id: int, at: datetime) -> None:
    found = claim(sessions, delivery_id, at)
    with sessions() as session, session.begin():
        transitions.kill(session, found, now=at, reason="permanent", error_class="E", error="e")


def delivery_ids(engine: Engine, source: MadeSource, event_id: str) -> list[int]:
    with engine.connect() as conn:
        return [
            int(r[0])
            for r in conn.execute(
                text(
                    "SELECT d.id FROM deliveries d JOIN receipts r"
                    " ON d.receipt_id = r.id AND d.expires_at = r.expires_at"
                    " WHERE r.source_id = :s AND r.event_id = :e ORDER BY d.route_id"
                ),
                {"s": source.id, "e": event_id},
            )
        ]


# ------------------------------------------------------------------------------------------
# Partitions ahead of now and behind it
# ------------------------------------------------------------------------------------------


def test_ensure_partitions_creates_ahead_through_the_longest_source_ttl(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings, made: list[MadeSource]
) -> None:
    # Only existing sources size the layout (tests/test_partition_layout.py, own database).
    # A sender that retries for 40 days (an Adyen-like contract) stretches the horizon.
    new_source(
        sessions,
        settings,
        made,
        "hmac",
        config={},
        ttl=TtlOverrides(retry_window=timedelta(days=40)),
    )
    longest = longest_ttl(engine, settings)
    assert longest >= timedelta(days=43, minutes=10)

    now = D + timedelta(hours=12)
    created = ensure_partitions(engine, settings, now)
    last = (
        now + longest + MAX_EVENT_TIME_LEAD + timedelta(days=settings.partition_ahead_days)
    ).date()
    assert last >= (now + timedelta(days=50)).date()
    found = layout(engine)
    day = now.date()
    while day <= last:
        lo, hi = partitions.day_bounds(day)
        for name in day_names(day):
            assert (found[name].lower, found[name].upper) == (lo, hi), name
        day += timedelta(days=1)
    # Yesterday is wholly past at ``now``: maintenance would only drop it again.
    assert not set(day_names(now.date() - timedelta(days=1))) & set(found)
    assert not set(day_names(last + timedelta(days=1))) & set(found)
    assert set(day_names(last)) <= set(created)
    assert ensure_partitions(engine, settings, now) == []  # idempotent


def test_drop_expired_partitions_drops_wholly_past_days_only(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings, made: list[MadeSource]
) -> None:
    """The day boundary, with finished work only: whatever is not expired stays."""
    source = new_source(sessions, settings, made)
    ttl = source_ttl(sessions, settings, source.id)
    received = D + timedelta(hours=12)
    ensure_partitions(engine, settings, received)
    targets = {
        "last-instant-of-day-1": D + timedelta(days=2) - US,
        "exactly-now": D + timedelta(days=2),
        "just-after-now": D + timedelta(days=2) + US,
        "midday-2": D + timedelta(days=2, hours=12),
        "day-3": D + timedelta(days=3),
    }
    for event_id, target in targets.items():
        assert (
            accept_at(settings, source, event_id, received, ttl=ttl, occurred_at=target - ttl)
            == "accepted"
        )
        (delivery,) = delivery_ids(engine, source, event_id)
        # Finished work, with an attempt row in its day's partition.
        succeed(sessions, delivery, received + SEC, received + 2 * SEC)
    (doomed,) = delivery_ids(engine, source, "last-instant-of-day-1")
    assert {r.event_id: r.expires_at for r in receipts_of(engine, source)} == targets

    now = D + timedelta(days=2)
    dropped = drop_expired_partitions(engine, settings, now)

    after = layout(engine)
    assert set(day_names((D + timedelta(days=1)).date())) <= set(dropped)
    assert not set(dropped) & set(after)
    assert set(day_names(now.date())) <= set(after)
    assert all(p.upper is None or p.upper > now for p in after.values())
    remaining = {r.event_id for r in receipts_of(engine, source)}
    # Everything unexpired stays; the receipt expiring exactly now (expired, since the
    # receiver deduplicates only while now < expires_at) waits for its day to pass.
    assert remaining == {"exactly-now", "just-after-now", "midday-2", "day-3"}
    assert count(engine, "deliveries", source) == 4
    assert attempts_of(engine, [doomed]) == {}


# Every state a delivery of an expired receipt can be in, and whether expiry may remove it.
# ``dead_old`` died before the (shortened) dead-letter retention; ``dead_recent`` within it.
HELD_KINDS = ("pending", "retrying", "processing", "dead_recent", "split")
GONE_KINDS = ("succeeded", "dead_old", "discarded", "no_route")


def _work_in_every_state(
    sessions: sessionmaker[Session],
    settings: Settings,
    source: MadeSource,
    received: datetime,
    now: datetime,
) -> dict[str, list[int]]:
    """Events received at ``received`` (expired by ``now``), one per kind; returns each
    kind's delivery ids. ``split`` has a succeeded and a pending delivery."""
    ttl = timedelta(days=1)
    first = received + SEC
    ids: dict[str, list[int]] = {}
    for kind in HELD_KINDS + GONE_KINDS:
        event_type = "other.thing" if kind == "no_route" else f"order.{kind}"
        _, outcome = accept_event(
            settings, source, event_id=kind, event_type=event_type, now=received, ttl=ttl
        )
        assert outcome.status == "accepted"
        ids[kind] = list(outcome.delivery_ids)
    assert ids["no_route"] == []
    assert len(ids["split"]) == 2
    succeed(sessions, ids["succeeded"][0], first, first)
    succeed(sessions, ids["split"][0], first, first)
    kill(sessions, ids["dead_old"][0], first)
    kill(sessions, ids["discarded"][0], first)
    found = claim(sessions, ids["retrying"][0], first)
    with sessions() as session, session.begin():
        transitions.retry_later(
            session,
            found,
            now=first,
            next_attempt_at=now + timedelta(hours=1),
            error_class="E",
            error="e",
        )
    claim(sessions, ids["processing"][0], first)  # its lease ran out long ago: still unfinished
    kill(sessions, ids["dead_recent"][0], now - timedelta(minutes=30))
    with sessions() as session, session.begin():
        assert requeue.discard(session, ids["discarded"], now=first) == ids["discarded"]
    return ids


def _states(engine: Engine, ids: list[int]) -> dict[int, tuple[str, datetime]]:
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT id, status, expires_at FROM deliveries WHERE id = ANY(:ids)"),
            {"ids": ids},
        ).all()
    return {int(r[0]): (r[1], r[2]) for r in rows}


def attempts_of(engine: Engine, ids: list[int]) -> dict[int, int]:
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT delivery_id, count(*) FROM attempts WHERE delivery_id = ANY(:ids)"
                " GROUP BY delivery_id"
            ),
            {"ids": ids},
        ).all()
    return {int(r[0]): int(r[1]) for r in rows}


def _check_expiry_kept_held_work(
    engine: Engine,
    source: MadeSource,
    ids: dict[str, list[int]],
    now: datetime,
    attempts_before: dict[int, int],
) -> None:
    """The assertions shared by both modes: held work, its receipt (with its payload) and
    its attempts all remain, moved forward; finished work is gone."""
    receipts = {r.event_id: r for r in receipts_of(engine, source)}
    assert set(receipts) == set(HELD_KINDS), "held work lost, or finished work kept"
    held_ids = [i for kind in HELD_KINDS for i in ids[kind]]
    gone_ids = [i for kind in GONE_KINDS for i in ids[kind]]
    states = _states(engine, held_ids)
    assert sorted(states) == sorted(held_ids)
    assert _states(engine, gone_ids) == {}
    assert attempts_of(engine, gone_ids) == {}
    assert attempts_of(engine, held_ids) == {
        i: n for i, n in attempts_before.items() if i in held_ids
    }
    expected_status = {
        "pending": ["pending"],
        "retrying": ["retrying"],
        "processing": ["processing"],
        "dead_recent": ["dead"],
        "split": ["succeeded", "pending"],
    }
    for kind in HELD_KINDS:
        receipt = receipts[kind]
        assert receipt.payload is not None, kind
        assert receipt.expires_at > now, kind  # still deduplicating
        assert [states[i][0] for i in ids[kind]] == expected_status[kind], kind
        assert {states[i][1] for i in ids[kind]} == {receipt.expires_at}, kind
        if kind == "dead_recent":  # held to the end of its retention (1 h), sooner than a day
            assert receipt.expires_at == now - timedelta(minutes=30) + timedelta(hours=1)
        else:
            assert receipt.expires_at == hold_end(now)


def test_expiry_never_removes_unfinished_or_dead_work_partition_mode(
    engine: Engine, sessions: sessionmaker[Session], made: list[MadeSource]
) -> None:
    """Partition mode: the expired day is dropped, but nothing unfinished, no dead letter
    within its retention, nor their receipts and attempts go with it."""
    settings = make_settings(database_url=RETENTION_URL, dead_letter_retention=timedelta(hours=1))
    source = new_source(sessions, settings, made, routes=HOLD_ROUTES)
    received = D + timedelta(days=4, hours=6)  # expires on day 5; dropped at day 7
    now = D + timedelta(days=7, hours=1)
    ensure_partitions(engine, settings, received)
    ids = _work_in_every_state(sessions, settings, source, received, now)
    everything = [i for v in ids.values() for i in v]
    attempts_before = attempts_of(engine, everything)
    assert len(attempts_before) == 7  # every delivery claimed at least once has its attempt

    report = run_maintenance(engine, settings, now)

    assert set(day_names((received + timedelta(days=1)).date())) <= set(report.partitions_dropped)
    _check_expiry_kept_held_work(engine, source, ids, now, attempts_before)
    assert report.held_receipts == len(HELD_KINDS)
    assert report.rows_moved == {"receipts": 5, "deliveries": 6, "attempts": 4}
    assert report.dead_letters_expired == 1  # dead_old; the discarded one is no dead letter
    assert report.postponed == []


def test_expiry_never_removes_unfinished_or_dead_work_delete_mode(
    delete_mode: tuple[Settings, Engine, sessionmaker[Session]],
) -> None:
    """Delete mode: the same promise from the hold step and the batches' own predicates."""
    base, engine, sessions = delete_mode
    settings = make_settings(
        database_url=base.database_url,
        retention_mode="delete",
        delete_batch_size=3,
        dead_letter_retention=timedelta(hours=1),
    )
    source = make_source(sessions, settings, routes=HOLD_ROUTES)
    try:
        received = D + timedelta(days=200)
        now = received + timedelta(days=3)
        ids = _work_in_every_state(sessions, settings, source, received, now)
        everything = [i for v in ids.values() for i in v]
        attempts_before = attempts_of(engine, everything)

        report = run_maintenance(engine, settings, now)

        _check_expiry_kept_held_work(engine, source, ids, now, attempts_before)
        assert report.held_receipts == len(HELD_KINDS)
        assert report.rows_moved == {"receipts": 5, "deliveries": 6, "attempts": 4}
        assert report.dead_letters_expired == 1
        assert report.rows_deleted["deliveries"] == 3  # succeeded, dead_old, discarded
        # A second pass finds nothing more to remove, and holds nothing (none is expired).
        again = run_maintenance(engine, settings, now)
        assert again.held_receipts == 0
        assert sum(again.rows_deleted.values()) == 0
        _check_expiry_kept_held_work(engine, source, ids, now, attempts_before)
    finally:
        forget(sessions, [source])  # the delete-mode database is shared by this module


HOLD_ROUTES = [
    {"handler": "log", "events": "order.*"},
    {"handler": "log", "events": "order.split"},
]


def test_partition_drop_never_removes_an_unexpired_receipt(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings, made: list[MadeSource]
) -> None:
    rng = random.Random(2024)
    # No route: receipts alone, so nothing holds them and the boundary is all that decides.
    source = new_source(sessions, settings, made, "github", routes=[])
    ttl = source_ttl(sessions, settings, source.id)
    start = D + timedelta(days=20)
    ensure_partitions(engine, settings, start - ttl)
    expiries = []
    for n in range(40):
        day = start + timedelta(days=rng.randrange(4))
        # Day boundaries and their neighbours are where an off-by-one would hide.
        offset = rng.choice(
            [timedelta(0), US, -US, SEC, -SEC, timedelta(seconds=rng.randrange(86400))]
        )
        expiry = day + offset
        expiries.append(expiry)
        # No event time (GitHub): the arrival is the anchor.
        assert accept_at(settings, source, f"e{n}", expiry - ttl, ttl=ttl) == "accepted"
    steps = sorted(
        {start + timedelta(days=d) for d in range(5)}
        | {e + d for e in expiries[:10] for d in (-US, timedelta(0), US)}
    )
    all_dropped: list[str] = []
    for now in steps:
        unexpired_before = {r.event_id for r in receipts_of(engine, source) if r.expires_at > now}
        dropped = drop_expired_partitions(engine, settings, now)
        unexpired_after = {r.event_id for r in receipts_of(engine, source) if r.expires_at > now}
        assert unexpired_after == unexpired_before, now
        assert all(name not in layout(engine) for name in dropped)
        all_dropped += dropped
    # And it does expire: whatever expired before the last step's day began is gone.
    last_midnight, _ = partitions.day_bounds(steps[-1].date())
    assert all(r.expires_at >= last_midnight for r in receipts_of(engine, source))
    assert set(day_names(start.date())) <= set(all_dropped)


# ------------------------------------------------------------------------------------------
# The dedup boundary, through the receiver's accept transaction
# ------------------------------------------------------------------------------------------


def test_dedup_boundary_one_second_before_and_after_expiry_maintenance(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings, made: list[MadeSource]
) -> None:
    source = new_source(sessions, settings, made)
    ttl = source_ttl(sessions, settings, source.id)
    expiry = D + timedelta(days=33) - SEC  # 23:59:59, so its day is wholly past one second later
    occurred = expiry - ttl
    ensure_partitions(engine, settings, occurred)

    assert (
        accept_at(settings, source, "evt_a", occurred + 5 * SEC, ttl=ttl, occurred_at=occurred)
        == "accepted"
    )
    # A retry one second before expiry (carrying the same event time) is a duplicate.
    assert (
        accept_at(settings, source, "evt_a", expiry - SEC, ttl=ttl, occurred_at=occurred)
        == "duplicate"
    )
    assert len(receipts_of(engine, source, "evt_a")) == 1
    # Its work is done (unfinished work would hold the receipt: test_retention_holds.py).
    (delivery,) = delivery_ids(engine, source, "evt_a")
    succeed(sessions, delivery, occurred + 6 * SEC, occurred + 7 * SEC)

    report = run_maintenance(engine, settings, expiry + SEC)
    assert set(day_names(expiry.date())) <= set(report.partitions_dropped)
    assert receipts_of(engine, source, "evt_a") == []

    assert (
        accept_at(settings, source, "evt_a", expiry + SEC, ttl=ttl, occurred_at=occurred)
        == "accepted"
    )
    (fresh,) = receipts_of(engine, source, "evt_a")
    assert fresh.expires_at == expiry + SEC + ttl  # new work, anchored on its arrival


def test_dedup_boundary_is_exactly_expires_at(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings, made: list[MadeSource]
) -> None:
    # No route: nothing to do, so nothing holds the receipt past its expiry (a receipt whose
    # work is unfinished keeps deduplicating: tests/test_accept_batch.py).
    source = new_source(sessions, settings, made, routes=[])
    ttl = source_ttl(sessions, settings, source.id)
    expiry = D + timedelta(days=33, hours=12)
    occurred = expiry - ttl
    ensure_partitions(engine, settings, occurred)
    assert (
        accept_at(settings, source, "evt_b", occurred, ttl=ttl, occurred_at=occurred) == "accepted"
    )
    assert (
        accept_at(settings, source, "evt_b", expiry - US, ttl=ttl, occurred_at=occurred)
        == "duplicate"
    )
    # At expires_at itself the receipt no longer deduplicates, maintenance or not.
    assert accept_at(settings, source, "evt_b", expiry, ttl=ttl, occurred_at=occurred) == "accepted"
    rows = receipts_of(engine, source, "evt_b")
    assert [r.expires_at for r in rows] == [expiry, expiry + ttl]
    assert [r.expires_at > expiry for r in rows] == [False, True]  # one live receipt


def test_redis_flush_postgres_still_deduplicates_within_the_window(
    engine: Engine, sessions: sessionmaker[Session], made: list[MadeSource]
) -> None:
    """The real receiver (ASGI app, injected clock) publishing to a real Redis broker."""
    settings = make_settings(
        database_url=RETENTION_URL, broker_url=PRIVATE_BROKER, redis_url=f"{REDIS}/13"
    )
    source = new_source(sessions, settings, made)
    ttl = source_ttl(sessions, settings, source.id)
    clock = FrozenClock(D + timedelta(days=40, hours=9))
    created = clock.now() - 5 * SEC
    ensure_partitions(engine, settings, clock.now())
    broker = redis.Redis.from_url(PRIVATE_BROKER)
    claims = redis.Redis.from_url(settings.redis_url)
    broker.flushdb()
    body = stripe_event("evt_flush", created)

    async def scenario() -> tuple[httpx.Response, int, httpx.Response]:
        app = create_app(settings, clock)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://receiver"
            ) as client,
        ):
            first = await post_stripe(client, source, body, clock.now())
            published = await queued(broker, 1)  # the receiver publishes after the commit
            broker.flushdb()
            claims.flushdb()
            clock.set(created + ttl - SEC)  # one second before the receipt expires
            again = await post_stripe(client, source, body, clock.now())
        return first, published, again

    try:
        first, published, again = asyncio.run(scenario())
    finally:
        broker.flushdb()
        broker.close()
        claims.close()
    assert first.status_code == 202
    assert published == 1
    assert again.status_code == 200
    assert again.json()["status"] == "duplicate"
    assert count(engine, "receipts", source) == 1
    assert count(engine, "deliveries", source) == 1


def test_a_source_with_a_longer_ttl_gets_its_partitions_on_first_receipt(
    engine: Engine, sessions: sessionmaker[Session], made: list[MadeSource]
) -> None:
    """The receiver, finding no partition for a far expires_at, lays them out and retries."""
    settings = make_settings(database_url=RETENTION_URL, broker_url=PRIVATE_BROKER)
    clock = FrozenClock(D + timedelta(days=45))
    ensure_partitions(engine, settings, clock.now())  # laid out before the long source exists
    source = new_source(sessions, settings, made, ttl=TtlOverrides(retry_window=timedelta(days=90)))
    ttl = source_ttl(sessions, settings, source.id)
    assert (clock.now() + ttl).date().strftime("receipts_p%Y%m%d") not in layout(engine)

    async def scenario() -> httpx.Response:
        app = create_app(settings, clock)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://receiver"
            ) as client,
        ):
            return await post_stripe(
                client, source, stripe_event("evt_long", clock.now()), clock.now()
            )

    try:
        response = asyncio.run(scenario())
    finally:
        redis.Redis.from_url(PRIVATE_BROKER).flushdb()
    assert response.status_code == 202
    (row,) = receipts_of(engine, source)
    assert row.expires_at == clock.now() + ttl


async def queued(broker: redis.Redis, expected: int, within: float = 10.0) -> int:
    """Wait (bounded, not timed) until the broker queue holds ``expected`` messages."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while (found := int(broker.llen("deliveries"))) < expected and loop.time() < deadline:
        await asyncio.sleep(0.02)
    return found


def stripe_event(event_id: str, created: datetime) -> dict[str, Any]:
    return {
        "id": event_id,
        "object": "event",
        "created": int(created.timestamp()),
        "type": "invoice.paid",
        "data": {"object": {"id": "in_1", "object": "invoice"}},
    }


async def post_stripe(
    client: httpx.AsyncClient, source: MadeSource, body_obj: dict[str, Any], at: datetime
) -> httpx.Response:
    headers, body = sign(
        "stripe", source.secret, event_id=body_obj["id"], body_obj=body_obj, timestamp=at
    )
    remember(body)
    return await client.post(f"/webhooks/{source.public_id}", headers=headers, content=body)


# ------------------------------------------------------------------------------------------
# Uniqueness across partitions under concurrency
# ------------------------------------------------------------------------------------------


def test_concurrent_retries_with_different_delivery_timestamps_make_one_receipt(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings, made: list[MadeSource]
) -> None:
    """Real receiver process, real clock: Stripe retries of one event, each signed with its
    own ``t`` (as every Stripe attempt is) but the same ``created``, sent at once."""
    source = new_source(sessions, settings, made)
    copies = 8
    with receiver(
        WEBHOOKS_BROKER_URL=PRIVATE_BROKER, WEBHOOKS_DATABASE_URL=settings.psycopg_dsn
    ) as rcv:
        try:
            for round_ in range(3):
                event_id = f"evt_race_{round_}_{uuid.uuid4().hex[:8]}"
                now = datetime.now(UTC)
                body_obj = stripe_event(event_id, now - timedelta(seconds=30))
                signed = [
                    sign(
                        "stripe",
                        source.secret,
                        event_id=event_id,
                        body_obj=body_obj,
                        timestamp=now - i * SEC,
                    )
                    for i in range(copies)
                ]
                assert len({h["Stripe-Signature"] for h, _ in signed}) == copies
                assert len({b for _, b in signed}) == 1
                remember(signed[0][1])
                statuses = race(f"{rcv.url}/webhooks/{source.public_id}", signed)
                assert sorted(code for code, _ in statuses) == [200] * (copies - 1) + [202]
                assert sorted(s for _, s in statuses) == ["accepted"] + ["duplicate"] * (copies - 1)
                assert len(receipts_of(engine, source, event_id)) == 1
        finally:
            redis.Redis.from_url(PRIVATE_BROKER).flushdb()
    assert count(engine, "receipts", source) == 3
    assert count(engine, "deliveries", source) == 3


def race(url: str, requests: list[tuple[dict[str, str], bytes]]) -> list[tuple[int, str]]:
    barrier = threading.Barrier(len(requests))
    results: list[tuple[int, str]] = []
    lock = threading.Lock()

    def send(headers: dict[str, str], body: bytes) -> None:
        with httpx.Client(timeout=20) as client:
            client.get(
                url.split("/webhooks/", maxsplit=1)[0] + "/healthz"
            )  # connect before the barrier
            barrier.wait()
            response = client.post(url, headers=headers, content=body)
        with lock:
            results.append((response.status_code, response.json().get("status", "")))

    threads = [threading.Thread(target=send, args=r) for r in requests]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results) == len(requests)
    return results


def test_uniqueness_holds_across_partitions_under_concurrency(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings, made: list[MadeSource]
) -> None:
    """Arrivals of one GitHub event (no event time: expiry anchored on arrival) straddling a
    partition boundary, racing through the receiver's accept transaction on separate
    connections: the primary key alone could not stop them (their expires_at differ and land
    in two partitions); the per-event lock and the live-receipt check do."""
    source = new_source(sessions, settings, made, "github")
    ttl = source_ttl(sessions, settings, source.id)
    boundary = D + timedelta(days=60)
    arrivals = [
        boundary - ttl - timedelta(milliseconds=300) + i * timedelta(milliseconds=120)
        for i in range(6)
    ]
    assert len({(a + ttl).date() for a in arrivals}) == 2
    ensure_partitions(engine, settings, arrivals[0])
    for round_ in range(5):
        event_id = f"gh-{round_}-{uuid.uuid4()}"
        order = random.Random(round_).sample(arrivals, len(arrivals))
        outcomes = race_accepts(settings, source, event_id, order, ttl)
        assert sorted(outcomes) == ["accepted"] + ["duplicate"] * (len(arrivals) - 1)
        assert len(receipts_of(engine, source, event_id)) == 1


def race_accepts(
    settings: Settings, source: MadeSource, event_id: str, arrivals: list[datetime], ttl: timedelta
) -> list[str]:
    """One thread per arrival, each on its own connection, released together."""
    raw = orjson.dumps({"action": "opened", "id": event_id})
    barrier = threading.Barrier(len(arrivals))
    outcomes: list[str] = []
    lock = threading.Lock()

    def arrive(now: datetime) -> None:
        receipt = NewReceipt(
            source_id=source.id,
            secret_id=source.secret_id,
            event_id=event_id,
            event_type="issues.opened",
            occurred_at=None,
            expires_at=expires_at(None, now, ttl),
            ttl=ttl,
            received_at=now,
            digest=hashlib.sha256(raw).digest(),
            content_type="application/json",
            payload=raw,
        )
        with psycopg.connect(settings.psycopg_dsn, autocommit=True) as conn:
            barrier.wait()
            outcome = accept_sync(conn, receipt, settings.publish_grace)
        with lock:
            outcomes.append(outcome.status)

    threads = [threading.Thread(target=arrive, args=(a,)) for a in arrivals]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return outcomes


# ------------------------------------------------------------------------------------------
# Delete mode (its own database, laid out by upgrade in delete mode)
# ------------------------------------------------------------------------------------------

DELETE_DB = f"{TEST_DB}_retention_delete"


@pytest.fixture(scope="module")
def delete_mode() -> Iterator[tuple[Settings, Engine, sessionmaker[Session]]]:
    with delete_mode_database(DELETE_DB, batch=3) as made:
        yield made


def test_delete_mode_lays_out_indexed_default_partitions_and_never_drops(
    delete_mode: tuple[Settings, Engine, sessionmaker[Session]],
) -> None:
    settings, engine, _ = delete_mode
    found = layout(engine)
    assert sorted(found) == ["attempts_default", "deliveries_default", "receipts_default"]
    assert all(p.is_default for p in found.values())
    with engine.connect() as conn:
        indexed = set(
            conn.execute(
                text("SELECT indexname FROM pg_indexes WHERE indexname LIKE '%default_expires_at'")
            ).scalars()
        )
    assert indexed == {f"ix_{t}_default_expires_at" for t in ("receipts", "deliveries", "attempts")}
    far = D + timedelta(days=3650)
    assert ensure_partitions(engine, settings, far) == []
    assert drop_expired_partitions(engine, settings, far) == []
    assert sorted(layout(engine)) == sorted(found)


def test_batched_delete_never_exceeds_the_batch_size(
    delete_mode: tuple[Settings, Engine, sessionmaker[Session]],
) -> None:
    settings, engine, sessions = delete_mode
    assert settings.delete_batch_size == 3
    source = make_source(sessions, settings, provider="stripe")
    ttl = source_ttl(sessions, settings, source.id)
    now = D + timedelta(days=30)
    expired = [now - timedelta(hours=h) for h in range(1, 11)] + [now]  # 11, one exactly now
    unexpired = [now + US, now + timedelta(hours=1), now + timedelta(days=2)]
    for n, expiry in enumerate(expired + unexpired):
        event_id = f"d{n}"
        occurred = expiry - ttl
        assert (
            accept_at(settings, source, event_id, occurred, ttl=ttl, occurred_at=occurred)
            == "accepted"
        )
        (delivery,) = delivery_ids(engine, source, event_id)
        # One attempt row each; finished (unfinished work is held, not deleted).
        succeed(sessions, delivery, occurred + SEC, occurred + SEC)
        if n < 4:  # the same id with another body: a conflict row, expiring with the receipt
            body = {"id": event_id, "n": 2}
            assert (
                accept_at(
                    settings,
                    source,
                    event_id,
                    occurred + SEC,
                    ttl=ttl,
                    occurred_at=occurred,
                    body=body,
                )
                == "conflict"
            )

    # What the stale-expiry alert reads (issue 35 item 5): the rows the next pass would
    # remove first, as the worker's gauge exports them after a run.
    assert record_expired(engine, settings, now) == {
        "deliveries": 11,
        "attempts": 0,  # their deliveries are still there
        "receipts": 0,
        "conflicts": 4,
    }
    assert REGISTRY.get_sample_value("webhooks_expired_rows", {"table": "deliveries"}) == 11

    statements: list[tuple[str, int]] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        # Batches run per partition: "receipts_default" counts for receipts. The deliveries'
        # delete is a CTE (its filtered rows' ledger entries appended: models.ledger).
        match = re.match(
            r'\s*(?:WITH gone AS \(\s*)?DELETE FROM "?([a-z]+?)(?:_default|_p\d{8})?"? ', statement
        )
        if match:
            assert "LIMIT" in statement
            statements.append((match.group(1), cursor.rowcount))

    event.listen(engine, "after_cursor_execute", record)
    try:
        report = run_maintenance(engine, settings, now)
    finally:
        event.remove(engine, "after_cursor_execute", record)

    assert all(rows <= 3 for _, rows in statements)
    per_table = {
        t: [rows for table, rows in statements if table == t]
        for t in ("attempts", "deliveries", "receipts", "conflicts")
    }
    assert per_table == {
        "attempts": [3, 3, 3, 2],
        "deliveries": [3, 3, 3, 2],
        "receipts": [3, 3, 3, 2],
        "conflicts": [3, 1],
    }
    assert report.mode == "delete"
    assert report.rows_deleted == {"attempts": 11, "deliveries": 11, "receipts": 11, "conflicts": 4}
    assert report.delete_statements == {t: len(v) for t, v in per_table.items()}
    assert {r.expires_at for r in receipts_of(engine, source)} == set(unexpired)
    with engine.connect() as conn:
        for table in ("attempts", "deliveries", "receipts", "conflicts"):
            assert (
                conn.execute(
                    text(f"SELECT count(*) FROM {table} WHERE expires_at <= :n"), {"n": now}
                ).scalar_one()
                == 0
            )
        assert conn.execute(text("SELECT count(*) FROM attempts")).scalar_one() == 3
    assert count(engine, "deliveries", source) == 3
    assert set(record_expired(engine, settings, report.now).values()) == {0}
    assert REGISTRY.get_sample_value("webhooks_expired_rows", {"table": "deliveries"}) == 0
    # Nothing left: one statement per table finds nothing.
    again = delete_expired(engine, settings, now)
    assert again.rows == {"attempts": 0, "deliveries": 0, "receipts": 0, "conflicts": 0}
    assert again.statements == {"attempts": 1, "deliveries": 1, "receipts": 1, "conflicts": 1}


def test_delete_mode_dedup_boundary_and_acceptance_after_maintenance(
    delete_mode: tuple[Settings, Engine, sessionmaker[Session]],
) -> None:
    settings, engine, sessions = delete_mode
    source = make_source(sessions, settings, provider="stripe")
    ttl = source_ttl(sessions, settings, source.id)
    expiry = D + timedelta(days=90, hours=7)
    occurred = expiry - ttl
    assert (
        accept_at(settings, source, "evt_c", occurred + SEC, ttl=ttl, occurred_at=occurred)
        == "accepted"
    )
    assert (
        accept_at(settings, source, "evt_c", expiry - SEC, ttl=ttl, occurred_at=occurred)
        == "duplicate"
    )
    # Its work is done (unfinished work would hold the receipt: test_retention_holds.py).
    (delivery,) = delivery_ids(engine, source, "evt_c")
    succeed(sessions, delivery, occurred + 2 * SEC, occurred + 3 * SEC)
    run_maintenance(engine, settings, expiry - US)
    assert len(receipts_of(engine, source, "evt_c")) == 1  # not yet expired: kept
    run_maintenance(engine, settings, expiry)
    assert receipts_of(engine, source, "evt_c") == []  # expired at expires_at exactly
    assert (
        accept_at(settings, source, "evt_c", expiry + SEC, ttl=ttl, occurred_at=occurred)
        == "accepted"
    )
    (fresh,) = receipts_of(engine, source, "evt_c")
    assert fresh.expires_at == expiry + SEC + ttl


# ------------------------------------------------------------------------------------------
# Payload retention
# ------------------------------------------------------------------------------------------


def test_by_default_a_body_goes_once_the_replay_grace_has_passed_since_its_success(
    engine: Engine, sessions: sessionmaker[Session], made: list[MadeSource]
) -> None:
    """Issue 35 item 7 (seed 004: bodies are not kept once dispatch is done): with the
    default settings a body whose deliveries all succeeded is dropped once the manual replay
    grace (2 d) has passed since the last success, not the 7 d it used to be."""
    settings = make_settings(database_url=RETENTION_URL)
    assert settings.payload_retention == settings.manual_replay_grace == timedelta(days=2)
    source = new_source(
        sessions,
        settings,
        made,
        "hmac",
        config={},
        ttl=TtlOverrides(retry_window=timedelta(days=30)),  # receipts outlive the bodies
        routes=[{"handler": "log"}],
    )
    ttl = source_ttl(sessions, settings, source.id)
    now = D + timedelta(days=130)
    received = now - timedelta(days=3)
    ensure_partitions(engine, settings, received)
    for name in ("past_grace", "within_grace"):
        assert accept_at(settings, source, name, received, ttl=ttl, body={"id": name}) == "accepted"
    first = received + timedelta(minutes=1)
    grace = settings.manual_replay_grace
    (past,) = delivery_ids(engine, source, "past_grace")
    (within,) = delivery_ids(engine, source, "within_grace")
    succeed(sessions, past, first, now - grace - SEC)
    succeed(sessions, within, first, now - grace + SEC)

    assert drop_payloads(engine, settings, now) == 1
    rows = {r.event_id: r for r in receipts_of(engine, source)}
    assert rows["past_grace"].payload is None
    assert json.loads(bytes(rows["within_grace"].payload)) == {"id": "within_grace"}


def test_payload_retention_drops_exactly_the_bodies_it_should(
    engine: Engine, sessions: sessionmaker[Session], made: list[MadeSource]
) -> None:
    # Batches of two, so the walk crosses batches and passes bodies it must keep.
    settings = make_settings(database_url=RETENTION_URL, delete_batch_size=2)
    source = new_source(
        sessions,
        settings,
        made,
        "hmac",
        config={},
        ttl=TtlOverrides(retry_window=timedelta(days=30)),  # receipts outlive payload retention
        routes=[
            {"handler": "log", "events": "order.*"},
            {"handler": "log", "events": "order.split"},
        ],
    )
    ttl = source_ttl(sessions, settings, source.id)
    now = D + timedelta(days=100)
    cutoff = now - settings.payload_retention
    received = now - timedelta(days=10)
    ensure_partitions(engine, settings, received)
    names = [
        "a",
        "b",
        "c",
        "dead",
        "pending",
        "retrying",
        "processing",
        "split",
        "replayed",
        "no_route",
        "rerun",
    ]
    bodies = {}
    for name in names:
        bodies[name] = {"id": name, "secret_looking_field": uuid.uuid4().hex}
        kind = (
            "order.split"
            if name == "split"
            else "other.thing"
            if name == "no_route"
            else "order.created"
        )
        assert (
            accept_at(settings, source, name, received, ttl=ttl, body=bodies[name], event_type=kind)
            == "accepted"
        )
    first = received + timedelta(minutes=1)

    def one(name: str) -> int:
        (delivery,) = delivery_ids(engine, source, name)
        return delivery

    succeed(sessions, one("a"), first, cutoff - SEC)
    succeed(sessions, one("b"), first, cutoff)  # retention over exactly now: dropped
    succeed(sessions, one("c"), first, cutoff + SEC)
    kill(sessions, one("dead"), first)
    found = claim(sessions, one("retrying"), first)
    with sessions() as session, session.begin():
        transitions.retry_later(
            session,
            found,
            now=first,
            next_attempt_at=now + timedelta(hours=1),
            error_class="E",
            error="e",
        )
    claim(sessions, one("processing"), now - timedelta(minutes=1))
    split_ok, split_dead = delivery_ids(engine, source, "split")
    succeed(sessions, split_ok, first, first)
    kill(sessions, split_dead, first)
    kill(sessions, one("replayed"), first)
    with sessions() as session, session.begin():
        assert requeue.replay(
            session, one("replayed"), now=received + timedelta(days=1), publish_grace=SEC
        )
    succeed(
        sessions,
        one("replayed"),
        received + timedelta(days=1, minutes=1),
        cutoff - timedelta(hours=1),
    )
    succeed(sessions, one("rerun"), first, first)
    with sessions() as session, session.begin():
        assert requeue.rerun(
            session, one("rerun"), now=received + timedelta(days=2), publish_grace=SEC
        )
    assert delivery_ids(engine, source, "no_route") == []

    dropped = drop_payloads(engine, settings, now)

    rows = {r.event_id: r for r in receipts_of(engine, source)}
    gone = {name for name, r in rows.items() if r.payload is None}
    assert gone == {"a", "b", "replayed", "no_route"}
    assert dropped == 4
    for name, row in rows.items():
        if name in gone:
            assert row.payload_dropped_at == now
        else:
            assert json.loads(bytes(row.payload)) == bodies[name]
            assert row.payload_dropped_at is None
    assert drop_payloads(engine, settings, now) == 0  # idempotent
    # The compact receipt itself lives on until expires_at.
    assert len(rows) == len(names)
    assert all(r.expires_at == received + ttl for r in rows.values())


# ------------------------------------------------------------------------------------------
# webhooks maintenance run
# ------------------------------------------------------------------------------------------


def test_maintenance_run_cli_reports_counts_in_both_modes(
    delete_mode: tuple[Settings, Engine, sessionmaker[Session]], settings: Settings, engine: Engine
) -> None:
    done = run_cli("maintenance", "run", "--json", WEBHOOKS_DATABASE_URL=settings.psycopg_dsn)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["mode"] == "partition"
    through = date.fromisoformat(report["partitions_through"])
    longest = longest_ttl(engine, settings)  # the existing sources' (this database's)
    assert (
        through
        >= (datetime.now(UTC) + longest + timedelta(days=settings.partition_ahead_days)).date()
    )
    assert set(report["rows_deleted"]) == {"conflicts"}  # the only table not partitioned

    delete_settings, _, _ = delete_mode
    done = run_cli(
        "maintenance",
        "run",
        WEBHOOKS_DATABASE_URL=delete_settings.database_url.replace("+psycopg", ""),
        WEBHOOKS_RETENTION_MODE="delete",
    )
    assert done.returncode == 0, done.stderr
    assert "mode delete" in done.stdout
    for table in ("attempts", "deliveries", "receipts", "conflicts"):
        assert re.search(rf"{table}: \d+ expired rows deleted in \d+ statements", done.stdout)


def run_cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "webhooks"), *args],
        env=subprocess_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
