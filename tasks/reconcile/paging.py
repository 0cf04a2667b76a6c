"""Walking a provider API's pages within a run's bounds (pure but for the injected sleep).

A 429 is waited out, honouring ``Retry-After`` (capped at :data:`MAX_WAIT` seconds, and at
most :data:`MAX_WAITS` times a run); a connection refused or reset before an answer
(:class:`Unreachable`) is tried again after a short wait, at most :data:`MAX_RECONNECTS` times
a run (one dropped connection must not fail a scheduled run until its next period); any other
API error stops the walk, keeping what was listed before it; the walk stops after
``max_pages`` pages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from core.errors import WebhooksError

MAX_WAIT = 60.0  # seconds: the longest Retry-After honoured as given
MAX_WAITS = 5  # 429s waited out per run, then the run stops
DEFAULT_WAIT = 2.0  # a 429 without Retry-After: 2, 4, 8 ... seconds
MAX_RECONNECTS = 3  # connections refused or reset per run, then the run stops
RECONNECT_WAIT = 0.5  # before the next try: 0.5, 1, 2 seconds


@dataclass(frozen=True)
class ProviderEvent:
    """One event the provider says it sent. ``body``: the event object to accept (Stripe);
    None where the provider itself re-sends it (GitHub, Svix)."""

    event_id: str
    event_type: str
    created: datetime
    body: bytes | None = None
    ref: str | None = None  # the provider's handle for recovery (a GitHub delivery id)
    # The provider saw it delivered (a 2xx from us): not missing whatever the receipts say.
    delivered: bool = False


@dataclass(frozen=True)
class Page:
    events: list[ProviderEvent]
    cursor: str | None  # the next page's cursor; None: this was the last page


class RateLimited(WebhooksError):
    """The API answered 429; ``retry_after`` in seconds when it said."""

    def __init__(self, retry_after: float | None) -> None:
        super().__init__("rate limited")
        self.retry_after = retry_after


class ApiError(WebhooksError):
    """The API failed: ``status`` (None: no answer) and a message with no key, no body."""

    def __init__(self, status: int | None, message: str) -> None:
        super().__init__(message)
        self.status = status


class Unreachable(ApiError):
    """No answer: the connection was refused, reset or closed before a response. Another
    try is safe (listing is read-only) and usually answered. A timeout is not one of these:
    the API was slow for the whole timeout, and the next run tries again."""

    def __init__(self, message: str) -> None:
        super().__init__(None, message)


@dataclass
class Listing:
    events: list[ProviderEvent] = field(default_factory=list)
    pages: int = 0
    truncated: bool = False  # stopped at max_pages with more pages to list
    waits: list[float] = field(default_factory=list)  # each 429's wait, in seconds
    reconnects: list[float] = field(default_factory=list)  # each wait after Unreachable
    error: ApiError | None = None  # the walk stopped on it; events holds what came before


def retry_after(value: str | None) -> float | None:
    """``Retry-After`` in seconds (the delta form; an HTTP date is not honoured: None)."""
    if value is None:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    return seconds if seconds >= 0 else None


def walk(
    fetch: Callable[[str | None], Page],
    *,
    max_pages: int,
    sleep: Callable[[float], None],
    on_page: Callable[[Page], None] | None = None,
) -> Listing:
    listing = Listing()
    cursor: str | None = None
    while True:
        if listing.pages >= max_pages:
            listing.truncated = True
            return listing
        try:
            page = fetch(cursor)
        except RateLimited as exc:
            if len(listing.waits) >= MAX_WAITS:
                listing.error = ApiError(429, f"rate limited {MAX_WAITS + 1} times: stopped")
                return listing
            wait = exc.retry_after
            if wait is None:
                wait = DEFAULT_WAIT * 2 ** len(listing.waits)
            wait = min(wait, MAX_WAIT)
            listing.waits.append(wait)
            sleep(wait)
            continue
        except Unreachable as exc:
            if len(listing.reconnects) >= MAX_RECONNECTS:
                listing.error = exc
                return listing
            wait = RECONNECT_WAIT * 2 ** len(listing.reconnects)
            listing.reconnects.append(wait)
            sleep(wait)
            continue
        except ApiError as exc:
            listing.error = exc
            return listing
        listing.pages += 1
        listing.events.extend(page.events)
        if on_page is not None:
            on_page(page)
        if page.cursor is None:
            return listing
        cursor = page.cursor
