"""Intercom: ``X-Hub-Signature: sha1=<hex HMAC-SHA1(app client secret, raw body)>``.

Only the body is signed; the notification's ``id`` (dedup), ``topic`` (type) and ``created_at``
are in it, so a capture replays only the same notification (dedup refuses it while the receipt
lives; no time is signed). Retries: Intercom documents no schedule, only that a subscription
answering errors "for more than seven days" is suspended (private apps), so seven days is
taken as the window. Docs: https://developers.intercom.com/docs/webhooks/webhook-notifications
"""

from __future__ import annotations

from core.providers.base import body_hmac, json_fields
from core.providers.descriptions import described

authenticate = body_hmac("x-hub-signature", scheme="sha1", algorithm="sha1")


extract = json_fields(id="id", type="topic", time="created_at")


PROVIDER = described("intercom", authenticate, extract, tolerance=None)
