"""GitHub: ``X-Hub-Signature-256: sha256=<hex HMAC-SHA256(secret, raw body)>``.

Only the body is signed. The delivery id ``X-GitHub-Delivery`` (the dedup id, the same on a
redelivery) and the event header are not: a captured request can be replayed with a new
delivery id and is then accepted as a new event, forever (no timestamp is signed). What
mitigates it: TLS (a capture needs the plaintext), a secret per source rotated when exposed,
and handlers that are idempotent on the payload's own object ids. GitHub does not retry
automatically; a delivery from the past 3 days can be redelivered by hand (same id).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qs

from ingest.providers.base import (
    Challenge,
    EventMeta,
    MalformedEvent,
    Provider,
    body_hmac,
    event_id,
    event_type,
    json_object,
)

authenticate = body_hmac("x-hub-signature-256", scheme="sha256")


def _payload(headers: Mapping[str, str], body: bytes) -> dict[str, Any]:
    """The JSON payload; GitHub can also be set to send it as the form field ``payload``."""
    content_type = headers.get("content-type", "")
    if content_type.startswith("application/x-www-form-urlencoded"):
        try:
            fields = parse_qs(body.decode("utf-8"), strict_parsing=True)
        except (UnicodeDecodeError, ValueError):
            raise MalformedEvent("bad_json") from None
        payload = fields.get("payload")
        if not payload:
            raise MalformedEvent("bad_json")
        return json_object(payload[0].encode("utf-8"))
    return json_object(body)


def extract(
    headers: Mapping[str, str], body: bytes, config: Mapping[str, Any]
) -> EventMeta | Challenge:
    the_id = event_id(headers.get("x-github-delivery"))
    the_type = event_type(headers.get("x-github-event"))
    action = _payload(headers, body).get("action")
    if isinstance(action, str) and action:
        the_type = event_type(f"{the_type}.{action}")
    return EventMeta(event_id=the_id, event_type=the_type, occurred_at=None)


PROVIDER = Provider(
    name="github",
    authenticate=authenticate,
    extract=extract,
    retry_window=timedelta(days=3),
    citation="https://docs.github.com/webhooks/testing-and-troubleshooting-webhooks/redelivering-webhooks",
    signed="body only: X-GitHub-Delivery (the id) is unsigned, so a capture replays under a new id",
    tolerance=None,
    summary="X-Hub-Signature-256 sha256= (HMAC-SHA256 hex)",
)
