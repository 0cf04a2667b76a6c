"""Helpers for authentication: reading signature and timestamp headers, keyed HMACs, the
constant-time match over a source's secrets, and the :data:`AuthFn` builders of the schemes
several senders share (body HMAC, ``t=,v1=`` headers, ``v0=`` with a timestamp header).

Pure, as :mod:`core.providers.contract`: every failure is an :class:`AuthError` with a reason.
"""

from __future__ import annotations

import base64
import binascii
import hmac
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Final, TypeVar

from cryptography.exceptions import InvalidSignature

from core.providers.contract import MAX_UNIX_DIGITS, AuthError, AuthFn, Config, Secrets

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
    return decode_signature(header(headers, name), scheme=scheme, decode=decode)


def decode_signature(
    value: str, *, scheme: str | None = None, decode: Callable[[str], bytes | None] = unhex
) -> bytes:
    """The signature bytes of ``value``, or of ``scheme=value`` when ``scheme`` is given.

    AuthError("malformed_signature") for another scheme (compared exactly) or a value
    ``decode`` refuses.
    """
    if scheme is not None:
        found, _, value = value.partition("=")
        if found != scheme:
            raise AuthError("malformed_signature")
    decoded = decode(value)
    if decoded is None:
        raise AuthError("malformed_signature")
    return decoded


def timestamped_signature(
    headers: Mapping[str, str],
    signature: str,
    timestamp: str,
    *,
    scheme: str | None = None,
    decode: Callable[[str], bytes | None] = unhex,
) -> tuple[bytes, str, int]:
    """A signature header and a unix-seconds timestamp header, read in the order the schemes
    that sign a timestamp header refuse them: missing_signature, missing_timestamp,
    malformed_timestamp, malformed_signature (:func:`decode_signature`).

    Returns the signature's bytes, the timestamp as sent (it is part of what is signed) and
    its value.
    """
    value = header(headers, signature)
    ts_text = header(headers, timestamp, "missing_timestamp")
    ts = unix(ts_text)
    return decode_signature(value, scheme=scheme, decode=decode), ts_text, ts


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
        decoded, ts_text, ts = timestamped_signature(headers, signature, timestamp, scheme=version)
        prefix = tag + b":" + ts_text.encode("ascii") + b":"
        return first_match(secrets, (decoded,), hmac_of("sha256", prefix, body)), ts

    return authenticate
