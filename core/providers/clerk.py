"""Clerk: "Clerk uses Svix to send our webhooks": the Svix scheme and retry schedule.

The payload is ``{"type", "data", "object": "event", "timestamp" (ms)}``; the dedup id is
``svix-id`` (signed). Clerk's Python backend library has no verifier, so this is the Svix
contract, verified by the same code as the ``svix`` provider.
Docs: https://clerk.com/docs/guides/development/webhooks/overview
"""

from __future__ import annotations

from core.providers.descriptions import described
from core.providers.standard import scheme
from core.providers.svix import SVIX_PREFIXES

# Clerk payloads carry "timestamp" in unix milliseconds.
_auth, _extract = scheme(SVIX_PREFIXES, millis=True)

PROVIDER = described("clerk", _auth, _extract, key_format="whsec")
