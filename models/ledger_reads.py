"""Reading the processed-events ledger (:mod:`models.ledger`): an event whose receipt expired,
as ``webhooks events show``, the admin API and the console find it. Read-only."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

from models import queries
from models.delivery_history import REMOVED_ROUTE
from models.ledger import SEP, STATUS_OF_CODE
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
# The runs shown, at most (the newest).
MAX_RUNS = 50

_ENTRY = re.compile(r"(\d+)\.(\d+)([a-z])(?::(.*))?", re.DOTALL)
# Of two entries of one route at the same attempt, the later decision: an operator discards a
# dead letter (d, then x); a success and a dead letter never end one attempt together.
_LATER = {"d": 0, "s": 1, "x": 2}


@dataclass(frozen=True)
class Entry:
    """One route's outcome as one ledger row wrote it."""

    route_id: int
    attempt: int
    code: str  # s | d | x
    detail: str | None  # the result reference or the dead reason


def entries(outcomes: str) -> list[Entry]:
    """A ledger row's entries (models/ledger.py); one that does not parse is left out."""
    out = []
    for part in outcomes.split(SEP):
        found = _ENTRY.fullmatch(part)
        if found:
            route, attempt, code, detail = found.groups()
            out.append(Entry(int(route), int(attempt), code, detail or None))
    return out


def merged(rows_outcomes: list[str]) -> dict[int, Entry]:
    """Each route's final entry across a receipt's rows: the highest attempt's (pure)."""
    final: dict[int, Entry] = {}
    for outcomes in rows_outcomes:
        for entry in entries(outcomes):
            seen = final.get(entry.route_id)
            if seen is None or (entry.attempt, _LATER.get(entry.code, -1)) > (
                seen.attempt,
                _LATER.get(seen.code, -1),
            ):
                final[entry.route_id] = entry
    return final


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


def _outcomes(final: dict[int, Entry], handlers: dict[int, str]) -> list[LedgerOutcome]:
    return [
        LedgerOutcome(
            e.route_id,
            handlers.get(e.route_id, REMOVED_ROUTE),
            STATUS_OF_CODE.get(e.code, e.code),
            result_ref=e.detail if e.code == "s" else None,
            dead_reason=e.detail if e.code == "d" else None,
        )
        for e in sorted(final.values(), key=lambda e: e.route_id)
    ]


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
