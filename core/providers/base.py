"""What a provider is (:class:`Provider`), the errors it raises, and the helpers schemes share.

Everything here is pure: no I/O, no clock (``now`` is always passed in) and no logging, so a
provider module is as testable as a function. Errors carry a short ``reason`` that is safe as
a metric label and in a response: it never contains a secret, a signature or body content.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from types import MappingProxyType
from typing import Any, Final, Literal, TypeVar

import orjson
from cryptography.exceptions import InvalidSignature

from core.errors import WebhooksError

# Every reason the built-in schemes raise, so metrics can pre-register their labels.
AUTH_REASONS: Final = frozenset(
    {
        "no_secret",  # the source has no usable secret: nothing can ever verify
        "missing_signature",
        "malformed_signature",
        "missing_timestamp",
        "malformed_timestamp",
        "missing_id",  # Standard Webhooks / Svix: the id is part of the signed string
        "missing_header",  # a header the signed-content template names is absent
        "bad_signature",
        "stale",
        "future",
    }
)
MALFORMED_REASONS: Final = frozenset(
    {
        "bad_json",
        "missing_id",
        "bad_id",
        "missing_type",
        "bad_type",
        "bad_time",
        "bad_challenge",
        "too_many_events",  # a batch over its provider's cap (answered 413, nothing written)
    }
)
REFUSED_REASONS: Final = frozenset({"too_many_parameters"})

FIVE_MINUTES: Final = timedelta(seconds=300)
# Most events one request may carry when the sender documents no maximum (SendGrid, Adyen).
# Every event of a request is accepted in one transaction holding one advisory lock per event
# id, and Postgres's shared lock table holds about 6,400 entries by default
# (max_locks_per_transaction 64 x max_connections 100): a bound well under it, and the largest
# group commit a receiver runs (WEBHOOKS_ACCEPT_BATCH_MAX is at most 1000).
DEFAULT_MAX_EVENTS: Final = 1000
# The most a source's ``max_events`` option may allow. Above about 1,000, raise Postgres's
# max_locks_per_transaction too (docs/providers.md, "Batches").
MAX_EVENTS_CEILING: Final = 5000
MAX_TYPE_LEN: Final = 255
# 1..255 printable ASCII characters without whitespace (0x21..0x7e): safe in URLs, logs and
# as part of a unique key, and no provider documents anything wider.
EVENT_ID: Final = re.compile(r"[\x21-\x7e]{1,255}")
# Unix seconds as an ASCII digit string. Eleven digits reach year 5138, well inside datetime.
MAX_UNIX_DIGITS: Final = 11


class ProviderError(WebhooksError):
    """Base of the providers' errors: a machine-readable ``reason`` and nothing from the request.

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


class UnsafeBody(ProviderError):
    """A body refused before any signature work because parsing it could cost more than any
    real delivery needs (answer 400, store nothing): an unauthenticated request must not be
    able to buy CPU time. Reasons: see :data:`REFUSED_REASONS`."""

    _prefix = "webhook body refused"


class TooManyEvents(MalformedEvent):
    """A batch carries more events than its provider's cap (answer 413, store nothing).

    Raised after counting and before any per-event work (Adyen: before any item's HMAC), so
    an oversized body costs one parse. ``limit`` is the cap, safe to show the sender.
    """

    def __init__(self, limit: int) -> None:
        super().__init__("too_many_events")
        self.limit = limit


@dataclass(frozen=True, slots=True)
class EventMeta:
    """What the pipeline needs to know about an event before storing it."""

    event_id: str
    event_type: str
    occurred_at: datetime | None  # aware, UTC
    # One event of a batch (:class:`Batch`): its own bytes and content type are its receipt's
    # payload. None: the request's body and content type, as received.
    payload: bytes | None = None
    content_type: str | None = None
    # False: ``occurred_at`` was read from a field the signature does not cover (Adyen's
    # ``eventDate``, Shopify's ``X-Shopify-Triggered-At``). It is stored for information but
    # never anchors the receipt's expiry: a replay could back-date it so that its receipt
    # expires at once and the next replay is new work (the arrival is the anchor instead).
    time_signed: bool = True


#: The event fields a provider reports, and whether the signature covers where each comes
#: from: ``signed``, ``unsigned``, or a short condition (GitLab: ``signed with the signing
#: token``). A field a provider does not report (GitHub has no time) is absent.
EVENT_FIELDS: Final = ("id", "type", "time")
SIGNED_FIELD: Final = "signed"
UNSIGNED_FIELD: Final = "unsigned"
#: Id, type and time all from signed parts (most body-signing senders).
ALL_SIGNED: Final[Mapping[str, str]] = MappingProxyType(
    {"id": SIGNED_FIELD, "type": SIGNED_FIELD, "time": SIGNED_FIELD}
)


@dataclass(frozen=True, slots=True)
class Challenge:
    """A handshake to answer instead of storing an event (Slack ``url_verification``).

    ``sign``: the answer depends on the secret that verified the request (Zoom's
    ``encryptedToken``); the receiver calls it with that secret and answers what it returns.
    """

    body: bytes
    content_type: str
    status: int = 200
    sign: Callable[[str], bytes] | None = None


@dataclass(frozen=True, slots=True)
class Batch:
    """Several events in one request (Adyen items, SendGrid and HubSpot arrays): one receipt
    each, deduplicated on its own id, all in one transaction; ``answer`` replaces the
    receiver's JSON answer when the sender requires its own (Adyen: ``[accepted]``)."""

    events: tuple[EventMeta, ...]
    answer: Challenge | None = None


Secrets = Sequence[tuple[str, str]]
Config = Mapping[str, Any]
#: ``(headers with lower-case names, raw body, [(secret_id, secret)], config)`` -> the id of
#: the matching secret and the signed unix timestamp (None when the scheme signs none).
AuthFn = Callable[[Mapping[str, str], bytes, Secrets, Config], tuple[str, int | None]]
#: ``(headers, raw body, config)`` -> the event's id/type/time, or a handshake to answer.
ExtractFn = Callable[[Mapping[str, str], bytes, Config], EventMeta | Challenge | Batch]
#: ``(query parameters, config)`` -> the answer to a GET handshake (Meta's ``hub.challenge``);
#: AuthError when it is not the sender's (answered 403).
VerifyGetFn = Callable[[Mapping[str, str], Config], Challenge]
#: A source's options -> their normalised form (what is stored); ValueError naming the option.
ConfigFn = Callable[[Config], dict[str, Any]]
#: ``whsec``: ``whsec_`` + base64 of the key (Standard Webhooks, Svix): 24+ decoded bytes.
#: ``text``: the string itself is the HMAC key or token: 16+ characters.
#: ``ed25519`` / ``p256``: the sender's public key (Discord: 64 hex; SendGrid: base64 SPKI);
#: ``hex``: an HMAC key the sender issues in hex (Adyen). Given by the user (never generated)
#: and checked by the provider's ``check_secret``.
KeyFormat = Literal["text", "whsec", "ed25519", "p256", "hex"]


def no_options(config: Config) -> dict[str, Any]:
    """The config rule of a provider whose scheme is fixed: any option is a mistake."""
    if not isinstance(config, Mapping):
        raise ValueError(f"provider options must be a mapping, not {type(config).__name__}")
    if config:
        names = ", ".join(sorted(repr(str(k)) for k in config))
        raise ValueError(f"takes no options (got {names})")
    return {}


def events_cap(config: Config, default: int) -> int:
    """The source's ``max_events`` option (validated by :func:`batch_options`), else
    ``default``."""
    value = config.get("max_events")
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def batch_options(default: int) -> ConfigFn:
    """The config rule of a batched provider whose sender documents no maximum count per
    request (SendGrid, Adyen): one option, ``max_events`` (1..MAX_EVENTS_CEILING; ``default``
    when absent), for a sender whose real batches are larger than ``default``."""

    def validate(config: Config) -> dict[str, Any]:
        if not isinstance(config, Mapping):
            raise ValueError(f"provider options must be a mapping, not {type(config).__name__}")
        unknown = sorted(str(k) for k in config if k != "max_events")
        if unknown:
            raise ValueError(f"unknown option {unknown[0]!r}; the only option is 'max_events'")
        if "max_events" not in config:
            return {}
        value = config["max_events"]
        if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
            value = int(value.strip())  # --config max_events=2000 arrives as text
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or not 1 <= value <= MAX_EVENTS_CEILING
        ):
            raise ValueError(
                f"option 'max_events' must be a whole number from 1 to {MAX_EVENTS_CEILING} "
                f"(default {default})"
            )
        return {"max_events": value}

    return validate


@dataclass(frozen=True, slots=True)
class Provider:
    """One sender's whole contract. A module defines one and the registry lists it.

    ``signed`` is one line: which fields the signature covers, and so what a captured request
    can replay (it is shown by ``webhooks providers list`` and in the table of docs/providers.md).
    ``tolerance`` is how far a signed timestamp may be from now, either way (None: the scheme
    signs none); ``tolerance_rule`` replaces it when it depends on the source's options.
    ``retry_window`` is the sender's documented retry horizon, ``citation`` where it is
    documented; the dedup TTL is derived from it (``core.ttl``).
    """

    name: str
    authenticate: AuthFn
    extract: ExtractFn
    retry_window: timedelta
    citation: str
    signed: str
    tolerance: timedelta | None = FIVE_MINUTES
    tolerance_rule: Callable[[Config], timedelta | None] | None = None
    validate_config: ConfigFn = no_options
    key_format: KeyFormat = "text"
    key_prefix: str = ""  # what generated secrets start with (Stripe: whsec_)
    signs_url: bool = False  # the signature covers the public URL (config public_url)
    handshake: str | None = None  # what is answered instead of stored, if anything
    verify_get: VerifyGetFn | None = None  # a GET handshake on the webhook URL (Meta)
    check_secret: Callable[[str], None] | None = None  # ValueError: not a key of this format
    batched: bool = False  # one request may carry several events (extract returns a Batch)
    # Batched: the most events one request may carry (the sender's documented maximum, or
    # DEFAULT_MAX_EVENTS); more is refused with 413 and nothing is written.
    max_events: int | None = None
    summary: str = ""  # one line for listings
    notes: tuple[str, ...] = field(default=())
    # Where the event's id, type and time come from (see EVENT_FIELDS): what a captured
    # request can change without breaking the signature. ``fields_rule`` replaces it when it
    # depends on the source's options. Empty: not stated (a plug-in that does not say).
    fields: Mapping[str, str] = field(default_factory=dict)
    fields_rule: Callable[[Config], Mapping[str, str]] | None = None

    def default_tolerance(self, config: Config | None = None) -> timedelta | None:
        if self.tolerance_rule is not None:
            return self.tolerance_rule(config or {})
        return self.tolerance

    def signed_fields(self, config: Config | None = None) -> Mapping[str, str]:
        """For each event field this provider reports (id, type, time): ``signed``,
        ``unsigned`` or the condition under which it is signed, under ``config``."""
        if self.fields_rule is not None:
            return self.fields_rule(config or {})
        return self.fields

    def check_count(self, count: int, config: Config | None = None) -> None:
        """TooManyEvents when a batch of ``count`` events is over this provider's cap (the
        source's ``max_events`` option where the provider takes one)."""
        default = self.max_events if self.max_events is not None else DEFAULT_MAX_EVENTS
        limit = events_cap(config or {}, default)
        if count > limit:
            raise TooManyEvents(limit)


# --------------------------------------------------------------------------------------------
# Helpers for authentication
# --------------------------------------------------------------------------------------------

# Keyed HMAC objects per secret: copying a keyed HMAC skips the key schedule. Small, and
# cleared when full.
_MAX_CACHED_KEYS: Final = 1024
_Key = TypeVar("_Key")
_MACS: dict[tuple[str, bytes], hmac.HMAC] = {}


def keyed(algorithm: str, secret: str | bytes) -> hmac.HMAC:
    """A fresh HMAC keyed with ``secret`` (a string's UTF-8 bytes, as most schemes use)."""
    key = secret.encode("utf-8") if isinstance(secret, str) else secret
    base = _MACS.get((algorithm, key))
    if base is None:
        if len(_MACS) >= _MAX_CACHED_KEYS:
            _MACS.clear()
        base = hmac.new(key, digestmod=algorithm)
        _MACS[(algorithm, key)] = base
    return base.copy()


def hmac_of(algorithm: str, *parts: bytes) -> Callable[[str], bytes]:
    """The digest function ``secret -> HMAC(secret, b"".join(parts))`` for :func:`first_match`."""

    def digest(secret: str) -> bytes:
        mac = keyed(algorithm, secret)
        for part in parts:
            mac.update(part)
        return mac.digest()

    return digest


def unhex(value: str) -> bytes | None:
    """Signature bytes from hex (either case); None when malformed or empty."""
    try:
        return bytes.fromhex(value) or None
    except ValueError:
        return None


def unb64(value: str) -> bytes | None:
    """Signature bytes from standard base64; None when malformed or empty."""
    try:
        return base64.b64decode(value, validate=True) or None
    except (binascii.Error, ValueError):
        return None


def unix(value: str) -> int:
    """Unix seconds from a header; strict, because the string is part of what was signed."""
    if not (0 < len(value) <= MAX_UNIX_DIGITS and value.isascii() and value.isdigit()):
        raise AuthError("malformed_timestamp")
    return int(value)


def header(headers: Mapping[str, str], name: str, reason: str = "missing_signature") -> str:
    """A header that must be present and non-empty; AuthError(``reason``) otherwise."""
    value = headers.get(name)
    if not value:
        raise AuthError(reason)
    return value


def first_match(
    secrets: Secrets, offered: Sequence[bytes], digest: Callable[[str], bytes | None]
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


def first_verified(
    secrets: Secrets, public_key: Callable[[str], _Key | None], verify: Callable[[_Key], None]
) -> str:
    """Id of the first secret, a public key here (Discord, SendGrid), that verifies: empty
    or unusable keys (``public_key`` gives None) are skipped, ``verify`` raises
    InvalidSignature to refuse; AuthError("bad_signature") when none verifies."""
    for secret_id, key in secrets:
        public = public_key(key) if key else None
        if public is None:
            continue
        try:
            verify(public)
        except InvalidSignature:
            continue
        return secret_id
    raise AuthError("bad_signature")


def check_fresh(timestamp: int, now: datetime, tolerance: timedelta | None) -> None:
    if tolerance is None:
        return
    skew = now.timestamp() - timestamp
    limit = tolerance.total_seconds()
    if skew > limit:
        raise AuthError("stale")
    if -skew > limit:
        raise AuthError("future")


def kv_header(value: str, pair_sep: str, kv_sep: str = "=") -> list[tuple[str, str]]:
    """``t=1,v1=ab`` -> [("t", "1"), ("v1", "ab")] (Stripe, Paddle, Calendly style headers)."""
    out = []
    for item in value.split(pair_sep):
        key, _, val = item.strip().partition(kv_sep)
        out.append((key, val))  # values exactly as sent: a timestamp's text is signed
    return out


def signature_header(
    headers: Mapping[str, str],
    name: str,
    *,
    scheme: str | None = None,
    decode: Callable[[str], bytes | None] = unhex,
) -> bytes:
    """The signature bytes of a one-value header, ``value`` or ``scheme=value``.

    Missing or empty: AuthError("missing_signature"); another scheme, or a value ``decode``
    refuses: AuthError("malformed_signature"). The scheme is compared exactly, as senders
    write it (``sha256``, ``sha1``).
    """
    value = header(headers, name)
    if scheme is not None:
        found, _, value = value.partition("=")
        if found != scheme:
            raise AuthError("malformed_signature")
    decoded = decode(value)
    if decoded is None:
        raise AuthError("malformed_signature")
    return decoded


def body_hmac(
    name: str,
    *,
    scheme: str | None = None,
    algorithm: str = "sha256",
    decode: Callable[[str], bytes | None] = unhex,
) -> AuthFn:
    """The :data:`AuthFn` of "one header holds HMAC(secret, raw body)", no timestamp signed.

    GitHub, Bitbucket, Intercom, Typeform, Sentry, WooCommerce, Shopify and Meta differ only
    in the header's name, its ``scheme=`` prefix, the hash and hex or base64 (see
    :func:`signature_header` for the reasons).
    """

    def authenticate(
        headers: Mapping[str, str], body: bytes, secrets: Secrets, config: Config
    ) -> tuple[str, int | None]:
        offered = signature_header(headers, name, scheme=scheme, decode=decode)
        return first_match(secrets, (offered,), hmac_of(algorithm, body)), None

    return authenticate


def timestamped_header(
    name: str,
    *,
    pair_sep: str = ",",
    timestamp_key: str = "t",
    signature_key: str = "v1",
    joiner: bytes = b".",
    timestamp_as_sent: bool = True,
    algorithm: str = "sha256",
) -> AuthFn:
    """The :data:`AuthFn` of a ``t=<unix>,v1=<hex>[,v1=...]`` header (Stripe, Paddle, Calendly).

    The signed line is ``<timestamp> + joiner + body``: the timestamp as sent, or, with
    ``timestamp_as_sent=False``, re-rendered from its integer value (Stripe's libraries do that,
    so ``t=0123`` signs ``123.``). The first timestamp counts; every hex ``signature_key``
    value is a candidate (several during a rotation), any other key is ignored. Reasons, in
    this order: missing_signature, missing_timestamp, malformed_timestamp,
    malformed_signature, bad_signature. Freshness is the caller's (the receiver checks the
    returned timestamp against the tolerance).
    """

    def authenticate(
        headers: Mapping[str, str], body: bytes, secrets: Secrets, config: Config
    ) -> tuple[str, int | None]:
        ts_text: str | None = None
        offered: list[bytes] = []
        for key, value in kv_header(header(headers, name), pair_sep):
            if key == timestamp_key and ts_text is None:
                ts_text = value
            elif key == signature_key:
                decoded = unhex(value)
                if decoded is not None:
                    offered.append(decoded)
        if ts_text is None:
            raise AuthError("missing_timestamp")
        timestamp = unix(ts_text)
        if not offered:
            raise AuthError("malformed_signature")
        signed_ts = ts_text.encode("ascii") if timestamp_as_sent else b"%d" % timestamp
        digest = hmac_of(algorithm, signed_ts, joiner, body)
        return first_match(secrets, offered, digest), timestamp

    return authenticate


def versioned_timestamp_hmac(signature: str, timestamp: str, *, version: str = "v0") -> AuthFn:
    """The :data:`AuthFn` of ``<signature>: v0=<hex>`` with unix seconds in ``<timestamp>``,
    signed as ``v0:<timestamp as sent>:<body>`` with HMAC-SHA256 (Slack, Zoom).

    Reasons, in this order: missing_signature, missing_timestamp, malformed_timestamp,
    malformed_signature (another version, or not hex), bad_signature.
    """
    tag = version.encode("ascii")

    def authenticate(
        headers: Mapping[str, str], body: bytes, secrets: Secrets, config: Config
    ) -> tuple[str, int | None]:
        value = header(headers, signature)
        ts_text = header(headers, timestamp, "missing_timestamp")
        ts = unix(ts_text)
        found, _, value = value.partition("=")
        decoded = unhex(value) if found == version else None
        if decoded is None:
            raise AuthError("malformed_signature")
        prefix = tag + b":" + ts_text.encode("ascii") + b":"
        return first_match(secrets, (decoded,), hmac_of("sha256", prefix, body)), ts

    return authenticate


# --------------------------------------------------------------------------------------------
# Helpers for extraction
# --------------------------------------------------------------------------------------------


def body_id(body: bytes) -> str:
    """An event id derived from the signed body, for senders whose id is not signed or absent:
    ``sha256:`` + the body's SHA-256 in hex (a retry repeats the body, so it dedups)."""
    return "sha256:" + hashlib.sha256(body).hexdigest()


def json_object(body: bytes) -> dict[str, Any]:
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise MalformedEvent("bad_json") from None
    if not isinstance(value, dict):
        raise MalformedEvent("bad_json")
    return value


def event_id(value: object) -> str:
    if value is None or value == "":
        raise MalformedEvent("missing_id")
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not EVENT_ID.fullmatch(value):
        raise MalformedEvent("bad_id")
    return value


def event_type(value: object) -> str:
    if value is None or value == "":
        raise MalformedEvent("missing_type")
    if not isinstance(value, str) or len(value) > MAX_TYPE_LEN or not value.isprintable():
        raise MalformedEvent("bad_type")
    return value


def parse_time(value: object) -> datetime:
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


def occurred_at(value: object) -> datetime | None:
    if value is None:
        return None
    try:
        return parse_time(value)
    except (ValueError, OverflowError, OSError):
        raise MalformedEvent("bad_time") from None


def unsigned_time(value: str | None) -> datetime | None:
    """An informational, unsigned time header: never a reason to refuse, so None if unusable."""
    if not value:
        return None
    try:
        return parse_time(value)
    except (ValueError, OverflowError, OSError):
        return None


def dig(obj: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    cur: Any = obj
    for part in path:
        if not isinstance(cur, dict):
            return None
        cur = cur.get(part)
    return cur


#: Where a field is in a JSON body: a top-level name, or a path of names into nested objects.
FieldPath = str | tuple[str, ...]


def _path(where: FieldPath) -> tuple[str, ...]:
    return (where,) if isinstance(where, str) else where


def json_fields(*, id: FieldPath, type: FieldPath, time: FieldPath | None = None) -> ExtractFn:
    """The :data:`ExtractFn` of a JSON object body that carries its own id, type and time.

    Reasons: bad_json (not a JSON object), then those of :func:`event_id`,
    :func:`event_type` and :func:`occurred_at` (a missing time is None, not an error).
    """
    id_path, type_path = _path(id), _path(type)
    time_path = None if time is None else _path(time)

    def extract(headers: Mapping[str, str], body: bytes, config: Config) -> EventMeta:
        obj = json_object(body)
        return EventMeta(
            event_id=event_id(dig(obj, id_path)),
            event_type=event_type(dig(obj, type_path)),
            occurred_at=None if time_path is None else occurred_at(dig(obj, time_path)),
        )

    return extract


def echo_challenge(value: object) -> Challenge:
    """A handshake answered with its challenge as text/plain (Slack, Twitch); bad_challenge
    when it is not a non-empty string."""
    if not isinstance(value, str) or not value:
        raise MalformedEvent("bad_challenge")
    return Challenge(body=value.encode("utf-8"), content_type="text/plain")


def millis_time(value: object) -> datetime | None:
    """An integer of unix milliseconds in a body (HubSpot, Zoom); None when absent, bad_time
    when it is anything else or out of range."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise MalformedEvent("bad_time")
    try:
        return datetime.fromtimestamp(value / 1000, UTC)
    except (OverflowError, OSError, ValueError):
        raise MalformedEvent("bad_time") from None


def json_batch(
    *,
    id: FieldPath,
    type: FieldPath,
    time: FieldPath,
    max_events: int,
    read_time: Callable[[object], datetime | None] = occurred_at,
) -> ExtractFn:
    """The :data:`ExtractFn` of a non-empty JSON array of event objects (HubSpot, SendGrid): a
    :class:`Batch`, each event with its own object re-serialised as its payload.

    More than ``max_events`` items (or the source's ``max_events`` option, see
    :func:`batch_options`) is :class:`TooManyEvents`, decided on the count alone.
    Items are checked in order, each fully before the next, so the first bad item decides the
    reason: bad_json (not a non-empty array, or an item that is not an object), then those
    of :func:`event_id`, :func:`event_type` and ``read_time``.
    """
    id_path, type_path, time_path = _path(id), _path(type), _path(time)

    def extract(headers: Mapping[str, str], body: bytes, config: Config) -> Batch:
        try:
            items = orjson.loads(body)
        except orjson.JSONDecodeError:
            raise MalformedEvent("bad_json") from None
        if not isinstance(items, list) or not items:
            raise MalformedEvent("bad_json")
        limit = events_cap(config, max_events)
        if len(items) > limit:
            raise TooManyEvents(limit)
        events = []
        for item in items:
            if not isinstance(item, dict):
                raise MalformedEvent("bad_json")
            events.append(
                EventMeta(
                    event_id=event_id(dig(item, id_path)),
                    event_type=event_type(dig(item, type_path)),
                    occurred_at=read_time(dig(item, time_path)),
                    payload=orjson.dumps(item),
                    content_type="application/json",
                )
            )
        return Batch(events=tuple(events))

    return extract
