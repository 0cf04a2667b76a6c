"""Meta (Graph API webhooks: WhatsApp Cloud API, Messenger, Instagram): ``X-Hub-Signature-256``.

``sha256=<hex HMAC-SHA256(app secret, raw body)>``: https://developers.facebook.com/docs/
graph-api/webhooks/getting-started#event-notifications . Subscribing, Meta first sends
``GET ?hub.mode=subscribe&hub.verify_token=...&hub.challenge=...``; it is answered 200 with
the challenge (text/plain) when the token equals the source's ``verify_token`` option
(``--config verify_token=...``, the value typed into Meta's dashboard), 403 otherwise, and
nothing is stored (:func:`verify_get`).

A notification carries no id of its own: the id is the SHA-256 of the body (a retry repeats
it), type ``<object>.<field>`` of its first change (``whatsapp_business_account.messages``),
time ``entry[0].time``. Retries: WhatsApp Cloud API "for up to 7 days" with backoff
(https://developers.facebook.com/docs/whatsapp/cloud-api/guides/set-up-webhooks; the Graph API
page says unacknowledged notifications are dropped after 36 hours): 7 days is used.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from typing import Any, Final

from core.providers.base import (
    AuthError,
    Challenge,
    EventMeta,
    MalformedEvent,
    body_hmac,
    body_id,
    dig,
    event_id,
    event_type,
    json_object,
    occurred_at,
    one_option,
)
from core.providers.descriptions import described

MIN_VERIFY_TOKEN: Final = 16


def validate(config: Mapping[str, Any]) -> dict[str, Any]:
    one_option(config, "verify_token", required=True)
    token = config.get("verify_token")
    if not isinstance(token, str) or len(token) < MIN_VERIFY_TOKEN or not token.isprintable():
        raise ValueError(
            f"needs verify_token (at least {MIN_VERIFY_TOKEN} printable characters, the value "
            "entered as Verify Token in Meta's dashboard): --config verify_token=..."
        )
    return {"verify_token": token}


def verify_get(query: Mapping[str, str], config: Mapping[str, Any]) -> Challenge:
    """The subscription check: the challenge when mode and token match; AuthError otherwise."""
    expected = config.get("verify_token")
    token = query.get("hub.verify_token", "")
    challenge = query.get("hub.challenge", "")
    if query.get("hub.mode") != "subscribe" or not challenge:
        raise AuthError("missing_signature")
    if not isinstance(expected, str) or not hmac.compare_digest(
        token.encode("utf-8"), expected.encode("utf-8")
    ):
        raise AuthError("bad_signature")
    return Challenge(body=challenge.encode("utf-8"), content_type="text/plain")


authenticate = body_hmac("x-hub-signature-256", scheme="sha256")


def extract(
    headers: Mapping[str, str], body: bytes, config: Mapping[str, Any]
) -> EventMeta | Challenge:
    obj = json_object(body)
    entries = obj.get("entry")
    first = entries[0] if isinstance(entries, list) and entries else None
    if not isinstance(first, dict):
        raise MalformedEvent("missing_type")
    changes = first.get("changes")
    field = dig(changes[0], ("field",)) if isinstance(changes, list) and changes else None
    kind = obj.get("object")
    if not isinstance(kind, str) or not kind:
        raise MalformedEvent("missing_type")
    return EventMeta(
        event_id=event_id(body_id(body)),
        event_type=event_type(f"{kind}.{field}" if isinstance(field, str) and field else kind),
        occurred_at=occurred_at(first.get("time")),
    )


PROVIDER = described(
    "meta", authenticate, extract, tolerance=None, validate_config=validate, verify_get=verify_get
)
