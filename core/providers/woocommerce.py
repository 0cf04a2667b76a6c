"""WooCommerce: ``X-WC-Webhook-Signature: <base64 HMAC-SHA256(secret, raw body)>``.

Only the body is signed. The dedup id ``X-WC-Webhook-Delivery-ID`` and the topic
(``X-WC-Webhook-Topic``, e.g. ``order.created``) are not: a captured request can be replayed
under a new delivery id, forever (no timestamp), and under another topic (``order.updated``
fires those routes). The body (the resource) does not name the topic, so nothing signed can
stand in. Mitigations: TLS, rotating the webhook secret,
handlers idempotent on the resource's own ``id`` and ``date_modified``. When a webhook is
saved, WooCommerce posts a signed ping (form body ``webhook_id=N``): answered 200, not stored.

Retries: WooCommerce delivers once (a failure is counted, and the webhook is disabled after 5
consecutive failures); no retry window is documented. One day is assumed, to cover a delivery
re-sent by hand or by a queue in front of the store.
Source: woocommerce includes/class-wc-webhook.php (deliver, failed_delivery).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

from core.providers.base import (
    Challenge,
    EventMeta,
    body_hmac,
    from_headers,
    unb64,
)
from core.providers.descriptions import described

_PING: Final = re.compile(rb"webhook_id=\d{1,20}")


authenticate = body_hmac("x-wc-webhook-signature", decode=unb64)
_headers = from_headers(id="x-wc-webhook-delivery-id", type="x-wc-webhook-topic")


def extract(
    headers: Mapping[str, str], body: bytes, config: Mapping[str, Any]
) -> EventMeta | Challenge:
    if _PING.fullmatch(body):
        return Challenge(body=b"", content_type="text/plain")
    return _headers(headers, body, config)


PROVIDER = described("woocommerce", authenticate, extract, tolerance=None)
