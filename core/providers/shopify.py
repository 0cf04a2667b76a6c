"""Shopify: ``X-Shopify-Hmac-Sha256: base64 HMAC-SHA256(app client secret, raw body)``.

Only the body is signed. ``X-Shopify-Webhook-Id`` (the dedup id the docs recommend), the topic
and ``X-Shopify-Triggered-At`` are not: a captured request can be replayed under a new webhook
id, forever (no timestamp is signed), and under another topic: a captured ``orders/create``
body re-sent with ``X-Shopify-Topic: orders/paid`` runs the routes for paid orders. The body
does not name its topic, so nothing signed can stand in: the topic is recorded as unsigned
(``events show`` and the console say so) and ``routes add`` warns for a route on one. Route on
the topic only for work a forged topic cannot abuse, or check the order's state in the
handler. The triggered-at time is
stored but, unsigned, never anchors the receipt's expiry.
Mitigations: TLS, rotating the client secret when it may be exposed, handlers idempotent on the
payload's object ids. Retries: "8 times over 4 hours".
"""

from __future__ import annotations

from core.providers.base import (
    Config,
    body_hmac,
    from_headers,
    unb64,
)
from core.providers.descriptions import described

authenticate = body_hmac("x-shopify-hmac-sha256", decode=unb64)


# Ids live in headers; the body (JSON or XML, by subscription) is not parsed at all.
extract = from_headers(
    id="x-shopify-webhook-id", type="x-shopify-topic", time="x-shopify-triggered-at"
)


def unsigned_type(config: Config, pattern: str) -> str | None:
    """Every topic is the unsigned ``X-Shopify-Topic``."""
    return "X-Shopify-Topic"


PROVIDER = described("shopify", authenticate, extract, tolerance=None, type_rule=unsigned_type)
