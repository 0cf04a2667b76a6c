"""Adyen (standard payment webhooks): an HMAC inside every notification item; batched.

The body is ``{"live": ..., "notificationItems": [{"NotificationRequestItem": {...}}, ...]}``.
Each item's ``additionalData.hmacSignature`` is the base64 HMAC-SHA256, keyed by the **hex-
decoded** HMAC key, of ``pspReference:originalReference:merchantAccountCode:merchantReference:
value:currency:eventCode:success`` (missing fields empty): https://docs.adyen.com/development-
resources/webhooks/secure-webhooks/verify-hmac-signatures . Every item must verify under the
same key, or the whole request is refused (401) and nothing is stored.

A request becomes one receipt per item, all in one transaction, each deduplicated on
``pspReference:eventCode:success`` (an item is not otherwise identified), payload the item's
own ``NotificationRequestItem``, type ``eventCode``, time ``eventDate``; the answer is
``[accepted]`` (text/plain), as Adyen's integrations expect. No timestamp is signed.
Retries: 3 immediate retries, then a retry queue "for up to 30 days":
https://docs.adyen.com/development-resources/webhooks/troubleshoot
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Final

import orjson

from ingest.providers.base import (
    AuthError,
    Batch,
    Challenge,
    EventMeta,
    MalformedEvent,
    Provider,
    Secrets,
    dig,
    event_id,
    event_type,
    occurred_at,
    unb64,
    unhex,
)

FIELDS: Final = (
    "pspReference",
    "originalReference",
    "merchantAccountCode",
    "merchantReference",
    "value",
    "currency",
    "eventCode",
    "success",
)
MIN_KEY_HEX: Final = 32
ACCEPTED: Final = Challenge(body=b"[accepted]", content_type="text/plain")


def check_key(key: str) -> None:
    """An Adyen HMAC key is hex (Customer Area > Webhooks > HMAC key); ValueError otherwise."""
    if len(key) < MIN_KEY_HEX or len(key) % 2 or unhex(key) is None:
        raise ValueError(
            f"an adyen key is the webhook's HMAC key: hex, at least {MIN_KEY_HEX} characters"
        )


def _text(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def signed_string(item: Mapping[str, Any]) -> bytes:
    found = item.get("amount")
    amount: Mapping[str, Any] = found if isinstance(found, dict) else {}
    values = {**item, "value": amount.get("value"), "currency": amount.get("currency")}
    return ":".join(_text(values.get(name)) for name in FIELDS).encode("utf-8")


def _items(body: bytes) -> list[dict[str, Any]]:
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise MalformedEvent("bad_json") from None
    wrapped = obj.get("notificationItems") if isinstance(obj, dict) else None
    if not isinstance(wrapped, list) or not wrapped:
        raise MalformedEvent("bad_json")
    items = []
    for entry in wrapped:
        item = entry.get("NotificationRequestItem") if isinstance(entry, dict) else None
        if not isinstance(item, dict):
            raise MalformedEvent("bad_json")
        items.append(item)
    return items


def authenticate(
    headers: Mapping[str, str], body: bytes, secrets: Secrets, config: Mapping[str, Any]
) -> tuple[str, int | None]:
    try:
        items = _items(body)
    except MalformedEvent:
        raise AuthError("missing_signature") from None
    offered = []
    for item in items:
        signature = dig(item, ("additionalData", "hmacSignature"))
        if not isinstance(signature, str) or not signature:
            raise AuthError("missing_signature")
        decoded = unb64(signature)
        if decoded is None:
            raise AuthError("malformed_signature")
        offered.append((signed_string(item), decoded))
    for secret_id, secret in secrets:
        key = unhex(secret) if secret else None
        if key is None:
            continue
        if all(
            hmac.compare_digest(hmac.new(key, text, hashlib.sha256).digest(), sig)
            for text, sig in offered
        ):
            return secret_id, None
    raise AuthError("bad_signature")


def extract(
    headers: Mapping[str, str], body: bytes, config: Mapping[str, Any]
) -> EventMeta | Challenge | Batch:
    events = []
    for item in _items(body):
        code = event_type(item.get("eventCode"))
        psp = item.get("pspReference")
        if not isinstance(psp, str) or not psp:
            raise MalformedEvent("missing_id")
        events.append(
            EventMeta(
                event_id=event_id(f"{psp}:{code}:{_text(item.get('success'))}"),
                event_type=code,
                occurred_at=occurred_at(item.get("eventDate")),
                payload=orjson.dumps(item),
                content_type="application/json",
            )
        )
    return Batch(events=tuple(events), answer=ACCEPTED)


def sign_item(item: Mapping[str, Any], key: str) -> str:
    """The ``hmacSignature`` of ``item`` under hex ``key`` (what Adyen computes; for tools)."""
    raw = unhex(key)
    if raw is None:
        raise ValueError("key must be hex")
    return base64.b64encode(hmac.new(raw, signed_string(item), hashlib.sha256).digest()).decode()


PROVIDER = Provider(
    name="adyen",
    authenticate=authenticate,
    extract=extract,
    retry_window=timedelta(days=30),
    citation="https://docs.adyen.com/development-resources/webhooks/troubleshoot",
    signed="each item's psp/original/merchant references, amount, eventCode, success (not the "
    "whole body): a capture replays only the same items (same ids)",
    tolerance=None,
    key_format="hex",
    check_secret=check_key,
    batched=True,
    handshake="answers [accepted]",
    summary="item additionalData.hmacSignature (HMAC-SHA256 base64, hex key), batched",
)
