"""Read-only queries for operators: operator input (ids, times, statuses), events, one event
or delivery looked up, dead letters.

Everything here is a SELECT; state changes go through :mod:`models.transitions`. Results are
plain dataclasses so the CLI and the admin API render the same facts. Payloads and secrets are
never selected for display: an event shows its size and whether retention dropped it.

Beside it: :mod:`models.event_walk` (events by a rare status), :mod:`models.delivery_history`
(a delivery's attempts and replays), :mod:`models.candidates` (what a replay would move).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import exists, func, select, tuple_
from sqlalchemy.orm import Session

from core.durations import DurationError, parse_duration
from core.errors import WebhooksError
from core.providers import registry
from core.states import DeliveryStatus
from models.catalog import get_source, glob_to_like
from models.delivery_history import REMOVED_ROUTE, DeliveryView, delivery_of_receipt, delivery_views
from models.event_walk import EVENT_COLUMNS, is_rare_status, probe_every_key, walk_by_created
from models.schema import (
    Delivery,
    Receipt,
    Route,
    Source,
)

MAX_LIST_LIMIT = 1000
# Operators' unambiguous id forms: ``receipt:12``, ``delivery:11``, ``event:evt_1``.
RECEIPT_PREFIX = "receipt:"
DELIVERY_PREFIX = "delivery:"
EVENT_PREFIX = "event:"
# Ids are Postgres bigints: a number beyond this is refused before it reaches a query.
MAX_ID = 2**63 - 1


def receipt_ref(receipt_id: int) -> str:
    """How a receipt id is printed: a bare number could also be a delivery id."""
    return f"{RECEIPT_PREFIX}{receipt_id}"


class QueryError(WebhooksError, ValueError):
    """Bad operator input (unknown status, unparseable time, ...); nothing was read."""

    def __init__(self, message: str, reason: str = "bad_query") -> None:
        super().__init__(message)
        self.reason = reason


class NotFoundError(QueryError):
    """The id, event or delivery asked for does not exist (``reason`` ``not_found``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "not_found")


def is_number(text: str) -> bool:
    """ASCII digits only (``str.isdigit`` also accepts ``²`` and other scripts' digits)."""
    return text.isascii() and text.isdigit()


def _fits(digits: str) -> bool:
    # The length first: int() of thousands of digits raises ValueError (and costs time).
    return len(digits) <= len(str(MAX_ID)) and int(digits) <= MAX_ID


def parse_id(text: str, what: str = "id") -> int:
    """An operator's numeric id: ASCII digits within a bigint; QueryError otherwise."""
    if not is_number(text):
        raise QueryError(f"not a {what}: {text!r} (a number)", "bad_id")
    if not _fits(text):
        raise QueryError(f"{what} out of range: {text!r} (at most {MAX_ID})", "out_of_range")
    return int(text)


def parse_time(text: str, *, now: datetime) -> datetime:
    """``2026-05-01T10:00``, ``2026-05-01`` (UTC when no offset) or a duration ago (``2h``);
    QueryError for anything else, including a time or duration beyond what can be stored."""
    value = text.strip()
    out_of_range = QueryError(f"time out of range: {text!r}", "out_of_range")
    try:
        return now - parse_duration(value)
    except DurationError:
        pass
    except OverflowError:  # a duration beyond timedelta, or a time before year 1
        raise out_of_range from None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise QueryError(
            f"not a time: {text!r} (use an ISO time such as 2026-05-01T10:00Z, "
            "or 2h for two hours ago)"
        ) from None
    if parsed.tzinfo is None:
        return parsed.replace(tzinfo=UTC)
    try:  # 0001-01-01T00:00+14:00 is before year 1 in UTC: no datetime can hold it
        parsed.astimezone(UTC)
    except OverflowError:
        raise out_of_range from None
    return parsed


def check_status(status: str | None, allowed: Sequence[str] = tuple(DeliveryStatus)) -> None:
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
    # Cursor pagination (the console): only receipts older than (received_at, id).
    before: tuple[datetime, int] | None = None


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
    # or reconcile (webhooks reconcile recovered it), or test (`webhooks send` minted it)
    arrived_via: str = "webhook"
    # Where the type was read from when the signature does not cover it (``X-GitHub-Event``),
    # judged by the provider's rules under the source's current options; None: signed, or
    # recovered from the provider's API (:func:`unsigned_type_of`).
    type_unsigned: str | None = None


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


def _delivery_number_message(number: int, also_event: bool) -> str:
    what = f"both delivery {number} and receipt {number}" if also_event else "a delivery id"
    if also_event:
        return (
            f"{number} is {what}: use `webhooks deliveries show {number}` for the delivery, or "
            f"`webhooks events show {RECEIPT_PREFIX}{number}` for the receipt"
        )
    return (
        f"{number} is {what}, not a receipt: use `webhooks deliveries show {number}` "
        f"(or `webhooks events show {DELIVERY_PREFIX}{number}` for its event)"
    )


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


def unsigned_type_of(
    provider: str, config: dict[str, Any] | None, event_type: str, arrived_via: str
) -> str | None:
    """Where a stored event's type came from when unsigned (``X-GitHub-Event``), by its
    provider's rules under its source's options; None when signed, when the event was
    recovered from the provider's API (no header involved), or when the provider is no longer
    installed (nothing to judge by). Receipts store no such mark: the rules decide it from the
    type itself (GitHub: whether the body identifies the event, else the request was refused;
    WooCommerce: action.* topics), so a source's options changed since are judged as now."""
    if arrived_via == "reconcile":
        return None
    try:
        found = registry.get(provider)
    except registry.UnknownProvider:
        return None
    return found.unsigned_type(config or {}, event_type)


@dataclass(frozen=True)
class DeliveryDetail:
    """One delivery as the operator looks it up by the id Flower, the logs and ``dead list``
    show: its event, its route and handler, its state and its attempt history."""

    id: int
    receipt: str  # receipt:12, for `webhooks events show`
    receipt_id: int
    source: str
    source_name: str
    provider: str
    event_id: str
    event_type: str
    received_at: datetime
    route_events: str | None  # None once the route is removed
    route_active: bool | None
    idempotency_key: str | None  # the downstream key of the current generation
    delivery: DeliveryView


# (source id, event id, route id, generation) -> the downstream idempotency key.
KeyOf = Callable[[int, str, int, int], str]


def parse_delivery_ref(ref: str | int) -> int:
    key = str(ref).strip().removeprefix(DELIVERY_PREFIX)
    if not is_number(key):
        raise QueryError(
            f"not a delivery id: {str(ref)!r} (a number, as `dead list` and Flower show it)"
        )
    return parse_id(key, "delivery id")


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
