"""Provider signature schemes and event metadata: the receiver's pure hot-path core.

Two functions per delivery, both free of I/O, clocks and logging:

* :func:`authenticate` proves that the raw body was signed with one of the source's secrets
  (and, where the scheme signs a timestamp, that it is fresh against the injected ``now``);
* :func:`extract` then reads the provider's own event id, type and time.

Every scheme, header and tolerance here follows ``shared/PROVIDERS.md`` (sources cited there).
Errors carry a short ``reason`` that is safe as a metric label and in a response: it never
contains a secret, a signature or any of the body.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Final
from urllib.parse import parse_qs

import orjson
from standardwebhooks.webhooks import EmptyWebhookSecretError, Webhook

PROVIDERS: Final[tuple[str, ...]] = (
    "stripe",
    "github",
    "shopify",
    "slack",
    "standard",
    "svix",
    "hmac",
)

# Every reason the two exception types can carry, so metrics can pre-register their labels.
AUTH_REASONS: Final = frozenset(
    {
        "no_secret",  # the source has no usable secret: nothing can ever verify
        "missing_signature",
        "malformed_signature",
        "missing_timestamp",
        "malformed_timestamp",
        "missing_id",  # Standard Webhooks / Svix: the id is part of the signed string
        "bad_signature",
        "stale",
        "future",
    }
)
MALFORMED_REASONS: Final = frozenset(
    {"bad_json", "missing_id", "bad_id", "missing_type", "bad_type", "bad_time", "bad_challenge"}
)

_FIVE_MINUTES: Final = timedelta(seconds=300)
_MAX_TYPE_LEN: Final = 255
# 1..255 printable ASCII characters without whitespace (0x21..0x7e): safe in URLs, logs and
# as part of a unique key, and no provider documents anything wider.
_EVENT_ID: Final = re.compile(r"[\x21-\x7e]{1,255}")
# Unix seconds as an ASCII digit string. Eleven digits reach year 5138, well inside datetime.
_MAX_UNIX_DIGITS: Final = 11


def _unknown_provider(provider: str) -> ValueError:
    return ValueError(f"unknown provider {provider!r}; one of {', '.join(PROVIDERS)}")


def _check_provider(provider: str) -> None:
    if provider not in PROVIDERS:
        raise _unknown_provider(provider)


class ProviderError(Exception):
    """Base of this module's errors: a machine-readable ``reason`` and nothing from the request.

    The message is built from the reason alone, so logging or returning it can never leak a
    secret, a signature or body content.
    """

    reason: str
    _prefix: str = "webhook rejected"

    def __init__(self, reason: str) -> None:
        super().__init__(f"{self._prefix}: {reason}")
        self.reason = reason


class AuthError(ProviderError):
    """The delivery is not proven to come from the source's sender (answer 401, store nothing).

    Reasons: see :data:`AUTH_REASONS`.
    """

    _prefix = "webhook authentication failed"


class MalformedEvent(ProviderError):  # noqa: N818 - the name is the agreed API
    """Authenticated, but the provider's id, type or time is missing or unusable (answer 400).

    Reasons: see :data:`MALFORMED_REASONS`.
    """

    _prefix = "malformed webhook event"


@dataclass(frozen=True, slots=True)
class EventMeta:
    """What the pipeline needs to know about an event before storing it."""

    event_id: str
    event_type: str
    occurred_at: datetime | None  # aware, UTC


@dataclass(frozen=True, slots=True)
class Challenge:
    """A handshake to answer instead of storing an event (Slack ``url_verification``)."""

    body: bytes
    content_type: str


# --------------------------------------------------------------------------------------------
# Generic HMAC options
# --------------------------------------------------------------------------------------------

_HMAC_DEFAULTS: Final[Mapping[str, str | None]] = {
    "signature_header": "x-signature",
    "algorithm": "sha256",
    "encoding": "hex",
    "prefix": "",
    "timestamp_header": None,
    "id_header": "x-webhook-id",
    "id_field": "id",
    "type_header": None,
    "type_field": "type",
    "time_field": None,
}
_HMAC_HEADER_OPTIONS: Final = frozenset(
    {"signature_header", "timestamp_header", "id_header", "type_header"}
)
_HMAC_FIELD_OPTIONS: Final = frozenset({"id_field", "type_field", "time_field"})
_HMAC_REQUIRED: Final = frozenset({"signature_header", "algorithm", "encoding"})
_ALGORITHMS: Final = ("sha1", "sha256", "sha512")
_ENCODINGS: Final = ("hex", "base64")
# RFC 9110 token characters, lower-cased: the receiver looks headers up by lower-case name.
_HEADER_NAME: Final = re.compile(r"[!#$%&'*+.^_`|~0-9a-z-]+")


@dataclass(frozen=True, slots=True)
class _HmacScheme:
    signature_header: str
    algorithm: str
    encoding: str
    prefix: str
    timestamp_header: str | None
    id_header: str | None
    id_field: tuple[str, ...] | None
    type_header: str | None
    type_field: tuple[str, ...] | None
    time_field: tuple[str, ...] | None


def validate_config(provider: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """Check and normalise a source's provider options; the result is what to store.

    Only the generic ``hmac`` provider has options; the named providers' schemes are fixed, so
    any option given to them is a mistake and is refused rather than silently ignored. The
    result lists every ``hmac`` option with its default filled in and header names lower-cased,
    and validating it again returns it unchanged. Raises ValueError naming the bad option.
    """
    _check_provider(provider)
    if not isinstance(config, Mapping):
        raise ValueError(f"provider options must be a mapping, not {type(config).__name__}")
    if provider != "hmac":
        if config:
            names = ", ".join(sorted(repr(str(k)) for k in config))
            raise ValueError(f"provider {provider!r} takes no options (got {names})")
        return {}
    unknown = sorted(str(k) for k in config if k not in _HMAC_DEFAULTS)
    if unknown:
        known = ", ".join(_HMAC_DEFAULTS)
        raise ValueError(f"unknown generic-HMAC option {unknown[0]!r}; known options: {known}")
    out: dict[str, Any] = {}
    for name, default in _HMAC_DEFAULTS.items():
        value = config.get(name, default)
        if value is not None and not isinstance(value, str):
            raise ValueError(f"generic-HMAC option {name!r} must be a string or null")
        if name == "prefix":
            out[name] = value or ""
            continue
        if isinstance(value, str):
            value = value.strip()
        if not value:
            if name in _HMAC_REQUIRED:
                raise ValueError(f"generic-HMAC option {name!r} must not be empty")
            out[name] = None
            continue
        if name in _HMAC_HEADER_OPTIONS:
            value = value.lower()
            if not _HEADER_NAME.fullmatch(value):
                raise ValueError(f"generic-HMAC option {name!r} is not a valid header name")
        elif name in _HMAC_FIELD_OPTIONS:
            if any(not part for part in value.split(".")):
                raise ValueError(
                    f"generic-HMAC option {name!r} must be a field name or a dotted path"
                )
        elif name == "algorithm":
            value = value.lower()
            if value not in _ALGORITHMS:
                raise ValueError(
                    f"generic-HMAC option 'algorithm' must be one of {', '.join(_ALGORITHMS)}"
                )
        elif name == "encoding":
            value = value.lower()
            if value not in _ENCODINGS:
                raise ValueError(
                    f"generic-HMAC option 'encoding' must be one of {', '.join(_ENCODINGS)}"
                )
        out[name] = value
    if out["id_header"] is None and out["id_field"] is None:
        raise ValueError("generic-HMAC options 'id_header' and 'id_field' cannot both be null")
    if out["type_header"] is None and out["type_field"] is None:
        raise ValueError("generic-HMAC options 'type_header' and 'type_field' cannot both be null")
    return out


_SCHEMES: dict[frozenset[tuple[str, Any]], _HmacScheme] = {}


def _hmac_scheme(config: Mapping[str, Any]) -> _HmacScheme:
    """The parsed options of a generic-HMAC source, cached by their value (hot path)."""
    try:
        key: frozenset[tuple[str, Any]] | None = frozenset(config.items())
    except TypeError:  # an unhashable value: let validation say what is wrong
        key = None
    if key is not None:
        hit = _SCHEMES.get(key)
        if hit is not None:
            return hit
    opts = validate_config("hmac", config)

    def path(name: str) -> tuple[str, ...] | None:
        value = opts[name]
        return None if value is None else tuple(value.split("."))

    scheme = _HmacScheme(
        signature_header=opts["signature_header"],
        algorithm=opts["algorithm"],
        encoding=opts["encoding"],
        prefix=opts["prefix"].lower(),
        timestamp_header=opts["timestamp_header"],
        id_header=opts["id_header"],
        id_field=path("id_field"),
        type_header=opts["type_header"],
        type_field=path("type_field"),
        time_field=path("time_field"),
    )
    if key is not None:
        if len(_SCHEMES) >= 256:
            _SCHEMES.clear()
        _SCHEMES[key] = scheme
    return scheme


def default_tolerance(provider: str, config: Mapping[str, Any] | None = None) -> timedelta | None:
    """How far a signed timestamp may be from ``now``, either way; None when nothing is signed.

    Stripe's library allows 300 s (past only; we also refuse the future, as the other schemes
    do); Slack and the Standard Webhooks libraries allow 300 s both ways. GitHub and Shopify sign
    no timestamp. A generic HMAC source has one only when ``timestamp_header`` is configured.
    """
    _check_provider(provider)
    if provider in ("github", "shopify"):
        return None
    if provider == "hmac" and (config is None or _hmac_scheme(config).timestamp_header is None):
        return None
    return _FIVE_MINUTES


# --------------------------------------------------------------------------------------------
# Authentication
# --------------------------------------------------------------------------------------------

# Keyed HMAC objects and Standard Webhooks signers per secret: copying a keyed HMAC skips the
# key schedule, and Webhook() base64-decodes the secret. Small, and cleared when full.
_MAX_CACHED_KEYS: Final = 1024
_MACS: dict[tuple[str, str], hmac.HMAC] = {}
_SIGNERS: dict[str, Any] = {}
_MISSING: Final = object()


def _keyed(algorithm: str, secret: str) -> hmac.HMAC:
    """A fresh HMAC keyed with ``secret`` (its UTF-8 bytes, as every scheme here uses)."""
    base = _MACS.get((algorithm, secret))
    if base is None:
        if len(_MACS) >= _MAX_CACHED_KEYS:
            _MACS.clear()
        base = hmac.new(secret.encode("utf-8"), digestmod=algorithm)
        _MACS[(algorithm, secret)] = base
    return base.copy()


def _signer(secret: str) -> Any:
    """The cached ``standardwebhooks.Webhook`` for ``secret``; None if it cannot be a key."""
    signer = _SIGNERS.get(secret, _MISSING)
    if signer is not _MISSING:
        return signer
    try:
        signer = Webhook(secret)
    except (ValueError, RuntimeError, EmptyWebhookSecretError):  # not base64, or empty
        signer = None
    if len(_SIGNERS) >= _MAX_CACHED_KEYS:
        _SIGNERS.clear()
    _SIGNERS[secret] = signer
    return signer


def _unhex(value: str) -> bytes | None:
    """Signature bytes from hex (either case); None when malformed or empty."""
    try:
        return bytes.fromhex(value) or None
    except ValueError:
        return None


def _unb64(value: str) -> bytes | None:
    """Signature bytes from standard base64; None when malformed or empty."""
    try:
        return base64.b64decode(value, validate=True) or None
    except (binascii.Error, ValueError):
        return None


def _unix(value: str) -> int:
    """Unix seconds from a header; strict, because the string is part of what was signed."""
    if not (0 < len(value) <= _MAX_UNIX_DIGITS and value.isascii() and value.isdigit()):
        raise AuthError("malformed_timestamp")
    return int(value)


def _first_match(
    secrets: Sequence[tuple[str, str]],
    offered: Sequence[bytes],
    digest: Callable[[str], bytes | None],
) -> str:
    """Id of the first secret whose digest equals one offered signature (constant-time)."""
    for secret_id, secret in secrets:
        if not secret:
            continue
        expected = digest(secret)
        if expected is None:
            continue
        for candidate in offered:
            if hmac.compare_digest(expected, candidate):
                return secret_id
    raise AuthError("bad_signature")


def _check_fresh(timestamp: int, now: datetime, tolerance: timedelta | None) -> None:
    if tolerance is None:
        return
    skew = now.timestamp() - timestamp
    limit = tolerance.total_seconds()
    if skew > limit:
        raise AuthError("stale")
    if -skew > limit:
        raise AuthError("future")


_Auth = Callable[
    [Mapping[str, str], bytes, Sequence[tuple[str, str]], Mapping[str, Any]],
    tuple[str, int | None],
]


def _auth_stripe(
    headers: Mapping[str, str],
    body: bytes,
    secrets: Sequence[tuple[str, str]],
    config: Mapping[str, Any],
) -> tuple[str, int | None]:
    header = headers.get("stripe-signature")
    if not header:
        raise AuthError("missing_signature")
    ts_text: str | None = None
    offered: list[bytes] = []
    for item in header.split(","):
        key, _, value = item.strip().partition("=")
        if key == "t" and ts_text is None:
            ts_text = value
        elif key == "v1":  # the only live scheme; a test-mode v0 is ignored, as Stripe's lib does
            decoded = _unhex(value)
            if decoded is not None:
                offered.append(decoded)
    if ts_text is None:
        raise AuthError("missing_timestamp")
    timestamp = _unix(ts_text)
    if not offered:
        raise AuthError("malformed_signature")
    prefix = b"%d." % timestamp

    def digest(secret: str) -> bytes:
        mac = _keyed("sha256", secret)  # the whole whsec_... string is the key
        mac.update(prefix)
        mac.update(body)
        return mac.digest()

    return _first_match(secrets, offered, digest), timestamp


def _auth_github(
    headers: Mapping[str, str],
    body: bytes,
    secrets: Sequence[tuple[str, str]],
    config: Mapping[str, Any],
) -> tuple[str, int | None]:
    header = headers.get("x-hub-signature-256")
    if not header:
        raise AuthError("missing_signature")
    scheme, _, value = header.partition("=")
    decoded = _unhex(value) if scheme == "sha256" else None
    if decoded is None:
        raise AuthError("malformed_signature")

    return _first_match(secrets, (decoded,), _body_sha256(body)), None


def _body_sha256(body: bytes) -> Callable[[str], bytes]:
    """HMAC-SHA256 of the raw body under one secret (GitHub hex, Shopify base64)."""

    def digest(secret: str) -> bytes:
        mac = _keyed("sha256", secret)
        mac.update(body)
        return mac.digest()

    return digest


def _auth_shopify(
    headers: Mapping[str, str],
    body: bytes,
    secrets: Sequence[tuple[str, str]],
    config: Mapping[str, Any],
) -> tuple[str, int | None]:
    header = headers.get("x-shopify-hmac-sha256")
    if not header:
        raise AuthError("missing_signature")
    decoded = _unb64(header)
    if decoded is None:
        raise AuthError("malformed_signature")

    return _first_match(secrets, (decoded,), _body_sha256(body)), None


def _auth_slack(
    headers: Mapping[str, str],
    body: bytes,
    secrets: Sequence[tuple[str, str]],
    config: Mapping[str, Any],
) -> tuple[str, int | None]:
    header = headers.get("x-slack-signature")
    if not header:
        raise AuthError("missing_signature")
    ts_text = headers.get("x-slack-request-timestamp")
    if not ts_text:
        raise AuthError("missing_timestamp")
    timestamp = _unix(ts_text)
    version, _, value = header.partition("=")
    decoded = _unhex(value) if version == "v0" else None
    if decoded is None:
        raise AuthError("malformed_signature")
    prefix = b"v0:" + ts_text.encode("ascii") + b":"

    def digest(secret: str) -> bytes:
        mac = _keyed("sha256", secret)
        mac.update(prefix)
        mac.update(body)
        return mac.digest()

    return _first_match(secrets, (decoded,), digest), timestamp


def _standard_headers(
    headers: Mapping[str, str], provider: str
) -> tuple[str | None, str | None, str | None]:
    """(id, timestamp, signature); Svix falls back per header to ``webhook-*`` as its lib does."""
    if provider == "svix":
        return (
            headers.get("svix-id") or headers.get("webhook-id"),
            headers.get("svix-timestamp") or headers.get("webhook-timestamp"),
            headers.get("svix-signature") or headers.get("webhook-signature"),
        )
    return (
        headers.get("webhook-id"),
        headers.get("webhook-timestamp"),
        headers.get("webhook-signature"),
    )


def _auth_standard_for(provider: str) -> _Auth:
    def auth(
        headers: Mapping[str, str],
        body: bytes,
        secrets: Sequence[tuple[str, str]],
        config: Mapping[str, Any],
    ) -> tuple[str, int | None]:
        msg_id, ts_text, header = _standard_headers(headers, provider)
        if not header:
            raise AuthError("missing_signature")
        if not ts_text:
            raise AuthError("missing_timestamp")
        if not msg_id:
            raise AuthError("missing_id")
        timestamp = _unix(ts_text)
        offered: list[bytes] = []
        for entry in header.split(" "):
            version, _, value = entry.partition(",")
            if version == "v1":  # v1a (ed25519) is not supported by the Python library
                decoded = _unb64(value)
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

        return _first_match(secrets, offered, digest), timestamp

    return auth


def _auth_hmac(
    headers: Mapping[str, str],
    body: bytes,
    secrets: Sequence[tuple[str, str]],
    config: Mapping[str, Any],
) -> tuple[str, int | None]:
    scheme = _hmac_scheme(config)
    header = headers.get(scheme.signature_header)
    if not header:
        raise AuthError("missing_signature")
    if scheme.prefix:
        if header[: len(scheme.prefix)].lower() != scheme.prefix:
            raise AuthError("malformed_signature")
        header = header[len(scheme.prefix) :]
    decoded = _unhex(header) if scheme.encoding == "hex" else _unb64(header)
    if decoded is None:
        raise AuthError("malformed_signature")
    timestamp: int | None = None
    prefix = b""
    if scheme.timestamp_header is not None:
        ts_text = headers.get(scheme.timestamp_header)
        if not ts_text:
            raise AuthError("missing_timestamp")
        timestamp = _unix(ts_text)
        prefix = ts_text.encode("ascii") + b"."

    def digest(secret: str) -> bytes:
        mac = _keyed(scheme.algorithm, secret)
        if prefix:
            mac.update(prefix)
        mac.update(body)
        return mac.digest()

    return _first_match(secrets, (decoded,), digest), timestamp


_AUTH: Final[Mapping[str, _Auth]] = {
    "stripe": _auth_stripe,
    "github": _auth_github,
    "shopify": _auth_shopify,
    "slack": _auth_slack,
    "standard": _auth_standard_for("standard"),
    "svix": _auth_standard_for("svix"),
    "hmac": _auth_hmac,
}


def authenticate(
    provider: str,
    headers: Mapping[str, str],
    body: bytes,
    secrets: Sequence[tuple[str, str]],
    *,
    config: Mapping[str, Any],
    now: datetime,
    tolerance: timedelta | None,
) -> str:
    """Return the id of the first ``(secret_id, secret)`` whose signature matches the delivery.

    ``headers`` must have lower-case names. Several secrets allow rotation: the first one that
    matches wins. The signature is checked before the timestamp's freshness, so "stale" and
    "future" are only ever reported for deliveries that really came from the sender (clock skew
    or a replay), never for forgeries. ``tolerance`` None means :func:`default_tolerance`.
    Every comparison uses :func:`hmac.compare_digest`. Raises :class:`AuthError`.
    """
    auth = _AUTH.get(provider)
    if auth is None:
        raise _unknown_provider(provider)
    if now.tzinfo is None:
        raise ValueError("now must be a timezone-aware datetime")
    if not any(secret for _, secret in secrets):
        raise AuthError("no_secret")
    secret_id, timestamp = auth(headers, body, secrets, config)
    if timestamp is not None:
        if tolerance is None:
            tolerance = default_tolerance(provider, config)
        _check_fresh(timestamp, now, tolerance)
    return secret_id


# --------------------------------------------------------------------------------------------
# Extraction
# --------------------------------------------------------------------------------------------


_Extract = Callable[[Mapping[str, str], bytes, Mapping[str, Any]], EventMeta | Challenge]


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise MalformedEvent("bad_json") from None
    if not isinstance(value, dict):
        raise MalformedEvent("bad_json")
    return value


def _event_id(value: object) -> str:
    if value is None or value == "":
        raise MalformedEvent("missing_id")
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not _EVENT_ID.fullmatch(value):
        raise MalformedEvent("bad_id")
    return value


def _event_type(value: object) -> str:
    if value is None or value == "":
        raise MalformedEvent("missing_type")
    if not isinstance(value, str) or len(value) > _MAX_TYPE_LEN or not value.isprintable():
        raise MalformedEvent("bad_type")
    return value


def _parse_time(value: object) -> datetime:
    """Unix seconds (number or digit string) or ISO 8601; naive ISO times are taken as UTC."""
    if isinstance(value, bool):
        raise ValueError("a boolean is not a time")
    if isinstance(value, str):
        text = value.strip()
        if text.replace(".", "", 1).isdigit() and text.isascii():
            value = float(text)
        else:
            parsed = datetime.fromisoformat(text)
            if parsed.tzinfo is None:
                return parsed.replace(tzinfo=UTC)
            return parsed.astimezone(UTC)
    if isinstance(value, int | float):
        return datetime.fromtimestamp(value, UTC)
    raise ValueError("not a time")


def _occurred_at(value: object) -> datetime | None:
    if value is None:
        return None
    try:
        return _parse_time(value)
    except (ValueError, OverflowError, OSError):
        raise MalformedEvent("bad_time") from None


def _dig(obj: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    cur: Any = obj
    for part in path:
        if not isinstance(cur, dict):
            return None
        cur = cur.get(part)
    return cur


def _extract_stripe(
    headers: Mapping[str, str], body: bytes, config: Mapping[str, Any]
) -> EventMeta | Challenge:
    obj = _json_object(body)
    return EventMeta(
        event_id=_event_id(obj.get("id")),
        event_type=_event_type(obj.get("type")),
        occurred_at=_occurred_at(obj.get("created")),
    )


def _github_payload(headers: Mapping[str, str], body: bytes) -> dict[str, Any]:
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
        return _json_object(payload[0].encode("utf-8"))
    return _json_object(body)


def _extract_github(
    headers: Mapping[str, str], body: bytes, config: Mapping[str, Any]
) -> EventMeta | Challenge:
    event_id = _event_id(headers.get("x-github-delivery"))
    event_type = _event_type(headers.get("x-github-event"))
    action = _github_payload(headers, body).get("action")
    if isinstance(action, str) and action:
        event_type = _event_type(f"{event_type}.{action}")
    return EventMeta(event_id=event_id, event_type=event_type, occurred_at=None)


def _extract_shopify(
    headers: Mapping[str, str], body: bytes, config: Mapping[str, Any]
) -> EventMeta | Challenge:
    # Ids live in headers; the body (JSON or XML, by subscription) is not parsed at all.
    triggered = headers.get("x-shopify-triggered-at")
    occurred_at: datetime | None = None
    if triggered:
        try:
            occurred_at = _parse_time(triggered)
        except (ValueError, OverflowError, OSError):
            occurred_at = None  # informational and unsigned: never a reason to refuse
    return EventMeta(
        event_id=_event_id(headers.get("x-shopify-webhook-id")),
        event_type=_event_type(headers.get("x-shopify-topic")),
        occurred_at=occurred_at,
    )


def _extract_slack(
    headers: Mapping[str, str], body: bytes, config: Mapping[str, Any]
) -> EventMeta | Challenge:
    obj = _json_object(body)
    if obj.get("type") == "url_verification":
        challenge = obj.get("challenge")
        if not isinstance(challenge, str) or not challenge:
            raise MalformedEvent("bad_challenge")
        return Challenge(body=challenge.encode("utf-8"), content_type="text/plain")
    event = obj.get("event")
    event_type = event.get("type") if isinstance(event, dict) else None
    if not isinstance(event_type, str) or not event_type:
        event_type = obj.get("type")
    return EventMeta(
        event_id=_event_id(obj.get("event_id")),
        event_type=_event_type(event_type),
        occurred_at=_occurred_at(obj.get("event_time")),
    )


def _extract_standard_for(provider: str) -> _Extract:
    def extract_standard(
        headers: Mapping[str, str], body: bytes, config: Mapping[str, Any]
    ) -> EventMeta | Challenge:
        msg_id = _standard_headers(headers, provider)[0]
        event_id = _event_id(msg_id)
        obj = _json_object(body)
        return EventMeta(
            event_id=event_id,
            event_type=_event_type(obj.get("type")),
            occurred_at=_occurred_at(obj.get("timestamp")),
        )

    return extract_standard


def _extract_hmac(
    headers: Mapping[str, str], body: bytes, config: Mapping[str, Any]
) -> EventMeta | Challenge:
    scheme = _hmac_scheme(config)
    parsed: dict[str, Any] | None = None

    def field(path: tuple[str, ...]) -> Any:
        nonlocal parsed
        if parsed is None:
            parsed = _json_object(body)
        return _dig(parsed, path)

    raw_id: object = headers.get(scheme.id_header) if scheme.id_header else None
    if not raw_id and scheme.id_field is not None:
        raw_id = field(scheme.id_field)
    event_id = _event_id(raw_id)
    raw_type: object = headers.get(scheme.type_header) if scheme.type_header else None
    if not raw_type and scheme.type_field is not None:
        raw_type = field(scheme.type_field)
    event_type = _event_type(raw_type)
    occurred_at = None
    if scheme.time_field is not None:
        occurred_at = _occurred_at(field(scheme.time_field))
    return EventMeta(event_id=event_id, event_type=event_type, occurred_at=occurred_at)


_EXTRACT: Final[Mapping[str, _Extract]] = {
    "stripe": _extract_stripe,
    "github": _extract_github,
    "shopify": _extract_shopify,
    "slack": _extract_slack,
    "standard": _extract_standard_for("standard"),
    "svix": _extract_standard_for("svix"),
    "hmac": _extract_hmac,
}


def extract(
    provider: str, headers: Mapping[str, str], body: bytes, *, config: Mapping[str, Any]
) -> EventMeta | Challenge:
    """Event id, type and time from the provider's own fields (call after :func:`authenticate`).

    The body is parsed at most once, and only when the provider keeps something in it. Returns a
    :class:`Challenge` for Slack's ``url_verification`` handshake. Raises :class:`MalformedEvent`
    when the id (1..255 printable ASCII characters, no whitespace), the type (1..255 printable
    characters) or a present time is missing or unusable.
    """
    fn = _EXTRACT.get(provider)
    if fn is None:
        raise _unknown_provider(provider)
    return fn(headers, body, config)
