"""Standard Webhooks: ``webhook-id``, ``webhook-timestamp``, ``webhook-signature: v1,<b64>``.

HMAC-SHA256 over ``"{id}.{timestamp}.{raw body}"`` keyed by the base64-decoded ``whsec_``
secret, computed by the ``standardwebhooks`` library itself. The id is signed, so a capture
replays only the same id (dedup) within the 5-minute tolerance (both directions, as the
libraries). :func:`scheme` builds the same contract for senders that use it under other
header names (Svix and the senders delivering through Svix: Resend, Clerk).
Spec: https://github.com/standard-webhooks/standard-webhooks/blob/main/spec/standard-webhooks.md
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Final

from standardwebhooks.webhooks import EmptyWebhookSecretError, Webhook

from core.providers.base import (
    AuthError,
    AuthFn,
    Challenge,
    EventMeta,
    ExtractFn,
    Secrets,
    event_id,
    event_type,
    first_match,
    json_object,
    occurred_at,
    unb64,
    unix,
)
from core.providers.descriptions import described

# Signers per secret (Webhook() base64-decodes the secret). Small, and cleared when full.
_MAX_CACHED: Final = 1024
_SIGNERS: dict[str, Any] = {}
_MISSING: Final = object()


def _signer(secret: str) -> Any:
    """The cached ``standardwebhooks.Webhook`` for ``secret``; None if it cannot be a key."""
    signer = _SIGNERS.get(secret, _MISSING)
    if signer is not _MISSING:
        return signer
    try:
        signer = Webhook(secret)
    except (ValueError, RuntimeError, EmptyWebhookSecretError):  # not base64, or empty
        signer = None
    if len(_SIGNERS) >= _MAX_CACHED:
        _SIGNERS.clear()
    _SIGNERS[secret] = signer
    return signer


def _headers(
    headers: Mapping[str, str], prefixes: tuple[str, ...]
) -> tuple[str | None, str | None, str | None]:
    """(id, timestamp, signature), each from the first prefix that has it (as Svix's lib)."""

    def first(name: str) -> str | None:
        for prefix in prefixes:
            value = headers.get(f"{prefix}-{name}")
            if value:
                return value
        return None

    return first("id"), first("timestamp"), first("signature")


def scheme(
    prefixes: tuple[str, ...], *, time_field: str = "timestamp", millis: bool = False
) -> tuple[AuthFn, ExtractFn]:
    """Authenticate and extract for the Standard Webhooks scheme under header ``prefixes``;
    the event time is the body's ``time_field`` (unix milliseconds when ``millis``)."""

    def authenticate(
        headers: Mapping[str, str], body: bytes, secrets: Secrets, config: Mapping[str, Any]
    ) -> tuple[str, int | None]:
        msg_id, ts_text, signature = _headers(headers, prefixes)
        if not signature:
            raise AuthError("missing_signature")
        if not ts_text:
            raise AuthError("missing_timestamp")
        if not msg_id:
            raise AuthError("missing_id")
        timestamp = unix(ts_text)
        offered: list[bytes] = []
        for entry in signature.split(" "):
            version, _, value = entry.partition(",")
            if version == "v1":  # v1a (ed25519) is not supported by the Python library
                decoded = unb64(value)
                if decoded is not None:
                    offered.append(decoded)
        if not offered:
            raise AuthError("malformed_signature")
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            # The library signs text; no sender using it can have signed these bytes.
            raise AuthError("bad_signature") from None
        when = datetime.fromtimestamp(timestamp, UTC)

        def digest(secret: str) -> bytes | None:
            signer = _signer(secret)
            if signer is None:
                return None
            signed = str(signer.sign(msg_id, when, text))  # "v1,<base64>"
            return base64.b64decode(signed.partition(",")[2])

        return first_match(secrets, offered, digest), timestamp

    def extract(
        headers: Mapping[str, str], body: bytes, config: Mapping[str, Any]
    ) -> EventMeta | Challenge:
        the_id = event_id(_headers(headers, prefixes)[0])
        obj = json_object(body)
        return EventMeta(
            event_id=the_id,
            event_type=event_type(obj.get("type")),
            occurred_at=_time(obj.get(time_field), millis),
        )

    return authenticate, extract


def _time(value: object, millis: bool) -> datetime | None:
    if millis and isinstance(value, int) and not isinstance(value, bool):
        return occurred_at(value / 1000)
    return occurred_at(value)


_auth, _extract = scheme(("webhook",))

PROVIDER = described("standard", _auth, _extract, key_format="whsec")
