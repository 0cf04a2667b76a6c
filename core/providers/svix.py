"""Svix: the Standard Webhooks scheme under ``svix-id``/``svix-timestamp``/``svix-signature``.

Svix's library also accepts the ``webhook-*`` names (white-labelled senders), per header, and so
do we. ``svix-id`` is the same on every retry and resend. Retries: immediately, 5 s, 5 min,
30 min, 2 h, 5 h, 10 h, 10 h: the last attempt about 27 h 35 m 05 s after the first.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Final

from core.providers.base import ALL_SIGNED, Provider
from core.providers.standard import SIGNED, scheme

SVIX_PREFIXES: Final = ("svix", "webhook")
SVIX_RETRY_WINDOW: Final = timedelta(hours=27, minutes=35, seconds=5)
SVIX_CITATION: Final = "https://docs.svix.com/retries"

_auth, _extract = scheme(SVIX_PREFIXES)

PROVIDER = Provider(
    name="svix",
    authenticate=_auth,
    extract=_extract,
    retry_window=SVIX_RETRY_WINDOW,
    citation=SVIX_CITATION,
    signed=SIGNED,
    key_format="whsec",
    fields=ALL_SIGNED,
    summary="svix-signature v1, (HMAC-SHA256 base64 over id.ts.body)",
)
