"""Twitch EventSub (webhook transport): HMAC-SHA256 over message id + timestamp + raw body.

``Twitch-Eventsub-Message-Signature: sha256=<hex>`` keyed by the subscription's secret, over
``Twitch-Eventsub-Message-Id`` + ``Twitch-Eventsub-Message-Timestamp`` (RFC 3339, nanoseconds,
as sent) + body, so a capture replays only the same message id, and Twitch asks receivers to
refuse messages older than 10 minutes (the tolerance here). ``Twitch-Eventsub-Message-Type``:

- ``webhook_callback_verification``: answered 200 with the raw ``challenge``, text/plain,
  nothing stored (Twitch then enables the subscription);
- ``notification``: stored; id the message id (the same when Twitch resends), type the
  subscription type (``channel.follow``), time the signed message timestamp;
- ``revocation``: stored too, as type ``revocation`` (the reason is ``subscription.status``),
  so a handler learns that the subscription is gone.

https://dev.twitch.tv/docs/eventsub/handling-webhook-events/ . Retries: Twitch resends when it
is unsure a notification arrived ("at least once", https://dev.twitch.tv/docs/eventsub/
#handling-duplicate-events) but documents no horizon (not established): one day is assumed.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any, Final

from core.providers.base import (
    AuthError,
    Challenge,
    EventMeta,
    Secrets,
    decode_signature,
    dig,
    echo_challenge,
    event_id,
    event_type,
    first_match,
    header,
    hmac_of,
    json_object,
)
from core.providers.descriptions import described

TEN_MINUTES: Final = timedelta(minutes=10)


def _timestamp(text: str) -> datetime:
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise AuthError("malformed_timestamp") from None
    if when.tzinfo is None:
        raise AuthError("malformed_timestamp")
    return when


def authenticate(
    headers: Mapping[str, str], body: bytes, secrets: Secrets, config: Mapping[str, Any]
) -> tuple[str, int | None]:
    signature = header(headers, "twitch-eventsub-message-signature")
    msg_id = header(headers, "twitch-eventsub-message-id", "missing_id")
    ts_text = header(headers, "twitch-eventsub-message-timestamp", "missing_timestamp")
    when = _timestamp(ts_text)
    decoded = decode_signature(signature, scheme="sha256")
    digest = hmac_of("sha256", msg_id.encode("utf-8"), ts_text.encode("utf-8"), body)
    return first_match(secrets, (decoded,), digest), int(when.timestamp())


def extract(
    headers: Mapping[str, str], body: bytes, config: Mapping[str, Any]
) -> EventMeta | Challenge:
    obj = json_object(body)
    kind = headers.get("twitch-eventsub-message-type")
    if kind == "webhook_callback_verification":
        return echo_challenge(obj.get("challenge"))
    the_id = event_id(headers.get("twitch-eventsub-message-id"))
    when = _timestamp(headers.get("twitch-eventsub-message-timestamp", ""))
    if kind == "revocation":
        return EventMeta(event_id=the_id, event_type="revocation", occurred_at=when)
    return EventMeta(
        event_id=the_id,
        event_type=event_type(dig(obj, ("subscription", "type"))),
        occurred_at=when,
    )


PROVIDER = described("twitch", authenticate, extract, tolerance=TEN_MINUTES)
