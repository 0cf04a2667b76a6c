"""Paddle Billing: ``Paddle-Signature: ts=<unix>;h1=<hex>[;h1=<hex>...]``.

HMAC-SHA256 keyed by the notification destination's secret (``pdl_ntfset_...``, as text) over
``"{ts}:{raw body}"``; several ``h1`` values are allowed (Paddle's rotation). The timestamp is
signed and Paddle's SDK allows 5 seconds either way, which is the default here (raise it per
source with ``--tolerance`` if clocks drift). Id/type/time from the signed body: ``event_id``,
``event_type``, ``occurred_at``; a manual replay sends a new ``notification_id`` with the same
``event_id``, which dedup catches. A capture replays only the same event, within 5 s.
Retries (live): "up to 60 times over 3 days"; answer within 5 s.
Signature: https://developer.paddle.com/webhooks/about/signature-verification
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from ingest.providers.base import (
    AuthError,
    Challenge,
    EventMeta,
    Provider,
    Secrets,
    event_id,
    event_type,
    first_match,
    header,
    hmac_of,
    json_object,
    kv_header,
    occurred_at,
    unhex,
    unix,
)


def authenticate(
    headers: Mapping[str, str], body: bytes, secrets: Secrets, config: Mapping[str, Any]
) -> tuple[str, int | None]:
    ts_text: str | None = None
    offered: list[bytes] = []
    for key, value in kv_header(header(headers, "paddle-signature"), ";"):
        if key == "ts" and ts_text is None:
            ts_text = value
        elif key == "h1":
            decoded = unhex(value)
            if decoded is not None:
                offered.append(decoded)
    if ts_text is None:
        raise AuthError("missing_timestamp")
    timestamp = unix(ts_text)
    if not offered:
        raise AuthError("malformed_signature")
    digest = hmac_of("sha256", ts_text.encode("ascii"), b":", body)
    return first_match(secrets, offered, digest), timestamp


def extract(
    headers: Mapping[str, str], body: bytes, config: Mapping[str, Any]
) -> EventMeta | Challenge:
    obj = json_object(body)
    return EventMeta(
        event_id=event_id(obj.get("event_id")),
        event_type=event_type(obj.get("event_type")),
        occurred_at=occurred_at(obj.get("occurred_at")),
    )


PROVIDER = Provider(
    name="paddle",
    authenticate=authenticate,
    extract=extract,
    retry_window=timedelta(days=3),
    citation="https://developer.paddle.com/webhooks/about/respond-to-webhooks",
    signed="ts + body (event_id inside): a capture replays only the same event, within 5 s",
    tolerance=timedelta(seconds=5),
    summary="Paddle-Signature ts=;h1= (HMAC-SHA256 hex over ts:body)",
)
