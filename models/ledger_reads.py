"""Reading the processed-events ledger (:mod:`models.ledger`): an event whose receipt expired,
as ``webhooks events show``, the admin API and the console find it. Read-only."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

from models import queries
from models.queries import EventDetail
from models.views import (
    ARRIVED_VIA_OF,
    FROM_LEDGER,
    MAX_RUNS,
    Entry,
    LedgerEntry,
    LedgerEvent,
    LedgerOutcome,
    _event_id_of,
    _outcomes,
    entries,
    merged,
)

# Defined in models.views (no database library: the CLI's fast reads build them too),
# importable from here, where they were first defined.
__all__ = [
    "ARRIVED_VIA_OF",
    "FROM_LEDGER",
    "MAX_RUNS",
    "Entry",
    "LedgerEntry",
    "LedgerEvent",
    "LedgerOutcome",
    "_event_id_of",
    "_outcomes",
    "entries",
    "merged",
]


# The event id's rows, by the index on its hash; the kind names the source (and the type).
_FIND = text(
    """
    SELECT l.received_at, s.public_id, s.name, s.provider, l.event_id, k.event_type,
           l.digest, l.outcomes, k.via
    FROM ledger l
    JOIN ledger_kinds k ON k.id = l.kind
    JOIN sources s ON s.id = k.source_id
    WHERE hashtextextended(l.event_id, 0) = hashtextextended(:e, 0) AND l.event_id = :e
      AND (CAST(:s AS bigint) IS NULL OR k.source_id = :s)
    ORDER BY l.received_at DESC, s.public_id
    LIMIT 500
    """
)


def find(session: Session, event_id: str, source_id: int | None = None) -> list[LedgerEntry]:
    """The ledger's receipts of this event id (of one source, or of every source), newest
    first, each with its rows merged."""
    receipts: dict[tuple[str, datetime], list[Any]] = {}
    for r in session.execute(_FIND, {"e": event_id, "s": source_id}).all():
        receipts.setdefault((r.public_id, r.received_at), []).append(r)
    runs = list(receipts.values())[:MAX_RUNS]
    finals = [merged([r.outcomes for r in rows]) for rows in runs]
    handlers = _handlers(session, {route for final in finals for route in final})
    return [
        LedgerEntry(
            source=rows[0].public_id,
            source_name=rows[0].name,
            provider=rows[0].provider,
            event_id=rows[0].event_id,
            event_type=rows[0].event_type,
            received_at=rows[0].received_at,
            digest=None if rows[0].digest is None else bytes(rows[0].digest).hex(),
            arrived_via=ARRIVED_VIA_OF.get(str(rows[0].via), "webhook"),
            outcomes=_outcomes(final, handlers),
        )
        for rows, final in zip(runs, finals, strict=True)
    ]


def _handlers(session: Session, route_ids: set[int]) -> dict[int, str]:
    if not route_ids:
        return {}
    rows = session.execute(
        text("SELECT id, handler FROM routes WHERE id = ANY(CAST(:ids AS bigint[]))"),
        {"ids": sorted(route_ids)},
    ).all()
    return {int(r[0]): str(r[1]) for r in rows}


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
