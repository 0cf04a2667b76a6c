"""Route transforms (issue 37 item 4): a registered Python callable that reshapes an event
before its route's handler sees it, or drops it.

    from tasks.transforms import Transformed, register_transform

    @register_transform("invoice_summary")
    def invoice_summary(event):
        obj = event.json["data"]["object"]
        if obj["amount_due"] == 0:
            return None  # dropped: the delivery ends ``filtered``
        return Transformed({"invoice": obj["id"], "due": obj["amount_due"]},
                           {"x-tenant": obj["metadata"]["tenant"]})

    webhooks routes add SOURCE --handler forward --option url=... --transform invoice_summary

Registered like handlers (:mod:`tasks.handlers.registry`): the built-ins here, modules listed
in ``WEBHOOKS_HANDLER_MODULES`` that call :func:`register_transform`, and the
``webhooks.transforms`` entry-point group. A route names one by ``--transform``; a name no
module registers is refused when the route is saved, with the registered names.

A transform takes the :class:`~tasks.context.Event` and returns a :class:`Transformed` (the
body, as bytes, text or a JSON value, and headers for the handler to send), or None to drop
the event: the delivery ends ``filtered`` (its reason names the transform), its handler never
called. The handler gets the event with the new body (and ``event.headers``): ``forward``
posts that body, signed (the Standard Webhooks signature covers what it sends), with those
headers; ``publish`` publishes it.

A transform must be pure: no I/O, no state; it runs on every attempt and every replay. It
runs under ``WEBHOOKS_TRANSFORM_TIME_LIMIT`` (the handler's soft limit if smaller). A
transform that raises, overruns its limit or returns something else sends the delivery to the
dead letters with ``transform_failed`` and the exception's class name (never its message: it
may quote the payload). Retrying cannot help a pure function, so none of it is retried.

How the limit stops a runaway (measured in tests/test_route_transforms.py): under the threads
and prefork pools a watchdog thread raises :class:`TransformTimeLimit` (a ``BaseException``:
a transform's ``except Exception`` cannot swallow it) into the transform's thread at its next
bytecode, within the limit plus a few milliseconds for a loop of Python code. A transform
stuck inside one C call (a catastrophic regular expression, ``sum(range(10**12))``) holds
the GIL and sees it only when that call returns; the handler's own watchdog around it
(:mod:`tasks.pools`) then kills the worker at 1.5 x the hard limit, the crash path (lease,
``max_redeliveries``, dead ``crashed``): the delivery is never held forever. Under gevent a
``gevent.Timeout`` stops a transform that yields, and a transform spinning on the CPU blocks
the event loop until the loop watchdog kills the process at the hard limit (the same crash
path). A separate process per call would stop anything at once, but costs a round trip of
the body per event; the thread's limit costs two dictionary writes.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from core.errors import WebhooksError
from core.logs import get_logger
from tasks.context import Event
from tasks.errors import PermanentError
from tasks.plugins import Plugins, Registry
from tasks.pools import is_green

log = get_logger(__name__)

ENTRY_POINT_GROUP = "webhooks.transforms"
BUILTIN_MODULES = ("tasks.transforms",)

# Header names a transform may not set: the handler's own (the signature, the idempotency key,
# the trace) and the connection's.
RESERVED_HEADERS = frozenset(
    {
        "idempotency-key",
        "webhook-id",
        "webhook-timestamp",
        "webhook-signature",
        "traceparent",
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
    }
)
_HEADER_NAME = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-_!#$%&'*+.^`|~")


@dataclass(frozen=True)
class Transformed:
    """What a transform returns for the handler: the body (bytes; text, sent as UTF-8; or a
    JSON value, sent as JSON) and headers for the handler to send with it."""

    body: bytes | str | Any
    headers: Mapping[str, str] = field(default_factory=dict)


Transform = Callable[[Event], Transformed | None]

# The transforms' registrations (tasks.plugins: shared with the handlers').
TRANSFORMS: Plugins[Transform] = Plugins("transform", ENTRY_POINT_GROUP, BUILTIN_MODULES)


def register_transform(name: str) -> Callable[[Transform], Transform]:
    """Decorator: make ``transform`` available to routes under ``name``."""
    return TRANSFORMS.register(name)


class UnregisteredTransformError(WebhooksError, ValueError):
    """A route would name a transform that no module registers: refused when it is saved."""

    reason = "unknown_transform"
    doc = "transforms"  # the docs topic a CLI refusal names (core.docs)


class UnknownTransformError(PermanentError):
    """A claimed delivery's route names a transform this worker does not register (deployed
    elsewhere, or removed since): its dead letter is replayed once it is deployed here."""

    reason = "unknown_transform"

    def __init__(self, name: str) -> None:
        super().__init__(f"no transform registered under {name!r}", reason=self.reason)


class TransformFailed(PermanentError):
    """The route's transform raised, overran its time limit or returned something else than
    a :class:`Transformed` or None: dead at once with ``transform_failed``. ``raised`` is the
    class name of what it raised (stored as the delivery's error class), never its message."""

    reason = "transform_failed"

    def __init__(self, name: str, raised: str, detail: str = "raised") -> None:
        super().__init__(f"transform {name!r} {detail} {raised}", reason=self.reason)
        self.raised = raised


class TransformDropped(WebhooksError):
    """The route's transform returned None: the delivery ends ``filtered``, no handler call."""

    reason = "filtered"

    def __init__(self, name: str) -> None:
        super().__init__(f"transform {name} dropped the event")
        self.name = name


class TransformTimeLimit(BaseException):  # noqa: N818 (named like Celery's limits)
    """Raised into a transform's thread at its time limit. A BaseException: a transform's
    ``except Exception`` must not swallow it."""


class TransformRegistry(Registry[Transform]):
    kind = "transform"
    unknown = UnknownTransformError
    unregistered = UnregisteredTransformError


def load_transforms(modules: Iterable[str] = ()) -> TransformRegistry:
    """Import the built-ins and ``modules`` (WEBHOOKS_HANDLER_MODULES: they register their
    handlers and transforms), then add the ``webhooks.transforms`` entry points (scanned once
    per process)."""
    table, origins = TRANSFORMS.load(modules)
    return TransformRegistry(table, origins)


# -- running one --------------------------------------------------------------------------


def _async_raise(ident: int, exc: type[BaseException] | None) -> None:
    """Raise ``exc`` in thread ``ident`` at its next bytecode (None: cancel a pending one)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(ident), ctypes.py_object(exc) if exc is not None else None
    )


class _Limits:
    """The deadlines of the transforms running in this process's threads, and the watchdog
    thread (one per process, started on first use) that raises :class:`TransformTimeLimit`
    into a thread past its deadline, once."""

    TICK = 0.005
    lock = threading.Lock()
    running: dict[int, list[Any]] = {}  # noqa: RUF012 (thread ident -> [deadline, sent])
    pid = 0

    @classmethod
    def enter(cls, limit: float) -> int:
        ident = threading.get_ident()
        with cls.lock:
            cls.running[ident] = [time.monotonic() + limit, False]
            if cls.pid != os.getpid():  # none yet, or the parent's (after a fork)
                cls.pid = os.getpid()
                threading.Thread(target=cls._watch, name="transform-limits", daemon=True).start()
        return ident

    @classmethod
    def leave(cls, ident: int) -> None:
        with cls.lock:
            deadline = cls.running.pop(ident, None)
            if deadline is not None and deadline[1]:
                _async_raise(ident, None)  # not raised yet: it must not hit the worker's code

    @classmethod
    def _watch(cls) -> None:
        while True:
            time.sleep(cls.TICK)
            now = time.monotonic()
            with cls.lock:
                for ident, deadline in cls.running.items():
                    if now >= deadline[0] and not deadline[1]:
                        deadline[1] = True
                        _async_raise(ident, TransformTimeLimit)


def _limited(transform: Transform, event: Event, limit: float) -> object:
    """``transform(event)`` under ``limit`` seconds; a limit that lands after it returned is
    absorbed (its result stands), none lands after this returns (see tasks.pools.run_limited,
    whose argument this follows)."""
    if is_green():
        from gevent import Timeout  # noqa: PLC0415 (gevent only under the gevent pool)

        with Timeout(limit, TransformTimeLimit):
            return transform(event)
    ident = _Limits.enter(limit)
    failure: BaseException | None = None
    returned: object = None
    try:
        try:
            returned = transform(event)
        except BaseException as exc:  # noqa: BLE001 (the transform's own outcome, raised below)
            tb = exc.__traceback__
            if not (exc.__class__ is TransformTimeLimit and tb is not None and tb.tb_next is None):
                failure = exc
        _Limits.leave(ident)
    except TransformTimeLimit:  # landed after the transform, before the deadline was dropped
        _Limits.leave(ident)
    if failure is not None:
        raise failure
    return returned


def _body(value: object) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    return orjson.dumps(value)


def _headers(value: object) -> dict[str, str]:
    """The transform's headers, lower-cased; TypeError / ValueError for one that cannot be
    sent or that the handler sets itself."""
    if not isinstance(value, Mapping):
        raise TypeError("headers")
    out: dict[str, str] = {}
    for name, text in value.items():
        if not isinstance(name, str) or not isinstance(text, str):
            raise TypeError("header")
        low = name.lower()
        if not low or not set(low) <= _HEADER_NAME or low in RESERVED_HEADERS:
            raise ValueError("header name")
        if not all(" " <= c <= "~" for c in text):
            raise ValueError("header value")
        out[low] = text
    return out


def apply(transform: Transform, name: str, event: Event, limit: float) -> Event:
    """The event the handler gets: the transform's body and headers (a ``content-type``
    among them becomes the event's content type; a JSON value's is application/json).
    :class:`TransformDropped` when it returned None; :class:`TransformFailed` when it raised,
    overran ``limit`` or returned something else."""
    try:
        result = _limited(transform, event, limit)
    except TransformTimeLimit:
        raise TransformFailed(name, TransformTimeLimit.__name__, f"ran past {limit}s:") from None
    except Exception as exc:  # noqa: BLE001 (any error of the transform: its class only)
        raise TransformFailed(name, type(exc).__name__) from None
    if result is None:
        raise TransformDropped(name)
    if not isinstance(result, Transformed):
        raise TransformFailed(name, type(result).__name__, "returned")
    try:
        body, headers = _body(result.body), _headers(result.headers)
    except (TypeError, ValueError, orjson.JSONEncodeError) as exc:
        raise TransformFailed(name, f"an unsendable {exc}", "returned") from None
    content_type = headers.pop("content-type", None)
    if content_type is None and not isinstance(result.body, bytes | str):
        content_type = "application/json"
    meta = event.meta if content_type is None else replace(event.meta, content_type=content_type)
    return Event(meta, body, headers)


# -- built-ins ----------------------------------------------------------------------------


@register_transform("data_object")
def data_object(event: Event) -> Transformed:
    """The body's ``data.object`` alone (Stripe-shaped events), as JSON."""
    return Transformed(event.json["data"]["object"])
