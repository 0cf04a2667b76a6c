"""SendGrid Event Webhook (signed): ECDSA P-256 over timestamp + body, with SendGrid's public key.

``X-Twilio-Email-Event-Webhook-Signature`` is the base64 DER ECDSA/SHA-256 signature of
``X-Twilio-Email-Event-Webhook-Timestamp`` followed by the raw body; it verifies with the
verification key shown under Mail Settings > Signed Event Webhook, the base64 of a P-256
SubjectPublicKeyInfo, which is this source's "secret" (:func:`check_key`):
https://www.twilio.com/docs/sendgrid/for-developers/tracking-events/getting-started-event-
webhook-security-features . SendGrid documents no tolerance; 5 minutes either way is applied.

The body is a JSON array of events: a request becomes one receipt per event, all in one
transaction, each deduplicated on its own ``sg_event_id`` ("unique for every event"), payload
the event object, type ``event``, time ``timestamp``. Retries: "for up to 24 hours after the
event occurs": https://docs.sendgrid.com/for-developers/tracking-events/troubleshooting
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any, Final

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_der_public_key

from core.providers.base import (
    DEFAULT_MAX_EVENTS,
    Secrets,
    batch_options,
    first_verified,
    json_batch,
    timestamped_signature,
    unb64,
)
from core.providers.descriptions import described

_KEYS: dict[str, ec.EllipticCurvePublicKey | None] = {}
# SendGrid bounds a batch by time and size ("every 30 seconds or when the batch size reaches
# 768 kilobytes", https://www.twilio.com/docs/sendgrid/for-developers/tracking-events/event),
# not by count, so the receiver's own bound applies. A busy account's full batch of small
# events can exceed it (413, and SendGrid retries the same batch): such a source sets
# ``--config max_events=N`` (up to MAX_EVENTS_CEILING).
MAX_EVENTS: Final = DEFAULT_MAX_EVENTS


def _load(key: str) -> ec.EllipticCurvePublicKey:
    try:
        public = load_der_public_key(base64.b64decode(key, validate=True))
    except (binascii.Error, ValueError, UnsupportedAlgorithm):
        raise ValueError("not a base64 public key") from None
    if not isinstance(public, ec.EllipticCurvePublicKey) or public.curve.name != "secp256r1":
        raise ValueError("not a P-256 key")
    return public


def check_key(key: str) -> None:
    """The verification key: base64 of a P-256 public key (SPKI DER); ValueError otherwise."""
    try:
        _load(key)
    except ValueError:
        raise ValueError(
            "a sendgrid key is the Signed Event Webhook verification key: the base64 of a "
            "P-256 public key (Mail Settings > Signed Event Webhook Requests)"
        ) from None


def _public_key(key: str) -> ec.EllipticCurvePublicKey | None:
    if key not in _KEYS:
        try:
            loaded: ec.EllipticCurvePublicKey | None = _load(key)
        except ValueError:
            loaded = None
        if len(_KEYS) > 1024:
            _KEYS.clear()
        _KEYS[key] = loaded
    return _KEYS[key]


def authenticate(
    headers: Mapping[str, str], body: bytes, secrets: Secrets, config: Mapping[str, Any]
) -> tuple[str, int | None]:
    signature, ts_text, timestamp = timestamped_signature(
        headers,
        "x-twilio-email-event-webhook-signature",
        "x-twilio-email-event-webhook-timestamp",
        decode=unb64,
    )
    message = ts_text.encode("ascii") + body
    ecdsa = ec.ECDSA(hashes.SHA256())
    secret_id = first_verified(
        secrets, _public_key, lambda key: key.verify(signature, message, ecdsa)
    )
    return secret_id, timestamp


extract = json_batch(id="sg_event_id", type="event", time="timestamp", max_events=MAX_EVENTS)


PROVIDER = described(
    "sendgrid",
    authenticate,
    extract,
    key_format="p256",
    check_secret=check_key,
    batched=True,
    max_events=MAX_EVENTS,
    validate_config=batch_options(MAX_EVENTS),
)
