"""Reading the processed-events ledger (:mod:`models.ledger`): an event whose receipt expired,
as ``webhooks events show``, the admin API and the console find it. Read-only."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

from models import queries
from models.delivery_history import REMOVED_ROUTE
from models.ledger import STATUS_OF_CODE
from models.queries import EventDetail

# The ledger's one-byte `via` (models/ledger.py) as receipts name it.
ARRIVED_VIA_OF = {"w": "webhook", "r": "reconcile", "t": "test"}

# Why an event shown from the ledger is not shown from its receipt.
FROM_LEDGER = "receipt expired; from the ledger"


@dataclass(frozen=True)
class LedgerOutcome:
    """One route's final outcome, as the ledger recorded it."""

    route_id: int
    handler: str  # REMOVED_ROUTE once the route is gone
    status: str  # succeeded | dead | discarded
    result_ref: str | None = None  # a success's result reference
    dead_reason: str | None = None


@dataclass(frozen=True)
class LedgerEntry:
    """One receipt of an event, from the ledger."""

    source: str
    source_name: str
    provider: str
    event_id: str
    event_type: str
    received_at: datetime
    digest: str | None  # hex, the first 8 bytes of the body's SHA-256; None when reconciled
    arrived_via: str  # webhook | reconcile
    outcomes: list[LedgerOutcome] = field(default_factory=list)


@dataclass(frozen=True)
class LedgerEvent:
    """An event whose receipt is gone, as the ledger keeps it: every receipt of it the ledger
    holds (a redelivery after the TTL was new work, with a row of its own), newest first."""

    source: str
    event_id: str
    runs: list[LedgerEntry]
    note: str = FROM_LEDGER
    found_in: str = "ledger"


# Every source's probe of the unique index (sources are few): the hash is seeded with the
# source, so an event id alone names one key per source.
_FIND = text(
    """
    SELECT l.received_at, s.public_id, s.name, s.provider, l.event_id, l.event_type,
           l.digest, l.outcomes, l.via
    FROM sources s
    JOIN ledger l ON hashtextextended(l.event_id, l.source_id) = hashtextextended(:e, s.id)
                 AND l.source_id = s.id AND l.event_id = :e
    WHERE CAST(:s AS bigint) IS NULL OR s.id = :s
    ORDER BY l.received_at DESC, s.public_id
    LIMIT 50
    """
)


def find(session: Session, event_id: str, source_id: int | None = None) -> list[LedgerEntry]:
    """The ledger's rows of this event id (of one source, or of every source), newest first."""
    rows = session.execute(_FIND, {"e": event_id, "s": source_id}).all()
    route_ids = {int(k) for r in rows for k in r.outcomes}
    handlers = _handlers(session, route_ids)
    return [
        LedgerEntry(
            source=r.public_id,
            source_name=r.name,
            provider=r.provider,
            event_id=r.event_id,
            event_type=r.event_type,
            received_at=r.received_at,
            digest=None if r.digest is None else bytes(r.digest).hex(),
            arrived_via=ARRIVED_VIA_OF.get(str(r.via), "webhook"),
            outcomes=_outcomes(r.outcomes, handlers),
        )
        for r in rows
    ]


def _handlers(session: Session, route_ids: set[int]) -> dict[int, str]:
    if not route_ids:
        return {}
    rows = session.execute(
        text("SELECT id, handler FROM routes WHERE id = ANY(CAST(:ids AS bigint[]))"),
        {"ids": sorted(route_ids)},
    ).all()
    return {int(r[0]): str(r[1]) for r in rows}


def _outcomes(stored: dict[str, Any], handlers: dict[int, str]) -> list[LedgerOutcome]:
    out = []
    for key, value in sorted(stored.items(), key=lambda kv: int(kv[0])):
        route_id, code, detail = int(key), str(value)[:1], str(value)[2:] or None
        status = STATUS_OF_CODE.get(code, code)
        out.append(
            LedgerOutcome(
                route_id,
                handlers.get(route_id, REMOVED_ROUTE),
                status,
                result_ref=detail if code == "s" else None,
                dead_reason=detail if code == "d" else None,
            )
        )
    return out


def _event_id_of(ref: str | int) -> str | None:
    """The provider event id an operator's reference names (None: a receipt or delivery id,
    which the ledger does not keep)."""
    key = str(ref).strip()
    for prefix in (queries.RECEIPT_PREFIX, queries.DELIVERY_PREFIX):
        if key.startswith(prefix) and key[len(prefix) :].isdigit():
            return None
    return key.removeprefix(queries.EVENT_PREFIX)


def get_event(
    session: Session, ref: str | int, *, source: str | None = None
) -> EventDetail | LedgerEvent:
    """The event as :func:`models.queries.get_event` finds it while its receipt lives; once
    the receipt is gone (expired at its dedup TTL), what the ledger kept of it, said so
    (:data:`FROM_LEDGER`). NotFoundError when neither has it."""
    try:
        return queries.get_event(session, ref, source=source)
    except queries.NotFoundError:
        event_id = _event_id_of(ref)
        if not event_id:
            raise
        runs = find(session, event_id, queries.source_id_of(session, source))
        if not runs:
            raise
        sources = sorted({r.source for r in runs})
        if len(sources) > 1:
            raise queries.QueryError(
                f"event id {event_id!r} is in the ledger of several sources "
                f"({', '.join(sources)}); add --source",
                "ambiguous_id",
            ) from None
        return LedgerEvent(source=sources[0], event_id=event_id, runs=runs)
