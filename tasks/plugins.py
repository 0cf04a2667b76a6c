"""Named plug-ins of one kind, registered three ways: handlers (:mod:`tasks.handlers.registry`,
``@register``, the ``webhooks.handlers`` entry-point group) and transforms
(:mod:`tasks.transforms`, ``@register_transform``, ``webhooks.transforms``) share this code.

- the built-in modules and the modules of ``WEBHOOKS_HANDLER_MODULES`` register theirs with
  the kind's decorator (:meth:`Plugins.register`) when :meth:`Plugins.load` imports them;
- an installed package's entry points in the kind's group add theirs. Each group is scanned
  and its entry points loaded once per process (:func:`entry_point_plugins`, cached): a worker
  builds its tables at start-up and at its first task, the console and the CLI on demand,
  and a scan of every installed distribution costs tens of milliseconds each time.

A name registered twice with different callables, an empty name, a module that fails to
import or an entry point that is not callable is a :class:`HandlerRegistrationError`: the
worker's start fails, loudly. :class:`Registry` is the table a loaded kind makes: look-up
(:meth:`Registry.get`: the kind's permanent error for a name no module registers) and the
refusal of such a name when a route is saved (:meth:`Registry.require`).
"""

from __future__ import annotations

import difflib
import functools
import importlib
from collections.abc import Callable, Iterable, Mapping
from importlib.metadata import entry_points
from typing import Any, ClassVar, Generic, TypeVar, cast

from tasks.errors import HandlerRegistrationError

P = TypeVar("P", bound=Callable[..., Any])

BUILT_IN = "built-in"
CONFIGURED = "WEBHOOKS_HANDLER_MODULES"


@functools.cache
def entry_point_plugins(group: str, kind: str) -> tuple[tuple[str, Callable[..., Any], str], ...]:
    """``group``'s entry points, loaded: (name, callable, origin), in discovery order. Scanned
    once per process (the installed packages do not change under a running process); one
    that fails to load or is not callable raises, and is not cached."""
    out = []
    for ep in entry_points(group=group):
        plugin = ep.load()
        if not callable(plugin):
            raise HandlerRegistrationError(f"{kind} entry point {ep.name!r} is not callable")
        out.append((ep.name, plugin, f"entry point ({ep.dist.name if ep.dist else ep.value})"))
    return tuple(out)


class Plugins(Generic[P]):
    """One kind of plug-in: its decorator's registrations, its entry-point group and its
    built-in modules."""

    def __init__(self, kind: str, group: str, builtins: tuple[str, ...]) -> None:
        self.kind = kind
        self.group = group
        self.builtins = builtins
        # Filled by the decorator at import time of the modules that define plug-ins.
        self.registered: dict[str, P] = {}

    def add(self, table: dict[str, P], name: str, plugin: P) -> None:
        if not name or not name.strip():
            raise HandlerRegistrationError(f"a {self.kind} name must not be empty")
        existing = table.get(name)
        if existing is not None and existing is not plugin:
            raise HandlerRegistrationError(f"{self.kind} name {name!r} is registered twice")
        table[name] = plugin

    def register(self, name: str) -> Callable[[P], P]:
        """Decorator: make the plug-in available to routes under ``name``."""

        def decorate(plugin: P) -> P:
            self.add(self.registered, name, plugin)
            return plugin

        return decorate

    def load(self, modules: Iterable[str] = ()) -> tuple[dict[str, P], dict[str, str]]:
        """Import the built-ins and ``modules`` (they register themselves), then add the
        entry points (scanned once per process): the table and each name's origin."""
        for module in (*self.builtins, *modules):
            try:
                importlib.import_module(module)
            except ImportError as exc:
                raise HandlerRegistrationError(
                    f"cannot import handler module {module!r}: {exc}"
                ) from None
        table = dict(self.registered)
        origins = {
            name: BUILT_IN if getattr(plugin, "__module__", None) in self.builtins else CONFIGURED
            for name, plugin in table.items()
        }
        for name, plugin, origin in entry_point_plugins(self.group, self.kind):
            self.add(table, name, cast("P", plugin))
            origins.setdefault(name, origin)
        return table, origins


class Registry(Generic[P]):
    """A loaded table of one kind's plug-ins by name."""

    kind: ClassVar[str] = "plug-in"
    # Raised with the name by :meth:`get` (a claimed delivery's route names it: permanent).
    unknown: ClassVar[type[Exception]] = LookupError
    # Raised with the refusal by :meth:`require` (a route being saved would name it).
    unregistered: ClassVar[type[Exception]] = ValueError

    def __init__(self, plugins: Mapping[str, P], origins: Mapping[str, str] | None = None) -> None:
        self._plugins = dict(plugins)
        self._origins = dict(origins or {})

    def get(self, name: str) -> P:
        try:
            return self._plugins[name]
        except KeyError:
            raise self.unknown(name) from None

    def names(self) -> list[str]:
        return sorted(self._plugins)

    def origin(self, name: str) -> str:
        return self._origins.get(name, "entry point")

    def require(self, name: str) -> None:
        """Refuse a name nothing is registered under, naming the registered ones (and the
        likely one, for ``Forward`` or ``fowrard``)."""
        if name in self._plugins:
            return
        close = difflib.get_close_matches(name.lower(), self.names(), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        registered = ", ".join(self.names()) or "none"
        raise self.unregistered(f"unknown {self.kind} {name!r}: {hint}registered: {registered}")
