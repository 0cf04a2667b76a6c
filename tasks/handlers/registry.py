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

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from core.errors import WebhooksError
from core.logs import get_logger
from tasks.context import Event, HandlerContext
from tasks.errors import UnknownHandlerError
from tasks.plugins import Plugins, Registry

Handler = Callable[[Event, HandlerContext], str | None]

ENTRY_POINT_GROUP = "webhooks.handlers"
BUILTIN_MODULES = (
    "tasks.handlers.builtin",
    "tasks.handlers.forward",
    "tasks.handlers.publish",
    "tasks.handlers.subscription",
)

log = get_logger(__name__)

# The handlers' registrations (tasks.plugins: shared with the transforms').
HANDLERS: Plugins[Handler] = Plugins("handler", ENTRY_POINT_GROUP, BUILTIN_MODULES)


def register(name: str) -> Callable[[Handler], Handler]:
    """Decorator: make ``handler`` available to routes under ``name``."""
    return HANDLERS.register(name)


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


class HandlerRegistry(Registry[Handler]):
    kind = "handler"
    unknown = UnknownHandlerError
    unregistered = UnregisteredHandlerError

    def describe(self) -> list[HandlerInfo]:
        infos = []
        for name in self.names():
            handler = self.get(name)
            module = getattr(handler, "__module__", "") or ""
            # Its docstring, else its module's (forward and stripe_subscription say it there).
            text = handler.__doc__ or getattr(sys.modules.get(module), "__doc__", None) or ""
            doc = [_plain(line) for line in text.strip().splitlines()]
            infos.append(HandlerInfo(name, self.origin(name), module, doc[0] if doc else ""))
        return infos


def _plain(line: str) -> str:
    """A docstring line as a terminal shows it: reStructuredText's ````literal```` markers go
    (``handlers list`` printed them raw)."""
    return line.replace("``", "")


def load_registry(modules: Iterable[str] = ()) -> HandlerRegistry:
    """Import the built-ins and ``modules`` (they register themselves), then add the entry
    points (scanned once per process). A module that fails to import fails the worker's
    start, loudly."""
    table, origins = HANDLERS.load(modules)
    log.debug("handlers.loaded", handlers=sorted(table))
    return HandlerRegistry(table, origins)
