"""Bitbucket Cloud: ``X-Hub-Signature: sha256=<hex HMAC-SHA256(secret, raw body)>``.

Bitbucket added webhook secrets in 2023 (https://bitbucket.org/blog/enhanced-webhook-security);
unlike GitHub's header of the same name, the value is SHA-256 (``sha256=``), not SHA-1. Only
the body is signed: ``X-Request-UUID`` (the dedup id) and ``X-Event-Key`` (the type) are not,
so a captured request replays under a new id. A hook without a secret sends no signature and
is refused here. Retries: Bitbucket documents no automatic retry schedule or manual resend
window that we could find (not established); one day is assumed and can be overridden per
source (``--retry-window``).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from ingest.providers.base import (
    Challenge,
    EventMeta,
    Provider,
    body_hmac,
    event_id,
    event_type,
    json_object,
)

authenticate = body_hmac("x-hub-signature", scheme="sha256")


def extract(
    headers: Mapping[str, str], body: bytes, config: Mapping[str, Any]
) -> EventMeta | Challenge:
    json_object(body)  # a JSON object, or 400
    return EventMeta(
        event_id=event_id(headers.get("x-request-uuid")),
        event_type=event_type(headers.get("x-event-key")),
        occurred_at=None,
    )


PROVIDER = Provider(
    name="bitbucket",
    authenticate=authenticate,
    extract=extract,
    retry_window=timedelta(days=1),
    citation="https://support.atlassian.com/bitbucket-cloud/docs/manage-webhooks/ (no retry "
    "window documented: 1 day assumed)",
    signed="body only: X-Request-UUID (the id) is unsigned, so a capture replays under a new id",
    tolerance=None,
    summary="X-Hub-Signature sha256= (HMAC-SHA256 hex over the body)",
)
