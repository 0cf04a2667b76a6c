"""The retry policy, pure: given a failed attempt, retry when, or go dead and why.

Backoff is exponential with full jitter (AWS "Exponential Backoff And Jitter"): the n-th
retry waits ``uniform(0, min(cap, base * 2 ** (n - 1)))``, so the first retry waits at most
``base`` and a herd of failures spreads out instead of returning in lockstep. A delay a
handler asks for (``RetryableError(delay=...)``, an HTTP ``Retry-After``) replaces the draw,
clamped to ``[0, cap]``.

A delivery goes dead when the error is permanent, when it has used its attempts, or when its
age (from its first attempt, else its creation) reaches the maximum; the last retry is
clamped to that deadline so the final attempt still happens. The defaults are settings
``retry_base`` 5 s, ``retry_cap`` 6 h, ``max_attempts`` 12, ``max_age`` 3 d; routes override
attempts and age. With them the attempts run out first: the twelfth attempt comes at most
2 h 50 m after the first (about 1 h 25 m on average), long before the cap or the age matter,
and far inside the senders' own windows (Stripe resends for 3 days, Standard Webhooks'
example schedule ends after ~75 h, Svix's after ~27 h). :func:`schedule` computes this, and
``python -m tasks.policy`` prints the table docs/retries.md shows.

Delays shorter than ``visibility_timeout - hard_time_limit`` go back to the broker as a Celery
countdown; longer ones wait in Postgres (``next_attempt_at``) for the sweeper, because a
Redis-broker message held past the visibility timeout is redelivered early.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from core.durations import format_duration
from core.settings import Settings
from core.states import DeadReason

# 2 ** 60 times any base already exceeds every sane cap; it also keeps the float finite.
_MAX_EXPONENT = 60

DEAD_PERMANENT = DeadReason.PERMANENT
DEAD_MAX_ATTEMPTS = DeadReason.MAX_ATTEMPTS
DEAD_MAX_AGE = DeadReason.MAX_AGE
DEAD_CRASHED = DeadReason.CRASHED  # set by models.transitions.claim on a crash loop
DEAD_EXPIRED = DeadReason.EXPIRED  # a failed breaker probe past max_age (tasks.steps.record)


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


@dataclass(frozen=True)
class Step:
    """After failed attempt ``attempt``: the longest wait before the next one, and when that
    next attempt comes, counted from the first attempt, at the latest and on average."""

    attempt: int
    bound: timedelta
    latest: timedelta
    mean: timedelta


@dataclass(frozen=True)
class Schedule:
    """A policy's whole retry schedule when every attempt fails and no delay is asked for."""

    steps: tuple[Step, ...]
    attempts: int  # attempts made before the delivery goes dead
    dead_reason: str  # DEAD_MAX_ATTEMPTS or DEAD_MAX_AGE: which limit ends it

    @property
    def horizon(self) -> timedelta:
        """The last attempt, after the first, at the latest (every draw at its bound)."""
        return self.steps[-1].latest if self.steps else timedelta()

    @property
    def mean_horizon(self) -> timedelta:
        """The last attempt, after the first, on average (full jitter: half of each bound)."""
        return self.steps[-1].mean if self.steps else timedelta()


def schedule(policy: RetryPolicy) -> Schedule:
    """The schedule :func:`decide` follows for a delivery whose every attempt fails with a
    retryable error and no requested delay (handler time and queueing not counted)."""
    steps: list[Step] = []
    latest = mean = timedelta()
    for attempt in range(1, policy.max_attempts):
        if latest >= policy.max_age:
            return Schedule(tuple(steps), attempt, DEAD_MAX_AGE)
        bound = backoff_bound(policy, attempt)
        latest = min(latest + bound, policy.max_age)
        mean = min(mean + bound / 2, policy.max_age)
        steps.append(Step(attempt, bound, latest, mean))
    # decide() looks at the attempt count before the age: the last attempt ends it by count.
    return Schedule(tuple(steps), policy.max_attempts, DEAD_MAX_ATTEMPTS)


def _d(delta: timedelta) -> str:
    return format_duration(delta)


def render_schedule(policy: RetryPolicy, windows: Mapping[str, timedelta]) -> str:
    """The Markdown docs/retries.md shows: the schedule, its horizon, and the horizon against
    the retry windows of the senders in ``windows`` (provider name: its window)."""
    plan = schedule(policy)
    lines = [
        f"Defaults: `WEBHOOKS_RETRY_BASE` {_d(policy.base)}, `WEBHOOKS_RETRY_CAP` "
        f"{_d(policy.cap)}, `WEBHOOKS_MAX_ATTEMPTS` {policy.max_attempts}, "
        f"`WEBHOOKS_MAX_AGE` {_d(policy.max_age)}; full jitter.",
        "",
        "| failed attempt | next attempt waits up to | next attempt after the first: "
        "at the latest | on average |",
        "|---|---|---|---|",
    ]
    for step in plan.steps:
        lines.append(f"| {step.attempt} | {_d(step.bound)} | {_d(step.latest)} | {_d(step.mean)} |")
    limit = "attempts" if plan.dead_reason == DEAD_MAX_ATTEMPTS else "age"
    lines += [
        "",
        f"Attempt {plan.attempts} is the last: when it fails the delivery goes dead "
        f"(`{plan.dead_reason}`; the {limit} limit ends it). It comes at most "
        f"{_d(plan.horizon)} after the first attempt, {_d(plan.mean_horizon)} on average.",
        "",
        "| sender | its retry window | our horizon ÷ its window |",
        "|---|---|---|",
    ]
    for name, window in windows.items():
        share = plan.horizon / window
        lines.append(f"| `{name}` | {_d(window)} | {share:.2f} |")
    return "\n".join(lines) + "\n"


# Senders docs/retries.md compares with: the shortest and the longest windows of the
# common ones.
COMPARED = ("slack", "shopify", "svix", "standard", "stripe", "adyen")


def _default(name: str) -> object:
    return Settings.model_fields[name].default


def _default_duration(name: str) -> timedelta:
    value = _default(name)
    if not isinstance(value, timedelta):
        raise TypeError(f"Settings.{name} has no duration default")
    return value


def default_policy() -> RetryPolicy:
    """The policy a route gets with no overrides, from the Settings defaults (no .env read)."""
    attempts = _default("max_attempts")
    if not isinstance(attempts, int):
        raise TypeError("Settings.max_attempts has no integer default")
    return RetryPolicy(
        base=_default_duration("retry_base"),
        cap=_default_duration("retry_cap"),
        max_attempts=attempts,
        max_age=_default_duration("max_age"),
        max_countdown=timedelta(),
    )


def main() -> None:
    """Print docs/retries.md's generated block (the shell around the pure functions)."""
    from core.providers import registry  # noqa: PLC0415 (only this docs generator reads the providers)

    windows = {name: registry.get(name).retry_window for name in COMPARED}
    print(render_schedule(default_policy(), windows), end="")  # noqa: T201


if __name__ == "__main__":
    main()
