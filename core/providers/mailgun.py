"""Mailgun: the signature is inside the JSON body, ``signature: {timestamp, token, signature}``.

``signature`` is the hex HMAC-SHA256, keyed by the HTTP webhook signing key, of ``timestamp +
token`` (no separator): https://documentation.mailgun.com/docs/mailgun/user-manual/webhooks/
securing-webhooks . Nothing else is signed, so the ``event-data`` next to a captured signature
could be swapped. Mailgun's answer is the token: a random 50-character string used once. The
dedup id here is therefore the token, not ``event-data.id``: a second request with the same
token (a replay, with the same or another body) is a duplicate or a recorded conflict and is
never delivered again, for the TTL; the timestamp must be within 15 minutes either way (the
``max_age_seconds`` default of Mailgun's Python SDK), which bounds how long a token must be
remembered. The cost: a retry that Mailgun signs afresh (a new token) is a new receipt, so a
handler sees that event again and should be idempotent on ``event-data.id`` (in the payload);
a forged event, which dedup on ``event-data.id`` would let through, costs more than that.
Type ``event-data.event``, time ``event-data.timestamp``. Retries: 5 min, 10 min, 15 min,
1 h, 2 h, 4 h ("during 8 hours"): https://documentation.mailgun.com/docs/mailgun/user-manual/webhooks/webhook-retries
Mailgun's form-encoded legacy webhooks are not supported (JSON only).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from datetime import timedelta
from typing import Any, Final

import orjson

from core.providers.base import (
    AuthError,
    Batch,
    Challenge,
    EventMeta,
    Secrets,
    first_match,
    hmac_of,
    json_fields,
    object_start,
    unhex,
    unix,
)
from core.providers.descriptions import described

FIFTEEN_MINUTES: Final = timedelta(minutes=15)


def _signature(body: bytes) -> tuple[str, str, str]:
    """(timestamp, token, signature) from the body; AuthError when absent or malformed."""
    if not object_start(body):  # refused before it is parsed
        raise AuthError("missing_signature")
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise AuthError("missing_signature") from None
    block = obj.get("signature") if isinstance(obj, dict) else None
    if not isinstance(block, dict):
        raise AuthError("missing_signature")
    timestamp, token, signature = (block.get(k) for k in ("timestamp", "token", "signature"))
    if not isinstance(signature, str) or not signature:
        raise AuthError("missing_signature")
    if isinstance(timestamp, int) and not isinstance(timestamp, bool):
        timestamp = str(timestamp)
    if not isinstance(timestamp, str) or not timestamp:
        raise AuthError("missing_timestamp")
    if not isinstance(token, str) or not token:
        raise AuthError("missing_id")
    return timestamp, token, signature


def authenticate(
    headers: Mapping[str, str], body: bytes, secrets: Secrets, config: Mapping[str, Any]
) -> tuple[str, int | None]:
    ts_text, token, signature = _signature(body)
    timestamp = unix(ts_text)
    decoded = unhex(signature)
    if decoded is None:
        raise AuthError("malformed_signature")
    digest = hmac_of("sha256", ts_text.encode("ascii"), token.encode("utf-8"))
    return first_match(secrets, (decoded,), digest), timestamp


_fields = json_fields(
    id=("signature", "token"),
    type=("event-data", "event"),
    time=("event-data", "timestamp"),
)


def extract(
    headers: Mapping[str, str], body: bytes, config: Mapping[str, Any]
) -> EventMeta | Challenge | Batch:
    """The token (signed) is the id; ``event-data`` is not signed, so its time is stored but
    never anchors the expiry."""
    meta = _fields(headers, body, config)
    return replace(meta, time_signed=False) if isinstance(meta, EventMeta) else meta


PROVIDER = described("mailgun", authenticate, extract, tolerance=FIFTEEN_MINUTES)
