"""The subscription watchdog's judgement (issue 38 item 1), pure: the provider's own view of
a source's endpoint (:class:`View`, read by :mod:`tasks.watchdog`) against what the source
expects (its URL, the event types its routes listen for), as findings.

Kinds (one open finding per source and kind, ``subscription_findings``):

- ``disabled``: Stripe's endpoint ``status`` is ``disabled``, GitHub's hook ``active`` false,
  Svix's endpoint ``disabled`` true.
- ``deleted``: the provider answered 404 for the endpoint or hook; Shopify: no subscription of
  the app for a topic a route listens for (Shopify deletes one after 8 failed deliveries over
  4 hours; a route's glob: when the app has no subscription left at all).
- ``url_mismatch``: it posts to another URL than this source's (``endpoint_url`` option, or
  ``WEBHOOKS_PUBLIC_BASE_URL`` + ``/webhooks/{source id}``; neither set: not compared);
  Shopify: every subscription of a routed topic does.
- ``events_missing``: a route of the source listens for an event type the subscription no
  longer includes (a route's exact type not subscribed; a glob no subscribed type matches;
  Shopify: a glob no subscribed topic matches while others remain).
- ``cannot_check``: the provider's API did not say (401/403, 429, 5xx, timeout, no answer,
  the source names no endpoint): the others are left as they were, neither opened nor closed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

DISABLED: Final = "disabled"
DELETED: Final = "deleted"
URL_MISMATCH: Final = "url_mismatch"
EVENTS_MISSING: Final = "events_missing"
CANNOT_CHECK: Final = "cannot_check"
# The kinds a provider's answer decides (cannot_check is decided by its absence).
JUDGED: Final = (DISABLED, DELETED, URL_MISMATCH, EVENTS_MISSING)
KINDS: Final = (*JUDGED, CANNOT_CHECK)
# The providers whose endpoint the watchdog reads, and which of them --fix can re-enable.
WATCHED: Final = ("stripe", "github", "svix", "shopify")
# Where each provider's endpoint is named in the source's config (Svix: with app_id; Shopify:
# the shop, whose app's subscriptions are listed).
ENDPOINT_OPTION: Final = {
    "stripe": "endpoint_id",
    "github": "hook",
    "svix": "endpoint_id",
    "shopify": "shop",
}


@dataclass(frozen=True)
class View:
    """The provider's view of our endpoint: ``status`` enabled, disabled (GitHub: inactive)
    or deleted (a 404); the URL it posts to; the event types it sends (Stripe's
    ``enabled_events``, GitHub's hook ``events``, Svix's ``filterTypes``; ``*``: all);
    GitHub's ``last_response`` (code and status) if any. Shopify has no endpoint but one
    subscription per topic and address: ``subscriptions`` (topic, address), ``events`` their
    topics, ``url`` their address when they share one."""

    status: str
    url: str | None = None
    events: tuple[str, ...] = ()
    last_response: str | None = None
    subscriptions: tuple[tuple[str, str], ...] | None = None

    def stored(self) -> dict[str, Any]:
        stored: dict[str, Any] = {
            "status": self.status,
            "url": self.url,
            "events": list(self.events),
            "last_response": self.last_response,
        }
        if self.subscriptions is not None:
            stored["subscriptions"] = [{"topic": t, "address": a} for t, a in self.subscriptions]
        return stored


@dataclass(frozen=True)
class Finding:
    kind: str
    detail: str


def expected_url(config: Mapping[str, Any], public_base: str | None, public_id: str) -> str | None:
    """The URL the provider should post to: the source's ``endpoint_url`` option, else the
    public base URL and the receiver's path, else None (the URL is not compared)."""
    given = config.get("endpoint_url")
    if isinstance(given, str) and given:
        return given
    if public_base:
        return f"{public_base.rstrip('/')}/webhooks/{public_id}"
    return None


def _glob(pattern: str) -> re.Pattern[str]:
    """A route's event glob as the accept reads it (``*`` any run, ``?`` one character)."""
    return re.compile(
        "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    )


def _wild(glob: str) -> bool:
    return "*" in glob or "?" in glob


def covered(provider: str, glob: str, events: Iterable[str]) -> bool:
    """Whether a route's ``glob`` can still receive an event from a subscription to
    ``events``. Stripe's types are the receiver's; GitHub's hook subscribes to event names
    (``issues``) and the receiver's types are ``issues.opened``: the glob's name part counts."""
    subscribed = set(events)
    if "*" in subscribed:
        return True
    if provider == "github":
        name = glob.split(".", 1)[0]
        if not _wild(name):
            return name in subscribed
        pattern = _glob(name)
        return any(pattern.fullmatch(n) for n in subscribed)
    if not _wild(glob):
        return glob in subscribed
    pattern = _glob(glob)
    return any(pattern.fullmatch(t) for t in subscribed)


def _same_url(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")


def judge(provider: str, view: View, url: str | None, globs: Iterable[str]) -> list[Finding]:
    """The findings of one answered check (never ``cannot_check``)."""
    if provider == "shopify":
        return _judge_topics(view, url, globs)
    if view.status == "deleted":
        return [Finding(DELETED, f"the {_thing(provider)} no longer exists at {provider} (404)")]
    found: list[Finding] = []
    if view.status != "enabled":
        said = f"; last response: {view.last_response}" if view.last_response else ""
        found.append(
            Finding(DISABLED, f"{provider} has the {_thing(provider)} {view.status}{said}")
        )
    if url is not None and (view.url is None or not _same_url(view.url, url)):
        found.append(Finding(URL_MISMATCH, f"{provider} posts to {view.url}, not {url}"))
    missing = sorted({g for g in globs if not covered(provider, g, view.events)})
    if missing:
        found.append(
            Finding(
                EVENTS_MISSING,
                f"routes listen for {', '.join(missing)}; the {_thing(provider)} subscribes"
                f" to {', '.join(view.events) or 'nothing'}",
            )
        )
    return found


def _thing(provider: str) -> str:
    return "hook" if provider == "github" else "endpoint"


DELETES_AFTER: Final = "Shopify deletes one after 8 failed deliveries over 4 hours"


def _judge_topics(view: View, url: str | None, globs: Iterable[str]) -> list[Finding]:
    """Shopify: each route's glob against the app's subscriptions (topic, address). A topic
    with no subscription is ``deleted``; a glob no subscribed topic matches is
    ``events_missing`` while the app still has other subscriptions (``deleted`` when it has
    none); a routed topic whose every subscription posts elsewhere is ``url_mismatch``."""
    subs = view.subscriptions or ()
    deleted: list[str] = []
    missing: list[str] = []
    elsewhere: list[str] = []
    for glob in sorted(set(globs)):
        pattern = _glob(glob)
        mine = [(t, a) for t, a in subs if pattern.fullmatch(t)]
        if not mine:
            (missing if _wild(glob) and subs else deleted).append(glob)
        elif url is not None and not any(_same_url(a, url) for _, a in mine):
            elsewhere.extend(f"{t} to {a}" for t, a in mine)
    found: list[Finding] = []
    if deleted:
        found.append(
            Finding(
                DELETED,
                f"shopify has no subscription for {', '.join(deleted)} ({DELETES_AFTER})",
            )
        )
    if elsewhere:
        found.append(
            Finding(URL_MISMATCH, f"shopify posts {'; '.join(sorted(set(elsewhere)))}, not {url}")
        )
    if missing:
        found.append(
            Finding(
                EVENTS_MISSING,
                f"routes listen for {', '.join(missing)}; the app subscribes to"
                f" {', '.join(sorted({t for t, _ in subs}))}",
            )
        )
    return found
