"""Test events as each built-in provider sends them: a body in the provider's format and the
headers that sign it with a source's secret (``webhooks send``).

The receiver's side of each scheme lives in its provider module; this is the sender's side,
written from the same documented schemes and reusing the modules' own pieces where they exist
(Adyen's signed string, Twilio's, HubSpot's URI rule, the generic scheme's template). The
tests check every signer here against the providers' official libraries (tests/signing.py)
and through a real receiver, so a drift between the two sides fails a test.

Pure: no I/O and no clock (``timestamp`` is passed in). Providers signed with the sender's
private key (SendGrid, Discord) cannot be signed with what a source stores (their public key):
:data:`PUBLIC_KEY` says so in one line.
"""

from __future__ import annotations

import base64
import hmac
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final
from urllib.parse import urlencode

import orjson

from core.errors import WebhooksError
from core.providers import adyen, generic_hmac, github, hubspot, twilio, urlsigned

Headers = dict[str, str]

#: Providers whose requests are signed with the sender's private key: a source holds only the
#: public key, so nothing here can sign for them.
PUBLIC_KEY: Final[Mapping[str, str]] = {
    "sendgrid": "SendGrid signs with its own private key (ECDSA); a source holds only the "
    "public key, so no test event can be signed here: use SendGrid's 'Test Your Integration'",
    "discord": "Discord signs with its own private key (Ed25519); a source holds only the "
    "public key, so no test event can be signed here: use the Developer Portal's test",
}

#: The event type sent when ``--type`` is not given.
DEFAULT_TYPES: Final[Mapping[str, str]] = {
    "stripe": "invoice.paid",
    "github": "issues.opened",
    "shopify": "orders/create",
    "slack": "app_mention",
    "standard": "invoice.paid",
    "svix": "user.created",
    "hmac": "order.created",
    "resend": "email.delivered",
    "clerk": "user.created",
    "gitlab": "Push Hook",
    "linear": "Issue.create",
    "paddle": "transaction.completed",
    "typeform": "form_response",
    "woocommerce": "order.created",
    "intercom": "contact.user.created",
    "sentry": "issue.created",
    "calendly": "invitee.created",
    "bitbucket": "repo:push",
    "pagerduty": "incident.triggered",
    "twitch": "channel.follow",
    "mailgun": "delivered",
    "square": "payment.updated",
    "hubspot": "contact.propertyChange",
    "twilio": "delivered",
    "zoom": "meeting.started",
    "meta": "messages",
    "adyen": "AUTHORISATION",
}


class CannotSign(WebhooksError, ValueError):
    """No test event can be built for this source (a public-key or plug-in provider, or
    options that name headers this sender cannot fill in); the message says why."""


@dataclass(frozen=True)
class Draft:
    """One test event: its id, type, the content to carry (``data``: None for the default)
    and the unix time it is signed at."""

    event_id: str
    event_type: str
    timestamp: int
    data: Any = None
    config: Mapping[str, Any] | None = None

    def content(self, default: Any) -> Any:
        return default if self.data is None else self.data

    @property
    def options(self) -> Mapping[str, Any]:
        return self.config or {}


Signer = Callable[[str, Draft], tuple[Headers, bytes]]


def _json(obj: Any) -> bytes:
    return orjson.dumps(obj)


def _iso(ts: int) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def _mac(secret: str | bytes, message: bytes, algorithm: str = "sha256") -> bytes:
    key = secret.encode() if isinstance(secret, str) else secret
    return hmac.new(key, message, algorithm).digest()


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _whsec(secret: str, msg_id: str, ts: int, body: bytes) -> str:
    """A Standard Webhooks ``v1,<base64>`` signature (``whsec_`` + base64 key)."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    return "v1," + _b64(_mac(key, f"{msg_id}.{ts}.".encode() + body))


def _standard_like(prefix: str, body_of: Callable[[Draft], Any], agent: str) -> Signer:
    def sign(secret: str, d: Draft) -> tuple[Headers, bytes]:
        body = _json(body_of(d))
        return {
            f"{prefix}-id": d.event_id,
            f"{prefix}-timestamp": str(d.timestamp),
            f"{prefix}-signature": _whsec(secret, d.event_id, d.timestamp, body),
            "Content-Type": "application/json",
            "User-Agent": agent,
        }, body

    return sign


def _standard_body(d: Draft) -> Any:
    return {
        "type": d.event_type,
        "timestamp": _iso(d.timestamp),
        "data": d.content({"id": "obj_1"}),
    }


def _stripe(secret: str, d: Draft) -> tuple[Headers, bytes]:
    body = {
        "id": d.event_id,
        "object": "event",
        "api_version": "2024-06-20",
        "created": d.timestamp,
        "type": d.event_type,
        "livemode": False,
        "pending_webhooks": 1,
        "data": {"object": d.content({"id": "in_test", "object": "invoice"})},
    }
    raw = _json(body)
    sig = _mac(secret, f"{d.timestamp}.".encode() + raw).hex()
    return {
        "Stripe-Signature": f"t={d.timestamp},v1={sig}",
        "Content-Type": "application/json; charset=utf-8",
    }, raw


def _github(secret: str, d: Draft) -> tuple[Headers, bytes]:
    event, _, action = d.event_type.partition(".")
    body = dict(d.content({"repository": {"id": 1, "full_name": "octo/hello"}}))
    # The objects by which the receiver knows the event from the signed body (an empty one
    # for each the data lacks), as GitHub's own payload for the event would carry them.
    keys = dict(github.BODY_KEYS).get(event, ())
    body = {**{key: {} for key in keys if key not in body}, **body}
    if action:
        body = {"action": action, **body}
    raw = _json(body)
    return {
        "X-GitHub-Delivery": d.event_id,
        "X-GitHub-Event": event,
        "X-Hub-Signature-256": "sha256=" + _mac(secret, raw).hex(),
        "Content-Type": "application/json",
    }, raw


def _shopify(secret: str, d: Draft) -> tuple[Headers, bytes]:
    raw = _json(d.content({"id": 820982911946154508, "email": "jon@example.com"}))
    return {
        "X-Shopify-Hmac-Sha256": _b64(_mac(secret, raw)),
        "X-Shopify-Topic": d.event_type,
        "X-Shopify-Webhook-Id": d.event_id,
        "X-Shopify-Triggered-At": _iso(d.timestamp),
        "Content-Type": "application/json",
    }, raw


def _slack(secret: str, d: Draft) -> tuple[Headers, bytes]:
    event = {"type": d.event_type, "user": "U0001", "text": "hi", "event_ts": f"{d.timestamp}.0"}
    if isinstance(d.data, Mapping):
        event = {**event, **d.data}
    body = {
        "team_id": "T0001",
        "api_app_id": "A0001",
        "event": event,
        "type": "event_callback",
        "event_id": d.event_id,
        "event_time": d.timestamp,
    }
    raw = _json(body)
    sig = _mac(secret, f"v0:{d.timestamp}:".encode() + raw).hex()
    return {
        "X-Slack-Signature": f"v0={sig}",
        "X-Slack-Request-Timestamp": str(d.timestamp),
        "Content-Type": "application/json",
    }, raw


def _title(name: str) -> str:
    return "-".join(part.capitalize() for part in name.split("-"))


def _set_path(obj: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for part in parents:
        obj = obj.setdefault(part, {})
    obj[last] = value


def _generic(secret: str, d: Draft) -> tuple[Headers, bytes]:
    """The generic scheme as the source configures it: the id, type and time go where its
    options read them; the signed content is its template, filled in."""
    opts = generic_hmac.validate_config(d.options)
    body: dict[str, Any] = {"data": d.content({"amount": 100})}
    for option, value in (
        ("id_field", d.event_id),
        ("type_field", d.event_type),
        ("time_field", d.timestamp),
    ):
        if opts.get(option):
            _set_path(body, opts[option], value)
    raw = _json(body)
    headers: Headers = {"Content-Type": "application/json"}
    for option, value in (
        ("timestamp_header", str(d.timestamp)),
        ("id_header", d.event_id),
        ("type_header", d.event_type),
    ):
        if opts.get(option):
            headers[_title(opts[option])] = value
    by_name = {k.lower(): v for k, v in headers.items()}
    signed = b""
    for part in generic_hmac.signed_parts(opts):
        if part is None:
            signed += raw
        elif isinstance(part, bytes):
            signed += part
        elif part in by_name:
            signed += by_name[part].encode("latin-1")
        else:
            raise CannotSign(
                f"the source's signed_content names header {part!r}, which a test event "
                "cannot fill in"
            )
    digest = _mac(secret, signed, opts["algorithm"])
    encoded = digest.hex() if opts["encoding"] == "hex" else _b64(digest)
    headers[_title(opts["signature_header"])] = opts["prefix"] + encoded
    return headers, raw


def _resend_body(d: Draft) -> Any:
    return {"type": d.event_type, "created_at": _iso(d.timestamp), "data": d.content({})}


def _clerk_body(d: Draft) -> Any:
    return {
        "type": d.event_type,
        "object": "event",
        "timestamp": d.timestamp * 1000,
        "data": d.content({"id": "user_1", "object": "user"}),
    }


def _gitlab(secret: str, d: Draft) -> tuple[Headers, bytes]:
    raw = _json(d.content({"object_kind": "push", "ref": "refs/heads/main"}))
    headers = {
        "X-Gitlab-Event": d.event_type,
        "Idempotency-Key": d.event_id,
        "Content-Type": "application/json",
    }
    if secret.startswith("whsec_"):  # a signing token: Standard Webhooks headers
        headers |= {
            "webhook-id": d.event_id,
            "webhook-timestamp": str(d.timestamp),
            "webhook-signature": _whsec(secret, d.event_id, d.timestamp, raw),
        }
    else:
        headers["X-Gitlab-Token"] = secret
    return headers, raw


def _linear(secret: str, d: Draft) -> tuple[Headers, bytes]:
    kind, _, action = d.event_type.partition(".")
    body = {
        "action": action or "create",
        "type": kind,
        "createdAt": _iso(d.timestamp),
        "data": d.content({"id": "2174add1-f7c8-44e3-bbf3-2d60b5ea8bc9", "title": "Bug"}),
        "webhookTimestamp": d.timestamp * 1000,
        "webhookId": "wh_1",
    }
    raw = _json(body)
    return {
        "Linear-Signature": _mac(secret, raw).hex(),
        "Linear-Delivery": d.event_id,
        "Linear-Event": kind,
        "Content-Type": "application/json",
    }, raw


def _paddle(secret: str, d: Draft) -> tuple[Headers, bytes]:
    body = {
        "event_id": d.event_id,
        "event_type": d.event_type,
        "occurred_at": _iso(d.timestamp),
        "data": d.content({"id": "txn_01h8bkrf", "status": "completed"}),
    }
    raw = _json(body)
    sig = _mac(secret, f"{d.timestamp}:".encode() + raw).hex()
    return {
        "Paddle-Signature": f"ts={d.timestamp};h1={sig}",
        "Content-Type": "application/json",
    }, raw


def _typeform(secret: str, d: Draft) -> tuple[Headers, bytes]:
    body = {
        "event_id": d.event_id,
        "event_type": d.event_type,
        "form_response": d.content({"form_id": "lT4Z3j", "submitted_at": _iso(d.timestamp)}),
    }
    raw = _json(body)
    return {
        "Typeform-Signature": "sha256=" + _b64(_mac(secret, raw)),
        "Content-Type": "application/json",
    }, raw


def _woocommerce(secret: str, d: Draft) -> tuple[Headers, bytes]:
    resource, _, event = d.event_type.partition(".")
    raw = _json(d.content({"id": 727, "status": "processing", "total": "29.35"}))
    return {
        "X-WC-Webhook-Signature": _b64(_mac(secret, raw)),
        "X-WC-Webhook-Delivery-ID": d.event_id,
        "X-WC-Webhook-Topic": d.event_type,
        "X-WC-Webhook-Resource": resource,
        "X-WC-Webhook-Event": event,
        "Content-Type": "application/json",
    }, raw


def _intercom(secret: str, d: Draft) -> tuple[Headers, bytes]:
    body = {
        "type": "notification_event",
        "id": d.event_id,
        "topic": d.event_type,
        "created_at": d.timestamp,
        "data": {"type": "notification_event_data", "item": d.content({"type": "contact"})},
    }
    raw = _json(body)
    return {
        "X-Hub-Signature": "sha1=" + _mac(secret, raw, "sha1").hex(),
        "Content-Type": "application/json",
    }, raw


def _sentry(secret: str, d: Draft) -> tuple[Headers, bytes]:
    resource, _, action = d.event_type.partition(".")
    body = {
        "action": action,
        "data": d.content({"issue": {"id": d.event_id, "shortId": "ACME-1"}}),
        "actor": {"type": "application", "id": "sentry", "name": "Sentry"},
    }
    raw = _json(body)
    return {
        "Sentry-Hook-Signature": _mac(secret, raw).hex(),
        "Sentry-Hook-Resource": resource,
        "Sentry-Hook-Timestamp": str(d.timestamp),
        "Content-Type": "application/json",
    }, raw


def _calendly(secret: str, d: Draft) -> tuple[Headers, bytes]:
    payload = {"uri": f"https://api.calendly.com/scheduled_events/EV1/invitees/{d.event_id}"}
    if isinstance(d.data, Mapping):
        payload = {**d.data, **payload}
    body = {"event": d.event_type, "created_at": _iso(d.timestamp), "payload": payload}
    raw = _json(body)
    sig = _mac(secret, f"{d.timestamp}.".encode() + raw).hex()
    return {
        "Calendly-Webhook-Signature": f"t={d.timestamp},v1={sig}",
        "Content-Type": "application/json",
    }, raw


def _bitbucket(secret: str, d: Draft) -> tuple[Headers, bytes]:
    raw = _json(d.content({"push": {"changes": []}, "repository": {"name": "r"}}))
    return {
        "X-Hub-Signature": "sha256=" + _mac(secret, raw).hex(),
        "X-Request-UUID": d.event_id,
        "X-Event-Key": d.event_type,
        "Content-Type": "application/json",
    }, raw


def _pagerduty(secret: str, d: Draft) -> tuple[Headers, bytes]:
    body = {
        "event": {
            "id": d.event_id,
            "event_type": d.event_type,
            "resource_type": "incident",
            "occurred_at": _iso(d.timestamp),
            "data": d.content({"id": "PGR0VU2", "type": "incident"}),
        }
    }
    raw = _json(body)
    return {
        "X-PagerDuty-Signature": "v1=" + _mac(secret, raw).hex(),
        "Content-Type": "application/json",
    }, raw


def _twitch(secret: str, d: Draft) -> tuple[Headers, bytes]:
    when = datetime.fromtimestamp(d.timestamp, UTC).strftime("%Y-%m-%dT%H:%M:%S.000000000Z")
    body = {
        "subscription": {"id": "f1c2a387", "type": d.event_type, "version": "2"},
        "event": d.content({"user_id": "1337", "broadcaster_user_id": "1234"}),
    }
    raw = _json(body)
    sig = _mac(secret, d.event_id.encode() + when.encode() + raw).hex()
    return {
        "Twitch-Eventsub-Message-Id": d.event_id,
        "Twitch-Eventsub-Message-Timestamp": when,
        "Twitch-Eventsub-Message-Signature": f"sha256={sig}",
        "Twitch-Eventsub-Message-Type": "notification",
        "Twitch-Eventsub-Subscription-Type": d.event_type,
        "Content-Type": "application/json",
    }, raw


def _mailgun(secret: str, d: Draft) -> tuple[Headers, bytes]:
    ts = str(d.timestamp)
    signature = _mac(secret, (ts + d.event_id).encode()).hex()
    event = {"id": d.event_id, "event": d.event_type, "timestamp": float(ts)}
    if isinstance(d.data, Mapping):
        event = {**d.data, **event}
    body = {
        "signature": {"timestamp": ts, "token": d.event_id, "signature": signature},
        "event-data": event,
    }
    return {"Content-Type": "application/json"}, _json(body)


def _square(secret: str, d: Draft) -> tuple[Headers, bytes]:
    body = {
        "merchant_id": "6SSW7HV8K2ST5",
        "type": d.event_type,
        "event_id": d.event_id,
        "created_at": _iso(d.timestamp),
        "data": d.content({"type": "payment", "id": "KkAkhdMs", "object": {}}),
    }
    raw = _json(body)
    url = urlsigned.public_url(d.options)
    return {
        "x-square-hmacsha256-signature": _b64(_mac(secret, url.encode() + raw)),
        "Content-Type": "application/json",
    }, raw


def _hubspot(secret: str, d: Draft) -> tuple[Headers, bytes]:
    ms = str(d.timestamp * 1000)
    event = {
        "eventId": d.event_id,
        "subscriptionId": 7,
        "portalId": 62515,
        "occurredAt": int(ms),
        "subscriptionType": d.event_type,
        "objectId": 123,
    }
    if isinstance(d.data, Mapping):
        event = {**d.data, **event}
    raw = _json([event])
    uri = hubspot.signed_uri(urlsigned.public_url(d.options))
    return {
        "X-HubSpot-Signature-v3": _b64(_mac(secret, b"POST" + uri.encode() + raw + ms.encode())),
        "X-HubSpot-Request-Timestamp": ms,
        "Content-Type": "application/json",
    }, raw


def _twilio(secret: str, d: Draft) -> tuple[Headers, bytes]:
    params = [("MessageSid", d.event_id), ("MessageStatus", d.event_type)]
    if isinstance(d.data, Mapping):
        params += [(str(k), str(v)) for k, v in d.data.items() if k not in dict(params)]
    else:
        params += [("From", "+15005550006"), ("To", "+15005550001"), ("Body", "Hello")]
    signed = twilio.signed_string(urlsigned.public_url(d.options), params)
    return {
        "X-Twilio-Signature": _b64(_mac(secret, signed, "sha1")),
        "Content-Type": "application/x-www-form-urlencoded; charset=utf-8",
    }, urlencode(params).encode()


def _zoom(secret: str, d: Draft) -> tuple[Headers, bytes]:
    body = {
        "event": d.event_type,
        "event_ts": d.timestamp * 1000,
        "payload": d.content({"account_id": "AAAAAA", "object": {"id": d.event_id}}),
    }
    raw = _json(body)
    sig = _mac(secret, f"v0:{d.timestamp}:".encode() + raw).hex()
    return {
        "x-zm-signature": f"v0={sig}",
        "x-zm-request-timestamp": str(d.timestamp),
        "Content-Type": "application/json",
    }, raw


def _meta(secret: str, d: Draft) -> tuple[Headers, bytes]:
    value = d.content(
        {
            "messaging_product": "whatsapp",
            "messages": [{"id": d.event_id, "type": "text", "text": {"body": "hi"}}],
        }
    )
    body = {
        "object": "whatsapp_business_account",
        "entry": [
            {"id": "102290129340398", "time": d.timestamp, "changes": [
                {"field": d.event_type, "value": value}
            ]}
        ],
    }  # fmt: skip
    raw = _json(body)
    return {
        "X-Hub-Signature-256": "sha256=" + _mac(secret, raw).hex(),
        "Content-Type": "application/json",
    }, raw


def _adyen(secret: str, d: Draft) -> tuple[Headers, bytes]:
    item: dict[str, Any] = {
        "amount": {"currency": "EUR", "value": 1130},
        "eventCode": d.event_type,
        "eventDate": _iso(d.timestamp),
        "merchantAccountCode": "TestMerchant",
        "merchantReference": f"order-{d.event_id}",
        "originalReference": "",
        "pspReference": d.event_id,
        "success": "true",
    }
    if isinstance(d.data, Mapping):
        item = {**d.data, **item}
    item["additionalData"] = {"hmacSignature": adyen.sign_item(item, secret)}
    body = {"live": "false", "notificationItems": [{"NotificationRequestItem": item}]}
    return {"Content-Type": "application/json"}, _json(body)


SIGNERS: Final[Mapping[str, Signer]] = {
    "stripe": _stripe,
    "github": _github,
    "shopify": _shopify,
    "slack": _slack,
    "standard": _standard_like("webhook", _standard_body, "webhooks-send"),
    "svix": _standard_like("svix", _standard_body, "Svix-Webhooks/1.0"),
    "hmac": _generic,
    "resend": _standard_like("svix", _resend_body, "Svix-Webhooks/1.0 (resend)"),
    "clerk": _standard_like("svix", _clerk_body, "Svix-Webhooks/1.0 (clerk)"),
    "gitlab": _gitlab,
    "linear": _linear,
    "paddle": _paddle,
    "typeform": _typeform,
    "woocommerce": _woocommerce,
    "intercom": _intercom,
    "sentry": _sentry,
    "calendly": _calendly,
    "bitbucket": _bitbucket,
    "pagerduty": _pagerduty,
    "twitch": _twitch,
    "mailgun": _mailgun,
    "square": _square,
    "hubspot": _hubspot,
    "twilio": _twilio,
    "zoom": _zoom,
    "meta": _meta,
    "adyen": _adyen,
}


def sign(
    provider: str,
    secret: str,
    *,
    event_id: str,
    timestamp: int,
    event_type: str | None = None,
    data: Any = None,
    config: Mapping[str, Any] | None = None,
) -> tuple[Headers, bytes]:
    """``(headers, body)`` of one test event as ``provider`` sends it, signed with ``secret``;
    :class:`CannotSign` when no such event can be built here (the message says why)."""
    if provider in PUBLIC_KEY:
        raise CannotSign(PUBLIC_KEY[provider])
    signer = SIGNERS.get(provider)
    if signer is None:
        raise CannotSign(f"provider {provider!r} has no test-event sender here (a plug-in)")
    kind = event_type or DEFAULT_TYPES[provider]
    draft = Draft(event_id, kind, timestamp, data, config)
    try:
        return signer(secret, draft)
    except ValueError as exc:  # a source's options that cannot be used (no public_url, ...)
        raise CannotSign(str(exc)) from None
