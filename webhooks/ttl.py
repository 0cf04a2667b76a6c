"""Dedup TTL derivation (pure): the sender's delivery contract, never a round number.

    dedup_ttl = provider_retry_window + queue_lag_budget + clock_skew_allowance + manual_replay_grace

Each term has a default (the provider's documented retry window, cited below; the other three
from Settings) and a per-source override. ``expires_at`` is deterministic for an event: it is
anchored on the provider's own event time where the format carries one, so every retry of the
same event computes the same value.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from webhooks.durations import format_duration
from webhooks.settings import Settings

# provider -> (documented retry window, where the figure comes from). See PROVIDERS.md.
PROVIDER_RETRY_WINDOWS: dict[str, tuple[timedelta, str]] = {
    # "Stripe automatically resends the undelivered events ... for up to three days"
    "stripe": (timedelta(days=3), "https://docs.stripe.com/webhooks/process-undelivered-events"),
    # No automatic retry; manual redelivery for deliveries from the past 3 days (same id).
    "github": (
        timedelta(days=3),
        "https://docs.github.com/webhooks/testing-and-troubleshooting-webhooks/redelivering-webhooks",
    ),
    # "retried a total of 8 times over 4 hours"
    "shopify": (
        timedelta(hours=4),
        "https://shopify.dev/changelog/updates-to-webhook-retry-mechanism",
    ),
    # 3 retries: immediately, +1 min, +5 min; rounded up to 10 minutes.
    "slack": (timedelta(minutes=10), "https://api.slack.com/apis/connections/events-api#retries"),
    # Spec example schedule: last attempt 75 h 35 m 05 s after the first.
    "standard": (
        timedelta(hours=75, minutes=35, seconds=5),
        "standard-webhooks spec/standard-webhooks.md (retry schedule example)",
    ),
    # Immediately, 5 s, 5 min, 30 min, 2 h, 5 h, 10 h, 10 h: about 27 h 35 m 05 s.
    "svix": (timedelta(hours=27, minutes=35, seconds=5), "https://docs.svix.com/retries"),
    # Generic senders publish nothing we can cite: assume three days and override per source.
    "hmac": (timedelta(days=3), "no published contract: conservative default, override per source"),
}

TERM_NAMES = ("retry_window", "queue_lag", "clock_skew", "replay_grace")


class TtlConfigError(ValueError):
    """A source's TTL terms do not cover its provider's retry window."""


@dataclass(frozen=True)
class TtlTerm:
    name: str
    value: timedelta
    origin: str  # "provider default (<source>)", "setting WEBHOOKS_...", "source override"


@dataclass(frozen=True)
class DedupTtl:
    provider: str
    terms: tuple[TtlTerm, ...]
    provider_window: timedelta

    @property
    def total(self) -> timedelta:
        return sum((t.value for t in self.terms), timedelta())

    def describe(self) -> str:
        parts = " + ".join(f"{t.name} {format_duration(t.value)}" for t in self.terms)
        return f"{parts} = {format_duration(self.total)}"


@dataclass(frozen=True)
class TtlOverrides:
    retry_window: timedelta | None = None
    queue_lag: timedelta | None = None
    clock_skew: timedelta | None = None
    replay_grace: timedelta | None = None

    @classmethod
    def from_seconds(
        cls,
        retry_window_s: int | None,
        queue_lag_s: int | None,
        clock_skew_s: int | None,
        replay_grace_s: int | None,
    ) -> TtlOverrides:
        def td(v: int | None) -> timedelta | None:
            return None if v is None else timedelta(seconds=v)

        return cls(td(retry_window_s), td(queue_lag_s), td(clock_skew_s), td(replay_grace_s))


def derive_ttl(
    provider: str, overrides: TtlOverrides, settings: Settings, *, source_name: str = "?"
) -> DedupTtl:
    """Sum the four terms; refuse a TTL that does not exceed the provider's retry window."""
    window, citation = PROVIDER_RETRY_WINDOWS[provider]
    defaults = {
        "retry_window": (window, f"provider default ({citation})"),
        "queue_lag": (settings.queue_lag_budget, "setting WEBHOOKS_QUEUE_LAG_BUDGET"),
        "clock_skew": (settings.clock_skew_allowance, "setting WEBHOOKS_CLOCK_SKEW_ALLOWANCE"),
        "replay_grace": (settings.manual_replay_grace, "setting WEBHOOKS_MANUAL_REPLAY_GRACE"),
    }
    terms = []
    for name in TERM_NAMES:
        override = getattr(overrides, name)
        if override is not None:
            if override < timedelta():
                raise TtlConfigError(f"source {source_name}: {name} must not be negative")
            terms.append(TtlTerm(name, override, "source override"))
        else:
            value, origin = defaults[name]
            terms.append(TtlTerm(name, value, origin))
    ttl = DedupTtl(provider, tuple(terms), window)
    if ttl.total <= window:
        raise TtlConfigError(
            f"source {source_name}: dedup TTL {ttl.describe()} is not above the {provider} "
            f"retry window {format_duration(window)}; a late retry would run twice"
        )
    return ttl


def expires_at(occurred_at: datetime | None, received_at: datetime, ttl: timedelta) -> datetime:
    """Deterministic expiry of an event's receipt.

    Anchored on the provider's event time when the format has one (every retry of the event
    carries the same time, so computes the same value). Formats without one (GitHub, a
    Standard Webhooks payload without ``timestamp``, generic HMAC without a time field) anchor
    on the first arrival: retries find that receipt under the per-event lock and keep it. An
    event time so old that the anchor has already expired is anchored on arrival too: the
    sender's contract is over, so the delivery is new work (see README, Retention).
    """
    if occurred_at is not None:
        anchored = occurred_at + ttl
        if anchored > received_at:
            return anchored
    return received_at + ttl
