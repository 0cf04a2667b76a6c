"""Zoom: ``x-zm-signature: v0=<hex HMAC-SHA256(secret, "v0:{ts}:{body}")>``.

``x-zm-request-timestamp`` and the body are signed with the app's webhook secret token
(https://developers.zoom.us/docs/api/webhooks/#verify-webhook-events); 5 minutes either way.
The ``endpoint.url_validation`` handshake is answered ``{"plainToken": ..., "encryptedToken":
hex HMAC-SHA256(secret, plainToken)}`` with the secret that verified the request, and stores
nothing. It is answered only once the request's own signature verifies: the answer is an HMAC
under the same key as the signatures, so answering an unsigned request would sign an
attacker's chosen ``plainToken`` (``v0:{ts}:{body}``) for them.

Zoom sends no event id: the id is the SHA-256 of the body (``event`` + ``event_ts`` +
``payload``, repeated by a retry), type ``event``, time ``event_ts`` (ms). Retries: 3, at 5,
20 and 60 minutes after the previous attempt (85 minutes; 90 used), 3 s timeout:
https://developers.zoom.us/blog/webhook-delays/
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from typing import Any

import orjson

from core.providers.base import (
    FIVE_MINUTES,
    Challenge,
    EventMeta,
    MalformedEvent,
    body_id,
    dig,
    event_id,
    event_type,
    json_object,
    millis_time,
    versioned_timestamp_hmac,
)
from core.providers.descriptions import described

authenticate = versioned_timestamp_hmac("x-zm-signature", "x-zm-request-timestamp")


def _validation(plain: str) -> Challenge:
    def answer(secret: str) -> bytes:
        token = hmac.new(secret.encode("utf-8"), plain.encode("utf-8"), hashlib.sha256)
        return orjson.dumps({"plainToken": plain, "encryptedToken": token.hexdigest()})

    return Challenge(body=b"", content_type="application/json", sign=answer)


def extract(
    headers: Mapping[str, str], body: bytes, config: Mapping[str, Any]
) -> EventMeta | Challenge:
    obj = json_object(body)
    kind = obj.get("event")
    if kind == "endpoint.url_validation":
        plain = dig(obj, ("payload", "plainToken"))
        if not isinstance(plain, str) or not plain:
            raise MalformedEvent("bad_challenge")
        return _validation(plain)
    return EventMeta(
        event_id=event_id(body_id(body)),
        event_type=event_type(kind),
        occurred_at=millis_time(obj.get("event_ts")),
    )


PROVIDER = described("zoom", authenticate, extract, tolerance=FIVE_MINUTES)
