"""HubSpot (webhooks API, signature v3): ``X-HubSpot-Signature-v3``.

base64 HMAC-SHA256, keyed by the app's client secret, over ``method + URI + body +
X-HubSpot-Request-Timestamp`` (UTF-8; the timestamp is in milliseconds and must be within 5
minutes): https://developers.hubspot.com/docs/api/webhooks/validating-requests . The URI is the
target URL configured at HubSpot, from ``--config public_url=...`` (never the Host header), with
the percent-escapes HubSpot's page lists decoded; the method is POST, the only one this route
takes. The body is a JSON array of up to 100 events, so a request becomes one receipt per
event, each deduplicated on its own ``eventId`` (the same on every retry; ``attemptNumber``
counts them), type ``subscriptionType``, time ``occurredAt`` (ms). Retries: "up to 10 times"
spread over the next 24 hours, 5 s timeout: https://developers.hubspot.com/docs/api/webhooks
(#retries; not re-verified against the current page).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from core.providers import urlsigned
from core.providers.base import (
    FIVE_MINUTES,
    MAX_UNIX_DIGITS,
    AuthError,
    Secrets,
    first_match,
    header,
    hmac_of,
    json_batch,
    millis_time,
    unb64,
)
from core.providers.descriptions import described

# The escapes HubSpot decodes in the URI before signing (its validating-requests page).
_DECODE: Final = {
    "%3A": ":", "%2F": "/", "%3F": "?", "%40": "@", "%21": "!", "%24": "$", "%27": "'",
    "%28": "(", "%29": ")", "%2A": "*", "%2C": ",", "%3B": ";",
}  # fmt: skip
# "Each request ... can contain up to 100 events" (batched by HubSpot):
# https://developers.hubspot.com/docs/api/webhooks (#webhook-payloads; not re-verified here).
MAX_EVENTS: Final = 100


def signed_uri(url: str) -> str:
    for escape, char in _DECODE.items():
        url = url.replace(escape, char).replace(escape.lower(), char)
    return url


def authenticate(
    headers: Mapping[str, str], body: bytes, secrets: Secrets, config: Mapping[str, Any]
) -> tuple[str, int | None]:
    decoded = unb64(header(headers, "x-hubspot-signature-v3"))
    ts_text = header(headers, "x-hubspot-request-timestamp", "missing_timestamp")
    if not (0 < len(ts_text) <= MAX_UNIX_DIGITS + 3 and ts_text.isascii() and ts_text.isdigit()):
        raise AuthError("malformed_timestamp")  # milliseconds
    millis = int(ts_text)
    if decoded is None:
        raise AuthError("malformed_signature")
    try:
        uri = signed_uri(urlsigned.public_url(config))
    except ValueError:
        raise AuthError("bad_signature") from None
    prefix = b"POST" + uri.encode("utf-8")
    digest = hmac_of("sha256", prefix, body, ts_text.encode("ascii"))
    return first_match(secrets, (decoded,), digest), millis // 1000


extract = json_batch(
    id="eventId",
    type="subscriptionType",
    time="occurredAt",
    max_events=MAX_EVENTS,
    read_time=millis_time,
)


PROVIDER = described(
    "hubspot",
    authenticate,
    extract,
    tolerance=FIVE_MINUTES,
    validate_config=urlsigned.validate,
    signs_url=True,
    batched=True,
    max_events=MAX_EVENTS,
)
