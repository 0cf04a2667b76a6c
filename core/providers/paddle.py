"""Paddle Billing: ``Paddle-Signature: ts=<unix>;h1=<hex>[;h1=<hex>...]``.

HMAC-SHA256 keyed by the notification destination's secret (``pdl_ntfset_...``, as text) over
``"{ts}:{raw body}"``; several ``h1`` values are allowed (Paddle's rotation). The timestamp is
signed and Paddle's SDK allows 5 seconds either way, which is the default here (raise it per
source with ``--tolerance`` if clocks drift). Id/type/time from the signed body: ``event_id``,
``event_type``, ``occurred_at``; a manual replay sends a new ``notification_id`` with the same
``event_id``, which dedup catches. A capture replays only the same event, within 5 s.
Retries (live): "up to 60 times over 3 days"; answer within 5 s.
Signature: https://developer.paddle.com/webhooks/about/signature-verification
"""

from __future__ import annotations

from datetime import timedelta

from core.providers.base import json_fields, timestamped_header
from core.providers.descriptions import described

authenticate = timestamped_header(
    "paddle-signature", pair_sep=";", timestamp_key="ts", signature_key="h1", joiner=b":"
)


extract = json_fields(id="event_id", type="event_type", time="occurred_at")


PROVIDER = described("paddle", authenticate, extract, tolerance=timedelta(seconds=5))
