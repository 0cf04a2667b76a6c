"""Providers: one module per sender, each holding its whole contract, and a registry.

How to add a provider (here, or in a package of your own):

1. Write a module with ``authenticate(headers, body, secrets, config) -> (secret_id, ts)`` and
   ``extract(headers, body, config) -> EventMeta | Challenge``; raise ``AuthError(reason)``
   (answered 401, nothing stored) or ``MalformedEvent(reason)`` (400); a body too costly to
   parse safely is refused before any signature work with ``UnsafeBody(reason)`` (400). Use
   the helpers in :mod:`core.providers.base` (``first_match`` compares in constant time).
2. Define ``PROVIDER = Provider(name=..., authenticate=..., extract=..., retry_window=...,
   citation=<URL of the documented retry window>, verified_on=<the day you read it: a date;
   unset, it is always due for review>, signed=<what the signature covers and what a capture
   replays>, tolerance=<None if no timestamp is signed>, ...)``. Beyond a signature:
   ``extract`` may return a ``Batch`` (several events, one receipt each, one transaction;
   ``batched=True``) or a ``Challenge`` whose ``sign(secret)`` computes the answer with the
   verifying secret (Zoom); ``verify_get`` answers a GET handshake (Meta); ``check_secret``
   and ``key_format`` describe keys the sender issues (public keys); ``validate_config`` with
   ``signs_url=True`` takes the signed ``public_url`` (:mod:`core.providers.urlsigned`).
3. Built in: the module states ``PROVIDER = described(name, authenticate, extract, ...)``
   with only what is code (:mod:`core.providers.descriptions`); the retry window, citation,
   ``verified_on``, ``signed``, handshake, fields and summary go in its table in
   ``descriptions.toml``. Add the
   module name to ``registry.BUILTIN_MODULES``, a signer to ``tests/signing.py``, tests, and a
   row in the table of docs/providers.md. Your own
   package: declare
   ``[project.entry-points."webhooks.providers"] <name> = "your_pkg.module:PROVIDER"`` and
   install it next to this one; ``webhooks providers list`` then shows it.

The receiver, the CLI and the TTL arithmetic read :mod:`core.providers.registry`; nothing
else lists providers. :func:`authenticate` and :func:`extract` are the receiver's entry points.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from core.providers import reconcile_options as options
from core.providers import registry
from core.providers.base import (
    AUTH_REASONS,
    MALFORMED_REASONS,
    REFUSED_REASONS,
    AuthError,
    Batch,
    Challenge,
    EventMeta,
    MalformedEvent,
    Provider,
    ProviderError,
    TooManyEvents,
    UnsafeBody,
    check_fresh,
)
from core.providers.registry import ProviderPluginError, UnknownProvider


def __getattr__(name: str) -> Any:
    """``BUILTIN_PROVIDERS``: the built-in providers' names, in listing order (plug-ins:
    ``registry.names()``). Computed on first use, not at import: it imports every built-in
    provider module, which a CLI read that names no provider (``sources list``) never needs."""
    if name != "BUILTIN_PROVIDERS":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    names = registry.builtin_names()
    globals()["BUILTIN_PROVIDERS"] = names
    return names


__all__ = [
    "AUTH_REASONS",
    "BUILTIN_PROVIDERS",
    "MALFORMED_REASONS",
    "REFUSED_REASONS",
    "AuthError",
    "Batch",
    "Challenge",
    "EventMeta",
    "MalformedEvent",
    "Provider",
    "ProviderError",
    "ProviderPluginError",
    "TooManyEvents",
    "UnknownProvider",
    "UnsafeBody",
    "authenticate",
    "default_tolerance",
    "extract",
    "get_provider",
    "validate_config",
]

get_provider = registry.get


def validate_config(provider: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """Check and normalise a source's options for ``provider``; the result is what to store.

    Raises ValueError (:class:`UnknownProvider` for a name nobody registered) naming the bad
    option; a provider with a fixed scheme refuses every option rather than ignore it.
    Reconciliation's options (``api_base``, :mod:`core.providers.reconcile_options`) are checked
    there and kept; the provider's validator never sees them.
    """
    found = registry.get(provider)
    try:
        own, reconcile = options.split(provider, config)
        return {**found.validate_config(own), **reconcile}
    except ValueError as exc:
        raise ValueError(f"provider {provider!r}: {exc}") from None


def default_tolerance(provider: str, config: Mapping[str, Any] | None = None) -> timedelta | None:
    """How far a signed timestamp may be from ``now``, either way; None when nothing is signed."""
    return registry.get(provider).default_tolerance(config)


def authenticate(
    provider: str,
    headers: Mapping[str, str],
    body: bytes,
    secrets: Sequence[tuple[str, str]],
    *,
    config: Mapping[str, Any],
    now: datetime,
    tolerance: timedelta | None,
) -> str:
    """Return the id of the first ``(secret_id, secret)`` whose signature matches the delivery.

    ``headers`` must have lower-case names. Several secrets allow rotation: the first one that
    matches wins. The signature is checked before the timestamp's freshness, so "stale" and
    "future" are only ever reported for deliveries that really came from the sender (clock skew
    or a replay), never for forgeries. ``tolerance`` None means the provider's default.
    Raises :class:`AuthError`.
    """
    found = registry.get(provider)
    if now.tzinfo is None:
        raise ValueError("now must be a timezone-aware datetime")
    if not any(secret for _, secret in secrets):
        raise AuthError("no_secret")
    secret_id, timestamp = found.authenticate(headers, body, secrets, config)
    if timestamp is not None:
        if tolerance is None:
            tolerance = found.default_tolerance(config)
        check_fresh(timestamp, now, tolerance)
    return secret_id


def extract(
    provider: str, headers: Mapping[str, str], body: bytes, *, config: Mapping[str, Any]
) -> EventMeta | Challenge | Batch:
    """Event id, type and time from the provider's own fields (call after :func:`authenticate`).

    Returns a :class:`Challenge` for a handshake, a :class:`Batch` for several events. Raises
    :class:`MalformedEvent` when the id (1..255 printable ASCII characters, no whitespace), the
    type (1..255 printable characters) or a present time is missing or unusable, and
    :class:`TooManyEvents` (one) for a batch over the provider's cap, checked here too, so a
    plug-in that does not count is still bounded.
    """
    found = registry.get(provider)
    meta = found.extract(headers, body, config)
    if isinstance(meta, Batch):
        found.check_count(len(meta.events), config)
    return meta
