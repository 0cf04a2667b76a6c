"""Discord (webhook events and interactions): Ed25519 over ``X-Signature-Timestamp + body``.

The "secret" is the application's **public key** (Developer Portal, General Information): 64
hex characters, the raw 32-byte Ed25519 key (:func:`check_key`). ``X-Signature-Ed25519`` is the
hex signature of the timestamp header's text followed by the raw body:
https://discord.com/developers/docs/interactions/overview#setting-up-an-endpoint-validating-
security-request-headers . Knowing the key lets one verify, not sign, so it is not sensitive,
but it is stored like any secret and can be rotated the same way. Discord documents no
tolerance; 5 minutes either way is applied to the signed timestamp.

Handshakes, answered and never stored: an interaction ``PING`` (``type`` 1, no ``version``) is
answered ``{"type": 1}`` (PONG); a webhook-event ``PING`` (``version`` 1, ``type`` 0) is
answered 204 with no body. Webhook events (``type`` 1) are stored: type ``event.type``
(``APPLICATION_AUTHORIZED``...), time ``event.timestamp``; they carry no id, so the id is the
SHA-256 of the body (a resend repeats it). Other interactions (commands, ``type`` 2+) are
stored under their ``id`` but Discord expects an interaction response in 3 s, which this
receiver does not give: use webhook events, not the interactions endpoint, for those.
Retries: not documented for webhook events (not established); one day is assumed:
https://discord.com/developers/docs/events/webhook-events
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from core.providers.base import (
    Challenge,
    EventMeta,
    Secrets,
    body_id,
    dig,
    event_id,
    event_type,
    first_verified,
    json_object,
    occurred_at,
    timestamped_signature,
    unhex,
)
from core.providers.descriptions import described

KEY_HEX_CHARS: Final = 64
SIGNATURE_BYTES: Final = 64
_KEYS: dict[str, Ed25519PublicKey | None] = {}


def check_key(key: str) -> None:
    """A Discord public key is 64 hex characters (32 bytes); ValueError otherwise."""
    if len(key) != KEY_HEX_CHARS or unhex(key) is None:
        raise ValueError(
            "a discord key is the application's public key: 64 hex characters "
            "(Developer Portal > General Information > Public Key)"
        )


def _public_key(key: str) -> Ed25519PublicKey | None:
    if key not in _KEYS:
        raw = unhex(key) if len(key) == KEY_HEX_CHARS else None
        if len(_KEYS) > 1024:
            _KEYS.clear()
        _KEYS[key] = None if raw is None else Ed25519PublicKey.from_public_bytes(raw)
    return _KEYS[key]


def _signature(value: str) -> bytes | None:
    """An Ed25519 signature: 64 bytes, in hex; None otherwise."""
    raw = unhex(value)
    return raw if raw is not None and len(raw) == SIGNATURE_BYTES else None


def authenticate(
    headers: Mapping[str, str], body: bytes, secrets: Secrets, config: Mapping[str, Any]
) -> tuple[str, int | None]:
    signature, ts_text, timestamp = timestamped_signature(
        headers, "x-signature-ed25519", "x-signature-timestamp", decode=_signature
    )
    message = ts_text.encode("ascii") + body
    secret_id = first_verified(
        secrets, _public_key, lambda public: public.verify(signature, message)
    )
    return secret_id, timestamp


def extract(
    headers: Mapping[str, str], body: bytes, config: Mapping[str, Any]
) -> EventMeta | Challenge:
    obj = json_object(body)
    kind = obj.get("type")
    if "version" in obj:  # a webhook event
        if kind == 0:
            return Challenge(body=b"", content_type="text/plain", status=204)
        return EventMeta(
            event_id=event_id(body_id(body)),
            event_type=event_type(dig(obj, ("event", "type"))),
            occurred_at=occurred_at(dig(obj, ("event", "timestamp"))),
        )
    if kind == 1:  # interaction PING
        return Challenge(body=b'{"type":1}', content_type="application/json")
    return EventMeta(
        event_id=event_id(obj.get("id")),
        event_type=event_type(f"interaction.{kind}"),
        occurred_at=None,
    )


PROVIDER = described("discord", authenticate, extract, key_format="ed25519", check_secret=check_key)
