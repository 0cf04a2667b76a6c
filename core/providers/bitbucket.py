"""Bitbucket Cloud: ``X-Hub-Signature: sha256=<hex HMAC-SHA256(secret, raw body)>``.

Bitbucket added webhook secrets in 2023 (https://bitbucket.org/blog/enhanced-webhook-security);
unlike GitHub's header of the same name, the value is SHA-256 (``sha256=``), not SHA-1. Only
the body is signed: ``X-Request-UUID`` (the dedup id) and ``X-Event-Key`` (the type) are not,
so a captured request replays under a new id, and under another event key (which changes the
routes it runs). Bitbucket Data Center also puts the event key in the signed body
(``eventKey``, https://confluence.atlassian.com/bitbucketserver/event-payload-938025882.html):
``--config type_from_body=true`` takes the type from there and ignores the header; a body
without ``eventKey`` (Bitbucket Cloud's) is then refused (400 missing_type).
A hook without a secret sends no signature and is refused here. Retries: Bitbucket documents no
automatic retry schedule or manual resend
window that we could find (not established); one day is assumed and can be overridden per
source (``--retry-window``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from core.providers.base import (
    SIGNED_FIELD,
    UNSIGNED_FIELD,
    Challenge,
    EventMeta,
    body_hmac,
    event_id,
    event_type,
    json_object,
    one_option,
)
from core.providers.descriptions import described

authenticate = body_hmac("x-hub-signature", scheme="sha256")

_TRUE: Final = frozenset({"true", "1", "yes", "on"})
_FALSE: Final = frozenset({"false", "0", "no", "off"})


def validate_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """One option, ``type_from_body`` (true/false): see the module's doc."""
    one_option(config, "type_from_body")
    if "type_from_body" not in config:
        return {}
    value = config["type_from_body"]
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        value = value.strip().lower() in _TRUE
    if not isinstance(value, bool):
        raise ValueError("option 'type_from_body' must be true or false")
    return {"type_from_body": value} if value else {}


def fields(config: Mapping[str, Any]) -> Mapping[str, str]:
    signed_type = config.get("type_from_body") is True
    return {"id": UNSIGNED_FIELD, "type": SIGNED_FIELD if signed_type else UNSIGNED_FIELD}


def unsigned_type(config: Mapping[str, Any], pattern: str) -> str | None:
    """``X-Event-Key`` unless ``type_from_body`` is set."""
    return None if config.get("type_from_body") is True else "X-Event-Key"


def extract(
    headers: Mapping[str, str], body: bytes, config: Mapping[str, Any]
) -> EventMeta | Challenge:
    obj = json_object(body)  # a JSON object, or 400
    if config.get("type_from_body") is True:
        raw_type = obj.get("eventKey")  # signed
    else:
        raw_type = headers.get("x-event-key")
    return EventMeta(
        event_id=event_id(headers.get("x-request-uuid")),
        event_type=event_type(raw_type),
        occurred_at=None,
    )


PROVIDER = described(
    "bitbucket",
    authenticate,
    extract,
    tolerance=None,
    validate_config=validate_config,
    fields_rule=fields,
    type_rule=unsigned_type,
)
