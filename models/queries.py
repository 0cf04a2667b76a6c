"""Read-only queries for operators: operator input (ids, times, statuses), events, one event
or delivery looked up, dead letters.

Everything here is a SELECT; state changes go through :mod:`models.transitions`. Results are
plain dataclasses so the CLI and the admin API render the same facts. Payloads and secrets are
never selected for display: an event shows its size and whether retention dropped it.

Beside it: :mod:`models.event_walk` (events by a rare status), :mod:`models.delivery_history`
(a delivery's attempts and replays), :mod:`models.candidates` (what a replay would move). The
types and the pure rules are in :mod:`models.views`; the CLI's read commands run these reads
on plain psycopg (:mod:`models.reads`, held to the same answers by tests/test_cli_lazy.py), so
a change to a query here is made there too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import exists, func, select, tuple_
from sqlalchemy.orm import Session

from core.states import DeliveryStatus
from models.catalog import get_source, glob_to_like
from models.delivery_history import REMOVED_ROUTE, delivery_of_receipt, delivery_views
from models.event_walk import EVENT_COLUMNS, is_rare_status, probe_every_key, walk_by_created
from models.schema import (
    Delivery,
    Receipt,
    Route,
    Source,
)
from models.views import (
    DELIVERY_PREFIX,
    EVENT_PREFIX,
    MAX_ID,
    MAX_LIST_LIMIT,
    RECEIPT_PREFIX,
    DeadGroup,
    DeliveryDetail,
    EventDetail,
    EventFilter,
    EventSummary,
    KeyOf,
    NotFoundError,
    QueryError,
    _delivery_number_message,
    _fits,
    _window,
    check_status,
    is_number,
    parse_delivery_ref,
    parse_id,
    parse_time,
    receipt_ref,
    unsigned_type_of,
)

# Defined in models.views (no database library: the CLI's fast reads build them too),
# importable from here, where they were first defined.
__all__ = [
    "DELIVERY_PREFIX",
    "EVENT_PREFIX",
    "MAX_ID",
    "MAX_LIST_LIMIT",
    "RECEIPT_PREFIX",
    "DeadGroup",
    "DeliveryDetail",
    "EventDetail",
    "EventFilter",
    "EventSummary",
    "KeyOf",
    "NotFoundError",
    "QueryError",
    "_delivery_number_message",
    "_fits",
    "_window",
    "check_status",
    "is_number",
    "parse_delivery_ref",
    "parse_id",
    "parse_time",
    "receipt_ref",
    "unsigned_type_of",
]


def source_id_of(session: Session, ref: str | None) -> int | None:
    return None if ref is None else get_source(session, ref).id


def receipt_conditions(
    session: Session,
    source: str | None,
    event_type: str | None,
    since: datetime | None,
    until: datetime | None,
) -> list[Any]:
    _window(since, until)
    conds: list[Any] = []
    source_id = source_id_of(session, source)
    if source_id is not None:
        conds.append(Receipt.source_id == source_id)
    if event_type is not None:
        conds.append(Receipt.event_type.like(glob_to_like(event_type), escape="\\"))
    if since is not None:
        conds.append(Receipt.received_at >= since)
    if until is not None:
        conds.append(Receipt.received_at < until)
    return conds


def list_events(session: Session, flt: EventFilter) -> list[EventSummary]:
    """Newest first."""
    check_status(flt.status)
    if not 1 <= flt.limit <= MAX_LIST_LIMIT:
        raise QueryError(f"--limit must be between 1 and {MAX_LIST_LIMIT}")
    conds = receipt_conditions(session, flt.source, flt.event_type, flt.since, flt.until)
    if flt.before is not None:
        conds.append(tuple_(Receipt.received_at, Receipt.id) < tuple_(*flt.before))
    rows: list[Any]
    source_id = None if flt.status is None else source_id_of(session, flt.source)
    if flt.status is not None and is_rare_status(session, flt.status, source_id):
        if source_id is not None and flt.status == DeliveryStatus.DEAD:
            rows = walk_by_created(session, source_id, conds, flt.limit, flt.since)
        else:
            rows = probe_every_key(session, flt.status, source_id, conds, flt.limit)
    else:
        if flt.status is not None:
            conds.append(exists().where(delivery_of_receipt(), Delivery.status == flt.status))
        found = select(*EVENT_COLUMNS).where(*conds).subquery()
        query = (
            select(found, Source.public_id, Source.name)
            .select_from(found.join(Source, Source.id == found.c.source_id))
            .order_by(found.c.received_at.desc(), found.c.id.desc())
            .limit(flt.limit)
        )
        rows = list(session.execute(query).all())
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


def _receipt_query() -> Any:
    return (
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
            Receipt.source_id,
            Receipt.arrived_via,
            Source.config,
        )
        .join(Source, Source.id == Receipt.source_id)
        .order_by(Receipt.received_at.desc())
    )


def _exists(session: Session, column: Any, value: Any) -> bool:
    return session.scalars(select(column).where(column == value).limit(1)).first() is not None


def _by_event_id(session: Session, event_id: str, source: str | None) -> list[Any]:
    """The newest receipt of this provider event id per source (older ones expired)."""
    query = _receipt_query().where(Receipt.event_id == event_id)
    if source is not None:
        query = query.where(Receipt.source_id == get_source(session, source).id)
    newest: dict[int, Any] = {}
    for row in session.execute(query.limit(50)).all():
        newest.setdefault(row.source_id, row)
    return list(newest.values())


def _find_receipt(session: Session, ref: str | int, source: str | None) -> Any:
    """The receipt an operator means; refuses a bare number that could mean something else.

    ``receipt:12`` is a receipt id, ``delivery:11`` the event of that delivery, ``event:X`` a
    provider event id; a bare number is a receipt id only when it is no delivery id (and no
    provider event id), since Flower, the logs and ``dead list`` show delivery ids."""
    key = str(ref).strip()
    receipt_id: int | None = None
    event_id: str | None = None
    if key.startswith(RECEIPT_PREFIX) and key[len(RECEIPT_PREFIX) :].isdigit():
        receipt_id = parse_id(key[len(RECEIPT_PREFIX) :], "receipt id")
    elif key.startswith(DELIVERY_PREFIX) and key[len(DELIVERY_PREFIX) :].isdigit():
        delivery_id = parse_id(key[len(DELIVERY_PREFIX) :], "delivery id")
        receipt_id = session.scalars(
            select(Delivery.receipt_id).where(Delivery.id == delivery_id).limit(1)
        ).first()
        if receipt_id is None:
            raise NotFoundError(f"no such delivery: {delivery_id}")
    elif key.startswith(EVENT_PREFIX):
        event_id = key[len(EVENT_PREFIX) :]
    elif is_number(key) and _fits(key):  # a larger number is a provider event id
        number = int(key)
        is_receipt = _exists(session, Receipt.id, number)
        is_delivery = _exists(session, Delivery.id, number)
        is_event = _exists(session, Receipt.event_id, key)
        if is_delivery:
            raise QueryError(
                _delivery_number_message(number, is_receipt or is_event), "ambiguous_id"
            )
        if is_receipt and is_event:
            raise QueryError(
                f"{number} is both receipt {number} and a provider event id: use "
                f"{RECEIPT_PREFIX}{number} or {EVENT_PREFIX}{number}",
                "ambiguous_id",
            )
        if is_receipt:
            receipt_id = number
        else:
            event_id = key
    else:
        event_id = key
    if receipt_id is not None:
        if source is not None:
            raise QueryError("--source goes with a provider event id, not a receipt id")
        rows = session.execute(_receipt_query().where(Receipt.id == receipt_id).limit(1)).all()
    else:
        assert event_id is not None
        rows = _by_event_id(session, event_id, source)
        if len(rows) > 1:
            names = ", ".join(sorted(r.public_id for r in rows))
            raise QueryError(
                f"event id {event_id!r} exists in several sources ({names}); add --source, "
                f"or use the receipt id ({', '.join(receipt_ref(r.id) for r in rows)})",
                "ambiguous_id",
            )
    if not rows:
        raise NotFoundError(f"no such event: {key!r}")
    return rows[0]


def get_event(session: Session, ref: str | int, *, source: str | None = None) -> EventDetail:
    """One receipt with its deliveries, by ``receipt:N``, ``delivery:N``, ``event:X``, a
    provider event id (``source`` narrows it), or a bare receipt number that is no delivery
    id (:func:`_find_receipt` refuses an ambiguous one)."""
    r = _find_receipt(session, ref, source)
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
        deliveries=delivery_views(session, r),
        arrived_via=r.arrived_via,
        type_unsigned=unsigned_type_of(r.provider, r.config, r.event_type, r.arrived_via),
    )


def get_delivery(
    session: Session, ref: str | int, *, key_of: KeyOf | None = None
) -> DeliveryDetail:
    """By delivery id (``11`` or ``delivery:11``)."""
    delivery_id = parse_delivery_ref(ref)
    found = session.execute(
        select(Delivery.receipt_id, Delivery.expires_at).where(Delivery.id == delivery_id).limit(1)
    ).first()
    if found is None:
        hint = ""
        if _exists(session, Receipt.id, delivery_id):
            ref = receipt_ref(delivery_id)
            hint = f" ({ref} is an event: webhooks events show {ref})"
        raise NotFoundError(f"no such delivery: {delivery_id}{hint}")
    r = session.execute(
        _receipt_query()
        .where(Receipt.id == found.receipt_id, Receipt.expires_at == found.expires_at)
        .limit(1)
    ).one()
    [view] = delivery_views(session, r, only=delivery_id)
    route = session.get(Route, view.route_id)
    key = (
        key_of(r.source_id, r.event_id, view.route_id, view.generation)
        if key_of is not None
        else None
    )
    return DeliveryDetail(
        id=view.id,
        receipt=receipt_ref(r.id),
        receipt_id=r.id,
        source=r.public_id,
        source_name=r.name,
        provider=r.provider,
        event_id=r.event_id,
        event_type=r.event_type,
        received_at=r.received_at,
        route_events=None if route is None else route.events_glob,
        route_active=None if route is None else route.active,
        idempotency_key=key,
        delivery=view,
    )


def dead_letters(
    session: Session, *, source: str | None = None, samples: int = 5
) -> list[DeadGroup]:
    """Dead deliveries grouped by source, route and reason; largest groups first."""
    conds: list[Any] = [Delivery.status == DeliveryStatus.DEAD]
    source_id = source_id_of(session, source)
    if source_id is not None:
        conds.append(Delivery.source_id == source_id)
    ids = func.array_agg(func.distinct(Delivery.id))
    handler = func.coalesce(Route.handler, REMOVED_ROUTE)
    rows = session.execute(
        select(
            Source.public_id,
            Source.name,
            Delivery.route_id,
            handler,
            Delivery.dead_reason,
            func.count(),
            func.min(Delivery.updated_at),
            func.max(Delivery.updated_at),
            func.array_remove(func.array_agg(func.distinct(Delivery.last_error_class)), None),
            ids,
        )
        .join(Source, Source.id == Delivery.source_id)
        .outerjoin(Route, Route.id == Delivery.route_id)
        .where(*conds)
        .group_by(Source.public_id, Source.name, Delivery.route_id, handler, Delivery.dead_reason)
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
            func.coalesce(Route.handler, REMOVED_ROUTE),
            Delivery.status,
            Delivery.attempts,
            Delivery.generation,
        )
        .join(Delivery, delivery_of_receipt())
        .outerjoin(Route, Route.id == Delivery.route_id)
        .where(Receipt.source_id == source_id, Receipt.event_id.in_(list(event_ids)))
        .order_by(Receipt.received_at, Delivery.id)
    ).all()
    return [DeliveryState(*row) for row in rows]
