"""Example database handler: a subscription's state from Stripe ``customer.subscription.*``.

Stripe does not deliver events in order, and retries and replays bring old events back. The
write is one UPSERT with an ordering guard: the stored row changes only when the incoming
event is newer, comparing (event ``created``, event id) so that two events in the same second
resolve the same way whatever order they arrive in. An older event never moves the state
backwards. It runs in ``ctx.session``, so it commits together with the delivery's success.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

from core.logs import get_logger
from tasks.context import Event, HandlerContext
from tasks.errors import PermanentError
from tasks.handlers.registry import register

log = get_logger(__name__)

EVENT_PREFIX = "customer.subscription."

_UPSERT = text(
    """
    INSERT INTO subscriptions
        (source_id, subscription_id, customer, status, event_id, event_created, updated_at)
    VALUES (:source_id, :subscription_id, :customer, :status, :event_id, :event_created, :now)
    ON CONFLICT (source_id, subscription_id) DO UPDATE SET
        customer = EXCLUDED.customer,
        status = EXCLUDED.status,
        event_id = EXCLUDED.event_id,
        event_created = EXCLUDED.event_created,
        updated_at = EXCLUDED.updated_at
    WHERE (subscriptions.event_created, subscriptions.event_id)
        < (EXCLUDED.event_created, EXCLUDED.event_id)
    RETURNING subscription_id
    """
)


def apply_subscription_event(
    session: Session,
    *,
    source_id: int,
    subscription_id: str,
    customer: str | None,
    status: str,
    event_id: str,
    event_created: datetime,
    now: datetime,
) -> bool:
    """Store the state unless a newer (or the same) event is already stored. True if applied."""
    row = session.execute(
        _UPSERT,
        {
            "source_id": source_id,
            "subscription_id": subscription_id,
            "customer": customer,
            "status": status,
            "event_id": event_id,
            "event_created": event_created,
            "now": now,
        },
    ).one_or_none()
    return row is not None


def _malformed(what: str) -> PermanentError:
    return PermanentError(f"subscription event without {what}", reason="malformed_event")


def _event_time(doc: dict[str, Any], event: Event) -> datetime:
    created = doc.get("created")
    if isinstance(created, int | float) and not isinstance(created, bool):
        return datetime.fromtimestamp(created, UTC)
    if event.meta.occurred_at is not None:
        return event.meta.occurred_at
    raise _malformed("a created time")


@register("stripe_subscription")
def stripe_subscription(event: Event, ctx: HandlerContext) -> None:
    if not event.event_type.startswith(EVENT_PREFIX):
        log.info("subscription.ignored", delivery_id=ctx.delivery_id, event_type=event.event_type)
        return
    doc = event.json
    if not isinstance(doc, dict):
        raise _malformed("a JSON object body")
    data = doc.get("data")
    obj = data.get("object") if isinstance(data, dict) else None
    if not isinstance(obj, dict):
        raise _malformed("data.object")
    sub_id, status = obj.get("id"), obj.get("status")
    if not isinstance(sub_id, str) or not sub_id:
        raise _malformed("data.object.id")
    if not isinstance(status, str) or not status:
        raise _malformed("data.object.status")
    customer = obj.get("customer")
    if isinstance(customer, dict):  # expanded object
        customer = customer.get("id")
    applied = apply_subscription_event(
        ctx.session,
        source_id=event.meta.source_id,
        subscription_id=sub_id,
        customer=customer if isinstance(customer, str) else None,
        status=status,
        event_id=event.event_id,
        event_created=_event_time(doc, event),
        now=ctx.clock.now(),
    )
    log.info(
        "subscription.applied" if applied else "subscription.stale",
        delivery_id=ctx.delivery_id,
        event_id=event.event_id,
        event_type=event.event_type,
    )
