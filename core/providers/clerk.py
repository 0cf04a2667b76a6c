"""Clerk: "Clerk uses Svix to send our webhooks": the Svix scheme and retry schedule.

The payload is ``{"type", "data", "object": "event", "timestamp" (ms)}``; the dedup id is
``svix-id`` (signed). Clerk's Python backend library has no verifier, so this is the Svix
contract, verified by the same code as the ``svix`` provider.
Docs: https://clerk.com/docs/guides/development/webhooks/overview
"""

from __future__ import annotations

from datetime import timedelta

from core.providers.base import ALL_SIGNED, Provider
from core.providers.standard import SIGNED, scheme
from core.providers.svix import SVIX_PREFIXES

# Clerk payloads carry "timestamp" in unix milliseconds.
_auth, _extract = scheme(SVIX_PREFIXES, millis=True)

PROVIDER = Provider(
    name="clerk",
    authenticate=_auth,
    extract=_extract,
    # Svix's schedule: immediately, 5 s, 5 min, 30 min, 2 h, 5 h, 10 h, 10 h.
    retry_window=timedelta(hours=27, minutes=35, seconds=5),
    citation="https://docs.svix.com/retries (Clerk: https://clerk.com/docs/guides/development/webhooks/overview)",
    signed=SIGNED,
    key_format="whsec",
    fields=ALL_SIGNED,
    summary="Svix scheme: svix-signature v1, (HMAC-SHA256 base64 over id.ts.body)",
)
