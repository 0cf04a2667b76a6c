"""Handlers by name: the built-ins, the ``webhooks.handlers`` entry-point group, and modules
listed in ``WEBHOOKS_HANDLER_MODULES`` that register with :func:`register`.

    from tasks.handlers import register

    @register("crm_sync")
    def crm_sync(event, ctx): ...

A handler is a callable ``(event, ctx) -> None``; it raises ``RetryableError`` or
``PermanentError`` (any other exception counts as retryable).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from importlib.metadata import entry_points

from tasks.context import Event, HandlerContext
from tasks.errors import HandlerRegistrationError, UnknownHandlerError
from webhooks.logs import get_logger

Handler = Callable[[Event, HandlerContext], None]

ENTRY_POINT_GROUP = "webhooks.handlers"
BUILTIN_MODULES = (
    "tasks.handlers.builtin",
    "tasks.handlers.forward",
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


class HandlerRegistry:
    def __init__(self, handlers: dict[str, Handler]) -> None:
        self._handlers = dict(handlers)

    def get(self, name: str) -> Handler:
        try:
            return self._handlers[name]
        except KeyError:
            raise UnknownHandlerError(name) from None

    def names(self) -> list[str]:
        return sorted(self._handlers)


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
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        handler = ep.load()
        if not callable(handler):
            raise HandlerRegistrationError(f"entry point {ep.name!r} is not callable")
        _add(table, ep.name, handler)
    log.debug("handlers.loaded", handlers=sorted(table))
    return HandlerRegistry(table)
