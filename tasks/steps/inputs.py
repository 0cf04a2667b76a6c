"""The handler's inputs, read from the claim's row: the event, the route, its retry policy
and the fast claim's dedup TTL. What is missing is a permanent error."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from core.crypto import SecretDecryptError, SecretMisplaced, SecretUnbound, route_secret_place
from core.logs import get_logger
from core.ttl import TtlConfigError, TtlOverrides, effective_ttl
from models.transitions import Claim, ClaimedEvent
from tasks.context import Event, EventMeta, RouteInfo
from tasks.errors import PermanentError
from tasks.policy import RetryPolicy
from tasks.runtime import Runtime

log = get_logger(__name__)


@dataclass(frozen=True)
class Loaded:
    event: Event
    route: RouteInfo
    policy: RetryPolicy
    dedup_ttl: timedelta | None


def _dedup_ttl(rt: Runtime, row: Any) -> timedelta | None:
    overrides = TtlOverrides.from_seconds(
        row.retry_window_s, row.queue_lag_s, row.clock_skew_s, row.replay_grace_s
    )
    try:
        # Raised to the safe floor when the terms no longer cover the retry window, as the
        # receiver does (reported at the start of every process).
        return effective_ttl(row.provider, overrides, rt.settings, source_name=row.name).total
    except (TtlConfigError, KeyError):
        # Misconfigured source: keep only the processing TTL; Postgres still dedups.
        log.warning("delivery.dedup_ttl_invalid", source=row.public_id)
        return None


def load(rt: Runtime, found: Claim, row: ClaimedEvent) -> Loaded:
    """The handler's inputs from the claim's row; what is missing is permanent."""
    if not row.route_found:
        raise PermanentError("the route of this delivery no longer exists", reason="route_gone")
    if not row.receipt_found:
        raise PermanentError("the receipt of this delivery no longer exists", reason="receipt_gone")
    if row.payload is None:
        raise PermanentError("the event's payload was dropped (retention)", reason="payload_gone")
    if not row.active:
        raise PermanentError("the route is disabled", reason="route_inactive")
    # NOT NULL columns of rows that were found:
    assert row.handler is not None
    assert row.public_id is not None
    assert row.provider is not None
    assert row.event_id is not None
    assert row.event_type is not None
    assert row.received_at is not None
    secret: str | None = None
    if row.signing_ciphertext is not None:
        try:
            secret = rt.box.open(bytes(row.signing_ciphertext), route_secret_place(found.route_id))
        except (SecretMisplaced, SecretUnbound) as exc:
            # Copied from another row or purpose, or not bound yet: never used to sign.
            raise PermanentError(str(exc), reason=f"secret_{exc.reason}") from None
        except SecretDecryptError:
            raise PermanentError(
                "the route's signing secret cannot be decrypted", reason="secret_undecryptable"
            ) from None
    meta = EventMeta(
        receipt_id=found.receipt_id,
        source_id=found.source_id,
        source=row.public_id,
        provider=row.provider,
        event_id=row.event_id,
        event_type=row.event_type,
        occurred_at=row.occurred_at,
        received_at=row.received_at,
        content_type=row.content_type,
    )
    return Loaded(
        event=Event(meta, bytes(row.payload)),
        route=RouteInfo(found.route_id, row.handler, dict(row.options or {}), secret),
        policy=RetryPolicy.for_route(
            rt.settings, max_attempts=row.max_attempts, max_age_s=row.max_age_s
        ),
        dedup_ttl=_dedup_ttl(rt, row),
    )
