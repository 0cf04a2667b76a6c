"""Read-only queries for operators: events, dead letters, replay candidates.

Everything here is a SELECT; state changes go through :mod:`models.transitions`. Results are
plain dataclasses so the CLI and the admin API render the same facts. Payloads and secrets are
never selected for display: an event shows its size and whether retention dropped it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import and_, exists, func, select
from sqlalchemy.orm import Session

from models.catalog import get_source, glob_to_like
from models.schema import DELIVERY_STATES, Attempt, Delivery, Receipt, Route, Source
from webhooks.durations import DurationError, parse_duration

REPLAYABLE_STATES = ("dead", "succeeded")
MAX_LIST_LIMIT = 1000


class QueryError(ValueError):
    """Bad operator input (unknown status, unparseable time, ...); nothing was read."""

    def __init__(self, message: str, reason: str = "bad_query") -> None:
        super().__init__(message)
        self.reason = reason


class NotFoundError(QueryError):
    def __init__(self, message: str) -> None:
        super().__init__(message, "not_found")


def parse_time(text: str, *, now: datetime) -> datetime:
    """``2026-05-01T10:00``, ``2026-05-01`` (UTC when no offset) or a duration ago (``2h``)."""
    value = text.strip()
    try:
        return now - parse_duration(value)
    except DurationError:
        pass
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise QueryError(
            f"not a time: {text!r} (use an ISO time such as 2026-05-01T10:00Z, "
            "or 2h for two hours ago)"
        ) from None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


def check_status(status: str | None, allowed: Sequence[str] = DELIVERY_STATES) -> None:
    if status is not None and status not in allowed:
        raise QueryError(f"unknown status {status!r}; one of {', '.join(allowed)}")


def _window(since: datetime | None, until: datetime | None) -> None:
    if since is not None and until is not None and since >= until:
        raise QueryError("--since must be before --until")


@dataclass(frozen=True)
class EventFilter:
    source: str | None = None  # public id or unambiguous name
    event_type: str | None = None  # glob: invoice.*
    status: str | None = None  # events having at least one delivery in this state
    since: datetime | None = None  # received_at >= since
    until: datetime | None = None  # received_at < until
    limit: int = 50


@dataclass(frozen=True)
class EventSummary:
    """One received event and how many of its deliveries are in each state."""

    id: int
    source: str
    source_name: str
    event_id: str
    event_type: str
    received_at: datetime
    occurred_at: datetime | None
    deliveries: dict[str, int]  # status -> count
    payload_dropped: bool


@dataclass(frozen=True)
class AttemptView:
    """One try of a delivery: who ran it, when, and how it ended."""

    number: int
    generation: int
    worker: str | None
    started_at: datetime
    ended_at: datetime | None
    outcome: str | None
    error_class: str | None
    error: str | None


@dataclass(frozen=True)
class DeliveryView:
    """One (event, route) unit of work with its attempts."""

    id: int
    route_id: int
    handler: str
    status: str
    attempts: int
    generation: int
    dead_reason: str | None
    last_error_class: str | None
    last_error: str | None
    next_attempt_at: datetime | None  # None once finished
    created_at: datetime
    updated_at: datetime
    succeeded_at: datetime | None
    attempt_log: list[AttemptView] = field(default_factory=list)


@dataclass(frozen=True)
class EventDetail:
    """A receipt with its deliveries and attempts; the payload's size, never its content."""

    id: int
    source: str
    source_name: str
    provider: str
    event_id: str
    event_type: str
    occurred_at: datetime | None
    received_at: datetime
    expires_at: datetime
    content_type: str | None
    payload_bytes: int | None
    payload_dropped_at: datetime | None
    deliveries: list[DeliveryView]


@dataclass(frozen=True)
class DeadGroup:
    """Dead deliveries of one source, route and reason."""

    source: str
    source_name: str
    route_id: int
    handler: str
    reason: str | None
    count: int
    oldest: datetime
    newest: datetime
    error_classes: list[str]
    sample_ids: list[int]  # newest first, for `webhooks replay ID ...`


@dataclass(frozen=True)
class ReplayFilter:
    source: str | None = None
    event_type: str | None = None
    status: str = "dead"
    since: datetime | None = None
    until: datetime | None = None


@dataclass(frozen=True)
class Candidate:
    """A delivery a replay would move, as planned."""

    delivery_id: int
    receipt_id: int
    source: str
    event_id: str
    event_type: str
    handler: str
    status: str
    generation: int
    dead_reason: str | None
    received_at: datetime
    has_payload: bool


def _source_id(session: Session, ref: str | None) -> int | None:
    return None if ref is None else get_source(session, ref).id


def _receipt_conditions(
    session: Session,
    source: str | None,
    event_type: str | None,
    since: datetime | None,
    until: datetime | None,
) -> list[Any]:
    _window(since, until)
    conds: list[Any] = []
    source_id = _source_id(session, source)
    if source_id is not None:
        conds.append(Receipt.source_id == source_id)
    if event_type is not None:
        conds.append(Receipt.event_type.like(glob_to_like(event_type), escape="\\"))
    if since is not None:
        conds.append(Receipt.received_at >= since)
    if until is not None:
        conds.append(Receipt.received_at < until)
    return conds


def _delivery_of_receipt() -> Any:
    return and_(Delivery.receipt_id == Receipt.id, Delivery.expires_at == Receipt.expires_at)


def list_events(session: Session, flt: EventFilter) -> list[EventSummary]:
    """Newest first."""
    check_status(flt.status)
    if not 1 <= flt.limit <= MAX_LIST_LIMIT:
        raise QueryError(f"--limit must be between 1 and {MAX_LIST_LIMIT}")
    conds = _receipt_conditions(session, flt.source, flt.event_type, flt.since, flt.until)
    if flt.status is not None:
        conds.append(exists().where(_delivery_of_receipt(), Delivery.status == flt.status))
    rows = session.execute(
        select(
            Receipt.id,
            Receipt.expires_at,
            Source.public_id,
            Source.name,
            Receipt.event_id,
            Receipt.event_type,
            Receipt.received_at,
            Receipt.occurred_at,
            Receipt.payload_dropped_at,
        )
        .join(Source, Source.id == Receipt.source_id)
        .where(*conds)
        .order_by(Receipt.received_at.desc(), Receipt.id.desc())
        .limit(flt.limit)
    ).all()
    counts: dict[int, dict[str, int]] = {r.id: {} for r in rows}
    if rows:
        keys = [(r.id, r.expires_at) for r in rows]
        for receipt_id, status, n in session.execute(
            select(Delivery.receipt_id, Delivery.status, func.count())
            .where(func.row(Delivery.receipt_id, Delivery.expires_at).in_(keys))
            .group_by(Delivery.receipt_id, Delivery.status)
        ).all():
            counts[receipt_id][status] = n
    return [
        EventSummary(
            id=r.id,
            source=r.public_id,
            source_name=r.name,
            event_id=r.event_id,
            event_type=r.event_type,
            received_at=r.received_at,
            occurred_at=r.occurred_at,
            deliveries=counts[r.id],
            payload_dropped=r.payload_dropped_at is not None,
        )
        for r in rows
    ]


def get_event(session: Session, ref: str | int) -> EventDetail:
    """By receipt id (a number) or by the provider's event id when only one source has it."""
    query = (
        select(
            Receipt.id,
            Receipt.expires_at,
            Source.public_id,
            Source.name,
            Source.provider,
            Receipt.event_id,
            Receipt.event_type,
            Receipt.occurred_at,
            Receipt.received_at,
            Receipt.content_type,
            func.octet_length(Receipt.payload).label("payload_bytes"),
            Receipt.payload_dropped_at,
        )
        .join(Source, Source.id == Receipt.source_id)
        .order_by(Receipt.received_at.desc())
        .limit(2)
    )
    key = str(ref).strip()
    if key.isdigit():
        rows = session.execute(query.where(Receipt.id == int(key))).all()
    else:
        rows = session.execute(query.where(Receipt.event_id == key)).all()
        if len(rows) > 1:
            raise QueryError(f"event id {key!r} exists in several sources; use the receipt number")
    if not rows:
        raise NotFoundError(f"no such event: {key!r}")
    r = rows[0]
    deliveries = session.execute(
        select(Delivery, Route.handler)
        .join(Route, Route.id == Delivery.route_id)
        .where(Delivery.receipt_id == r.id, Delivery.expires_at == r.expires_at)
        .order_by(Delivery.id)
    ).all()
    attempts: dict[int, list[AttemptView]] = {d.id: [] for d, _ in deliveries}
    if deliveries:
        for a in session.scalars(
            select(Attempt)
            .where(
                Attempt.delivery_id.in_(list(attempts)),
                Attempt.expires_at == r.expires_at,
            )
            .order_by(Attempt.delivery_id, Attempt.generation, Attempt.number, Attempt.id)
        ):
            attempts[a.delivery_id].append(
                AttemptView(
                    a.number,
                    a.generation,
                    a.worker,
                    a.started_at,
                    a.ended_at,
                    a.outcome,
                    a.error_class,
                    a.error_message,
                )
            )
    return EventDetail(
        id=r.id,
        source=r.public_id,
        source_name=r.name,
        provider=r.provider,
        event_id=r.event_id,
        event_type=r.event_type,
        occurred_at=r.occurred_at,
        received_at=r.received_at,
        expires_at=r.expires_at,
        content_type=r.content_type,
        payload_bytes=r.payload_bytes,
        payload_dropped_at=r.payload_dropped_at,
        deliveries=[
            DeliveryView(
                id=d.id,
                route_id=d.route_id,
                handler=handler,
                status=d.status,
                attempts=d.attempts,
                generation=d.generation,
                dead_reason=d.dead_reason,
                last_error_class=d.last_error_class,
                last_error=d.last_error,
                next_attempt_at=d.next_attempt_at,
                created_at=d.created_at,
                updated_at=d.updated_at,
                succeeded_at=d.succeeded_at,
                attempt_log=attempts[d.id],
            )
            for d, handler in deliveries
        ],
    )


def dead_letters(
    session: Session, *, source: str | None = None, samples: int = 5
) -> list[DeadGroup]:
    """Dead deliveries grouped by source, route and reason; largest groups first."""
    conds: list[Any] = [Delivery.status == "dead"]
    source_id = _source_id(session, source)
    if source_id is not None:
        conds.append(Delivery.source_id == source_id)
    ids = func.array_agg(func.distinct(Delivery.id))
    rows = session.execute(
        select(
            Source.public_id,
            Source.name,
            Delivery.route_id,
            Route.handler,
            Delivery.dead_reason,
            func.count(),
            func.min(Delivery.updated_at),
            func.max(Delivery.updated_at),
            func.array_remove(func.array_agg(func.distinct(Delivery.last_error_class)), None),
            ids,
        )
        .join(Source, Source.id == Delivery.source_id)
        .join(Route, Route.id == Delivery.route_id)
        .where(*conds)
        .group_by(
            Source.public_id, Source.name, Delivery.route_id, Route.handler, Delivery.dead_reason
        )
        .order_by(func.count().desc(), Source.public_id, Delivery.route_id)
    ).all()
    return [
        DeadGroup(
            source=r[0],
            source_name=r[1],
            route_id=r[2],
            handler=r[3],
            reason=r[4],
            count=r[5],
            oldest=r[6],
            newest=r[7],
            error_classes=sorted(r[8] or []),
            sample_ids=sorted(r[9] or [], reverse=True)[:samples],
        )
        for r in rows
    ]


def _candidate_query() -> Any:
    return (
        select(
            Delivery.id,
            Delivery.receipt_id,
            Source.public_id,
            Receipt.event_id,
            Receipt.event_type,
            Route.handler,
            Delivery.status,
            Delivery.generation,
            Delivery.dead_reason,
            Receipt.received_at,
            Receipt.payload.is_not(None),
        )
        .join(Receipt, _delivery_of_receipt())
        .join(Source, Source.id == Delivery.source_id)
        .join(Route, Route.id == Delivery.route_id)
        .order_by(Delivery.id)
    )


def candidates_by_filter(session: Session, flt: ReplayFilter, *, limit: int) -> list[Candidate]:
    """Deliveries in ``flt.status`` whose event matches the filter, oldest id first.

    ``since`` and ``until`` bound the event's arrival (received_at), as in ``events list``.
    At most ``limit`` rows; the caller asks for one more than it accepts to detect overflow.
    """
    check_status(flt.status, REPLAYABLE_STATES)
    conds = _receipt_conditions(session, flt.source, flt.event_type, flt.since, flt.until)
    rows = session.execute(
        _candidate_query().where(Delivery.status == flt.status, *conds).limit(limit)
    ).all()
    return [Candidate(*row) for row in rows]


def candidates_by_ids(session: Session, ids: Sequence[int]) -> list[Candidate]:
    """The named deliveries in any state; raises NotFoundError naming the missing ones."""
    wanted = sorted(set(ids))
    rows = session.execute(_candidate_query().where(Delivery.id.in_(wanted))).all()
    found = [Candidate(*row) for row in rows]
    missing = sorted(set(wanted) - {c.delivery_id for c in found})
    if missing:
        raise NotFoundError("no such delivery: " + ", ".join(str(i) for i in missing))
    return found


def current_status(session: Session, delivery_id: int) -> str | None:
    return session.scalars(select(Delivery.status).where(Delivery.id == delivery_id)).first()


def payload_present(session: Session, receipt_id: int) -> tuple[bool, datetime | None]:
    """(payload still stored, when retention dropped it)."""
    row = session.execute(
        select(Receipt.payload.is_not(None), Receipt.payload_dropped_at).where(
            Receipt.id == receipt_id
        )
    ).first()
    if row is None:
        return False, None
    return bool(row[0]), row[1]


@dataclass(frozen=True)
class DeliveryState:
    """Where one delivery of a watched event stands (the demo's live view)."""

    event_id: str
    event_type: str
    delivery_id: int
    handler: str
    status: str
    attempts: int
    generation: int


def deliveries_of(session: Session, source: str, event_ids: Sequence[str]) -> list[DeliveryState]:
    """The deliveries of the given events of one source, in event order."""
    source_id = get_source(session, source).id
    rows = session.execute(
        select(
            Receipt.event_id,
            Receipt.event_type,
            Delivery.id,
            Route.handler,
            Delivery.status,
            Delivery.attempts,
            Delivery.generation,
        )
        .join(Delivery, _delivery_of_receipt())
        .join(Route, Route.id == Delivery.route_id)
        .where(Receipt.source_id == source_id, Receipt.event_id.in_(list(event_ids)))
        .order_by(Receipt.received_at, Delivery.id)
    ).all()
    return [DeliveryState(*row) for row in rows]
