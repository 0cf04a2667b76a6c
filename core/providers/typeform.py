"""Typeform: ``Typeform-Signature: sha256=<base64 HMAC-SHA256(secret, raw body)>``.

Only the body is signed, and the id is in it (``event_id``; type ``event_type``, time
``form_response.submitted_at``): a capture replays only the same event, which dedup refuses
while its receipt lives; no timestamp is signed, so after the TTL it would be new work.
Retries: 429/408/503/423 are retried every 2-3 minutes for 10 hours; other failures 5 times
(5, 10, 20, 60, 120 min); 404/410 disable the webhook. Timeout 30 s.
Signature: https://www.typeform.com/developers/webhooks/secure-your-webhooks/
"""

from __future__ import annotations

from core.providers.base import body_hmac, json_fields, unb64
from core.providers.descriptions import described

authenticate = body_hmac("typeform-signature", scheme="sha256", decode=unb64)


extract = json_fields(id="event_id", type="event_type", time=("form_response", "submitted_at"))


PROVIDER = described("typeform", authenticate, extract, tolerance=None)
