"""Helpers that create sources and accept events through the receiver's own insert path.

``accept_event`` runs :func:`ingest.store.accept_sync` (the same advisory lock and the same
accept statement the HTTP receiver runs) with an injected time, so tests of workers,
operators and retention can make receipts and deliveries without HTTP.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
import psycopg
from sqlalchemy.orm import Session, sessionmaker

from core.crypto import SecretBox
from core.providers import validate_config
from core.settings import Settings
from core.ttl import derive_ttl, expires_at
from models import catalog, route_catalog
from models.accept import NewReceipt, Outcome, accept_sync
from models.schema import Source


@dataclass(frozen=True)
class MadeSource:
    id: int
    public_id: str
    name: str
    provider: str
    secret_id: str
    secret: str
    route_ids: tuple[int, ...]


def make_source(
    sessions: sessionmaker[Session],
    settings: Settings,
    *,
    provider: str = "standard",
    account: str = "default",
    name: str | None = None,
    secret: str | None = None,
    routes: list[dict[str, Any]] | None = None,
    config: dict[str, Any] | None = None,
    **source_kwargs: Any,
) -> MadeSource:
    """A source with one secret and the given routes (default: one ``log`` route for ``*``)."""
    box = SecretBox(settings.secret_key.get_secret_value())
    with sessions() as session, session.begin():
        source, created = catalog.create_source(
            session,
            box,
            settings,
            name=name or f"test-{uuid.uuid4().hex[:10]}",
            provider=provider,
            account=account,
            secret=secret,
            config=config,
            validate_config=validate_config,
            **source_kwargs,
        )
        plaintext = secret if secret is not None else created.plaintext
        assert plaintext is not None
        route_ids = []
        for spec in routes if routes is not None else [{"handler": "log"}]:
            route, _ = route_catalog.add_route(session, box, source, **spec)
            route_ids.append(route.id)
        return MadeSource(
            source.id,
            source.public_id,
            source.name,
            provider,
            created.id,
            plaintext,
            tuple(route_ids),
        )


def source_ttl(sessions: sessionmaker[Session], settings: Settings, source_id: int) -> timedelta:
    with sessions() as session:
        row = session.get(Source, source_id)
        assert row is not None
        return derive_ttl(row.provider, catalog.source_ttl_overrides(row), settings).total


def accept_event(
    settings: Settings,
    source: MadeSource,
    *,
    event_id: str | None = None,
    event_type: str = "test.event",
    body: bytes | dict[str, Any] | None = None,
    occurred_at: datetime | None = None,
    now: datetime | None = None,
    ttl: timedelta = timedelta(days=4),
    secret_id: str | None = None,
) -> tuple[str, Outcome]:
    """Accept one event through the receiver's transaction; returns (event_id, outcome)."""
    now = now or datetime.now(UTC)
    event_id = event_id or f"evt_{uuid.uuid4().hex}"
    if body is None:
        body = {"id": event_id, "type": event_type, "data": {"n": 1}}
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    receipt = NewReceipt(
        source_id=source.id,
        secret_id=secret_id or source.secret_id,
        event_id=event_id,
        event_type=event_type,
        occurred_at=occurred_at,
        expires_at=expires_at(occurred_at, now, ttl),
        ttl=ttl,
        received_at=now,
        digest=hashlib.sha256(raw).digest(),
        content_type="application/json",
        payload=raw,
    )
    with psycopg.connect(settings.psycopg_dsn, autocommit=True) as conn:
        return event_id, accept_sync(conn, receipt, settings.publish_grace)
