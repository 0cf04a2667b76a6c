"""Handlers by name: the built-ins, the ``webhooks.handlers`` entry-point group, and modules
listed in ``WEBHOOKS_HANDLER_MODULES`` that register with :func:`register`.

    from tasks.handlers import register

    @register("crm_sync")
    def crm_sync(event, ctx): ...

A handler is a callable ``(event, ctx) -> None``, or ``-> str`` to return a result reference
(``tasks.context``: stored with the success, answered to duplicates); it raises
``RetryableError`` or ``PermanentError`` (any other exception counts as retryable).
"""

from __future__ import annotations

import difflib
import importlib
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib.metadata import entry_points

from core.errors import WebhooksError
from core.logs import get_logger
from tasks.context import Event, HandlerContext
from tasks.errors import HandlerRegistrationError, UnknownHandlerError

Handler = Callable[[Event, HandlerContext], str | None]

ENTRY_POINT_GROUP = "webhooks.handlers"
BUILTIN_MODULES = (
    "tasks.handlers.builtin",
    "tasks.handlers.forward",
    "tasks.handlers.publish",
    "tasks.handlers.subscription",
)

log = get_logger(__name__)

# Filled by @register at import time of the modules that define handlers.
_registered: dict[str, Handler] = {}


def _add(table: dict[str, Handler], name: str, handler: Handler) -> None:
    if not name or not name.strip():
        raise HandlerRegistrationError("a handler name must not be empty")
    existing = table.get(name)
    if existing is not None and existing is not handler:
        raise HandlerRegistrationError(f"handler name {name!r} is registered twice")
    table[name] = handler


def register(name: str) -> Callable[[Handler], Handler]:
    """Decorator: make ``handler`` available to routes under ``name``."""

    def decorate(handler: Handler) -> Handler:
        _add(_registered, name, handler)
        return handler

    return decorate


class UnregisteredHandlerError(WebhooksError, ValueError):
    """A route would name a handler that no module registers: refused when the route is made
    or enabled, rather than every event of its source going dead with ``unknown_handler``."""


@dataclass(frozen=True)
class HandlerInfo:
    """A registered handler as operators see it (``webhooks handlers list``)."""

    name: str
    origin: str  # built-in | WEBHOOKS_HANDLER_MODULES | entry point
    module: str
    summary: str  # the first line of its docstring


class HandlerRegistry:
    def __init__(self, handlers: dict[str, Handler], origins: dict[str, str] | None = None) -> None:
        self._handlers = dict(handlers)
        self._origins = dict(origins or {})

    def get(self, name: str) -> Handler:
        try:
            return self._handlers[name]
        except KeyError:
            raise UnknownHandlerError(name) from None

    def names(self) -> list[str]:
        return sorted(self._handlers)

    def require(self, name: str) -> None:
        """Refuse a name no handler is registered under, naming the registered ones (and the
        likely one, for ``Forward`` or ``fowrard``)."""
        if name in self._handlers:
            return
        close = difflib.get_close_matches(name.lower(), self.names(), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UnregisteredHandlerError(
            f"unknown handler {name!r}: {hint}registered: {', '.join(self.names())}"
        )

    def describe(self) -> list[HandlerInfo]:
        infos = []
        for name in self.names():
            handler = self._handlers[name]
            module = getattr(handler, "__module__", "") or ""
            # Its docstring, else its module's (forward and stripe_subscription say it there).
            text = handler.__doc__ or getattr(sys.modules.get(module), "__doc__", None) or ""
            doc = [_plain(line) for line in text.strip().splitlines()]
            infos.append(
                HandlerInfo(
                    name,
                    self._origins.get(name, "entry point"),
                    module,
                    doc[0] if doc else "",
                )
            )
        return infos


def _plain(line: str) -> str:
    """A docstring line as a terminal shows it: reStructuredText's ````literal```` markers go
    (``handlers list`` printed them raw)."""
    return line.replace("``", "")


def load_registry(modules: Iterable[str] = ()) -> HandlerRegistry:
    """Import the built-ins and ``modules`` (they register themselves), then add the entry
    points. A module that fails to import fails the worker's start, loudly."""
    for module in (*BUILTIN_MODULES, *modules):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise HandlerRegistrationError(
                f"cannot import handler module {module!r}: {exc}"
            ) from None
    table = dict(_registered)
    origins = {}
    for name, handler in table.items():
        builtin = getattr(handler, "__module__", None) in BUILTIN_MODULES
        origins[name] = "built-in" if builtin else "WEBHOOKS_HANDLER_MODULES"
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        handler = ep.load()
        if not callable(handler):
            raise HandlerRegistrationError(f"entry point {ep.name!r} is not callable")
        _add(table, ep.name, handler)
        origins.setdefault(ep.name, f"entry point ({ep.dist.name if ep.dist else ep.value})")
    log.debug("handlers.loaded", handlers=sorted(table))
    return HandlerRegistry(table, origins)
