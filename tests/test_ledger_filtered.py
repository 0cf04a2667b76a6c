"""A delivery that ends ``filtered`` has its ledger row (code ``f``): written by the accept's
own statement when the route's filter did not match (migration 0034; the single accept and
the batch accept alike), and by the worker's ending statement when the route's transform
dropped the event (:func:`models.transitions.filter_out`). Real Postgres: the accept
functions and the guarded transitions as the receiver and the worker run them."""

from __future__ import annotations

import uuid
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from alembic import command
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core.filters import document, evaluate
from core.settings import Settings
from models import ledger_reads, transitions
from models.accept import (
    ACCEPT_MANY_SQL,
    NewReceipt,
    accept_many_params,
    accept_sync,
    decide_many,
)
from models.db import alembic_config
from models.views import STATUS_OF_CODE
from tests.conftest import TEST_DB
from tests.factories import MadeSource, make_source
from tests.retention_support import claim, own_database

NO_GRACE = timedelta(0)
MISS = "type == 'nothing.matches'"


def _receipt(source: MadeSource) -> NewReceipt:
    now = datetime.now(UTC)
    body = b'{"data": {"object": {"amount": 5}}}'
    return NewReceipt(
        source_id=source.id,
        secret_id=source.secret_id,
        event_id=f"evt_{uuid.uuid4().hex}",
        event_type="charge.succeeded",
        occurred_at=None,
        expires_at=now + timedelta(days=4),
        received_at=now,
        digest=bytes(range(32)),
        content_type="application/json",
        payload=body,
        ttl=timedelta(days=4),
    )


def _judged(receipt: NewReceipt, route: int) -> NewReceipt:
    verdict = evaluate(route, MISS, document(receipt.payload, receipt.event_type, {}))
    assert verdict.matched is False
    return replace(receipt, verdicts=(verdict,))


def _ledger(engine: Engine, event_id: str) -> list[Any]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                text(
                    "SELECT l.outcomes, l.digest, l.received_at, k.event_type, k.via"
                    " FROM ledger l JOIN ledger_kinds k ON k.id = l.kind"
                    " WHERE l.event_id = :e ORDER BY l.received_at"
                ),
                {"e": event_id},
            ).all()
        )


def _final(rows: list[Any]) -> dict[int, tuple[int, str]]:
    merged = ledger_reads.merged([r.outcomes for r in rows])
    return {route: (e.attempt, STATUS_OF_CODE[e.code]) for route, e in merged.items()}


@pytest.mark.parametrize("way", ["single", "batch"])
def test_the_accept_writes_a_ledger_row_for_a_filtered_delivery(
    sessions: sessionmaker[Session], settings: Settings, engine: Engine, way: str
) -> None:
    """The filtered route's delivery ends at the accept: its row is in the ledger at once,
    ``<route>.0f``, with the receipt's digest, time, type and way of arrival; the route that
    took the event has no entry until its work ends."""
    made = make_source(
        sessions,
        settings,
        provider="stripe",
        routes=[{"handler": "log", "filter": MISS}, {"handler": "log"}],
    )
    filtered_route, plain_route = made.route_ids
    judged = _judged(_receipt(made), filtered_route)
    with psycopg.connect(settings.psycopg_dsn, autocommit=True) as conn:
        if way == "single":
            outcome = accept_sync(conn, judged, NO_GRACE)
        else:
            rows = conn.execute(ACCEPT_MANY_SQL, accept_many_params([judged], NO_GRACE)).fetchall()
            [outcome] = decide_many([judged], rows)
    assert (outcome.status, outcome.filtered_routes) == ("accepted", (filtered_route,))
    kept = _ledger(engine, judged.event_id)
    assert len(kept) == 1
    assert kept[0].outcomes == f"{filtered_route}.0f"
    assert _final(kept) == {filtered_route: (0, "filtered")}
    assert plain_route not in _final(kept)
    assert bytes(kept[0].digest) == judged.digest[:8]
    assert (kept[0].event_type, kept[0].via) == ("charge.succeeded", "w")
    with engine.connect() as conn:
        received = conn.execute(
            text("SELECT received_at FROM receipts WHERE id = :r"), {"r": outcome.receipt_id}
        ).scalar_one()
    assert kept[0].received_at == received


def test_a_batch_writes_one_ledger_row_per_receipt_with_filtered_work_and_none_without(
    sessions: sessionmaker[Session], settings: Settings, engine: Engine
) -> None:
    """Two events in one batch statement, one filtered on both of its routes, one taken by
    both (no verdict says it did not match): one row, for the first, with both entries."""
    made = make_source(
        sessions,
        settings,
        provider="stripe",
        routes=[{"handler": "log", "filter": MISS}, {"handler": "log", "filter": MISS}],
    )
    first, second = made.route_ids
    dropped = _receipt(made)
    doc = document(dropped.payload, dropped.event_type, {})
    dropped = replace(dropped, verdicts=(evaluate(first, MISS, doc), evaluate(second, MISS, doc)))
    taken = replace(_receipt(made), received_at=dropped.received_at)  # one instant a batch
    matched = [replace(evaluate(r, MISS, doc), matched=True, reason=None) for r in (first, second)]
    taken = replace(taken, verdicts=tuple(matched))
    with psycopg.connect(settings.psycopg_dsn, autocommit=True) as conn:
        rows = conn.execute(
            ACCEPT_MANY_SQL, accept_many_params([dropped, taken], NO_GRACE)
        ).fetchall()
        outcomes = decide_many([dropped, taken], rows)
    assert [o.status for o in outcomes] == ["accepted", "accepted"]
    assert outcomes[0].filtered_routes == (first, second)
    assert len(outcomes[1].delivery_ids) == 2
    kept = _ledger(engine, dropped.event_id)
    assert len(kept) == 1
    assert _final(kept) == {first: (0, "filtered"), second: (0, "filtered")}
    assert _ledger(engine, taken.event_id) == []


def test_a_delivery_its_transform_drops_ends_with_a_ledger_row(
    sessions: sessionmaker[Session], settings: Settings, engine: Engine
) -> None:
    """The worker's ending statement for a dropped event (``filter_out``) appends its
    route's ``f`` entry at the attempt it ended, as a success or a dead letter does."""
    made = make_source(sessions, settings, routes=[{"handler": "log", "transform": "reshape"}])
    [route] = made.route_ids
    receipt = _receipt(made)
    with psycopg.connect(settings.psycopg_dsn, autocommit=True) as conn:
        outcome = accept_sync(conn, receipt, NO_GRACE)
    [delivery] = outcome.delivery_ids
    assert _ledger(engine, receipt.event_id) == []
    now = datetime.now(UTC)
    found = claim(sessions, delivery, now)
    with sessions() as session, session.begin():
        transitions.filter_out(
            session, found, now=now, reason=f"route {route}: transform reshape dropped the event"
        )
    kept = _ledger(engine, receipt.event_id)
    assert [r.outcomes for r in kept] == [f"{route}.1f"]
    assert _final(kept) == {route: (1, "filtered")}


def test_migration_0034_goes_down_and_up_again() -> None:
    """Down: the accept functions are 0028's again and a filtered delivery writes no ledger
    row (what this migration fixes); up: it does."""
    with own_database(f"{TEST_DB}_ledger_0034") as (own, own_engine, own_sessions):
        made = make_source(
            own_sessions, own, provider="stripe", routes=[{"handler": "log", "filter": MISS}]
        )
        [route] = made.route_ids
        config = alembic_config(own)
        command.downgrade(config, "0032")
        before = _judged(_receipt(made), route)
        with psycopg.connect(own.psycopg_dsn, autocommit=True) as conn:
            assert accept_sync(conn, before, NO_GRACE).filtered_routes == (route,)
        assert _ledger(own_engine, before.event_id) == []
        command.upgrade(config, "head")
        after = _judged(_receipt(made), route)
        with psycopg.connect(own.psycopg_dsn, autocommit=True) as conn:
            assert accept_sync(conn, after, NO_GRACE).filtered_routes == (route,)
        assert [r.outcomes for r in _ledger(own_engine, after.event_id)] == [f"{route}.0f"]
