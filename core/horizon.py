"""The horizon, re-checked (issue 35 item 3): which providers' retry windows are due for review.

Each provider's retry window (the provider term of every dedup TTL, :mod:`core.ttl`) is a
value read from its sender's documentation, with the page it was read from (``citation``) and
the day it was last checked against that page (``verified_on``; for the built-ins, in
``core/providers/descriptions.toml``). A sender can change its policy at any time, and nothing
would say so: a window checked longer ago than ``WEBHOOKS_HORIZON_REVIEW_AFTER`` (or never,
a plug-in that states no date) is a review task. Someone reads the cited page and commits the
window, the citation and a new date together (docs/providers.md, "When a window was last
verified").

Pure arithmetic over the registry: ``today`` is always passed in (a CLI's clock, a worker's
clock; never ``date.today()`` here), and nothing is read or written. ``webhooks ttl check``
lists what is due; maintenance exports it as gauges (:func:`tasks.horizon.record`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

from core.providers.contract import Provider


@dataclass(frozen=True, slots=True)
class WindowReview:
    """One provider's retry window as of ``today``: how long ago it was verified, and whether
    that is long enough ago (or unknown, or impossible) to need a review."""

    provider: str
    retry_window: timedelta
    citation: str
    verified_on: date | None  # None: never verified (a plug-in that states no date)
    age_days: int | None  # today - verified_on in days; None when never verified
    due: bool
    reason: str  # why it is due, or how old it is: one line for the CLI and the log


def utc_day(now: datetime) -> date:
    """The UTC calendar day of an aware instant (a clock's ``now()``): the day ages count in."""
    if now.tzinfo is None:
        raise ValueError("utc_day needs an aware datetime")
    return now.astimezone(UTC).date()


def review_one(provider: Provider, today: date, review_after: timedelta) -> WindowReview:
    """``provider``'s window as of ``today``. Due when it was never verified, when it was
    verified longer ago than ``review_after`` (strictly: exactly ``review_after`` ago is not
    yet due), or when its date is after ``today`` (a typo, or a clock far behind: either way
    the date cannot be trusted)."""
    verified = provider.verified_on
    if verified is None:
        age, due, reason = None, True, "never verified"
    else:
        age = (today - verified).days
        if age < 0:
            due, reason = True, f"verified_on {verified} is after today ({today})"
        elif today - verified > review_after:
            due, reason = True, f"verified {age} days ago, over {review_after.days}"
        else:
            due, reason = False, f"verified {age} days ago"
    return WindowReview(
        provider=provider.name,
        retry_window=provider.retry_window,
        citation=provider.citation,
        verified_on=verified,
        age_days=age,
        due=due,
        reason=reason,
    )


def review(
    providers: Iterable[Provider], today: date, review_after: timedelta
) -> tuple[WindowReview, ...]:
    """Every provider's window as of ``today``, in the order given (the registry's)."""
    if review_after <= timedelta(0):
        raise ValueError("review_after must be positive")
    return tuple(review_one(p, today, review_after) for p in providers)


def due(reviews: Iterable[WindowReview]) -> tuple[WindowReview, ...]:
    """The reviews that are review tasks, oldest first (never verified before any date)."""
    found = [r for r in reviews if r.due]
    return tuple(sorted(found, key=lambda r: (r.age_days is not None, -(r.age_days or 0))))
