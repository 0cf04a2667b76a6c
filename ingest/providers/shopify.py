"""Shopify: ``X-Shopify-Hmac-Sha256: base64 HMAC-SHA256(app client secret, raw body)``.

Only the body is signed. ``X-Shopify-Webhook-Id`` (the dedup id the docs recommend), the topic
and ``X-Shopify-Triggered-At`` are not: a captured request can be replayed under a new webhook
id, forever (no timestamp is signed). Mitigations: TLS, rotating the client secret when it may
be exposed, handlers idempotent on the payload's object ids. Retries: "8 times over 4 hours".
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
    unb64,
    unsigned_time,
)


def authenticate(
    headers: Mapping[str, str], body: bytes, secrets: Secrets, config: Mapping[str, Any]
) -> tuple[str, int | None]:
    decoded = unb64(header(headers, "x-shopify-hmac-sha256"))
    if decoded is None:
        raise AuthError("malformed_signature")
    return first_match(secrets, (decoded,), hmac_of("sha256", body)), None


def extract(
    headers: Mapping[str, str], body: bytes, config: Mapping[str, Any]
) -> EventMeta | Challenge:
    # Ids live in headers; the body (JSON or XML, by subscription) is not parsed at all.
    return EventMeta(
        event_id=event_id(headers.get("x-shopify-webhook-id")),
        event_type=event_type(headers.get("x-shopify-topic")),
        occurred_at=unsigned_time(headers.get("x-shopify-triggered-at")),
    )


PROVIDER = Provider(
    name="shopify",
    authenticate=authenticate,
    extract=extract,
    retry_window=timedelta(hours=4),
    citation="https://shopify.dev/changelog/updates-to-webhook-retry-mechanism",
    signed="body only: X-Shopify-Webhook-Id (the id) is unsigned, so a capture replays under "
    "a new id",
    tolerance=None,
    summary="X-Shopify-Hmac-Sha256 (HMAC-SHA256 base64)",
)
