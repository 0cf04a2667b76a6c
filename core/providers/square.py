"""Square: ``x-square-hmacsha256-signature: base64 HMAC-SHA256(key, notification URL + body)``.

The key is the subscription's signature key (used as text); the URL is the notification URL
configured at Square, taken from ``--config public_url=...`` (never from the request's Host
header), so a request signed for another endpoint is refused. No timestamp is signed; the id
is the body's ``event_id`` ("a generated idempotency value"), type ``type``, time
``created_at``. https://developer.squareup.com/docs/webhooks/step3validate . Retries: "for up
to 72 hours after the originating event" (one version of the troubleshooting page says 24 h;
the larger is used): https://developer.squareup.com/docs/webhooks-api/delivery-sla
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from core.providers import urlsigned
from core.providers.base import (
    AuthError,
    Secrets,
    first_match,
    hmac_of,
    json_fields,
    signature_header,
    unb64,
)
from core.providers.descriptions import described


def authenticate(
    headers: Mapping[str, str], body: bytes, secrets: Secrets, config: Mapping[str, Any]
) -> tuple[str, int | None]:
    decoded = signature_header(headers, "x-square-hmacsha256-signature", decode=unb64)
    try:
        url = urlsigned.public_url(config).encode("utf-8")
    except ValueError:
        raise AuthError("bad_signature") from None
    return first_match(secrets, (decoded,), hmac_of("sha256", url, body)), None


extract = json_fields(id="event_id", type="type", time="created_at")


PROVIDER = described(
    "square",
    authenticate,
    extract,
    tolerance=None,
    validate_config=urlsigned.validate,
    signs_url=True,
)
