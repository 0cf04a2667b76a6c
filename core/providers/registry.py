"""The providers this installation knows: the built-in modules, then the entry-point group.

Loaded once per process, on first use. A plug-in is an entry point in the group
``webhooks.providers`` whose name is the provider's name and whose object is a
:class:`~core.providers.base.Provider` (or a callable returning one). A plug-in that cannot be
imported, is not a Provider, is named differently from its entry point, or reuses a name is a
:class:`ProviderPluginError` naming the entry point and its distribution: the process stops
at start rather than answer 401 for a provider it half knows.
"""

from __future__ import annotations

import difflib
import importlib
import threading
from collections.abc import Callable, Mapping, Sequence
from datetime import date, datetime, timedelta
from importlib.metadata import EntryPoint, entry_points
from types import MappingProxyType
from typing import Any, Final

from core.durations import parse_duration
from core.errors import WebhooksError
from core.providers import descriptions
from core.providers.base import Provider

ENTRY_POINT_GROUP: Final = "webhooks.providers"

# Module names under core.providers, each defining PROVIDER; the order is the listing order.
BUILTIN_MODULES: Final = (
    "stripe",
    "github",
    "shopify",
    "slack",
    "standard",
    "svix",
    "generic_hmac",
    # Issue 13: the Svix senders, token and body-HMAC schemes.
    "resend",
    "clerk",
    "gitlab",
    "linear",
    "paddle",
    "typeform",
    "woocommerce",
    "intercom",
    "sentry",
    "calendly",
    # Issue 13, second half (URL-signed, handshakes, public keys, form and batched bodies):
    "bitbucket",
    "pagerduty",
    "twitch",
    "mailgun",
    "discord",
    "square",
    "hubspot",
    "twilio",
    "zoom",
    "meta",
    "adyen",
    "sendgrid",
)

# Built-in modules named otherwise than their provider.
_MODULE_OF: Final = {"hmac": "generic_hmac"}

_lock = threading.Lock()
_loaded: Mapping[str, Provider] | None = None


class ProviderPluginError(WebhooksError, ValueError):
    """A provider plug-in (entry point) is broken; the message says which and why (a
    ValueError, so the CLI reports it as one error line)."""


class UnknownProvider(WebhooksError, ValueError):
    """No provider of that name is registered."""

    def __init__(self, name: str, known: Sequence[str]) -> None:
        super().__init__(unknown_provider_message(name, known))
        self.name = name


def unknown_provider_message(name: str, known: Sequence[str]) -> str:
    """``unknown provider 'Stripe'; did you mean 'stripe'? one of ...``: the likely one first,
    as for handlers (a capital letter or a typo), then every registered name."""
    close = difflib.get_close_matches(name.lower(), list(known), n=1, cutoff=0.6)
    hint = f" did you mean {close[0]!r}?" if close else ""
    return f"unknown provider {name!r};{hint} one of {', '.join(known)}"


def _builtins() -> list[Provider]:
    out = []
    for module in BUILTIN_MODULES:
        provider = importlib.import_module(f"core.providers.{module}").PROVIDER
        assert isinstance(provider, Provider), module
        out.append(provider)
    return out


def builtin_names() -> tuple[str, ...]:
    """The built-in providers' names, in listing order."""
    return tuple(p.name for p in _builtins())


def _describe(ep: EntryPoint) -> str:
    dist = ep.dist.name if ep.dist is not None else "unknown distribution"
    return f"provider plug-in {ep.name!r} ({ep.value}, from {dist})"


def _plugin(ep: EntryPoint) -> Provider:
    try:
        obj: Any = ep.load()
    except Exception as exc:  # noqa: BLE001 - any import failure is the plug-in's, reported
        raise ProviderPluginError(
            f"{_describe(ep)} cannot be loaded: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(obj, Provider) and callable(obj):
        try:
            obj = obj()
        except Exception as exc:  # noqa: BLE001
            raise ProviderPluginError(
                f"{_describe(ep)} failed to build its provider: {type(exc).__name__}: {exc}"
            ) from exc
    if not isinstance(obj, Provider):
        raise ProviderPluginError(
            f"{_describe(ep)} is a {type(obj).__name__}, not an core.providers.Provider"
        )
    if obj.name != ep.name:
        raise ProviderPluginError(
            f"{_describe(ep)} defines provider {obj.name!r}: the entry point's name must be the "
            "provider's name"
        )
    if obj.retry_window <= timedelta(0) or not obj.citation.strip() or not obj.signed.strip():
        raise ProviderPluginError(
            f"{_describe(ep)} must state a positive retry_window, its citation and what is signed"
        )
    verified_on = obj.verified_on
    if verified_on is not None and (
        not isinstance(verified_on, date) or isinstance(verified_on, datetime)
    ):
        raise ProviderPluginError(
            f"{_describe(ep)}: verified_on must be a datetime.date (the day its retry window was "
            f"last checked against its citation) or None (never), not {verified_on!r}"
        )
    return obj


def load(
    discover: Callable[[], list[EntryPoint]] | None = None,
) -> Mapping[str, Provider]:
    """Every provider by name: built-ins, then plug-ins (``discover`` replaces the entry-point
    lookup, for tests). Raises :class:`ProviderPluginError` for a broken plug-in."""
    found: dict[str, Provider] = {p.name: p for p in _builtins()}
    eps = discover() if discover is not None else list(entry_points(group=ENTRY_POINT_GROUP))
    for ep in sorted(eps, key=lambda e: e.name):
        if ep.name in found:
            raise ProviderPluginError(f"{_describe(ep)} reuses the name of a known provider")
        found[ep.name] = _plugin(ep)
    return MappingProxyType(found)


def providers() -> Mapping[str, Provider]:
    """The registry of this process (loaded once, on first use)."""
    global _loaded  # noqa: PLW0603 - one registry per process, by design
    loaded = _loaded
    if loaded is None:
        with _lock:
            if _loaded is None:
                _loaded = load()
            loaded = _loaded
    return loaded


def names() -> tuple[str, ...]:
    return tuple(providers())


def get_one(name: str) -> Provider:
    """:func:`get`, importing only ``name``'s module when it is a built-in and the registry is
    not loaded yet: what reads one stored event by its provider's rules (``webhooks events
    show``) needs, and no other provider's module. Any other name loads the registry
    (built-ins and plug-ins) as :func:`get` does; so does a module whose provider is named
    otherwise (a plug-in may not reuse a built-in's name, so a built-in's is final)."""
    module = _MODULE_OF.get(name, name)
    if _loaded is None and module in BUILTIN_MODULES:
        provider = importlib.import_module(f"core.providers.{module}").PROVIDER
        if isinstance(provider, Provider) and provider.name == name:
            return provider
    return get(name)


def retry_window_of(name: str) -> tuple[timedelta, str]:
    """``name``'s documented retry window and its citation. A built-in's come from its row of
    descriptions.toml, which is what its module's ``described()`` reads them from, so no
    provider module is imported (``webhooks sources list`` needs no other fact of a provider);
    a plug-in's from the registry. UnknownProvider otherwise."""
    row = descriptions.table().get(name) if _loaded is None else None
    if row is not None and _MODULE_OF.get(name, name) in BUILTIN_MODULES:
        return parse_duration(row["retry_window"]), str(row["citation"])
    found = get(name)
    return found.retry_window, found.citation


def get(name: str) -> Provider:
    """The provider called ``name``; :class:`UnknownProvider` (a ValueError) otherwise."""
    found = providers().get(name)
    if found is None:
        raise UnknownProvider(name, names())
    return found
