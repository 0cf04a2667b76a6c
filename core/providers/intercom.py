"""Intercom: ``X-Hub-Signature: sha1=<hex HMAC-SHA1(app client secret, raw body)>``.

Only the body is signed; the notification's ``id`` (dedup), ``topic`` (type) and ``created_at``
are in it, so a capture replays only the same notification (dedup refuses it while the receipt
lives; no time is signed). Retries: Intercom documents no schedule, only that a subscription
answering errors "for more than seven days" is suspended (private apps), so seven days is
taken as the window. Docs: https://developers.intercom.com/docs/webhooks/webhook-notifications
"""

from __future__ import annotations

from datetime import timedelta

from core.providers.base import (
    ALL_SIGNED,
    Provider,
    body_hmac,
    json_fields,
)

authenticate = body_hmac("x-hub-signature", scheme="sha1", algorithm="sha1")


extract = json_fields(id="id", type="topic", time="created_at")


PROVIDER = Provider(
    name="intercom",
    authenticate=authenticate,
    extract=extract,
    retry_window=timedelta(days=7),
    citation="https://developers.intercom.com/docs/webhooks/webhook-notifications (suspended "
    "after 7 days of errors; no schedule published)",
    signed="body (id inside): a capture replays only the same notification; no signed time",
    tolerance=None,
    fields=ALL_SIGNED,
    summary="X-Hub-Signature sha1= (HMAC-SHA1 hex of the body)",
)
