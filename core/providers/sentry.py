"""Sentry (integration platform): ``Sentry-Hook-Signature: <hex HMAC-SHA256(client secret,
raw body)>``.

Only the body is signed. ``Request-ID``, ``Sentry-Hook-Resource`` and ``Sentry-Hook-Timestamp``
are not, and the body carries no event id, so the dedup id is derived from what is signed:
``sha256:`` + the body's SHA-256. A capture therefore replays only as the same event (dedup
refuses it while the receipt lives); a retry of the same delivery has the same body and the
same id. Type: ``{Sentry-Hook-Resource}.{action}`` (informational; the header is unsigned).

Retries: Sentry's docs publish no retry window in the sources searched here; three days is
assumed (override per source). Docs: https://docs.sentry.io/integrations/integration-platform/webhooks/
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from core.providers.base import Challenge, EventMeta, body_hmac, body_id, event_type, json_object
from core.providers.descriptions import described

authenticate = body_hmac("sentry-hook-signature")


def extract(
    headers: Mapping[str, str], body: bytes, config: Mapping[str, Any]
) -> EventMeta | Challenge:
    action = json_object(body).get("action")
    resource = headers.get("sentry-hook-resource")
    parts = [p for p in (resource, action) if isinstance(p, str) and p]
    return EventMeta(
        event_id=body_id(body),
        event_type=event_type(".".join(parts) or None),
        occurred_at=None,
    )


PROVIDER = described("sentry", authenticate, extract, tolerance=None)
