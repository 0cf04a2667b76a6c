"""Read-only queries for operators: events, dead letters, replay candidates.

Everything here is a SELECT; state changes go through :mod:`models.transitions`. Results are
plain dataclasses so the CLI and the admin API render the same facts. Payloads and secrets are
never selected for display: an event shows its size and whether retention dropped it.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import and_, exists, func, literal_column, or_, select, true, tuple_
from sqlalchemy.orm import Session

from core.durations import DurationError, parse_duration
from models.catalog import get_source, glob_to_like
from models.schema import (
    DELIVERY_STATES,
    Attempt,
    Delivery,
    Receipt,
    Replay,
    Route,
    Source,
)

REPLAYABLE_STATES = ("dead", "succeeded")
MAX_LIST_LIMIT = 1000
# The handler shown for a delivery whose route was removed (``webhooks routes remove``).
REMOVED_ROUTE = "(route removed)"
# Operators' unambiguous id forms: ``receipt:12``, ``delivery:11``, ``event:evt_1``.
RECEIPT_PREFIX = "receipt:"
DELIVERY_PREFIX = "delivery:"
EVENT_PREFIX = "event:"
# Ids are Postgres bigints: a number beyond this is refused before it reaches a query.
MAX_ID = 2**63 - 1


def receipt_ref(receipt_id: int) -> str:
    """How a receipt id is printed: a bare number could also be a delivery id."""
    return f"{RECEIPT_PREFIX}{receipt_id}"


class QueryError(ValueError):
    """Bad operator input (unknown status, unparseable time, ...); nothing was read."""

    def __init__(self, message: str, reason: str = "bad_query") -> None:
        super().__init__(message)
        self.reason = reason


class NotFoundError(QueryError):
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
class AttemptView:
    """One try of a delivery: who ran it, when, and how it ended. ``number`` is the attempt's
    fencing token: it only grows, across replays and re-runs too."""

    number: int
    generation: int
    worker: str | None
    started_at: datetime
    ended_at: datetime | None
    outcome: str | None
    error_class: str | None
    error: str | None


@dataclass(frozen=True)
class ReplayMark:
    """A replay (or re-run) that moved a delivery: the attempts from ``first_attempt`` on
    belong to it (None: none has started since). The audit fields are None when no audit row
    accounts for it (a replay older than the ``replays`` rows kept)."""

    replay_id: int | None
    operator: str | None
    reason: str | None
    via: str | None
    started_at: datetime | None
    rerun: bool
    first_attempt: int | None


@dataclass(frozen=True)
class DeliveryView:
    """One (event, route) unit of work with its attempts (in time order) and the replays that
    split them into runs."""

    id: int
    route_id: int
    handler: str  # REMOVED_ROUTE once the route is gone
    status: str
    attempts: int  # the latest attempt's number (the fencing token; goes on across replays)
    attempts_since_replay: int  # what the retry policy counts: attempts - attempt_base
    generation: int
    dead_reason: str | None
    last_error_class: str | None
    last_error: str | None
    next_attempt_at: datetime | None  # None once finished
    created_at: datetime
    updated_at: datetime
    succeeded_at: datetime | None
    attempt_log: list[AttemptView] = field(default_factory=list)
    replays: list[ReplayMark] = field(default_factory=list)


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
    arrived_via: str = "webhook"  # or reconcile (webhooks reconcile recovered it)


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


def receipt_conditions(
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


# Events filtered by a delivery status: when at most this many deliveries (of the source) are
# in that status, the query starts from them; above it, the status is common and walking the
# receipts newest first with an EXISTS per receipt finds a page sooner. For a source's dead
# deliveries (the dead-letter view, and the floor of issue 21) it walks them newest first and
# stops after a page (_walk_by_created, on a partial index the hot path never writes); for
# another rare status, or without a source, it reads every delivery in the status (of the
# source), probes each one's receipt and sorts those.
# (Benchmark and plans: bench/results_console.txt.)
RARE_STATUS_ROWS = 20_000

# The walk reads the index in batches: the first of WALK_FIRST_BATCH x the page size, each
# next one WALK_GROWTH times larger, so a page needs one statement when the receipts it finds
# pass the other filters, and a handful when few do.
WALK_FIRST_BATCH = 2
WALK_GROWTH = 4


def _is_rare_status(session: Session, status: str, source_id: int | None) -> bool:
    """At most RARE_STATUS_ROWS deliveries (of the source) in ``status``: an index-only count
    that stops one row past the threshold."""
    conds: list[Any] = [Delivery.status == status]
    if source_id is not None:
        conds.append(Delivery.source_id == source_id)
    probe = select(Delivery.id).where(*conds).limit(RARE_STATUS_ROWS + 1).subquery()
    found = session.execute(select(func.count()).select_from(probe)).scalar_one()
    return bool(found <= RARE_STATUS_ROWS)


_EVENT_COLUMNS = (
    Receipt.id,
    Receipt.expires_at,
    Receipt.source_id,
    Receipt.event_id,
    Receipt.event_type,
    Receipt.received_at,
    Receipt.occurred_at,
    Receipt.payload_dropped_at,
)


def _walk_by_created(
    session: Session,
    source_id: int,
    conds: list[Any],
    limit: int,
    since: datetime | None,
) -> list[Any]:
    """The first ``limit`` receipts (newest first by received_at, id) meeting ``conds`` that
    have a dead delivery of the source: exactly what probing every such delivery's
    receipt and sorting would return, reading only the newest deliveries.

    The walk reads the deliveries newest first by created_at (ix_deliveries_source_dead,
    index-only) and probes each one's receipt by its key. A delivery is never created before
    its receipt was received: ``webhooks_accept`` and ``webhooks_accept_many`` (the only
    writers of deliveries) stamp both columns from one instant, and nothing updates either
    (tests/test_console_queries.py checks both functions). So once the walk is at created_at
    ``c``, every receipt it has not reached was received at or before ``c``, and it can stop
    as soon as ``limit`` receipts found were received after ``c``: those outrank every receipt
    behind it. It does not rely on the two instants being equal, only on the order: a
    delivery created later than its receipt only makes the walk go deeper. Cursor pages
    (``conds`` holds the cursor) walk from the newest again, which costs at most what reading
    every key costs; ``since`` ends the walk once it is past it."""
    walked = (Delivery.created_at, Delivery.receipt_id, Delivery.expires_at)
    found: dict[tuple[int, datetime], Any] = {}
    after: tuple[datetime, int, datetime] | None = None
    batch = WALK_FIRST_BATCH * limit
    while True:
        # 'dead' inline, not a parameter: the partial index's predicate must be provable
        # from the statement text, generic plans included.
        where: list[Any] = [
            Delivery.source_id == source_id,
            Delivery.status == literal_column("'dead'"),
        ]
        if after is not None:
            where.append(tuple_(*walked) < tuple_(*after))
        keys = (
            select(
                Delivery.created_at.label("walk_created_at"),
                Delivery.receipt_id.label("walk_receipt_id"),
                Delivery.expires_at.label("walk_expires_at"),
            )
            .where(*where)
            .order_by(*(c.desc() for c in walked))
            .limit(batch)
            .cte("walk")
        )
        key_columns = (keys.c.walk_created_at, keys.c.walk_receipt_id, keys.c.walk_expires_at)
        # One receipt per key (LATERAL, pruned to its partition at run time), or none when it
        # fails the other filters; of those only the batch's first ``limit`` can be on the
        # page, so only they leave the database.
        receipt = (
            select(*_EVENT_COLUMNS)
            .where(
                Receipt.id == keys.c.walk_receipt_id,
                Receipt.expires_at == keys.c.walk_expires_at,
                *conds,
            )
            .limit(1)
            .lateral()
        )
        top = (
            select(receipt)
            .select_from(keys.join(receipt, true()))
            .distinct()  # a receipt with two deliveries in the status is one row of the page
            .order_by(receipt.c.received_at.desc(), receipt.c.id.desc())
            .limit(limit)
            .subquery()
        )
        # Where the batch ended (its oldest key) and how many keys it read.
        edge = select(*key_columns).order_by(*key_columns).limit(1).subquery()
        size = select(func.count()).select_from(keys).scalar_subquery()
        rows = session.execute(
            select(edge, size.label("walked"), top, Source.public_id, Source.name).select_from(
                edge.outerjoin(top, true()).outerjoin(Source, Source.id == top.c.source_id)
            )
        ).all()
        for r in rows:
            if r.id is not None:
                found[(r.id, r.expires_at)] = r
        if not rows or rows[0].walked < batch:
            break  # every delivery in the status walked
        last = (rows[0].walk_created_at, rows[0].walk_receipt_id, rows[0].walk_expires_at)
        horizon = last[0]
        if sum(1 for r in found.values() if r.received_at > horizon) >= limit:
            break
        if since is not None and horizon < since:
            break  # everything behind the walk was received before ``since``
        after = last
        batch *= WALK_GROWTH
    ranked = sorted(found.values(), key=lambda r: (r.received_at, r.id), reverse=True)
    return ranked[:limit]


def _probe_every_key(
    session: Session, status: str, source_id: int | None, conds: list[Any], limit: int
) -> list[Any]:
    """The first ``limit`` receipts (newest first) meeting ``conds`` that have a delivery in
    ``status`` (of the source, or any source): every such delivery's receipt probed by its
    key, then sorted."""
    where: list[Any] = [Delivery.status == status]
    if source_id is not None:
        where.append(Delivery.source_id == source_id)  # ix_deliveries_source_status
    keys = select(Delivery.receipt_id, Delivery.expires_at).where(*where).distinct().subquery()
    # One receipt per key: a delivery's receipt is the one with its (id, expires_at).
    probed = (
        select(*_EVENT_COLUMNS)
        .where(Receipt.id == keys.c.receipt_id, Receipt.expires_at == keys.c.expires_at, *conds)
        .limit(1)
        .lateral()
    )
    query = (
        select(probed, Source.public_id, Source.name)
        .select_from(keys.join(probed, true()).join(Source, Source.id == probed.c.source_id))
        .order_by(probed.c.received_at.desc(), probed.c.id.desc())
        .limit(limit)
    )
    return list(session.execute(query).all())


def list_events(session: Session, flt: EventFilter) -> list[EventSummary]:
    """Newest first."""
    check_status(flt.status)
    if not 1 <= flt.limit <= MAX_LIST_LIMIT:
        raise QueryError(f"--limit must be between 1 and {MAX_LIST_LIMIT}")
    conds = receipt_conditions(session, flt.source, flt.event_type, flt.since, flt.until)
    if flt.before is not None:
        conds.append(tuple_(Receipt.received_at, Receipt.id) < tuple_(*flt.before))
    rows: list[Any]
    source_id = None if flt.status is None else _source_id(session, flt.source)
    if flt.status is not None and _is_rare_status(session, flt.status, source_id):
        if source_id is not None and flt.status == "dead":
            rows = _walk_by_created(session, source_id, conds, flt.limit, flt.since)
        else:
            rows = _probe_every_key(session, flt.status, source_id, conds, flt.limit)
    else:
        if flt.status is not None:
            conds.append(exists().where(_delivery_of_receipt(), Delivery.status == flt.status))
        found = select(*_EVENT_COLUMNS).where(*conds).subquery()
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
        deliveries=_delivery_views(session, r),
        arrived_via=r.arrived_via,
    )


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
    [view] = _delivery_views(session, r, only=delivery_id)
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


def _delivery_views(session: Session, r: Any, *, only: int | None = None) -> list[DeliveryView]:
    conds = [Delivery.receipt_id == r.id, Delivery.expires_at == r.expires_at]
    if only is not None:
        conds.append(Delivery.id == only)
    deliveries = session.execute(
        select(Delivery, func.coalesce(Route.handler, REMOVED_ROUTE))
        .outerjoin(Route, Route.id == Delivery.route_id)
        .where(*conds)
        .order_by(Delivery.id)
    ).all()
    if not deliveries:
        return []
    attempts: dict[int, list[AttemptView]] = {d.id: [] for d, _ in deliveries}
    for a in session.scalars(
        select(Attempt)
        .where(Attempt.delivery_id.in_(list(attempts)), Attempt.expires_at == r.expires_at)
        # Time order; the number breaks ties (it only grows, across replays too).
        .order_by(Attempt.delivery_id, Attempt.started_at, Attempt.number, Attempt.id)
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
    first_created = min(d.created_at for d, _ in deliveries)
    audit = _replays_since(session, first_created, list(attempts))
    return [
        DeliveryView(
            id=d.id,
            route_id=d.route_id,
            handler=handler,
            status=d.status,
            attempts=d.attempts,
            attempts_since_replay=d.attempts - d.attempt_base,
            generation=d.generation,
            dead_reason=d.dead_reason,
            last_error_class=d.last_error_class,
            last_error=d.last_error,
            next_attempt_at=d.next_attempt_at,
            created_at=d.created_at,
            updated_at=d.updated_at,
            succeeded_at=d.succeeded_at,
            attempt_log=attempts[d.id],
            replays=replay_marks(
                attempts[d.id],
                [a for a in audit if a.could_have_moved(d.id, r.public_id, r.name, r.event_type)],
                attempt_base=d.attempt_base,
            ),
        )
        for d, handler in deliveries
    ]


@dataclass(frozen=True)
class ReplayAudit:
    """A ``replays`` row, as far as attributing it to a delivery needs."""

    id: int
    operator: str
    reason: str
    via: str
    started_at: datetime
    rerun: bool
    filter: dict[str, Any]

    def names(self, delivery_id: int) -> bool:
        return delivery_id in (self.filter.get("ids") or [])

    def could_have_moved(
        self, delivery_id: int, source: str, source_name: str, event_type: str
    ) -> bool:
        """Named by id, or a filter replay whose filter (as given) matches the event."""
        if "ids" in self.filter:
            return self.names(delivery_id)
        given_source = self.filter.get("source")
        if given_source is not None and given_source not in (source, source_name):
            return False
        pattern = self.filter.get("type")
        return pattern is None or fnmatch.fnmatchcase(event_type, str(pattern))


def _replays_since(session: Session, since: datetime, ids: list[int]) -> list[ReplayAudit]:
    rows = session.scalars(
        select(Replay)
        .where(
            Replay.started_at >= since,
            or_(
                ~Replay.filter.has_key("ids"),
                *(Replay.filter["ids"].contains([i]) for i in ids),
            ),
        )
        .order_by(Replay.started_at, Replay.id)
    )
    return [
        ReplayAudit(r.id, r.operator, r.reason, r.via, r.started_at, r.rerun_succeeded, r.filter)
        for r in rows
    ]


def replay_marks(
    attempts: Sequence[AttemptView], audit: Sequence[ReplayAudit], *, attempt_base: int
) -> list[ReplayMark]:
    """Where replays split a delivery's attempts (in time order) into runs, and which audit
    row each was (pure).

    A new run starts at an attempt that follows a finished one (its predecessor ended
    ``dead`` or ``succeeded``), carries a new key generation (a re-run), or is the first
    after ``attempt_base`` (the latest replay; this also finds a replay of a delivery that
    went dead by crashing, whose last attempt says ``crashed``); a replay that names the
    delivery between two of its attempts marks one too. A replay whose attempt has not
    started yet is a mark at the end. Each mark takes the earliest replay that could have
    moved the delivery after the run before it had started (one naming it by id first):
    later ones could only have found it no longer dead.
    """
    starts: list[int] = []  # indexes of attempts that open a run
    for i in range(1, len(attempts)):
        prev, cur = attempts[i - 1], attempts[i]
        if (
            prev.outcome in ("dead", "succeeded")
            or cur.generation > prev.generation
            or (attempt_base > 0 and cur.number == attempt_base + 1)
            or any(
                prev.started_at < a.started_at <= cur.started_at and "ids" in a.filter
                for a in audit
            )
        ):
            starts.append(i)
    pending_replay = attempt_base > 0 and not any(a.number > attempt_base for a in attempts)
    if pending_replay and attempts:
        starts.append(len(attempts))
    marks: list[ReplayMark] = []
    for k, i in enumerate(starts):
        after = attempts[i - 1].started_at
        # The run it opens ends where the next run's last attempt before it starts.
        until = attempts[starts[k + 1] - 1].started_at if k + 1 < len(starts) else None
        window = [
            a for a in audit if a.started_at > after and (until is None or a.started_at <= until)
        ]
        window.sort(key=lambda a: ("ids" not in a.filter, a.started_at, a.id))
        first = attempts[i].number if i < len(attempts) else None
        rerun = i < len(attempts) and attempts[i].generation > attempts[i - 1].generation
        if window:
            a = window[0]
            marks.append(
                ReplayMark(a.id, a.operator, a.reason, a.via, a.started_at, a.rerun or rerun, first)
            )
        else:
            marks.append(ReplayMark(None, None, None, None, None, rerun, first))
    return marks


def dead_letters(
    session: Session, *, source: str | None = None, samples: int = 5
) -> list[DeadGroup]:
    """Dead deliveries grouped by source, route and reason; largest groups first."""
    conds: list[Any] = [Delivery.status == "dead"]
    source_id = _source_id(session, source)
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


def _candidate_query() -> Any:
    return (
        select(
            Delivery.id,
            Delivery.receipt_id,
            Source.public_id,
            Receipt.event_id,
            Receipt.event_type,
            func.coalesce(Route.handler, REMOVED_ROUTE),
            Delivery.status,
            Delivery.generation,
            Delivery.dead_reason,
            Receipt.received_at,
            Receipt.payload.is_not(None),
        )
        .join(Receipt, _delivery_of_receipt())
        .join(Source, Source.id == Delivery.source_id)
        .outerjoin(Route, Route.id == Delivery.route_id)
        .order_by(Delivery.id)
    )


def candidates_by_filter(session: Session, flt: ReplayFilter, *, limit: int) -> list[Candidate]:
    """Deliveries in ``flt.status`` whose event matches the filter, oldest id first.

    ``since`` and ``until`` bound the event's arrival (received_at), as in ``events list``.
    At most ``limit`` rows; the caller asks for one more than it accepts to detect overflow.
    """
    check_status(flt.status, REPLAYABLE_STATES)
    conds = receipt_conditions(session, flt.source, flt.event_type, flt.since, flt.until)
    source_id = _source_id(session, flt.source)
    if source_id is not None:
        # The same rows (a delivery's source is its receipt's); this one lets the planner start
        # from the deliveries' (source_id, status) index instead of every receipt of the source.
        conds.append(Delivery.source_id == source_id)
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
            func.coalesce(Route.handler, REMOVED_ROUTE),
            Delivery.status,
            Delivery.attempts,
            Delivery.generation,
        )
        .join(Delivery, _delivery_of_receipt())
        .outerjoin(Route, Route.id == Delivery.route_id)
        .where(Receipt.source_id == source_id, Receipt.event_id.in_(list(event_ids)))
        .order_by(Receipt.received_at, Delivery.id)
    ).all()
    return [DeliveryState(*row) for row in rows]
