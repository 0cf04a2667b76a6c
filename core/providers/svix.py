"""Svix: the Standard Webhooks scheme under ``svix-id``/``svix-timestamp``/``svix-signature``.

Svix's library also accepts the ``webhook-*`` names (white-labelled senders), per header, and so
do we. ``svix-id`` is the same on every retry and resend. Retries: immediately, 5 s, 5 min,
30 min, 2 h, 5 h, 10 h, 10 h: the last attempt about 27 h 35 m 05 s after the first.
"""

from __future__ import annotations

from typing import Final

from core.providers.descriptions import described
from core.providers.standard import scheme

SVIX_PREFIXES: Final = ("svix", "webhook")

_auth, _extract = scheme(SVIX_PREFIXES)

PROVIDER = described("svix", _auth, _extract, key_format="whsec")
