"""PagerDuty webhooks v3: ``X-PagerDuty-Signature: v1=<hex>[,v1=<hex>...]``.

Each ``v1`` is the hex HMAC-SHA256 of the raw body under one of the subscription's signing
secrets; during a secret rotation PagerDuty sends one per secret, and a match on any one passes
(https://developer.pagerduty.com/docs/ZG9jOjExMDI5NTkz-verifying-signatures). Only the body is
signed; the id, type and time are inside it (``event.id``, ``event.event_type``,
``event.occurred_at``), so a capture replays only the same event, which dedup catches within
the TTL. No timestamp is signed. Retries: a failed delivery is retried a few times over about
20 minutes (Svix's review of PagerDuty v3, secondary; PagerDuty's own page gives no horizon):
one hour is assumed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from core.providers.base import AuthError, Secrets, first_match, header, hmac_of, json_fields, unhex
from core.providers.descriptions import described


def authenticate(
    headers: Mapping[str, str], body: bytes, secrets: Secrets, config: Mapping[str, Any]
) -> tuple[str, int | None]:
    offered: list[bytes] = []
    for item in header(headers, "x-pagerduty-signature").split(","):
        version, _, value = item.strip().partition("=")
        decoded = unhex(value) if version == "v1" else None
        if decoded is not None:
            offered.append(decoded)
    if not offered:
        raise AuthError("malformed_signature")
    return first_match(secrets, offered, hmac_of("sha256", body)), None


extract = json_fields(
    id=("event", "id"), type=("event", "event_type"), time=("event", "occurred_at")
)


PROVIDER = described("pagerduty", authenticate, extract, tolerance=None)
