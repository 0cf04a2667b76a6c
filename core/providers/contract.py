"""What a provider is (:class:`Provider`), what it returns (:class:`EventMeta`,
:class:`Challenge`, :class:`Batch`) and the errors it raises, with their reasons and limits.

Everything here is pure: no I/O, no clock (``now`` is always passed in) and no logging, so a
provider module is as testable as a function. Errors carry a short ``reason`` that is safe as
a metric label and in a response: it never contains a secret, a signature or body content.
The helpers that schemes share are in :mod:`core.providers.signatures` (authentication) and
:mod:`core.providers.parsing` (extraction); :mod:`core.providers.base` gathers all three.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from types import MappingProxyType
from typing import Any, Final, Literal

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
#: ``(config, event type or route glob)`` -> what an unsigned type is read from, or None
#: (:meth:`Provider.unsigned_type`).
TypeRule = Callable[[Config, str], str | None]
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


def check_mapping(config: object) -> None:
    """The first check of every config rule: ValueError naming the type of a non-mapping."""
    if not isinstance(config, Mapping):
        raise ValueError(f"provider options must be a mapping, not {type(config).__name__}")


def one_option(config: Config, name: str, *, required: bool = False) -> None:
    """The checks before a config rule that takes one option, ``name``, reads it: a mapping,
    and no other key (ValueError naming the first one; every one when ``name`` is required)."""
    check_mapping(config)
    unknown = sorted(str(k) for k in config if k != name)
    if unknown and required:
        raise ValueError(f"unknown option(s) {', '.join(map(repr, unknown))}; takes {name}")
    if unknown:
        raise ValueError(f"unknown option {unknown[0]!r}; the only option is {name!r}")


def no_options(config: Config) -> dict[str, Any]:
    """The config rule of a provider whose scheme is fixed: any option is a mistake."""
    check_mapping(config)
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
        one_option(config, "max_events")
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
    documented; the dedup TTL is derived from it (``core.ttl``). ``verified_on`` is the day the
    window was last checked against that page (None: never, so always due for review:
    ``core.horizon``, ``webhooks ttl check``); keyword-only, so it sits beside them without
    moving any positional field.
    """

    name: str
    authenticate: AuthFn
    extract: ExtractFn
    retry_window: timedelta
    citation: str
    verified_on: date | None = field(default=None, kw_only=True)
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
    # ``(config, an event type or a route's glob)`` -> what the type is read from when the
    # signature does not cover it (``X-GitHub-Event``), or None when it is signed: see
    # :meth:`unsigned_type`. None: judged from ``signed_fields``.
    type_rule: TypeRule | None = None

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

    def unsigned_type(self, config: Config | None, pattern: str) -> str | None:
        """Where an event type matching ``pattern`` (a stored type, or a route's glob such as
        ``issues.*``) is read from when the signature does not cover it, as a short text for
        the operator (``the X-GitHub-Event header``); None when every such type comes from
        signed parts. A glob that could match one unsigned type counts as unsigned."""
        if self.type_rule is not None:
            return self.type_rule(config or {}, pattern)
        if self.signed_fields(config).get("type", "").startswith(UNSIGNED_FIELD):
            return "a part the signature does not cover"
        return None

    def check_count(self, count: int, config: Config | None = None) -> None:
        """TooManyEvents when a batch of ``count`` events is over this provider's cap (the
        source's ``max_events`` option where the provider takes one)."""
        default = self.max_events if self.max_events is not None else DEFAULT_MAX_EVENTS
        limit = events_cap(config or {}, default)
        if count > limit:
            raise TooManyEvents(limit)
