"""Generic HMAC (provider ``hmac``): a configurable HMAC for senders not listed.

Options (``--config KEY=VALUE``): ``signature_header``, ``algorithm`` (sha1/sha256/sha512),
``encoding`` (hex/base64), ``prefix`` (e.g. ``sha256=``), ``timestamp_header`` (checked for
freshness), ``signed_content`` (what is signed, below), ``id_field`` (or ``id_path``) /
``type_field`` / ``time_field`` (dotted paths into a JSON body), ``id_header``, ``type_header`` and
``id_from_unsigned_header``.

What is signed: by default the raw body, or ``"{timestamp}.{body}"`` when ``timestamp_header``
is set. ``signed_content`` is a template for anything else: ``{body}`` (exactly once),
``{header:NAME}`` (that header's value, exactly as sent; a missing one fails authentication)
and literal text, ``{{`` and ``}}`` for braces; e.g.
``{header:x-webhook-id}.{header:x-webhook-timestamp}.{body}``.

The event id is the dedup key, so by default it comes from the signed body (``id_field``,
default ``id``): a captured request replays only as the same event. ``id_header`` takes it
from a header instead, which is allowed only when the template signs that header, or with
``id_from_unsigned_header=true``: then a captured request can be replayed under a new id and
is accepted as a new event (the behaviour before migration 0009; documented, not advised).
Generic senders publish no retry contract: three days is assumed; override per source.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Final

from core.providers.base import (
    FIVE_MINUTES,
    SIGNED_FIELD,
    UNSIGNED_FIELD,
    AuthError,
    Challenge,
    EventMeta,
    Secrets,
    check_mapping,
    dig,
    event_id,
    event_type,
    first_match,
    header,
    hmac_of,
    json_object,
    occurred_at,
    unb64,
    unhex,
    unix,
)
from core.providers.descriptions import described

DEFAULTS: Final[Mapping[str, str | bool | None]] = {
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
_HEADER_OPTIONS: Final = frozenset(
    {"signature_header", "timestamp_header", "id_header", "type_header"}
)
_FIELD_OPTIONS: Final = frozenset({"id_field", "type_field", "time_field"})
_REQUIRED: Final = frozenset({"signature_header", "algorithm", "encoding"})
_ALGORITHMS: Final = ("sha1", "sha256", "sha512")
_ENCODINGS: Final = ("hex", "base64")
# RFC 9110 token characters, lower-cased: the receiver looks headers up by lower-case name.
_HEADER_NAME: Final = re.compile(r"[!#$%&'*+.^_`|~0-9a-z-]+")
_TRUE: Final = frozenset({"true", "1", "yes", "on"})
_FALSE: Final = frozenset({"false", "0", "no", "off", ""})
_MAX_TEMPLATE: Final = 512
# A template token: an escaped brace, a placeholder, or a lone brace (an error).
_TOKEN: Final = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")

#: One part of the signed content: literal bytes, the body (None), or a header's name (str).
Part = bytes | str | None


def parse_template(template: str) -> tuple[Part, ...]:
    """``signed_content`` -> its parts; ValueError saying what is wrong with it."""
    if len(template) > _MAX_TEMPLATE:
        raise ValueError(f"'signed_content' is longer than {_MAX_TEMPLATE} characters")
    parts: list[Part] = []
    literal: list[str] = []
    pos = 0
    bodies = 0

    def flush() -> None:
        if literal:
            parts.append("".join(literal).encode("utf-8"))
            literal.clear()

    for match in _TOKEN.finditer(template):
        literal.append(template[pos : match.start()])
        pos = match.end()
        token = match.group(0)
        if token in ("{{", "}}"):
            literal.append(token[0])
            continue
        name = match.group(1)
        if name is None:
            raise ValueError(
                f"'signed_content' has a lone {token!r}: write {token * 2} for a literal brace"
            )
        flush()
        if name == "body":
            bodies += 1
            parts.append(None)
        elif name.startswith("header:"):
            header_name = name.removeprefix("header:").strip().lower()
            if not _HEADER_NAME.fullmatch(header_name):
                raise ValueError(f"'signed_content' placeholder {{{name}}}: not a header name")
            parts.append(header_name)
        else:
            raise ValueError(
                f"'signed_content' placeholder {{{name}}} is unknown: use {{body}} or "
                "{header:NAME}"
            )
    literal.append(template[pos:])
    flush()
    if bodies != 1:
        raise ValueError("'signed_content' must contain {body} exactly once")
    return tuple(parts)


def _flag(name: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"generic-HMAC option {name!r} must be true or false")


@dataclass(frozen=True, slots=True)
class _Scheme:
    signature_header: str
    algorithm: str
    encoding: str
    prefix: str
    timestamp_header: str | None
    signed: tuple[Part, ...]
    id_header: str | None
    id_field: tuple[str, ...] | None
    type_header: str | None
    type_field: tuple[str, ...] | None
    time_field: tuple[str, ...] | None


def validate_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """Check and normalise the options; the result is what to store.

    Every option is listed with its default filled in and header names lower-cased, and
    validating the result again returns it unchanged. Raises ValueError naming the bad option.
    """
    check_mapping(config)
    if "id_path" in config:  # another name for id_field (a dotted path into the body)
        if "id_field" in config:
            raise ValueError("generic-HMAC options 'id_path' and 'id_field' are the same: give one")
        config = {("id_field" if k == "id_path" else k): v for k, v in config.items()}
    unknown = sorted(str(k) for k in config if k not in DEFAULTS)
    if unknown:
        known = ", ".join(DEFAULTS)
        raise ValueError(f"unknown generic-HMAC option {unknown[0]!r}; known options: {known}")
    out: dict[str, Any] = {}
    for name, default in DEFAULTS.items():
        value = config.get(name, default)
        if name == "id_from_unsigned_header":
            out[name] = _flag(name, value)
            continue
        if value is not None and not isinstance(value, str):
            raise ValueError(f"generic-HMAC option {name!r} must be a string or null")
        if name == "prefix":
            out[name] = value or ""
            continue
        if isinstance(value, str) and name != "signed_content":  # a template is taken verbatim
            value = value.strip()
        if not value:
            if name in _REQUIRED:
                raise ValueError(f"generic-HMAC option {name!r} must not be empty")
            out[name] = None
            continue
        if name in _HEADER_OPTIONS:
            value = value.lower()
            if not _HEADER_NAME.fullmatch(value):
                raise ValueError(f"generic-HMAC option {name!r} is not a valid header name")
        elif name in _FIELD_OPTIONS:
            if any(not part for part in value.split(".")):
                raise ValueError(
                    f"generic-HMAC option {name!r} must be a field name or a dotted path"
                )
        elif name == "signed_content":
            parse_template(value)
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
    covered = set(signed_headers(out))
    if out["timestamp_header"] is not None and out["timestamp_header"] not in covered:
        raise ValueError(
            "generic-HMAC option 'signed_content' must sign the timestamp header "
            f"{{header:{out['timestamp_header']}}}: an unsigned timestamp proves nothing"
        )
    if (
        out["id_header"] is not None
        and out["id_header"] not in covered
        and not out["id_from_unsigned_header"]
    ):
        raise ValueError(
            f"generic-HMAC option 'id_header' ({out['id_header']}) is not signed, so a captured "
            "request could be replayed under a new id: sign it with signed_content="
            f"'{{header:{out['id_header']}}}.{{body}}' (as the sender does), take the id from "
            "the body (id_field), or accept the risk with id_from_unsigned_header=true"
        )
    if out["id_from_unsigned_header"] and out["id_header"] is None:
        raise ValueError("generic-HMAC option 'id_from_unsigned_header' needs an 'id_header'")
    if out["type_header"] is None and out["type_field"] is None:
        raise ValueError("generic-HMAC options 'type_header' and 'type_field' cannot both be null")
    return out


def _template(opts: Mapping[str, Any]) -> tuple[Part, ...]:
    """The signed content of normalised options (the default when no template is set)."""
    if opts["signed_content"] is not None:
        return parse_template(opts["signed_content"])
    if opts["timestamp_header"] is not None:
        return (opts["timestamp_header"], b".", None)
    return (None,)


def signed_parts(opts: Mapping[str, Any]) -> tuple[Part, ...]:
    """What is signed under normalised options, in order: ``None`` for the body, bytes as
    written, a header's lower-case name for its value (for senders: ``webhooks send``)."""
    return _template(opts)


def signed_headers(opts: Mapping[str, Any]) -> tuple[str, ...]:
    """The headers the signature covers under normalised options."""
    return tuple(part for part in _template(opts) if isinstance(part, str))


_SCHEMES: dict[frozenset[tuple[str, Any]], _Scheme] = {}


def _scheme(config: Mapping[str, Any]) -> _Scheme:
    """The parsed options of a source, cached by their value (hot path)."""
    try:
        key: frozenset[tuple[str, Any]] | None = frozenset(config.items())
    except TypeError:  # an unhashable value: let validation say what is wrong
        key = None
    if key is not None:
        hit = _SCHEMES.get(key)
        if hit is not None:
            return hit
    opts = validate_config(config)

    def path(name: str) -> tuple[str, ...] | None:
        value = opts[name]
        return None if value is None else tuple(value.split("."))

    scheme = _Scheme(
        signature_header=opts["signature_header"],
        algorithm=opts["algorithm"],
        encoding=opts["encoding"],
        prefix=opts["prefix"].lower(),
        timestamp_header=opts["timestamp_header"],
        signed=_template(opts),
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


def fields(config: Mapping[str, Any]) -> Mapping[str, str]:
    """Where id, type and time come from under these options (the body is always signed)."""
    try:
        opts = validate_config(config)
    except ValueError:
        return {}
    covered = set(signed_headers(opts))

    def source(header_option: str) -> str:
        name = opts[header_option]
        if name is None or name in covered:
            return SIGNED_FIELD
        return f"{UNSIGNED_FIELD} ({name}) unless absent"

    out = {"id": source("id_header"), "type": source("type_header")}
    if opts["time_field"] is not None:
        out["time"] = SIGNED_FIELD
    return out


def tolerance(config: Mapping[str, Any]) -> timedelta | None:
    """Five minutes when a timestamp header is configured (and so signed); None otherwise."""
    return FIVE_MINUTES if _scheme(config).timestamp_header is not None else None


def authenticate(
    headers: Mapping[str, str], body: bytes, secrets: Secrets, config: Mapping[str, Any]
) -> tuple[str, int | None]:
    scheme = _scheme(config)
    signature = header(headers, scheme.signature_header)
    if scheme.prefix:
        if signature[: len(scheme.prefix)].lower() != scheme.prefix:
            raise AuthError("malformed_signature")
        signature = signature[len(scheme.prefix) :]
    decoded = unhex(signature) if scheme.encoding == "hex" else unb64(signature)
    if decoded is None:
        raise AuthError("malformed_signature")
    timestamp: int | None = None
    if scheme.timestamp_header is not None:
        timestamp = unix(header(headers, scheme.timestamp_header, "missing_timestamp"))
    parts: list[bytes] = []
    for part in scheme.signed:
        if part is None:
            parts.append(body)
        elif isinstance(part, str):
            value = headers.get(part)
            if value is None:  # present but empty is signed as empty
                raise AuthError("missing_header")
            parts.append(_header_bytes(value))
        else:
            parts.append(part)
    return first_match(secrets, (decoded,), hmac_of(scheme.algorithm, *parts)), timestamp


def _header_bytes(value: str) -> bytes:
    """A header's value as it was sent (servers decode header bytes as latin-1)."""
    try:
        return value.encode("latin-1")
    except UnicodeEncodeError:
        return value.encode("utf-8")


def extract(
    headers: Mapping[str, str], body: bytes, config: Mapping[str, Any]
) -> EventMeta | Challenge:
    scheme = _scheme(config)
    parsed: dict[str, Any] | None = None

    def field(path: tuple[str, ...]) -> Any:
        nonlocal parsed
        if parsed is None:
            parsed = json_object(body)
        return dig(parsed, path)

    raw_id: object = headers.get(scheme.id_header) if scheme.id_header else None
    if not raw_id and scheme.id_field is not None:
        raw_id = field(scheme.id_field)
    the_id = event_id(raw_id)
    raw_type: object = headers.get(scheme.type_header) if scheme.type_header else None
    if not raw_type and scheme.type_field is not None:
        raw_type = field(scheme.type_field)
    the_type = event_type(raw_type)
    when = None
    if scheme.time_field is not None:
        when = occurred_at(field(scheme.time_field))
    return EventMeta(event_id=the_id, event_type=the_type, occurred_at=when)


PROVIDER = described(
    "hmac",
    authenticate,
    extract,
    tolerance_rule=tolerance,
    validate_config=validate_config,
    fields_rule=fields,
)
