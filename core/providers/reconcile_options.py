"""Which providers reconciliation knows, and the source options it reads (pure).

A source's reconciliation options live in its ``config`` next to the provider's own options
(``webhooks sources add|update SOURCE --config api_base=URL``); the provider's validator never
sees them (:func:`split`). ``api_base`` defaults to the provider's real API; plain http is
allowed only to loopback (a test's fake, a local proxy), so an API key never crosses a network
in clear. Its host is judged as :mod:`core.addresses` judges a forward route's: a cloud
metadata or link-local address is refused, a private one unless ``allow_private=true``; here
by what needs no DNS (an address literal, ``localhost``, the metadata names), and again by
every address the name resolves to when each connection is made
(``tasks.reconcile.transport``).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlsplit

from core.addresses import ALLOW_PRIVATE, AddressRefused, allows_private, check_api_host


@dataclass(frozen=True)
class ApiSpec:
    """One provider's API, as reconciliation uses it."""

    provider: str
    default_base: str
    # How far back the provider lists events (Stripe: 30 days; GitHub: 3 days of deliveries).
    horizon_days: int
    summary: str


SPECS: dict[str, ApiSpec] = {
    "stripe": ApiSpec(
        "stripe",
        "https://api.stripe.com",
        30,
        "GET /v1/events (30 days); missing events are accepted from the API's event object",
    ),
    "github": ApiSpec(
        "github",
        "https://api.github.com",
        3,
        "GET /{hook}/deliveries (3 days); missing deliveries are redelivered by GitHub",
    ),
    "svix": ApiSpec(
        "svix",
        "https://api.svix.com",
        90,
        "GET /api/v1/app/{app_id}/msg; Svix resends the window's failed messages (recover)",
    ),
}

# Options reconciliation reads from a source's config, per provider.
# endpoint_url: the URL registered at the provider, compared by the subscription watchdog
# (core.watchdog; default WEBHOOKS_PUBLIC_BASE_URL + /webhooks/{source id}).
OPTIONS: dict[str, tuple[str, ...]] = {
    "stripe": ("api_base", ALLOW_PRIVATE, "endpoint_id", "endpoint_url"),
    "github": ("api_base", ALLOW_PRIVATE, "hook", "endpoint_url"),
    "svix": ("api_base", ALLOW_PRIVATE, "app_id", "endpoint_id", "endpoint_url"),
    # Not reconciled: only the subscription watchdog reads a Shopify source's API (the shop's
    # webhook subscriptions, at https://{shop} unless api_base says otherwise).
    "shopify": ("api_base", ALLOW_PRIVATE, "shop", "endpoint_url"),
}
# Providers a source's API credential (--api-key) is for: reconciliation's, and Shopify's
# Admin API access token, which the subscription watchdog reads the subscriptions with.
CREDENTIAL_PROVIDERS: Final = frozenset({*SPECS, "shopify"})
ALL_OPTIONS = frozenset(o for names in OPTIONS.values() for o in names)


def supported(provider: str) -> bool:
    return provider in SPECS


def takes_credential(provider: str) -> bool:
    """Whether a source of ``provider`` may hold an API credential (reconciliation's or the
    subscription watchdog's)."""
    return provider in CREDENTIAL_PROVIDERS


def split(provider: str, config: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """(the provider's own options, reconciliation's options, checked). A reconciliation
    option on a provider reconciliation does not know is refused (ValueError)."""
    if not isinstance(config, Mapping):
        raise ValueError(f"config must be a mapping of options, not {type(config).__name__}")
    own = {k: v for k, v in config.items() if k not in ALL_OPTIONS}
    ours = {k: v for k, v in config.items() if k in ALL_OPTIONS}
    allowed = OPTIONS.get(provider, ())
    for key in sorted(ours):
        if key not in allowed:
            known = ", ".join(sorted(SPECS)) or "none"
            if provider in OPTIONS and provider not in SPECS:
                raise ValueError(
                    f"option {key!r} is not one of {provider}'s API options"
                    f" ({', '.join(OPTIONS[provider])})"
                )
            raise ValueError(
                f"option {key!r} is for reconciliation, which supports {known}, not {provider!r}"
            )
    checked = {}
    for key, value in ours.items():
        if not isinstance(value, str):
            raise ValueError(f"option {key!r} must be a string")
        checked[key] = CHECKS[key](value)
    if "api_base" in checked:
        check_base_host(checked["api_base"], private_allowed(checked))
    return own, checked


def private_allowed(config: Mapping[str, Any]) -> bool:
    """The source's ``allow_private`` option (absent: false)."""
    return allows_private({ALLOW_PRIVATE: config.get(ALLOW_PRIVATE, "")})


def check_base_host(base: str, allow_private: bool) -> None:
    """ValueError when ``base``'s host is refused by what needs no DNS (an address literal,
    ``localhost``, the metadata names): :func:`core.addresses.check_api_host`."""
    parts = urlsplit(base)
    try:
        check_api_host(
            parts.hostname or "", plain_http=parts.scheme == "http", allow_private=allow_private
        )
    except AddressRefused as exc:
        raise ValueError(str(exc)) from None


def api_base(value: str) -> str:
    """A provider API base URL: https anywhere, plain http only to loopback; no credentials,
    query or fragment. Returned without its trailing slash (ValueError otherwise)."""
    text = value.strip()
    parts = urlsplit(text)
    if parts.scheme not in ("https", "http") or not parts.hostname:
        raise ValueError(f"api_base must be an https:// URL, got {text!r}")
    if parts.username is not None or parts.password is not None:
        raise ValueError("api_base must not carry credentials (set them with --api-key)")
    if parts.query or parts.fragment:
        raise ValueError(f"api_base must not have a query or fragment, got {text!r}")
    if parts.scheme == "http" and not is_loopback(parts.hostname):
        raise ValueError(
            f"api_base {text!r}: plain http is allowed only to loopback (127.0.0.1, ::1, "
            "localhost); use https"
        )
    try:
        parts.port  # noqa: B018  (raises on a bad port)
    except ValueError:
        raise ValueError(f"api_base has a bad port: {text!r}") from None
    return text.rstrip("/")


# A GitHub hook's path (tasks.reconcile.github_api lists its deliveries).
HOOK: Final = re.compile(r"(repos/[\w.-]+/[\w.-]+|orgs/[\w.-]+)/hooks/\d+")


def check_hook(value: str) -> str:
    hook = value.strip().strip("/")
    if not HOOK.fullmatch(hook):
        raise ValueError(
            f"option 'hook' must be repos/OWNER/REPO/hooks/ID or orgs/ORG/hooks/ID, got {value!r}"
        )
    return hook


def _hook(value: str) -> str:
    return check_hook(value)


def _svix_id(value: str) -> str:
    text = value.strip()
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,256}", text):
        raise ValueError(f"ids are letters, digits, '_', '.' and '-', got {value!r}")
    return text


def _endpoint_id(value: str) -> str:
    """Svix's endpoint id (``ep_...``), or Stripe's (``we_...``): ids of letters, digits and
    ``_.-``."""
    return _svix_id(value)


def _endpoint_url(value: str) -> str:
    """The URL the provider posts to, as registered there: an absolute http(s) URL."""
    text = value.strip()
    parts = urlsplit(text)
    if parts.scheme not in ("https", "http") or not parts.hostname or parts.fragment:
        raise ValueError(f"endpoint_url must be an absolute http(s) URL, got {value!r}")
    return text


def _shop(value: str) -> str:
    """A Shopify shop's domain, ``NAME.myshopify.com`` (a bare ``NAME`` is completed)."""
    text = value.strip().lower().removeprefix("https://").rstrip("/")
    if re.fullmatch(r"[a-z0-9][a-z0-9-]{0,62}", text):
        text = f"{text}.myshopify.com"
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,62}\.myshopify\.com", text):
        raise ValueError(f"option 'shop' must be NAME.myshopify.com, got {value!r}")
    return text


def _flag(value: str) -> str:
    """``allow_private``: true or false (also 1/0, yes/no), stored as ``true``/``false``."""
    return "true" if allows_private({ALLOW_PRIVATE: value}) else "false"


CHECKS = {
    "api_base": api_base,
    ALLOW_PRIVATE: _flag,
    "hook": _hook,
    "app_id": _svix_id,
    "endpoint_id": _endpoint_id,
    "endpoint_url": _endpoint_url,
    "shop": _shop,
}


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def base_of(provider: str, config: Mapping[str, Any]) -> str:
    """The source's API base: its ``api_base`` option, else the provider's real API (Shopify:
    the source's shop, ``https://{shop}``)."""
    given = config.get("api_base")
    if isinstance(given, str):
        return api_base(given)
    if provider == "shopify":
        return f"https://{_shop(str(config.get('shop') or ''))}"
    return SPECS[provider].default_base
