"""Linear: ``Linear-Signature: <hex HMAC-SHA256(webhook secret, raw body)>``.

The body carries ``webhookTimestamp`` (unix milliseconds), so the time is signed: it must be
within 60 seconds of now, either way, as Linear's own verifier refuses it (``@linear/sdk``
``LinearWebhooks.verify``: "more than one minute delta between provided ts and current
time"). The dedup id is the ``Linear-Delivery`` header, which is
not signed: a captured request can be replayed under a new delivery id, but only inside that
minute, because its signed timestamp goes stale. Type: ``{type}.{action}`` (``Issue.create``).

Retries: Linear's docs say failed deliveries are retried with back-off but publish no window in
the sources searched here; 24 hours is assumed (override per source if Linear documents one).
Docs: https://linear.app/developers/webhooks
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import orjson

from core.providers.base import (
    AuthError,
    Challenge,
    EventMeta,
    Secrets,
    body_hmac,
    event_id,
    event_type,
    json_object,
    occurred_at,
)
from core.providers.descriptions import described

_body_signature = body_hmac("linear-signature")


def _signed_timestamp(body: bytes) -> int:
    """``webhookTimestamp`` (ms) from the body that was just verified, in whole seconds."""
    try:
        value = orjson.loads(body).get("webhookTimestamp")
    except (orjson.JSONDecodeError, AttributeError):
        raise AuthError("missing_timestamp") from None
    if value is None:
        raise AuthError("missing_timestamp")
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 10**14:
        raise AuthError("malformed_timestamp")
    return value // 1000


def authenticate(
    headers: Mapping[str, str], body: bytes, secrets: Secrets, config: Mapping[str, Any]
) -> tuple[str, int | None]:
    secret_id, _ = _body_signature(headers, body, secrets, config)
    return secret_id, _signed_timestamp(body)


def extract(
    headers: Mapping[str, str], body: bytes, config: Mapping[str, Any]
) -> EventMeta | Challenge:
    obj = json_object(body)
    kind, action = obj.get("type"), obj.get("action")
    the_type = f"{kind}.{action}" if isinstance(kind, str) and isinstance(action, str) else kind
    data = obj.get("data")
    created = obj.get("createdAt") or (data.get("createdAt") if isinstance(data, dict) else None)
    return EventMeta(
        event_id=event_id(headers.get("linear-delivery")),
        event_type=event_type(the_type),
        occurred_at=occurred_at(created),
    )


PROVIDER = described("linear", authenticate, extract, tolerance=timedelta(seconds=60))
