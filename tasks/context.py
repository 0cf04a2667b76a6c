"""What a handler sees: the event, and the context of this attempt.

A handler is a callable ``handler(event, ctx)``. ``ctx.idempotency_key`` is the key to hand
to any downstream that accepts one: it is derived from (scope, event id, route, generation),
so every retry and every replay of one event carries the same key, a re-run (generation + 1)
gets a new one, and two events about the same resource get different ones (we dedup the
delivery event, never the business resource). ``ctx.session`` is the open transaction in which
the worker marks the delivery succeeded: whatever the handler writes through it commits
atomically with that mark, or not at all. ``ctx.fence()`` raises
:class:`~tasks.errors.LeaseFenced` when this attempt's lease may end before a call started
now could finish and be recorded: a handler that calls a service calls it right before each
call, as ``forward`` does (docs/workers.md, "Fencing at the downstream").

A handler may return a **result reference**: a short text naming what it made (the id of the
row it wrote, the downstream's order number), at most :data:`MAX_RESULT_REF` printable
characters. It is stored with the success (``deliveries.result_ref``), and a duplicate of the
event is answered with it, as ``webhooks events show`` and the console show it. Anything else
it returns is not stored (:func:`result_reference`): the success stands either way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from typing import Any
from urllib.parse import parse_qs

import orjson
from sqlalchemy.orm import Session

from core.clock import Clock
from core.idempotency import KEY_PREFIX, idempotency_key
from tasks.errors import LeaseFenced, PermanentError

# The key is defined in core.idempotency (the CLI's `deliveries show` computes it without
# importing this package, which loads the settings, and this module sqlalchemy.orm);
# importable from here as before.
__all__ = ["KEY_PREFIX", "idempotency_key"]

FORM_TYPE = "application/x-www-form-urlencoded"
# What a lease must have left beyond a call's I/O timeout for the call to start: the time to
# record its outcome once it has answered (one synchronous commit).
COMMIT_MARGIN = 1.0
# The longest result reference a handler may return (stored, answered to duplicates).
MAX_RESULT_REF = 200


def result_reference(returned: object) -> tuple[str | None, str | None]:
    """(the result reference to store, why what the handler returned is not stored): a
    non-empty ``str`` of at most :data:`MAX_RESULT_REF` printable characters is stored; None is
    nothing to store; anything else is refused with its reason, never stored (pure)."""
    if returned is None:
        return None, None
    if not isinstance(returned, str):
        return None, f"not text ({type(returned).__name__})"
    if not returned or len(returned) > MAX_RESULT_REF:
        return None, f"{len(returned)} characters (1 to {MAX_RESULT_REF})"
    if not returned.isprintable():
        return None, "not printable"
    return returned, None


@dataclass(frozen=True)
class EventMeta:
    """Receipt metadata: safe to log (ids, type, times), never the body."""

    receipt_id: int
    source_id: int
    source: str  # the source's public id
    provider: str
    event_id: str
    event_type: str
    occurred_at: datetime | None
    received_at: datetime
    content_type: str | None


@dataclass(frozen=True)
class Event:
    meta: EventMeta
    body: bytes = field(repr=False)
    # Headers the route's transform (tasks.transforms) set for the handler to send with the
    # body (lower-cased names); empty without a transform.
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)

    @property
    def event_id(self) -> str:
        return self.meta.event_id

    @property
    def event_type(self) -> str:
        return self.meta.event_type

    @property
    def is_form(self) -> bool:
        """The body is form-encoded (Twilio): read :attr:`form`, not :attr:`json`."""
        media_type = (self.meta.content_type or "").split(";", 1)[0].strip().lower()
        return media_type == FORM_TYPE

    @cached_property
    def json(self) -> Any:
        """The body parsed as JSON (once). A body that is not JSON is a permanent error."""
        if self.is_form:
            raise PermanentError(
                f"event body is {FORM_TYPE}, not JSON: read event.form", reason="malformed_body"
            )
        try:
            return orjson.loads(self.body)
        except orjson.JSONDecodeError:
            raise PermanentError("event body is not valid JSON", reason="malformed_body") from None

    @cached_property
    def form(self) -> dict[str, list[str]]:
        """A form-encoded body parsed (once): every name with its values in order (a name may
        repeat). A body stored with another content type is a permanent error."""
        if not self.is_form:
            raise PermanentError(
                f"event body is {self.meta.content_type or 'untyped'}, not {FORM_TYPE}: "
                "read event.json",
                reason="malformed_body",
            )
        try:
            text = self.body.decode("utf-8")
            return parse_qs(text, keep_blank_values=True, strict_parsing=bool(text))
        except (UnicodeDecodeError, ValueError):
            raise PermanentError(
                "event body is not a valid form", reason="malformed_body"
            ) from None


@dataclass(frozen=True)
class RouteInfo:
    id: int
    handler: str
    options: Mapping[str, Any]
    # The route's own signing secret (decrypted), for handlers that sign what they send.
    signing_secret: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class HandlerContext:
    idempotency_key: str
    delivery_id: int
    attempt: int  # this attempt's number, as operators see it; it goes on across replays
    generation: int
    meta: EventMeta
    route: RouteInfo
    session: Session = field(repr=False)
    clock: Clock = field(repr=False)
    # Connect / read timeout for the handler's own I/O, below the soft time limit.
    io_timeout: float = 10.0
    # Seconds this attempt's lease has left (tasks.steps.claim.Claimed.lease_left).
    lease_left: Callable[[], float] = field(default=lambda: math.inf, repr=False)
    # The handler's span (a W3C traceparent) when traces are on (core/tracing.py): a handler
    # that calls a service makes its call's span a child of it and sends it on.
    traceparent: str | None = None

    def fence(self) -> None:
        """Raise :class:`~tasks.errors.LeaseFenced` unless this attempt's lease outlives a
        call started now: its I/O timeout plus :data:`COMMIT_MARGIN`. A monotonic clock read,
        no round trip."""
        left, needed = self.lease_left(), self.io_timeout + COMMIT_MARGIN
        if left < needed:
            raise LeaseFenced(left, needed)
