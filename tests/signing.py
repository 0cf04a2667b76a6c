"""Test-side signers: build ``(headers, body)`` as each provider would send them.

Each provider is signed with its official library where one exists (stripe, slack_sdk,
standardwebhooks, svix; githubkit for GitHub), so the receiver is tested against the
senders' own code rather than against a copy of itself. Shopify and the generic HMAC scheme
have no official signer and follow the documented scheme (shared/PROVIDERS.md).

Headers use the capitalisation providers send; the receiver lower-cases them
(:func:`lower` does the same for tests that call ``ingest.providers`` directly).

Every function takes ``timestamp`` (unix seconds or an aware datetime; default: the wall
clock) so tests can pin it against an injected ``now``. ``body_obj`` replaces the default
JSON body; ``raw_body`` signs exact bytes instead (non-JSON, non-UTF-8, ...).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets as _secrets
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import githubkit.webhooks
import slack_sdk.signature
import standardwebhooks
import stripe
import svix.webhooks

Headers = dict[str, str]
Timestamp = int | datetime | None

DEFAULT_TYPES: dict[str, str] = {
    "stripe": "invoice.paid",
    "github": "issues.opened",
    "shopify": "orders/create",
    "slack": "app_mention",
    "standard": "invoice.paid",
    "svix": "user.created",
    "hmac": "order.created",
}

# The generic-HMAC options and their defaults, restated from the documented contract so the
# signer does not borrow the implementation it is testing.
HMAC_DEFAULTS: dict[str, str | None] = {
    "signature_header": "x-signature",
    "algorithm": "sha256",
    "encoding": "hex",
    "prefix": "",
    "timestamp_header": None,
    "signed_content": None,
    "id_header": None,
    "id_field": "id",
    "id_from_unsigned_header": False,
    "type_header": None,
    "type_field": "type",
    "time_field": None,
}


def new_secret(provider: str) -> str:
    """A random secret in the format the provider issues."""
    if provider in ("standard", "svix"):
        return "whsec_" + base64.b64encode(_secrets.token_bytes(32)).decode()
    if provider == "stripe":
        return "whsec_" + _secrets.token_hex(16)
    if provider == "slack":
        return _secrets.token_hex(16)
    return _secrets.token_urlsafe(32)


def lower(headers: Mapping[str, str]) -> Headers:
    """Header names lower-cased, as the receiver hands them to ``ingest.providers``."""
    return {k.lower(): v for k, v in headers.items()}


def unix(timestamp: Timestamp) -> int:
    if timestamp is None:
        return int(time.time())
    if isinstance(timestamp, datetime):
        if timestamp.tzinfo is None:
            raise ValueError("timestamp must be an aware datetime")
        return int(timestamp.timestamp())
    return int(timestamp)


def iso(ts: int) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def dump(obj: Any, *, indent: int | None = None) -> bytes:
    """Serialise with the standard library (independent of the receiver's orjson)."""
    if indent is None:
        return json.dumps(obj, separators=(",", ":")).encode()
    return json.dumps(obj, indent=indent).encode()


def _body(raw_body: bytes | None, body_obj: Any, default: Any, **dump_kw: Any) -> bytes:
    if raw_body is not None:
        return raw_body
    return dump(default if body_obj is None else body_obj, **dump_kw)


def _secrets_list(secret: str | Sequence[str]) -> list[str]:
    return [secret] if isinstance(secret, str) else list(secret)


def _single(provider: str, secret: str | Sequence[str]) -> str:
    keys = _secrets_list(secret)
    if len(keys) != 1:
        raise ValueError(f"{provider} sends one signature; sign with one secret")
    return keys[0]


# --------------------------------------------------------------------------------------------


def sign_stripe(
    secret: str | Sequence[str],
    *,
    event_id: str,
    event_type: str = DEFAULT_TYPES["stripe"],
    body_obj: Any = None,
    raw_body: bytes | None = None,
    timestamp: Timestamp = None,
) -> tuple[Headers, bytes]:
    """``Stripe-Signature: t=..,v1=..`` by ``stripe.WebhookSignature`` (one v1 per secret)."""
    ts = unix(timestamp)
    default = {
        "id": event_id,
        "object": "event",
        "api_version": "2024-06-20",
        "created": ts,
        "type": event_type,
        "livemode": False,
        "pending_webhooks": 1,
        "data": {"object": {"id": "in_test", "object": "invoice"}},
    }
    body = _body(raw_body, body_obj, default, indent=2)  # Stripe pretty-prints its bodies
    parts = [f"t={ts}"]
    for key in _secrets_list(secret):
        header = stripe.WebhookSignature.generate_signature_header(
            body.decode("utf-8"), key, timestamp=ts
        )
        parts.extend(p for p in header.split(",") if p.startswith("v1="))
    return {
        "Stripe-Signature": ",".join(parts),
        "Content-Type": "application/json; charset=utf-8",
        "User-Agent": "Stripe/1.0 (+https://stripe.com/docs/webhooks)",
    }, body


def sign_github(
    secret: str | Sequence[str],
    *,
    event_id: str,
    event_type: str = DEFAULT_TYPES["github"],
    body_obj: Any = None,
    raw_body: bytes | None = None,
    timestamp: Timestamp = None,
) -> tuple[Headers, bytes]:
    """``X-Hub-Signature-256`` by ``githubkit.webhooks.sign``.

    ``event_type`` "issues.opened" becomes ``X-GitHub-Event: issues`` and body ``"action":
    "opened"``, which is what the receiver turns back into "issues.opened". GitHub signs no
    timestamp; ``timestamp`` is accepted for a uniform signature and ignored.
    """
    event, _, action = event_type.partition(".")
    default: dict[str, Any] = {
        "repository": {"id": 1, "full_name": "octo/hello"},
        "sender": {"login": "octocat"},
    }
    if action:
        default = {"action": action, **default}
    body = _body(raw_body, body_obj, default)
    key = _single("github", secret)
    return {
        "X-GitHub-Delivery": event_id,
        "X-GitHub-Event": event,
        "X-GitHub-Hook-ID": "123456",
        "X-Hub-Signature-256": githubkit.webhooks.sign(key, body, "sha256"),
        "User-Agent": "GitHub-Hookshot/abc1234",
        "Content-Type": "application/json",
    }, body


def sign_shopify(
    secret: str | Sequence[str],
    *,
    event_id: str,
    event_type: str = DEFAULT_TYPES["shopify"],
    body_obj: Any = None,
    raw_body: bytes | None = None,
    timestamp: Timestamp = None,
) -> tuple[Headers, bytes]:
    """``X-Shopify-Hmac-Sha256: base64 HMAC-SHA256(secret, body)`` (documented scheme).

    ``timestamp`` becomes the unsigned ``X-Shopify-Triggered-At``.
    """
    ts = unix(timestamp)
    body = _body(raw_body, body_obj, {"id": 820982911946154508, "email": "jon@example.com"})
    key = _single("shopify", secret)
    digest = hmac.new(key.encode(), body, hashlib.sha256).digest()
    return {
        "X-Shopify-Hmac-Sha256": base64.b64encode(digest).decode(),
        "X-Shopify-Topic": event_type,
        "X-Shopify-Webhook-Id": event_id,
        "X-Shopify-Event-Id": "98880550-7158-44d4-b7cd-2c97c8a091b5",
        "X-Shopify-Triggered-At": iso(ts),
        "X-Shopify-Shop-Domain": "example.myshopify.com",
        "X-Shopify-API-Version": "2024-07",
        "Content-Type": "application/json",
    }, body


def sign_slack(
    secret: str | Sequence[str],
    *,
    event_id: str,
    event_type: str = DEFAULT_TYPES["slack"],
    body_obj: Any = None,
    raw_body: bytes | None = None,
    timestamp: Timestamp = None,
) -> tuple[Headers, bytes]:
    """``X-Slack-Signature: v0=..`` by ``slack_sdk.signature.SignatureVerifier``."""
    ts = unix(timestamp)
    default = {
        "token": "XXYYZZ",
        "team_id": "T0001",
        "api_app_id": "A0001",
        "event": {"type": event_type, "user": "U0001", "text": "hi", "event_ts": f"{ts}.000100"},
        "type": "event_callback",
        "event_id": event_id,
        "event_time": ts,
    }
    body = _body(raw_body, body_obj, default)
    key = _single("slack", secret)
    signature = slack_sdk.signature.SignatureVerifier(key).generate_signature(
        timestamp=str(ts), body=body
    )
    assert signature is not None  # None only when no timestamp is given
    return {
        "X-Slack-Signature": signature,
        "X-Slack-Request-Timestamp": str(ts),
        "Content-Type": "application/json",
        "User-Agent": "Slackbot 1.0 (+https://api.slack.com/robots)",
    }, body


def slack_url_verification(
    secret: str, challenge: str, *, timestamp: Timestamp = None
) -> tuple[Headers, bytes]:
    """Slack's signed ``url_verification`` handshake."""
    return sign_slack(
        secret,
        event_id="unused",
        timestamp=timestamp,
        body_obj={"token": "XXYYZZ", "challenge": challenge, "type": "url_verification"},
    )


def _standard_body(event_type: str, ts: int) -> dict[str, Any]:
    return {"type": event_type, "timestamp": iso(ts), "data": {"id": "obj_1"}}


def sign_standard(
    secret: str | Sequence[str],
    *,
    event_id: str,
    event_type: str = DEFAULT_TYPES["standard"],
    body_obj: Any = None,
    raw_body: bytes | None = None,
    timestamp: Timestamp = None,
) -> tuple[Headers, bytes]:
    """``webhook-id/-timestamp/-signature`` by ``standardwebhooks.Webhook`` (one v1 per secret)."""
    ts = unix(timestamp)
    body = _body(raw_body, body_obj, _standard_body(event_type, ts))
    when = datetime.fromtimestamp(ts, UTC)
    text = body.decode("utf-8")
    signatures = [
        standardwebhooks.Webhook(key).sign(event_id, when, text) for key in _secrets_list(secret)
    ]
    return {
        "webhook-id": event_id,
        "webhook-timestamp": str(ts),
        "webhook-signature": " ".join(signatures),
        "Content-Type": "application/json",
    }, body


def sign_svix(
    secret: str | Sequence[str],
    *,
    event_id: str,
    event_type: str = DEFAULT_TYPES["svix"],
    body_obj: Any = None,
    raw_body: bytes | None = None,
    timestamp: Timestamp = None,
) -> tuple[Headers, bytes]:
    """``svix-id/-timestamp/-signature`` by ``svix.webhooks.Webhook`` (one v1 per secret)."""
    ts = unix(timestamp)
    body = _body(raw_body, body_obj, _standard_body(event_type, ts))
    when = datetime.fromtimestamp(ts, UTC)
    text = body.decode("utf-8")
    signatures = [
        svix.webhooks.Webhook(key).sign(event_id, when, text) for key in _secrets_list(secret)
    ]
    return {
        "svix-id": event_id,
        "svix-timestamp": str(ts),
        "svix-signature": " ".join(signatures),
        "Content-Type": "application/json",
        "User-Agent": "Svix-Webhooks/1.0",
    }, body


def _title(header: str) -> str:
    return "-".join(part.capitalize() for part in header.split("-"))


def _set_path(obj: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for part in parents:
        obj = obj.setdefault(part, {})
    obj[last] = value


def render_signed_content(template: str, headers: Mapping[str, str], body: bytes) -> bytes:
    """A ``signed_content`` template filled in, written from the documented syntax
    (``{body}``, ``{header:NAME}``, ``{{``/``}}``) independently of the receiver's parser."""
    lower_headers = {k.lower(): v for k, v in headers.items()}
    out = b""
    rest = template
    while rest:
        if rest.startswith(("{{", "}}")):
            out += rest[0].encode()
            rest = rest[2:]
        elif rest.startswith("{"):
            name, _, rest = rest[1:].partition("}")
            if name == "body":
                out += body
            else:
                out += lower_headers[name.removeprefix("header:").lower()].encode("latin-1")
        else:
            out += rest[0].encode()
            rest = rest[1:]
    return out


def hmac_options(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The generic-HMAC options with defaults filled in (header names lower-cased)."""
    opts: dict[str, Any] = {**HMAC_DEFAULTS, **(config or {})}
    for name in ("signature_header", "timestamp_header", "id_header", "type_header"):
        if opts[name]:
            opts[name] = opts[name].lower()
    return opts


def sign_hmac(
    secret: str | Sequence[str],
    *,
    event_id: str,
    event_type: str = DEFAULT_TYPES["hmac"],
    body_obj: Any = None,
    raw_body: bytes | None = None,
    timestamp: Timestamp = None,
    config: Mapping[str, Any] | None = None,
    extra_headers: Mapping[str, str] | None = None,
) -> tuple[Headers, bytes]:
    """The generic HMAC scheme, as configured (documented scheme; no library exists).

    The id goes in the body field and, when ``id_header`` is set, in that header too; the type
    likewise. ``time_field`` gets the unix timestamp. A ``signed_content`` template is signed
    as written; the headers it names must be among those set here (id, timestamp, type, or
    ``extra_headers``).
    """
    opts = hmac_options(config)
    ts = unix(timestamp)
    default: dict[str, Any] = {"data": {"amount": 100}}
    if opts["id_field"]:
        _set_path(default, opts["id_field"], event_id)
    if opts["type_field"]:
        _set_path(default, opts["type_field"], event_type)
    if opts["time_field"]:
        _set_path(default, opts["time_field"], ts)
    body = _body(raw_body, body_obj, default)
    signed = body
    headers: Headers = {"Content-Type": "application/json", **(extra_headers or {})}
    if opts["timestamp_header"]:
        headers[_title(opts["timestamp_header"])] = str(ts)
        signed = f"{ts}.".encode() + body
    if opts["id_header"]:
        headers[_title(opts["id_header"])] = event_id
    if opts["type_header"]:
        headers[_title(opts["type_header"])] = event_type
    if opts["signed_content"]:
        signed = render_signed_content(opts["signed_content"], headers, body)
    key = _single("hmac", secret)
    digest = hmac.new(key.encode(), signed, opts["algorithm"]).digest()
    encoded = digest.hex() if opts["encoding"] == "hex" else base64.b64encode(digest).decode()
    headers[_title(opts["signature_header"])] = opts["prefix"] + encoded
    return headers, body


_SIGNERS = {
    "stripe": sign_stripe,
    "github": sign_github,
    "shopify": sign_shopify,
    "slack": sign_slack,
    "standard": sign_standard,
    "svix": sign_svix,
}


def sign(
    provider: str,
    secret: str | Sequence[str],
    *,
    event_id: str,
    event_type: str | None = None,
    body_obj: Any = None,
    raw_body: bytes | None = None,
    timestamp: Timestamp = None,
    config: Mapping[str, Any] | None = None,
) -> tuple[Headers, bytes]:
    """Sign a delivery for ``provider``; ``config`` is only for the generic ``hmac`` provider.

    ``secret`` may be a list for Stripe, Standard Webhooks and Svix, which send one signature
    per secret during a rotation.
    """
    kind = DEFAULT_TYPES[provider] if event_type is None else event_type
    if provider == "hmac":
        return sign_hmac(
            secret,
            event_id=event_id,
            event_type=kind,
            body_obj=body_obj,
            raw_body=raw_body,
            timestamp=timestamp,
            config=config,
        )
    if config:
        raise ValueError(f"provider {provider!r} takes no config")
    try:
        signer = _SIGNERS[provider]
    except KeyError:
        raise ValueError(f"no signer for provider {provider!r}") from None
    return signer(
        secret,
        event_id=event_id,
        event_type=kind,
        body_obj=body_obj,
        raw_body=raw_body,
        timestamp=timestamp,
    )
