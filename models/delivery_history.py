"""A delivery's history as operators read it: its attempts in time order and the replays
(with their audit rows) that split them into runs. Read-only, like :mod:`models.queries`."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import and_, func, or_, select
from sqlalchemy.orm import Session

from models.schema import (
    Attempt,
    Delivery,
    Receipt,
    Replay,
    Route,
)
from models.views import (
    ANSWER_TIMEOUT,
    LEASE_TAKEN_OVER,
    REMOVED_ROUTE,
    AttemptView,
    DeliveryView,
    ReplayAudit,
    ReplayMark,
    replay_marks,
)

# Defined in models.views (no database library: the CLI's fast reads build them too),
# importable from here, where they were first defined.
__all__ = [
    "ANSWER_TIMEOUT",
    "LEASE_TAKEN_OVER",
    "REMOVED_ROUTE",
    "AttemptView",
    "DeliveryView",
    "ReplayAudit",
    "ReplayMark",
    "replay_marks",
]


def delivery_views(session: Session, r: Any, *, only: int | None = None) -> list[DeliveryView]:
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
                a.committed_at,
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
            result_ref=d.result_ref,
            attempt_log=attempts[d.id],
            replays=replay_marks(
                attempts[d.id],
                [a for a in audit if a.could_have_moved(d.id, r.public_id, r.name, r.event_type)],
                attempt_base=d.attempt_base,
            ),
        )
        for d, handler in deliveries
    ]


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


def delivery_of_receipt() -> Any:
    return and_(Delivery.receipt_id == Receipt.id, Delivery.expires_at == Receipt.expires_at)
