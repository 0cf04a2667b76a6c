"""The deliveries a replay or a discard would move, as planned (read-only; the moves go
through :mod:`models.transitions`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from core.states import DRIFT_HELD, REPLAYABLE, DeliveryStatus
from models.delivery_history import REMOVED_ROUTE, delivery_of_receipt
from models.queries import NotFoundError, check_status, receipt_conditions, source_id_of
from models.schema import (
    Delivery,
    Receipt,
    Route,
    Source,
)


@dataclass(frozen=True)
class ReplayFilter:
    source: str | None = None
    event_type: str | None = None
    status: str = DeliveryStatus.DEAD
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
    # Its last error is a drift hold (core.states.DRIFT_HELD): with ``retrying``, a delivery a
    # quarantined route holds for drift (docs/drift.md), replayed only when chosen by its id.
    drift_held: bool = False

    @property
    def held_for_drift(self) -> bool:
        return self.status == DeliveryStatus.RETRYING and self.drift_held


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
            Delivery.last_error_class.is_not_distinct_from(DRIFT_HELD),
        )
        .join(Receipt, delivery_of_receipt())
        .join(Source, Source.id == Delivery.source_id)
        .outerjoin(Route, Route.id == Delivery.route_id)
        .order_by(Delivery.id)
    )


def candidates_by_filter(session: Session, flt: ReplayFilter, *, limit: int) -> list[Candidate]:
    """Deliveries in ``flt.status`` whose event matches the filter, oldest id first.

    ``since`` and ``until`` bound the event's arrival (received_at), as in ``events list``.
    At most ``limit`` rows; the caller asks for one more than it accepts to detect overflow.
    """
    check_status(flt.status, REPLAYABLE)
    conds = receipt_conditions(session, flt.source, flt.event_type, flt.since, flt.until)
    source_id = source_id_of(session, flt.source)
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
