"""The retry policy, pure: given a failed attempt, retry when, or go dead and why.

Backoff is exponential with full jitter (AWS "Exponential Backoff And Jitter"): the n-th
retry waits ``uniform(0, min(cap, base * 2 ** (n - 1)))``, so the first retry waits at most
``base`` and a herd of failures spreads out instead of returning in lockstep. A delay a
handler asks for (``RetryableError(delay=...)``, an HTTP ``Retry-After``) replaces the draw,
clamped to ``[0, cap]``.

A delivery goes dead when the error is permanent, when it has used its attempts, or when its
age (from its first attempt, else its creation) reaches the maximum; the last retry is
clamped to that deadline so the final attempt still happens. The defaults (settings
``retry_base`` 5 s, ``retry_cap`` 6 h, ``max_attempts`` 12, ``max_age`` 3 d) follow the
providers' own schedules in PROVIDERS.md: Stripe resends for 3 days, Standard Webhooks'
example schedule ends after ~75 h with gaps growing to 24 h, Svix's after ~27 h with 10 h gaps.
Routes override attempts and age.

Delays shorter than ``visibility_timeout - hard_time_limit`` go back to the broker as a Celery
countdown; longer ones wait in Postgres (``next_attempt_at``) for the sweeper, because a
Redis-broker message held past the visibility timeout is redelivered early.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime, timedelta

from webhooks.settings import Settings

# 2 ** 60 times any base already exceeds every sane cap; it also keeps the float finite.
_MAX_EXPONENT = 60

DEAD_PERMANENT = "permanent"
DEAD_MAX_ATTEMPTS = "max_attempts"
DEAD_MAX_AGE = "max_age"
DEAD_CRASHED = "crashed"  # set by models.transitions.claim on a crash loop


@dataclass(frozen=True)
class RetryPolicy:
    base: timedelta
    cap: timedelta
    max_attempts: int
    max_age: timedelta
    max_countdown: timedelta

    def __post_init__(self) -> None:
        if self.base <= timedelta() or self.cap < self.base:
            raise ValueError("retry policy needs 0 < base <= cap")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if self.max_age <= timedelta():
            raise ValueError("max_age must be positive")

    @classmethod
    def for_route(
        cls, settings: Settings, *, max_attempts: int | None = None, max_age_s: int | None = None
    ) -> RetryPolicy:
        """Settings defaults with the route's own overrides."""
        return cls(
            base=settings.retry_base,
            cap=settings.retry_cap,
            max_attempts=max_attempts or settings.max_attempts,
            max_age=timedelta(seconds=max_age_s) if max_age_s else settings.max_age,
            max_countdown=timedelta(seconds=settings.max_countdown),
        )


@dataclass(frozen=True)
class Decision:
    retry: bool
    # Dead reason (permanent / max_attempts / max_age) when not retrying, else "retry".
    reason: str
    delay: timedelta
    next_attempt_at: datetime | None
    # Seconds for ``apply_async(countdown=...)``; None leaves the retry to the sweeper.
    countdown: float | None


def backoff_bound(policy: RetryPolicy, attempt: int) -> timedelta:
    """Upper bound of the jittered delay after failed attempt number ``attempt`` (1-based)."""
    if attempt < 1:
        raise ValueError("attempt numbers start at 1")
    exponent = min(attempt - 1, _MAX_EXPONENT)
    seconds = min(policy.cap.total_seconds(), policy.base.total_seconds() * 2.0**exponent)
    return timedelta(seconds=seconds)


def _dead(reason: str) -> Decision:
    return Decision(False, reason, timedelta(), None, None)


def decide(
    policy: RetryPolicy,
    *,
    attempt: int,
    started_at: datetime,
    now: datetime,
    permanent: bool,
    requested_delay: float | None,
    rng: random.Random,
) -> Decision:
    """What to do after attempt ``attempt`` failed at ``now``.

    ``started_at`` is the delivery's first attempt (or creation): the max-age clock.
    """
    if permanent:
        return _dead(DEAD_PERMANENT)
    if attempt >= policy.max_attempts:
        return _dead(DEAD_MAX_ATTEMPTS)
    deadline = started_at + policy.max_age
    if now >= deadline:
        return _dead(DEAD_MAX_AGE)
    if requested_delay is not None:
        seconds = min(max(requested_delay, 0.0), policy.cap.total_seconds())
    else:
        seconds = rng.uniform(0.0, backoff_bound(policy, attempt).total_seconds())
    delay = timedelta(seconds=seconds)
    next_at = min(now + delay, deadline)
    delay = next_at - now
    countdown = delay.total_seconds() if delay < policy.max_countdown else None
    return Decision(True, "retry", delay, next_at, countdown)
