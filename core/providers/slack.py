"""Slack Events API: ``X-Slack-Signature: v0=<hex HMAC-SHA256("v0:{ts}:{raw body}")>``.

The request timestamp and the body are signed; the dedup id is the body's ``event_id``, so a
capture replays only the same event within 5 minutes. The ``url_verification`` handshake is
answered with its challenge (text/plain) and stores nothing. Retries: 3, immediately, +1 min,
+5 min (rounded up to 10 minutes here).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from core.providers.base import (
    Challenge,
    EventMeta,
    echo_challenge,
    event_id,
    event_type,
    json_object,
    occurred_at,
    versioned_timestamp_hmac,
)
from core.providers.descriptions import described

authenticate = versioned_timestamp_hmac("x-slack-signature", "x-slack-request-timestamp")


def extract(
    headers: Mapping[str, str], body: bytes, config: Mapping[str, Any]
) -> EventMeta | Challenge:
    obj = json_object(body)
    if obj.get("type") == "url_verification":
        return echo_challenge(obj.get("challenge"))
    event = obj.get("event")
    the_type = event.get("type") if isinstance(event, dict) else None
    if not isinstance(the_type, str) or not the_type:
        the_type = obj.get("type")
    return EventMeta(
        event_id=event_id(obj.get("event_id")),
        event_type=event_type(the_type),
        occurred_at=occurred_at(obj.get("event_time")),
    )


PROVIDER = described("slack", authenticate, extract)
