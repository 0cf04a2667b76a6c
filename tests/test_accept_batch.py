"""The receiver's group commit (issue 2): many accepts in one statement and one transaction.

The batch function (migration 0004) must give every element exactly the outcome the
one-at-a-time function (migration 0003) gives when the same arrivals come in the same order;
the Store must group concurrent requests, and one bad element must not fail its neighbours.
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core import metrics
from core.crypto import SecretBox
from core.settings import Settings
from core.ttl import expires_at
from ingest.store import Store
from models import catalog
from models.accept import (
    ACCEPT_MANY_SQL,
    NewReceipt,
    Outcome,
    accept_many_params,
    accept_sync,
    decide_many,
)
from models.schema import Source
from tests.conftest import make_settings
from tests.factories import MadeSource, make_source

ROUTES = [{"handler": "log", "events": "invoice.*"}, {"handler": "log"}]


@dataclass(frozen=True)
class Arrival:
    event_id: str
    body: bytes
    event_type: str = "invoice.paid"
    revoked: bool = False


def receipt_for(
    source: MadeSource, revoked_secret: str, arrival: Arrival, now: datetime
) -> NewReceipt:
    return NewReceipt(
        source_id=source.id,
        secret_id=revoked_secret if arrival.revoked else source.secret_id,
        event_id=arrival.event_id,
        event_type=arrival.event_type,
        occurred_at=None,
        expires_at=expires_at(None, now, timedelta(days=4)),
        ttl=timedelta(days=4),
        received_at=now,
        digest=hashlib.sha256(arrival.body).digest(),
        content_type="application/json",
        payload=arrival.body,
    )


def source_with_revoked_secret(
    sessions: sessionmaker[Session], settings: Settings
) -> tuple[MadeSource, str]:
    source = make_source(sessions, settings, routes=ROUTES)
    box = SecretBox(settings.secret_key.get_secret_value())
    with sessions() as session, session.begin():
        row = session.get(Source, source.id)
        assert row is not None
        extra = catalog.add_secret(session, box, row)
        catalog.revoke_secret(session, row, extra.id, now=datetime.now(UTC))
    return source, extra.id


def rows_of(engine: Engine, source_id: int) -> dict[str, int]:
    with engine.connect() as conn:
        return {
            table: int(
                conn.execute(
                    text(f"SELECT count(*) FROM {table} WHERE source_id = :s"), {"s": source_id}
                ).scalar_one()
            )
            for table in ("receipts", "deliveries", "conflicts")
        }


def shape(outcomes: list[Outcome]) -> list[tuple[str, int]]:
    return [(o.status, len(o.delivery_ids)) for o in outcomes]


def test_a_batch_decides_each_arrival_as_the_one_at_a_time_function_does(
    sessions: sessionmaker[Session], settings: Settings, engine: Engine
) -> None:
    live, other = f"evt_live_{uuid.uuid4().hex}", f"evt_{uuid.uuid4().hex}"
    arrivals = [
        Arrival("evt_a", b'{"a":1}'),  # new, two routes match
        Arrival("evt_a", b'{"a":1}'),  # the same again in the same batch: duplicate
        Arrival("evt_a", b'{"a":2}'),  # same id, other body: conflict
        Arrival(live, b'{"live":1}'),  # accepted before the batch: duplicate
        Arrival(live, b'{"live":2}'),  # ... with another body: conflict
        Arrival("evt_r", b'{"r":1}', revoked=True),  # revoked secret: nothing written
        Arrival("evt_d", b'{"d":1}', revoked=True),  # revoked first ...
        Arrival("evt_d", b'{"d":1}', event_type="charge.ok"),  # ... then authorised: accepted
        Arrival(other, b'{"o":1}', event_type="charge.ok"),  # new, one route matches
    ]
    expected_shape = [
        ("accepted", 2),
        ("duplicate", 0),
        ("conflict", 0),
        ("duplicate", 0),
        ("conflict", 0),
        ("revoked", 0),
        ("revoked", 0),
        ("accepted", 1),
        ("accepted", 1),
    ]
    now = datetime.now(UTC)
    results = {}
    for path in ("one_at_a_time", "batch"):
        source, revoked = source_with_revoked_secret(sessions, settings)
        receipts = [receipt_for(source, revoked, a, now) for a in arrivals]
        with psycopg.connect(settings.psycopg_dsn, autocommit=True) as conn:
            accept_sync(
                conn,
                receipt_for(source, revoked, Arrival(live, b'{"live":1}'), now),
                settings.publish_grace,
            )
            if path == "batch":
                cur = conn.execute(
                    ACCEPT_MANY_SQL, accept_many_params(receipts, settings.publish_grace)
                )
                outcomes = decide_many(receipts, cur.fetchall())
            else:
                outcomes = [accept_sync(conn, r, settings.publish_grace) for r in receipts]
        results[path] = (shape(outcomes), rows_of(engine, source.id))

    assert results["batch"] == results["one_at_a_time"]
    assert results["batch"][0] == expected_shape
    # The live receipt, evt_a, evt_d and the new one: 2 + 2 + 1 + 1 deliveries; two conflicts.
    assert results["batch"][1] == {"receipts": 4, "deliveries": 6, "conflicts": 2}


@pytest.mark.parametrize(
    "offset", [-timedelta(microseconds=1), timedelta(0), timedelta(microseconds=1)]
)
def test_batch_and_one_at_a_time_agree_at_the_expiry_boundary(
    sessions: sessionmaker[Session], settings: Settings, engine: Engine, offset: timedelta
) -> None:
    """An earlier receipt of the event, its work done, expires at X; the arrivals come at
    X - 1 us, X and X + 1 us. Before X they are duplicates (and a conflict) of it; from X on
    the first inserts anew and the rest are duplicates (and a conflict) of that one, in both
    paths."""
    expiry = datetime.now(UTC).replace(microsecond=500_000) + timedelta(hours=1)
    instant = expiry + offset
    event, other = f"evt_{uuid.uuid4().hex}", f"evt_{uuid.uuid4().hex}"
    arrivals = [
        Arrival(event, b'{"v":1}'),
        Arrival(event, b'{"v":1}'),
        Arrival(event, b'{"v":2}'),
        Arrival(other, b'{"o":1}'),
    ]
    results = {}
    for path in ("one_at_a_time", "batch"):
        source, revoked = source_with_revoked_secret(sessions, settings)
        earlier = instant - timedelta(days=1)
        first = NewReceipt(
            source_id=source.id,
            secret_id=source.secret_id,
            event_id=event,
            event_type="invoice.paid",
            occurred_at=None,
            expires_at=expiry,
            received_at=earlier,
            digest=hashlib.sha256(b'{"v":1}').digest(),
            content_type="application/json",
            payload=b'{"v":1}',
            ttl=expiry - earlier,
        )
        receipts = [receipt_for(source, revoked, a, instant) for a in arrivals]
        with psycopg.connect(settings.psycopg_dsn, autocommit=True) as conn:
            assert accept_sync(conn, first, settings.publish_grace).status == "accepted"
            conn.execute(
                "UPDATE deliveries SET status = 'succeeded', next_attempt_at = NULL"
                " WHERE source_id = %s",
                (source.id,),
            )
            if path == "batch":
                cur = conn.execute(
                    ACCEPT_MANY_SQL, accept_many_params(receipts, settings.publish_grace)
                )
                outcomes = decide_many(receipts, cur.fetchall())
            else:
                outcomes = [accept_sync(conn, r, settings.publish_grace) for r in receipts]
        results[path] = (shape(outcomes), rows_of(engine, source.id))
    assert results["batch"] == results["one_at_a_time"]
    live = offset < timedelta(0)
    expected = [
        ("duplicate", 0) if live else ("accepted", 2),
        ("duplicate", 0),
        ("conflict", 0),
        ("accepted", 2),
    ]
    assert results["batch"][0] == expected
    assert results["batch"][1] == {
        "receipts": 2 if live else 3,
        "deliveries": 4 if live else 6,
        "conflicts": 1,
    }


@pytest.mark.parametrize("status", ["pending", "retrying", "dead", "succeeded", "discarded"])
def test_an_expired_receipt_whose_work_is_not_done_still_deduplicates(
    sessions: sessionmaker[Session], settings: Settings, engine: Engine, status: str
) -> None:
    """Past its expires_at, before maintenance has moved it forward (held), a receipt whose
    delivery is unfinished or dead still deduplicates its event, in both paths; finished
    work (succeeded, discarded) does not."""
    instant = datetime.now(UTC).replace(microsecond=0) + timedelta(hours=1)
    expiry = instant - timedelta(seconds=1)
    event = f"evt_{uuid.uuid4().hex}"
    results = {}
    for path in ("one_at_a_time", "batch"):
        source, revoked = source_with_revoked_secret(sessions, settings)
        earlier = expiry - timedelta(days=1)
        first = receipt_for(source, revoked, Arrival(event, b'{"v":1}'), earlier)
        first = NewReceipt(**{**first.__dict__, "expires_at": expiry, "ttl": expiry - earlier})
        receipts = [
            receipt_for(source, revoked, a, instant) for a in [Arrival(event, b'{"v":1}')] * 2
        ]
        with psycopg.connect(settings.psycopg_dsn, autocommit=True) as conn:
            assert accept_sync(conn, first, settings.publish_grace).status == "accepted"
            conn.execute(
                "UPDATE deliveries SET status = %s WHERE source_id = %s", (status, source.id)
            )
            if path == "batch":
                cur = conn.execute(
                    ACCEPT_MANY_SQL, accept_many_params(receipts, settings.publish_grace)
                )
                outcomes = decide_many(receipts, cur.fetchall())
            else:
                outcomes = [accept_sync(conn, r, settings.publish_grace) for r in receipts]
        results[path] = (shape(outcomes), rows_of(engine, source.id)["receipts"])
    assert results["batch"] == results["one_at_a_time"]
    held = status in ("pending", "retrying", "dead")
    expected = [("duplicate", 0), ("duplicate", 0)] if held else [("accepted", 2), ("duplicate", 0)]
    assert results["batch"] == (expected, 1 if held else 2)


def test_a_batch_is_decided_at_one_instant() -> None:
    now = datetime.now(UTC)
    receipts = [
        NewReceipt(1, "s", f"e{n}", "t", None, now, at, b"d", None, b"p", timedelta(1))
        for n, at in enumerate((now, now + timedelta(microseconds=1)))
    ]
    with pytest.raises(ValueError, match="one instant"):
        accept_many_params(receipts, timedelta(seconds=30))


def test_a_receipt_is_never_written_into_a_day_already_past(
    sessions: sessionmaker[Session], settings: Settings, engine: Engine
) -> None:
    """A receiver whose clock lags the database's computes an expiry that has already passed
    by the database's clock (its event time + TTL): the accept anchors it on its own instant
    instead, so the receipt lands in a live day and is deduplicated for a whole TTL."""
    source, _ = source_with_revoked_secret(sessions, settings)
    ttl = timedelta(days=2)
    lagging_now = datetime.now(UTC) - timedelta(days=3)  # the receiver's idea of now
    occurred = lagging_now - timedelta(hours=1)
    stale = NewReceipt(
        source_id=source.id,
        secret_id=source.secret_id,
        event_id=f"evt_{uuid.uuid4().hex}",
        event_type="invoice.paid",
        occurred_at=occurred,
        expires_at=occurred + ttl,  # yesterday, by the database's clock
        received_at=None,  # production: the database stamps it
        digest=b"d",
        content_type="application/json",
        payload=b"{}",
        ttl=ttl,
    )
    with psycopg.connect(settings.psycopg_dsn, autocommit=True) as conn:
        outcome = accept_sync(conn, stale, settings.publish_grace)
        assert outcome.status == "accepted"
        expires, received, db_now = conn.execute(
            "SELECT expires_at, received_at, now() FROM receipts WHERE id = %s",
            (outcome.receipt_id,),
        ).fetchone()  # type: ignore[misc]
        assert received <= db_now
        assert expires == received + ttl  # anchored on the database's instant
        assert expires > db_now + ttl - timedelta(minutes=1)
        again = accept_sync(conn, stale, settings.publish_grace)
    assert again.status == "duplicate"


def test_a_batch_of_one_event_many_times_writes_one_receipt(
    sessions: sessionmaker[Session], settings: Settings, engine: Engine
) -> None:
    source, revoked = source_with_revoked_secret(sessions, settings)
    now = datetime.now(UTC)
    receipts = [receipt_for(source, revoked, Arrival("evt_same", b'{"x":1}'), now)] * 30
    with psycopg.connect(settings.psycopg_dsn, autocommit=True) as conn:
        cur = conn.execute(ACCEPT_MANY_SQL, accept_many_params(receipts, settings.publish_grace))
        outcomes = decide_many(receipts, cur.fetchall())
    assert shape(outcomes) == [("accepted", 2)] + [("duplicate", 0)] * 29
    assert rows_of(engine, source.id) == {"receipts": 1, "deliveries": 2, "conflicts": 0}


def batch_sizes() -> tuple[float, float]:
    """(number of accept statements, receipts they carried) so far in this process."""
    count = total = 0.0
    for family in metrics.ACCEPT_BATCH.collect():
        for sample in family.samples:
            if sample.name.endswith("_count"):
                count = sample.value
            elif sample.name.endswith("_sum"):
                total = sample.value
    return count, total


def test_the_store_commits_concurrent_requests_together(
    sessions: sessionmaker[Session], settings: Settings, engine: Engine
) -> None:
    source, revoked = source_with_revoked_secret(sessions, settings)
    now = datetime.now(UTC)
    ids = [f"evt_{uuid.uuid4().hex}" for _ in range(40)]
    arrivals = [Arrival(i, i.encode()) for i in ids] + [Arrival(ids[0], ids[0].encode())]
    store = Store(
        make_settings(accept_concurrency=1), SecretBox(settings.secret_key.get_secret_value())
    )

    async def scenario() -> list[Outcome]:
        await store.open()
        try:
            return await asyncio.gather(
                *(store.accept(receipt_for(source, revoked, a, now)) for a in arrivals)
            )
        finally:
            await store.close()

    before = batch_sizes()
    outcomes = asyncio.run(scenario())
    after = batch_sizes()

    assert shape(outcomes) == [("accepted", 2)] * 40 + [("duplicate", 0)]
    assert rows_of(engine, source.id) == {"receipts": 40, "deliveries": 80, "conflicts": 0}
    statements, carried = after[0] - before[0], after[1] - before[1]
    assert carried == 41
    assert statements < 41  # grouped: fewer statements than requests


def test_one_bad_arrival_fails_alone_and_its_neighbours_commit(
    sessions: sessionmaker[Session], settings: Settings, engine: Engine
) -> None:
    source, revoked = source_with_revoked_secret(sessions, settings)
    now = datetime.now(UTC)
    good = [receipt_for(source, revoked, Arrival(f"evt_{n}", b"{}"), now) for n in range(5)]
    # expires_at years ahead: no partition holds it, so its insert fails (CheckViolation).
    bad = receipt_for(source, revoked, Arrival("evt_far", b"{}"), now)
    bad = NewReceipt(**{**bad.__dict__, "expires_at": now + timedelta(days=3650)})
    store = Store(
        make_settings(accept_concurrency=1), SecretBox(settings.secret_key.get_secret_value())
    )

    async def scenario() -> list[Outcome | BaseException]:
        await store.open()
        try:
            return await asyncio.gather(
                *(store.accept(r) for r in [*good[:2], bad, *good[2:]]), return_exceptions=True
            )
        finally:
            await store.close()

    outcomes = asyncio.run(scenario())
    assert isinstance(outcomes[2], psycopg.errors.CheckViolation)
    assert [o.status for o in outcomes if isinstance(o, Outcome)] == ["accepted"] * 5
    assert rows_of(engine, source.id) == {"receipts": 5, "deliveries": 10, "conflicts": 0}


@pytest.mark.parametrize("size", [2, 64])
def test_batch_parameters_line_up_with_positions(size: int) -> None:
    now = datetime.now(UTC)
    receipts = [
        NewReceipt(
            1, "s", f"e{n}", "t", None, now, now, bytes([n]), None, bytes([n]) * 3, timedelta(1)
        )
        for n in range(size)
    ]
    params = accept_many_params(receipts, timedelta(seconds=30))
    assert params["digests"] == [bytes([n]) for n in range(size)]
    assert params["payloads"] == [bytes([n]) * 3 for n in range(size)]
    assert '"ord":1,' in params["items"]
    assert f'"ord":{size},' in params["items"]
    with pytest.raises(RuntimeError):
        decide_many(receipts, [(1, True, 1, None, [1])])  # rows missing: refused
