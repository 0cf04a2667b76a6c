"""Twilio (voice and messaging webhooks): ``X-Twilio-Signature``, form-encoded bodies.

base64 HMAC-SHA1, keyed by the account's Auth Token, over the full URL Twilio posts to followed
by every POST parameter sorted by name, each as ``name + value`` with no separator (repeated
names: their distinct values sorted, as Twilio's library does):
https://www.twilio.com/docs/usage/webhooks/webhooks-security .
With a Webhook SharedKey (``X-Twilio-Webhooks-Signature-Settings: ...algorithm=HMAC_SHA256``)
the same string is signed with HMAC-SHA256 and the SharedKey secret. The URL is the one
configured at Twilio, from ``--config public_url=...`` (never the Host header), byte for byte
(query included). JSON bodies (signed through a ``bodySHA256`` URL parameter) are not supported.

The body is stored as received (``application/x-www-form-urlencoded``); handlers read it with
``event.form()``. Twilio signs no timestamp and sends no event id: the id is the
``I-Twilio-Idempotency-Token`` header when present (unsigned), otherwise the resource SID and
its status (``MessageSid:MessageStatus``, ``CallSid:CallStatus``), which a retry repeats; the
type is ``message.<status>`` / ``call.<status>``. Retries: per request, ``rc`` (default 1
retry) within ``tt`` (default 15 s): https://www.twilio.com/docs/usage/webhooks/webhooks-
connection-overrides ; one hour is used (Event Streams, a separate product, retries for 4 h).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl

from core.providers import urlsigned
from core.providers.base import (
    AuthError,
    Challenge,
    EventMeta,
    MalformedEvent,
    Secrets,
    UnsafeBody,
    body_id,
    event_id,
    event_type,
    first_match,
    header,
    hmac_of,
    unb64,
)
from core.providers.descriptions import described

FORM = "application/x-www-form-urlencoded"


# Twilio's requests carry a few dozen parameters (a message status callback about 20, an
# incoming call about 40, with every optional geo and SIP field well under 200). More than this
# is refused before the signature is computed: parsing and sorting what an unauthenticated
# client sends must cost a bounded, small time (a 1 MiB body holds 300,000 empty parameters).
MAX_PARAMS = 1000


def form_params(body: bytes) -> list[tuple[str, str]]:
    """The POST parameters, as Twilio signs them; ValueError when not a UTF-8 form, and
    :class:`UnsafeBody` (before any parsing) when it has more than :data:`MAX_PARAMS`."""
    if body.count(b"&") >= MAX_PARAMS:
        raise UnsafeBody("too_many_parameters")
    text = body.decode("utf-8")
    return parse_qsl(text, keep_blank_values=True, strict_parsing=bool(text))


def signed_string(url: str, params: list[tuple[str, str]]) -> bytes:
    """The URL, then each distinct name in sorted order followed by its distinct values in
    sorted order, each as ``name + value`` (as Twilio's library). One pass to group the
    values by name, then one sort per level: O(n log n) in the count of parameters."""
    values: dict[str, set[str]] = {}
    for name, value in params:
        values.setdefault(name, set()).add(value)
    parts = [url]
    for name in sorted(values):
        parts += [name + value for value in sorted(values[name])]
    return "".join(parts).encode("utf-8")


def _algorithm(headers: Mapping[str, str]) -> str:
    settings = headers.get("x-twilio-webhooks-signature-settings", "")
    for item in settings.split(","):
        key, _, value = item.strip().partition("=")
        if key == "algorithm" and value.upper() == "HMAC_SHA256":
            return "sha256"
    return "sha1"


def authenticate(
    headers: Mapping[str, str], body: bytes, secrets: Secrets, config: Mapping[str, Any]
) -> tuple[str, int | None]:
    # The cheapest checks first (a signature header that decodes, a configured URL); the body
    # is parsed only after them, and refused unparsed when it holds too many parameters.
    decoded = unb64(header(headers, "x-twilio-signature"))
    if decoded is None:
        raise AuthError("malformed_signature")
    try:
        url = urlsigned.public_url(config)
    except ValueError:
        raise AuthError("bad_signature") from None
    try:
        params = form_params(body)
    except (ValueError, UnicodeDecodeError):
        raise AuthError("bad_signature") from None
    digest = hmac_of(_algorithm(headers), signed_string(url, params))
    return first_match(secrets, (decoded,), digest), None


def extract(
    headers: Mapping[str, str], body: bytes, config: Mapping[str, Any]
) -> EventMeta | Challenge:
    try:
        params = dict(form_params(body))
    except (ValueError, UnicodeDecodeError):
        raise MalformedEvent("bad_json") from None
    kind, sid, status = "event", None, None
    for name, sid_field, status_field in (
        ("message", "MessageSid", "MessageStatus"),
        ("message", "SmsSid", "SmsStatus"),
        ("call", "CallSid", "CallStatus"),
    ):
        if params.get(sid_field):
            kind, sid, status = name, params[sid_field], params.get(status_field) or "received"
            break
    token = headers.get("i-twilio-idempotency-token")
    if token:
        the_id = event_id(token)
    elif sid is not None:
        the_id = event_id(f"{sid}:{status}")
    else:  # no SID: the parameters themselves (a retry repeats them)
        the_id = event_id(body_id(body))
    return EventMeta(
        event_id=the_id,
        event_type=event_type(f"{kind}.{(status or 'received').lower()}"),
        occurred_at=None,
    )


PROVIDER = described(
    "twilio",
    authenticate,
    extract,
    tolerance=None,
    validate_config=urlsigned.validate,
    signs_url=True,
)
