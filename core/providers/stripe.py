"""Stripe: ``Stripe-Signature: t=<unix>,v1=<hex>``, HMAC-SHA256 over ``"{t}.{raw body}"``.

The whole ``whsec_...`` string is the key. Id, type and time come from the signed body (``id``,
``type``, ``created``), so a captured request replays only the same event, inside the
tolerance, and dedup catches it. Stripe's library allows 300 s in the past; we also refuse the
future, as the other schemes do. Retries: "automatically resends ... for up to three days".
Signature docs: https://docs.stripe.com/webhooks#verify-manually
"""

from __future__ import annotations

from datetime import timedelta

from core.providers.base import (
    ALL_SIGNED,
    Provider,
    json_fields,
    timestamped_header,
)

# Only v1 (a test-mode v0 is ignored) and the timestamp re-rendered as an integer, as Stripe's
# own library computes the signed line.
authenticate = timestamped_header("stripe-signature", timestamp_as_sent=False)


extract = json_fields(id="id", type="type", time="created")


PROVIDER = Provider(
    name="stripe",
    authenticate=authenticate,
    extract=extract,
    retry_window=timedelta(days=3),
    citation="https://docs.stripe.com/webhooks/process-undelivered-events",
    signed="t + body (id, type, created inside): a capture replays only the same event, "
    "within the tolerance",
    key_prefix="whsec_",
    fields=ALL_SIGNED,
    summary="Stripe-Signature t=,v1= (HMAC-SHA256 hex)",
)
