"""The mark of a test send: how the receiver tells ``webhooks send`` from a provider.

``webhooks send`` signs its request as the provider does (the receiver verifies that as for
any request) and adds :data:`HEADER`, which says who sent it and proves that whoever made it
holds ``WEBHOOKS_SECRET_KEY`` (what every process of this installation holds, and no provider
and no stranger does)::

    Webhooks-Test-Send: t=1767225600,op=<operator, base64url>,v1=<hex HMAC-SHA256>

The HMAC covers the version, the source's public id, the time, the operator and the SHA-256
of the body, under a key derived from the scrypt-stretched ``WEBHOOKS_SECRET_KEY`` (its
newest key signs; every listed key verifies, so a rotation does not break sends) with an HMAC
naming this purpose. A mark therefore cannot be moved to another body or source, and is
refused :data:`TOLERANCE` after it was made (its event is a duplicate by then anyway).

A verified mark makes the receiver record the event with ``arrived_via = 'test'`` and an
``audit_log`` row (``event.send``: the operator, the source, the event's type and id, never
its payload) in the accept's own transaction. A request whose mark does not verify is
**refused** (401, nothing written), not accepted as if unmarked: no provider sends this
header, so a bad one is a CLI holding another key or a tampered request, and recording it
as a production event (``arrived_via = 'webhook'``, unaudited) is what marks exist to stop.
Pure: no I/O; the clock is the caller's.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

from core.crypto import split_keys, stretched_key
from core.errors import WebhooksError

HEADER = "webhooks-test-send"
TOLERANCE = timedelta(minutes=5)
MAX_OPERATOR = 200  # characters; the name an audit row records
_PURPOSE = b"webhook-pipeline/test-send/v1"


class MarkRefused(WebhooksError):
    """A test-send mark that does not verify: malformed, stale, or not made with this
    installation's key for this source and body. Nothing is written for its request."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"test-send mark refused: {reason}")
        self.reason = reason


@dataclass(frozen=True)
class TestSend:
    """A verified mark: who sent the event."""

    __test__ = False  # not a pytest class

    operator: str


def mark_keys(secret_key: str) -> tuple[bytes, ...]:
    """The marks' keys of ``WEBHOOKS_SECRET_KEY``, newest first (scrypt once per key and
    process: :func:`core.crypto.stretched_key` is cached)."""
    return tuple(
        hmac.new(stretched_key(k), _PURPOSE, hashlib.sha256).digest()
        for k in split_keys(secret_key)
    )


def _mac(key: bytes, source: str, at: int, operator: str, body: bytes) -> str:
    signed = b"\n".join(
        (b"v1", source.encode(), str(at).encode(), operator.encode(), hashlib.sha256(body).digest())
    )
    return hmac.new(key, signed, hashlib.sha256).hexdigest()


def check_operator(operator: str) -> str:
    """The operator's name as a mark carries it: stripped, 1 to :data:`MAX_OPERATOR`
    characters, no control character; ValueError saying what is wrong."""
    name = operator.strip()
    if not name or len(name) > MAX_OPERATOR or any(ord(ch) < 32 or ord(ch) == 127 for ch in name):
        raise ValueError(
            f"an operator name is 1 to {MAX_OPERATOR} printable characters (--operator)"
        )
    return name


def make(keys: Sequence[bytes], *, source: str, body: bytes, operator: str, at: int) -> str:
    """The header's value for this body sent to ``source`` by ``operator`` at ``at`` (unix
    seconds), signed with the newest key."""
    name = check_operator(operator)
    op = base64.urlsafe_b64encode(name.encode()).decode().rstrip("=")
    return f"t={at},op={op},v1={_mac(keys[0], source, at, name, body)}"


def verify(keys: Sequence[bytes], value: str, *, source: str, body: bytes, now: int) -> TestSend:
    """The sender of a verified mark; :class:`MarkRefused` (reason ``malformed``, ``stale``
    or ``signature``) otherwise."""
    fields: dict[str, str] = {}
    for part in value.split(","):
        name, sep, text = part.strip().partition("=")
        if not sep or name in fields:
            raise MarkRefused("malformed")
        fields[name] = text
    if set(fields) != {"t", "op", "v1"} or not fields["t"].isdigit() or len(fields["t"]) > 12:
        raise MarkRefused("malformed")
    try:
        padded = fields["op"] + "=" * (-len(fields["op"]) % 4)
        operator = check_operator(base64.urlsafe_b64decode(padded.encode()).decode())
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise MarkRefused("malformed") from None
    at = int(fields["t"])
    if abs(now - at) > TOLERANCE.total_seconds():
        raise MarkRefused("stale")
    given = fields["v1"].encode()
    # Every key is compared, a match or not: timing tells nothing of which.
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(given, _mac(key, source, at, operator, body).encode())
    if not matched:
        raise MarkRefused("signature")
    return TestSend(operator)
