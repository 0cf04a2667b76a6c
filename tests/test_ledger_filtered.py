"""A delivery that ends ``filtered`` has its ledger row (code ``f``), written once: when the
route's filter did not match, by the statement that deletes the delivery at its expiry
(retention, partition and delete mode alike; the accept itself writes none since migration
0035, issue 37's receiver floor), and when the route's transform dropped the event, by the
worker's ending statement (:func:`models.transitions.filter_out`). Real Postgres: the accept
functions, the guarded transitions and maintenance as the receiver, the worker and beat run
them; maintenance on databases of this module's own at pinned instants."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
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
from models.retention import run_maintenance
from models.views import STATUS_OF_CODE
from tests.conftest import BIN, TEST_DB
from tests.conftest import test_env as subprocess_env
from tests.factories import MadeSource, make_source
from tests.retention_support import TTL, claim, delete_mode_database, own_database

NO_GRACE = timedelta(0)
MISS = "type == 'nothing.matches'"
T = datetime(2023, 3, 15, 12, tzinfo=UTC)  # the pinned arrival of the expiry tests
SEC = timedelta(seconds=1)


def _receipt(source: MadeSource, at: datetime | None = None) -> NewReceipt:
    now = at or datetime.now(UTC)
    body = b'{"data": {"object": {"amount": 5}}}'
    return NewReceipt(
        source_id=source.id,
        secret_id=source.secret_id,
        event_id=f"evt_{uuid.uuid4().hex}",
        event_type="charge.succeeded",
        occurred_at=None,
        expires_at=now + TTL,
        received_at=now,
        digest=bytes(range(32)),
        content_type="application/json",
        payload=body,
        ttl=TTL,
    )


def _judged(receipt: NewReceipt, *missed: int, matched: tuple[int, ...] = ()) -> NewReceipt:
    """The receipt with its verdicts: ``missed`` routes' filters did not match, ``matched``
    ones' did (every filtered route of the source must have one, or the accept says stale)."""
    doc = document(receipt.payload, receipt.event_type, {})
    verdicts = tuple(evaluate(route, MISS, doc) for route in missed)
    assert all(v.matched is False for v in verdicts)
    kept = tuple(replace(evaluate(r, MISS, doc), matched=True, reason=None) for r in matched)
    return replace(receipt, verdicts=verdicts + kept)


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


def _entries(rows: list[Any], entry: str) -> int:
    """How many times ``entry`` was written, over the receipt's rows."""
    return sum(r.outcomes.split("\x1f").count(entry) for r in rows)


@pytest.mark.parametrize("way", ["single", "batch"])
def test_the_accept_writes_no_ledger_row_for_a_filtered_delivery(
    sessions: sessionmaker[Session], settings: Settings, engine: Engine, way: str
) -> None:
    """The filtered route's delivery ends at the accept (``filtered``, attempt 0), and the
    accept's statement writes nothing to the ledger (migration 0035): the row waits for the
    delivery's expiry, the delivery itself is the record until then."""
    made = make_source(
        sessions,
        settings,
        provider="stripe",
        routes=[{"handler": "log", "filter": MISS}, {"handler": "log"}],
    )
    filtered_route, _ = made.route_ids
    judged = _judged(_receipt(made), filtered_route)
    with psycopg.connect(settings.psycopg_dsn, autocommit=True) as conn:
        if way == "single":
            outcome = accept_sync(conn, judged, NO_GRACE)
        else:
            rows = conn.execute(ACCEPT_MANY_SQL, accept_many_params([judged], NO_GRACE)).fetchall()
            [outcome] = decide_many([judged], rows)
    assert (outcome.status, outcome.filtered_routes) == ("accepted", (filtered_route,))
    assert _ledger(engine, judged.event_id) == []
    with engine.connect() as conn:
        kept = conn.execute(
            text("SELECT route_id, status, attempts FROM deliveries WHERE receipt_id = :r"),
            {"r": outcome.receipt_id},
        ).all()
    assert (filtered_route, "filtered", 0) in [tuple(r) for r in kept]


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


# ------------------------------------------------------------------------------------------
# At expiry: the statement that deletes a filtered delivery appends its row
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["partition", "delete"])
def expiring(
    request: pytest.FixtureRequest,
) -> Iterator[tuple[Settings, Engine, sessionmaker[Session]]]:
    """A database of its own in each retention mode (delete mode in batches of 2, so a day's
    filtered deliveries take several statements)."""
    name = f"{TEST_DB}_ledger_f_{request.param}"
    made = own_database(name) if request.param == "partition" else delete_mode_database(name, 2)
    with made as out:
        yield out


def _events_show(settings: Settings, event_id: str) -> str:
    shown = subprocess.run(
        [str(BIN / "webhooks"), "events", "show", event_id],
        env=subprocess_env(WEBHOOKS_DATABASE_URL=settings.psycopg_dsn, COLUMNS="200"),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert shown.returncode == 0, shown.stderr
    return shown.stdout


def test_expiry_appends_each_filtered_routes_entry_once_and_events_show_lists_it(
    expiring: tuple[Settings, Engine, sessionmaker[Session]],
) -> None:
    """Three receipts at a pinned instant: one filtered by both of its routes, one filtered
    by one route and taken (then succeeded) by the other, one whose transform dropped it at
    the worker (its ``.1f`` row written then). Before expiry, only the transform's row is in
    the ledger. Maintenance past the TTL deletes them all: each filter's entry is appended
    once (a second run adds nothing), the transform's is not appended again, and
    ``events show`` finds the event in the ledger and lists the filtered route."""
    settings, engine, sessions = expiring
    made = make_source(
        sessions,
        settings,
        provider="stripe",
        routes=[
            {"handler": "log", "filter": MISS},
            {"handler": "log", "filter": MISS},
            {"handler": "log"},
            {"handler": "log", "transform": "reshape"},
        ],
    )
    first, second, plain, transform = made.route_ids
    arrived = T
    run_maintenance(engine, settings, arrived)  # its days and months laid out
    both = _judged(_receipt(made, arrived), first, second)
    one = _judged(_receipt(made, arrived), first, matched=(second,))
    plain_one = _judged(_receipt(made, arrived), matched=(first, second))
    with psycopg.connect(settings.psycopg_dsn, autocommit=True) as conn:
        outcomes = [accept_sync(conn, r, NO_GRACE) for r in (both, one, plain_one)]
    assert [o.filtered_routes for o in outcomes] == [(first, second), (first,), ()]
    assert [len(o.delivery_ids) for o in outcomes] == [2, 3, 4]
    # Every delivery that was not filtered ends: the transform drops plain_one's, the
    # others succeed (each writing its ledger row).
    with engine.connect() as conn:
        route_of = dict(
            conn.execute(
                text("SELECT id, route_id FROM deliveries WHERE source_id = :s"), {"s": made.id}
            ).all()
        )
    for outcome in outcomes:
        for d in outcome.delivery_ids:
            found = claim(sessions, d, arrived + SEC)
            with sessions() as session, session.begin():
                if outcome is outcomes[2] and route_of[d] == transform:
                    transitions.filter_out(session, found, now=arrived + SEC, reason="dropped")
                else:
                    transitions.succeed(session, found, now=arrived + SEC)
    # Before expiry: no filter's entry in the ledger, the transform's there once.
    for receipt, route in ((both, first), (both, second), (one, first)):
        assert _entries(_ledger(engine, receipt.event_id), f"{route}.0f") == 0
    assert _entries(_ledger(engine, plain_one.event_id), f"{transform}.1f") == 1

    after_ttl = arrived + TTL + timedelta(days=2)
    for _ in range(2):  # a second run finds nothing left to record
        run_maintenance(engine, settings, after_ttl)
        with engine.connect() as conn:
            left = conn.execute(
                text("SELECT count(*) FROM deliveries WHERE source_id = :s"), {"s": made.id}
            ).scalar_one()
        assert left == 0
        kept = _ledger(engine, both.event_id)
        assert _entries(kept, f"{first}.0f") == _entries(kept, f"{second}.0f") == 1
        assert _final(kept) == {
            first: (0, "filtered"),
            second: (0, "filtered"),
            plain: (1, "succeeded"),
            transform: (1, "succeeded"),
        }
        assert bytes(kept[0].digest) == both.digest[:8]
        assert kept[0].received_at == arrived
        assert (kept[0].event_type, kept[0].via) == ("charge.succeeded", "w")
        kept = _ledger(engine, one.event_id)
        assert _entries(kept, f"{first}.0f") == 1
        assert _final(kept) == {
            first: (0, "filtered"),
            **dict.fromkeys((second, plain, transform), (1, "succeeded")),
        }
        kept = _ledger(engine, plain_one.event_id)
        assert _entries(kept, f"{transform}.1f") == 1
        assert STATUS_OF_CODE[ledger_reads.merged([r.outcomes for r in kept])[transform].code] == (
            "filtered"
        )

    shown = _events_show(settings, one.event_id)
    assert "receipt expired; from the ledger" in shown
    assert f"route {first} log: filtered" in shown
    assert f"route {plain} log: succeeded" in shown


def test_migration_0035_goes_down_and_up_again() -> None:
    """Down (to 0034): the accept appends a filtered delivery's row again; up: it does not."""
    with own_database(f"{TEST_DB}_ledger_0035") as (own, own_engine, own_sessions):
        made = make_source(
            own_sessions, own, provider="stripe", routes=[{"handler": "log", "filter": MISS}]
        )
        [route] = made.route_ids
        config = alembic_config(own)
        command.downgrade(config, "0034")
        before = _judged(_receipt(made), route)
        with psycopg.connect(own.psycopg_dsn, autocommit=True) as conn:
            assert accept_sync(conn, before, NO_GRACE).filtered_routes == (route,)
        assert [r.outcomes for r in _ledger(own_engine, before.event_id)] == [f"{route}.0f"]
        command.upgrade(config, "head")
        after = _judged(_receipt(made), route)
        with psycopg.connect(own.psycopg_dsn, autocommit=True) as conn:
            assert accept_sync(conn, after, NO_GRACE).filtered_routes == (route,)
        assert _ledger(own_engine, after.event_id) == []
