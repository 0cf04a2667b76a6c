"""Stripe: ``Stripe-Signature: t=<unix>,v1=<hex>``, HMAC-SHA256 over ``"{t}.{raw body}"``.

The whole ``whsec_...`` string is the key. Id, type and time come from the signed body (``id``,
``type``, ``created``), so a captured request replays only the same event, inside the
tolerance, and dedup catches it. Stripe's library allows 300 s in the past; we also refuse the
future, as the other schemes do. Retries: "automatically resends ... for up to three days".
Signature docs: https://docs.stripe.com/webhooks#verify-manually
"""

from __future__ import annotations

from core.providers.base import json_fields, timestamped_header
from core.providers.descriptions import described

# Only v1 (a test-mode v0 is ignored) and the timestamp re-rendered as an integer, as Stripe's
# own library computes the signed line.
authenticate = timestamped_header("stripe-signature", timestamp_as_sent=False)


extract = json_fields(id="id", type="type", time="created")


PROVIDER = described("stripe", authenticate, extract, key_prefix="whsec_")
