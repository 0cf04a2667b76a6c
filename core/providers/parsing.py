"""Helpers for extraction: the event's id, type and time from a JSON body or headers, each
checked (:class:`MalformedEvent` with a reason), and the :data:`ExtractFn` builders of the
shapes several senders share (fields of a JSON object, a JSON array of events).

Pure, as :mod:`core.providers.contract`.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, Final

import orjson

from core.providers.contract import (
    EVENT_ID,
    MAX_TYPE_LEN,
    Batch,
    Challenge,
    Config,
    EventMeta,
    ExtractFn,
    MalformedEvent,
    TooManyEvents,
    events_cap,
)

#: The ``type_from`` option of a sender whose type header is outside the signature while its
#: body names the type, for some events or all (GitHub, WooCommerce): ``body`` (the default:
#: the type only from the signed body where it names one, the header then only checked) or
#: ``header`` (the header as sent, unchecked: a captured body re-sent under another type runs
#: that type's routes).
TYPE_FROM_BODY: Final = "body"
TYPE_FROM_HEADER: Final = "header"


def type_from_option(config: Config) -> dict[str, Any]:
    """The stored form of ``type_from`` (absent: ``body``, stored as nothing); ValueError
    naming the option otherwise."""
    if "type_from" not in config:
        return {}
    value = config["type_from"]
    text = value.strip().lower() if isinstance(value, str) else None
    if text == TYPE_FROM_BODY:
        return {}
    if text == TYPE_FROM_HEADER:
        return {"type_from": TYPE_FROM_HEADER}
    raise ValueError(
        "option 'type_from' must be body (the default: the type from the signed body where "
        "it names one) or header (the unsigned header, unchecked)"
    )


def header_type(config: Config) -> bool:
    """Whether the source opted out into the unsigned header's type (``type_from=header``)."""
    return config.get("type_from") == TYPE_FROM_HEADER


def body_id(body: bytes) -> str:
    """An event id derived from the signed body, for senders whose id is not signed or absent:
    ``sha256:`` + the body's SHA-256 in hex (a retry repeats the body, so it dedups)."""
    return "sha256:" + hashlib.sha256(body).hexdigest()


# A body that must be a JSON object is refused on its first byte when it is anything else:
# parsing a 1 MiB array of empty objects only to refuse it costs ~57 ms of CPU.
_OBJECT_START: Final = re.compile(rb"[ \t\r\n]*\{")


def object_start(body: bytes) -> bool:
    """Whether ``body`` can be a JSON object (it starts, after JSON whitespace, with ``{``)."""
    return _OBJECT_START.match(body) is not None


def json_object(body: bytes) -> dict[str, Any]:
    if not object_start(body):
        raise MalformedEvent("bad_json")
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


#: Where a field is in the headers: a lower-case name, or names tried in order (the first
#: present and non-empty one counts).
HeaderNames = str | tuple[str, ...]


def from_headers(
    *, id: HeaderNames, type: str, time: str | None = None
) -> Callable[[Mapping[str, str], bytes, Config], EventMeta]:
    """The :data:`ExtractFn` of a sender whose event id, type and time are headers (Shopify,
    WooCommerce, GitLab); the body is not read.

    Reasons: those of :func:`event_id`, then :func:`event_type`. The time header is
    informational (:func:`unsigned_time`: None when unusable) and, the headers being unsigned,
    never anchors the receipt's expiry.
    """
    id_names = (id,) if isinstance(id, str) else id

    def extract(headers: Mapping[str, str], body: bytes, config: Config) -> EventMeta:
        raw_id = next((v for v in map(headers.get, id_names) if v), None)
        return EventMeta(
            event_id=event_id(raw_id),
            event_type=event_type(headers.get(type)),
            occurred_at=None if time is None else unsigned_time(headers.get(time)),
            time_signed=time is None,
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
