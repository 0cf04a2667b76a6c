"""Adyen (standard payment webhooks): an HMAC inside every notification item; batched.

The body is ``{"live": ..., "notificationItems": [{"NotificationRequestItem": {...}}, ...]}``.
Each item's ``additionalData.hmacSignature`` is the base64 HMAC-SHA256, keyed by the **hex-
decoded** HMAC key, of ``pspReference:originalReference:merchantAccountCode:merchantReference:
value:currency:eventCode:success`` (missing fields empty): https://docs.adyen.com/development-
resources/webhooks/secure-webhooks/verify-hmac-signatures . Every item must verify under the
same key, or the whole request is refused (401) and nothing is stored. The items are counted
first (more than :data:`MAX_EVENTS`: 413), then each item's HMAC is checked as soon as that
item is reached, before anything else of it is read.

Only those 8 fields are signed: ``eventDate``, ``reason``, ``paymentMethod``,
``additionalData`` and the rest could be changed in a captured request. So the stored payload
of an item says which is which, ``{"signed": {...}, "unsigned": {...}}``: ``signed`` holds the
signed fields as received (``amount`` with only ``value`` and ``currency``), ``unsigned``
everything else of the item (``hmacSignature`` included). A handler that acts on money reads
``signed``; anything read from ``unsigned`` is the sender's word only as far as TLS goes.

A request becomes one receipt per item, all in one transaction, each deduplicated on
``pspReference:eventCode:success`` (signed), type ``eventCode`` (signed); ``eventDate`` is
stored as the receipt's time but, being unsigned, never anchors its expiry (the arrival does:
a back-dated replay cannot make its receipt expire early). The answer is ``[accepted]``
(text/plain), as Adyen's integrations expect. No timestamp is signed.
Retries: 3 immediate retries, then a retry queue "for up to 30 days":
https://docs.adyen.com/development-resources/webhooks/troubleshoot
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Mapping
from typing import Any, Final

import orjson

from core.providers.base import (
    DEFAULT_MAX_EVENTS,
    AuthError,
    Batch,
    Challenge,
    EventMeta,
    MalformedEvent,
    Secrets,
    TooManyEvents,
    batch_options,
    decode_signature,
    event_id,
    event_type,
    events_cap,
    json_object,
    occurred_at,
    unb64,
    unhex,
)
from core.providers.descriptions import described

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
AMOUNT_FIELDS: Final = ("value", "currency")
MIN_KEY_HEX: Final = 32
# Adyen documents no maximum number of items per request (the API reference types
# ``notificationItems`` as a plain array), so the receiver's own bound applies; a source can
# change it with ``--config max_events=N``.
MAX_EVENTS: Final = DEFAULT_MAX_EVENTS
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


def _items(body: bytes, config: Mapping[str, Any]) -> list[Any]:
    """The ``notificationItems`` entries, counted (TooManyEvents) but not yet looked into."""
    wrapped = json_object(body).get("notificationItems")  # not an object: refused unparsed
    if not isinstance(wrapped, list) or not wrapped:
        raise MalformedEvent("bad_json")
    limit = events_cap(config, MAX_EVENTS)
    if len(wrapped) > limit:
        raise TooManyEvents(limit)
    return wrapped


def _item(entry: object) -> dict[str, Any] | None:
    item = entry.get("NotificationRequestItem") if isinstance(entry, dict) else None
    return item if isinstance(item, dict) else None


def _offered(item: Mapping[str, Any]) -> bytes:
    """The item's ``additionalData.hmacSignature``, decoded; AuthError when absent or bad."""
    extra = item.get("additionalData")
    signature = extra.get("hmacSignature") if isinstance(extra, dict) else None
    if not isinstance(signature, str) or not signature:
        raise AuthError("missing_signature")
    return decode_signature(signature, decode=unb64)


def authenticate(
    headers: Mapping[str, str], body: bytes, secrets: Secrets, config: Mapping[str, Any]
) -> tuple[str, int | None]:
    """Every item verifies under one key: each item is checked when reached (the keys still
    in the running narrow as it goes), so the first forged item ends the work."""
    try:
        entries = _items(body, config)
    except TooManyEvents:
        raise
    except MalformedEvent:
        raise AuthError("missing_signature") from None
    keys = [(i, k) for i, k in ((i, unhex(s) if s else None) for i, s in secrets) if k]
    for entry in entries:
        item = _item(entry)
        if item is None:
            raise AuthError("missing_signature")
        offered = _offered(item)
        text = signed_string(item)
        keys = [
            (i, k)
            for i, k in keys
            if hmac.compare_digest(hmac.new(k, text, hashlib.sha256).digest(), offered)
        ]
        if not keys:
            raise AuthError("bad_signature")
    return keys[0][0], None


def split(item: Mapping[str, Any]) -> dict[str, Any]:
    """``{"signed": ..., "unsigned": ...}``: the item's signed fields as received (present
    ones only) and everything else, so a handler cannot mistake one for the other."""
    signed: dict[str, Any] = {}
    unsigned: dict[str, Any] = {}
    for name, value in item.items():
        if name == "amount" and isinstance(value, dict):
            covered = {k: v for k, v in value.items() if k in AMOUNT_FIELDS}
            rest = {k: v for k, v in value.items() if k not in AMOUNT_FIELDS}
            if covered:
                signed["amount"] = covered
            if rest:
                unsigned["amount"] = rest
        elif name in FIELDS:
            signed[name] = value
        else:
            unsigned[name] = value
    return {"signed": signed, "unsigned": unsigned}


def extract(
    headers: Mapping[str, str], body: bytes, config: Mapping[str, Any]
) -> EventMeta | Challenge | Batch:
    events = []
    for entry in _items(body, config):
        item = _item(entry)
        if item is None:
            raise MalformedEvent("bad_json")
        code = event_type(item.get("eventCode"))
        psp = item.get("pspReference")
        if not isinstance(psp, str) or not psp:
            raise MalformedEvent("missing_id")
        events.append(
            EventMeta(
                event_id=event_id(f"{psp}:{code}:{_text(item.get('success'))}"),
                event_type=code,
                occurred_at=occurred_at(item.get("eventDate")),
                payload=orjson.dumps(split(item)),
                content_type="application/json",
                time_signed=False,  # eventDate is not among the signed fields
            )
        )
    return Batch(events=tuple(events), answer=ACCEPTED)


def sign_item(item: Mapping[str, Any], key: str) -> str:
    """The ``hmacSignature`` of ``item`` under hex ``key`` (what Adyen computes; for tools)."""
    raw = unhex(key)
    if raw is None:
        raise ValueError("key must be hex")
    return base64.b64encode(hmac.new(raw, signed_string(item), hashlib.sha256).digest()).decode()


PROVIDER = described(
    "adyen",
    authenticate,
    extract,
    tolerance=None,
    key_format="hex",
    check_secret=check_key,
    batched=True,
    max_events=MAX_EVENTS,
    validate_config=batch_options(MAX_EVENTS),
)
