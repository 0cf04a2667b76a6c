"""WooCommerce: ``X-WC-Webhook-Signature: <base64 HMAC-SHA256(secret, raw body)>``.

Only the body is signed. The dedup id ``X-WC-Webhook-Delivery-ID`` and the topic
(``X-WC-Webhook-Topic``, e.g. ``order.created``) are not: a captured request can be replayed
under a new delivery id, forever (no timestamp), and, for a resource's topic, under another
topic (``order.updated`` fires those routes): the body (the resource) does not name its topic,
so the header's is recorded as unsigned (``events show`` and the console say so, ``routes
add`` warns for a route on it). A custom action's topic is in the signed body: WooCommerce
sends ``{"action": HOOK, "arg": ...}`` for ``action.HOOK``, so by default the type of such a
body is ``action.HOOK`` from the body and the header must name it, and a header naming an
``action.`` topic over any other body is refused (400 bad_type), nothing written.
``--config type_from=header`` takes the header as sent, unchecked. Mitigations: TLS, rotating
the webhook secret, handlers idempotent on the resource's own ``id`` and ``date_modified``.
When a webhook is saved, WooCommerce posts a signed ping (form body ``webhook_id=N``): answered
200, not stored.

Retries: WooCommerce delivers once (a failure is counted, and the webhook is disabled after 5
consecutive failures); no retry window is documented. One day is assumed, to cover a delivery
re-sent by hand or by a queue in front of the store.
Source: woocommerce includes/class-wc-webhook.php (deliver, failed_delivery, build_payload).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

import orjson

from core.providers.base import (
    SIGNED_FIELD,
    UNSIGNED_FIELD,
    Challenge,
    EventMeta,
    MalformedEvent,
    body_hmac,
    from_headers,
    header_type,
    one_option,
    type_from_option,
    unb64,
)
from core.providers.descriptions import described

_PING: Final = re.compile(rb"webhook_id=\d{1,20}")
# The start of a custom action's payload (wp_json_encode of array('action' => ..., 'arg' =>
# ...)): only such a body is parsed; a resource's body starts with its "id".
_ACTION_BODY: Final = re.compile(rb'\s*\{\s*"action"\s*:')
ACTION_PREFIX: Final = "action."
HEADER: Final = "X-WC-Webhook-Topic"


authenticate = body_hmac("x-wc-webhook-signature", decode=unb64)
_headers = from_headers(id="x-wc-webhook-delivery-id", type="x-wc-webhook-topic")


def validate_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """One option, ``type_from`` (``body``, the default, or ``header``): see the module's doc."""
    one_option(config, "type_from")
    return type_from_option(config)


def fields(config: Mapping[str, Any]) -> Mapping[str, str]:
    the_type = (
        UNSIGNED_FIELD
        if header_type(config)
        else f"{SIGNED_FIELD} for action.* topics, else {UNSIGNED_FIELD}"
    )
    return {"id": UNSIGNED_FIELD, "type": the_type}


def unsigned_type(config: Mapping[str, Any], pattern: str) -> str | None:
    """``X-WC-Webhook-Topic`` unless the type (or glob) is a custom action's, read from the
    body."""
    if not header_type(config) and pattern.startswith(ACTION_PREFIX):
        return None
    return HEADER


def _action_topic(body: bytes) -> str | None:
    """``action.HOOK`` from a custom action's signed body, or None for any other body."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    action = payload.get("action") if isinstance(payload, dict) else None
    return ACTION_PREFIX + action if isinstance(action, str) and action else None


def extract(
    headers: Mapping[str, str], body: bytes, config: Mapping[str, Any]
) -> EventMeta | Challenge:
    if _PING.fullmatch(body):
        return Challenge(body=b"", content_type="text/plain")
    meta = _headers(headers, body, config)
    if header_type(config):
        return meta
    # An action.* topic must be the body's own; a body that is an action's, likewise.
    if meta.event_type.startswith(ACTION_PREFIX) or _ACTION_BODY.match(body):  # noqa: SIM102
        if _action_topic(body) != meta.event_type:
            raise MalformedEvent("bad_type")
    return meta


PROVIDER = described(
    "woocommerce",
    authenticate,
    extract,
    tolerance=None,
    validate_config=validate_config,
    fields_rule=fields,
    type_rule=unsigned_type,
)
