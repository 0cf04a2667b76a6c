"""GitHub: ``X-Hub-Signature-256: sha256=<hex HMAC-SHA256(secret, raw body)>``.

Only the body is signed. The delivery id ``X-GitHub-Delivery`` (the dedup id, the same on a
redelivery) and the event header ``X-GitHub-Event`` are not: a captured request can be
replayed with a new delivery id and is then accepted as a new event, forever (no timestamp is
signed), and with another event header, which changes the type (``{event}.{action}``) and so
the routes it runs. The body carries only the ``action``, not the event's name.

``--config hook_event=NAME`` (for a hook subscribed to that one event, e.g. ``issues``) takes
the type from signed parts only: ``NAME.{action}`` with ``action`` from the body, or
``ping`` for GitHub's ping (its body carries ``hook`` and ``zen``). ``X-GitHub-Event`` is then
only checked: a delivery naming another event is refused (400 bad_type), nothing written. What
mitigates it: TLS (a capture needs the plaintext), a secret per source rotated when exposed,
and handlers that are idempotent on the payload's own object ids. GitHub does not retry
automatically; a delivery from the past 3 days can be redelivered by hand (same id).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final
from urllib.parse import parse_qs

from core.providers.base import (
    SIGNED_FIELD,
    UNSIGNED_FIELD,
    Challenge,
    EventMeta,
    MalformedEvent,
    body_hmac,
    event_id,
    event_type,
    json_object,
    one_option,
)
from core.providers.descriptions import described

authenticate = body_hmac("x-hub-signature-256", scheme="sha256")

# GitHub's event names: lower-case words joined by underscores (pull_request_review).
_EVENT_NAME: Final = re.compile(r"[a-z][a-z0-9_]{0,63}")


def validate_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """One option, ``hook_event``: the single event the hook sends (see the module's doc)."""
    one_option(config, "hook_event")
    if "hook_event" not in config:
        return {}
    value = config["hook_event"]
    if not isinstance(value, str) or not _EVENT_NAME.fullmatch(value.strip()):
        raise ValueError(
            "option 'hook_event' must be the one GitHub event the hook sends, e.g. issues or "
            "pull_request (lower case, underscores)"
        )
    return {"hook_event": value.strip()}


def fields(config: Mapping[str, Any]) -> Mapping[str, str]:
    signed_type = bool(config.get("hook_event"))
    return {"id": UNSIGNED_FIELD, "type": SIGNED_FIELD if signed_type else UNSIGNED_FIELD}


def _payload(headers: Mapping[str, str], body: bytes) -> dict[str, Any]:
    """The JSON payload; GitHub can also be set to send it as the form field ``payload``."""
    content_type = headers.get("content-type", "")
    if content_type.startswith("application/x-www-form-urlencoded"):
        try:
            fields = parse_qs(body.decode("utf-8"), strict_parsing=True)
        except (UnicodeDecodeError, ValueError):
            raise MalformedEvent("bad_json") from None
        payload = fields.get("payload")
        if not payload:
            raise MalformedEvent("bad_json")
        return json_object(payload[0].encode("utf-8"))
    return json_object(body)


def extract(
    headers: Mapping[str, str], body: bytes, config: Mapping[str, Any]
) -> EventMeta | Challenge:
    the_id = event_id(headers.get("x-github-delivery"))
    hook_event = config.get("hook_event")
    payload = _payload(headers, body)
    if isinstance(hook_event, str) and hook_event:
        the_type = _signed_type(headers, payload, hook_event)
        return EventMeta(event_id=the_id, event_type=the_type, occurred_at=None)
    the_type = event_type(headers.get("x-github-event"))
    action = payload.get("action")
    if isinstance(action, str) and action:
        the_type = event_type(f"{the_type}.{action}")
    return EventMeta(event_id=the_id, event_type=the_type, occurred_at=None)


def _signed_type(headers: Mapping[str, str], payload: Mapping[str, Any], hook_event: str) -> str:
    """The type from the configured event and the signed body; the header must agree."""
    if "hook" in payload and "zen" in payload:  # GitHub's ping when a hook is created
        return "ping"
    if headers.get("x-github-event") != hook_event:
        raise MalformedEvent("bad_type")
    action = payload.get("action")
    if isinstance(action, str) and action:
        return event_type(f"{hook_event}.{action}")
    return hook_event


PROVIDER = described(
    "github",
    authenticate,
    extract,
    tolerance=None,
    validate_config=validate_config,
    fields_rule=fields,
)
