"""Helpers of the lane tests (tests/test_route_lanes.py, tests/test_lane_members.py): a
source with one ordered route, and an event accepted as the receiver does."""

from __future__ import annotations

import hashlib
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
import psycopg
from sqlalchemy.orm import Session, sessionmaker

from core.filters import decide
from core.settings import Settings
from core.ttl import expires_at
from models.accept import NewReceipt, accept_sync, route_filters_sync
from tests.factories import MadeSource, make_source
from tests.workers import worker_settings


def lane_source(
    sessions: sessionmaker[Session],
    url: str,
    *,
    lane_on_dead: str = "block",
    supersede: bool = False,
    order_key: str = "body.key",
    transform: str | None = None,
    settings: Settings | None = None,
) -> MadeSource:
    """A source with one ``forward`` route ordered by ``order_key`` (and ``transform``)."""
    route: dict[str, Any] = {
        "handler": "forward",
        "options": {"url": url, "allow_private": "true"},
        "order_key": order_key,
        "lane_on_dead": lane_on_dead,
        "supersede": supersede,
    }
    if transform is not None:
        route["transform"] = transform
    return make_source(sessions, settings or worker_settings(), routes=[route])


def accept(
    settings: Settings,
    source: MadeSource,
    body: dict[str, Any],
    *,
    occurred_at: datetime | None = None,
    judged: bool = True,
    conn: psycopg.Connection[Any] | None = None,
) -> tuple[str, Any]:
    """Accept one event as the receiver does: its routes' filters and order keys judged
    first (core.filters.decide), then the accept statement (on ``conn`` if given: an
    autocommit connection; a test accepting many events shares one)."""
    if conn is None:
        with psycopg.connect(settings.psycopg_dsn, autocommit=True) as own:
            return accept(settings, source, body, occurred_at=occurred_at, judged=judged, conn=own)
    now = datetime.now(UTC)
    event_id = body.setdefault("id", f"evt_{uuid.uuid4().hex}")
    raw = orjson.dumps(body)
    verdicts = decide(route_filters_sync(conn, source.id), raw, "test.event", {}) if judged else ()
    receipt = NewReceipt(
        source_id=source.id,
        secret_id=source.secret_id,
        event_id=event_id,
        event_type="test.event",
        occurred_at=occurred_at,
        expires_at=expires_at(occurred_at, now, timedelta(days=4)),
        ttl=timedelta(days=4),
        received_at=None,
        digest=hashlib.sha256(raw).digest(),
        content_type="application/json",
        payload=raw,
        verdicts=verdicts,
    )
    return event_id, accept_sync(conn, receipt, settings.publish_grace)


def delivery_of(
    settings: Settings, outcome: Any, conn: psycopg.Connection[Any] | None = None
) -> int:
    """The one delivery of an accepted event (the accept returns it for publishing only when
    it is its lane's head)."""
    assert outcome.status == "accepted"
    if conn is None:
        with psycopg.connect(settings.psycopg_dsn, autocommit=True) as own:
            return delivery_of(settings, outcome, own)
    [(delivery_id,)] = conn.execute(
        "SELECT id FROM deliveries WHERE receipt_id = %s", (outcome.receipt_id,)
    ).fetchall()
    return int(delivery_id)
