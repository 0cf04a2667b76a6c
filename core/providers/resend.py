"""Resend: delivered through Svix, so the Svix scheme (``svix-id``/``-timestamp``/``-signature``,
HMAC-SHA256 over ``"{id}.{timestamp}.{body}"``, ``whsec_`` secret) and the Svix retry schedule.

Signature: https://resend.com/docs/webhooks/verify-webhooks-requests. Retries "follow Svix's
schedule" (the last attempt about 27 h 35 m after the first); replays from the dashboard or the
API resend the same ``svix-id``, which dedup catches while the receipt lives.
"""

from __future__ import annotations

from core.providers.descriptions import described
from core.providers.standard import scheme
from core.providers.svix import SVIX_PREFIXES

# Resend payloads: {"type", "created_at", "data"}.
_auth, _extract = scheme(SVIX_PREFIXES, time_field="created_at")

PROVIDER = described("resend", _auth, _extract, key_format="whsec")
