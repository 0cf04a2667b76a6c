"""Acme: a made-up sender, written the way a user adds one without touching the pipeline.

``X-Acme-Signature: v1=<hex HMAC-SHA256(secret, "{X-Acme-Timestamp}.{raw body}")>``; the id,
type and time are the body's ``id``, ``kind`` and ``at``. Acme documents retries for 2 hours.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

# The documented import path (ingest.providers re-exports core.providers).
from ingest.providers import AuthError, Challenge, EventMeta, Provider
from ingest.providers.base import (
    Secrets,
    event_id,
    event_type,
    first_match,
    header,
    hmac_of,
    json_object,
    occurred_at,
    unhex,
    unix,
)


def authenticate(
    headers: Mapping[str, str], body: bytes, secrets: Secrets, config: Mapping[str, Any]
) -> tuple[str, int | None]:
    version, _, value = header(headers, "x-acme-signature").partition("=")
    decoded = unhex(value) if version == "v1" else None
    if decoded is None:
        raise AuthError("malformed_signature")
    ts_text = header(headers, "x-acme-timestamp", "missing_timestamp")
    timestamp = unix(ts_text)
    digest = hmac_of("sha256", ts_text.encode("ascii"), b".", body)
    return first_match(secrets, (decoded,), digest), timestamp


def extract(
    headers: Mapping[str, str], body: bytes, config: Mapping[str, Any]
) -> EventMeta | Challenge:
    obj = json_object(body)
    return EventMeta(
        event_id=event_id(obj.get("id")),
        event_type=event_type(obj.get("kind")),
        occurred_at=occurred_at(obj.get("at")),
    )


PROVIDER = Provider(
    name="acme",
    authenticate=authenticate,
    extract=extract,
    retry_window=timedelta(hours=2),
    citation="https://acme.example/docs/webhooks#retries",
    signed="timestamp + body (id inside): a capture replays only the same event",
    summary="X-Acme-Signature v1= (HMAC-SHA256 hex over ts.body)",
)
