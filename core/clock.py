"""Injected time. Logic never calls ``datetime.now()``; it is handed a Clock.

Two kinds of time. A host's clock (:class:`SystemClock`) serves what is local to that host:
signature freshness against a sender's timestamp, the anchor of an event's expiry, log
fields. Every comparison that decides ownership (leases, due times, expiry, which partitions
are past) is made on one clock, the database's: the guarded statements read ``now()`` /
``clock_timestamp()`` themselves, because hosts disagree and the database is one. Those
statements take ``now: datetime | None``; :func:`pinned` gives None (the database decides)
unless a test pinned time with a :class:`FrozenClock`, which then stands for the database's
clock too.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Protocol


class Clock(Protocol):
    def now(self) -> datetime: ...


class SystemClock:
    def now(self) -> datetime:
        return datetime.now(UTC)


class FrozenClock:
    """A clock that only moves when told to (tests, replaying scenarios)."""

    def __init__(self, start: datetime) -> None:
        if start.tzinfo is None:
            raise ValueError("FrozenClock needs an aware datetime")
        self._now = start

    def now(self) -> datetime:
        return self._now

    def set(self, when: datetime) -> None:
        self._now = when

    def advance(self, delta: timedelta) -> None:
        self._now += delta


def pinned(clock: Clock) -> datetime | None:
    """The instant an ownership decision is taken at: None (the database's own clock, read
    inside the statement) unless the clock is a :class:`FrozenClock` a test pinned."""
    return clock.now() if isinstance(clock, FrozenClock) else None
