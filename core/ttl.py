"""Dedup TTL derivation (pure): the sender's delivery contract, never a round number.

    dedup_ttl = provider_retry_window + queue_lag_budget
              + clock_skew_allowance + manual_replay_grace

Each term has a default (the provider's documented retry window, cited below; the other three
from Settings) and a per-source override. A TTL that is not strictly above the retry window in
force (the provider's documented one, or a longer overridden one) is refused: a late retry
would then run twice.

The expiry boundary is inclusive: a receipt deduplicates while ``now < expires_at`` and is
expired (new work, removable by maintenance) from ``now >= expires_at`` on.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from core.durations import format_duration
from core.errors import WebhooksError
from core.settings import Settings


def provider_retry_window(provider: str) -> tuple[timedelta, str]:
    """A provider's documented retry window and where it is documented, from the provider
    registry (each provider module cites its own). UnknownProvider (a ValueError) otherwise."""
    from core.providers import registry  # noqa: PLC0415 (the provider package imports every built-in provider module, ~40 ms of a CLI run that names no provider)

    return registry.retry_window_of(provider)


def unknown_provider(name: str) -> str:
    """The refusal of a provider name nobody registered, with the likely one if any."""
    from core.providers import registry  # noqa: PLC0415 (the provider package imports every built-in provider module, ~40 ms of a CLI run that names no provider)

    return registry.unknown_provider_message(name, registry.names())


def known_providers() -> tuple[str, ...]:
    """Every registered provider (built-ins and plug-ins)."""
    from core.providers import registry  # noqa: PLC0415 (the provider package imports every built-in provider module, ~40 ms of a CLI run that names no provider)

    return registry.names()


TERM_NAMES = ("retry_window", "queue_lag", "clock_skew", "replay_grace")

# An event time further ahead of our clock than this is not trusted as the expiry anchor: a
# sender with a broken clock must not push a receipt past the partitions laid out ahead
# (maintenance keeps at least a day of slack beyond the longest TTL).
MAX_EVENT_TIME_LEAD = timedelta(hours=1)

# The queue-lag term is checked against what the pipeline measures: each maintenance run (and
# ``webhooks ttl explain``) reads from the database the p99 of the time from a receipt's
# arrival to its deliveries' final outcome over this window (models/queue_lag.py), and the
# WebhookQueueLagOverBudget alert fires when it exceeds the term. The term is never changed
# by what is measured: the configured value is the budget (docs/retention.md).
QUEUE_LAG_WINDOW = timedelta(hours=24)

# The least margin a raised TTL keeps above the retry window in force (:func:`effective_ttl`),
# whatever the clock-skew allowance: a TTL equal to the window would end with a late retry.
RAISED_MARGIN_FLOOR = timedelta(seconds=1)


class TtlConfigError(WebhooksError, ValueError):
    """A source's TTL terms do not cover its provider's retry window (or are invalid)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class TtlTerm:
    name: str
    value: timedelta
    origin: str  # "provider default (<source>)", "setting WEBHOOKS_...", "source override"


@dataclass(frozen=True)
class DedupTtl:
    provider: str
    terms: tuple[TtlTerm, ...]
    provider_window: timedelta  # the provider's documented retry window

    @property
    def total(self) -> timedelta:
        return sum((t.value for t in self.terms), timedelta())

    @property
    def retry_window(self) -> timedelta:
        """The retry window in force: the larger of the documented and the configured one."""
        configured = next(t.value for t in self.terms if t.name == "retry_window")
        return max(self.provider_window, configured)

    @property
    def covers_retries(self) -> bool:
        return self.total > self.retry_window

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


def queue_lag_budget(override: timedelta | None, settings: Settings) -> timedelta:
    """A source's queue-lag term: its override, else ``WEBHOOKS_QUEUE_LAG_BUDGET``."""
    return settings.queue_lag_budget if override is None else override


@dataclass(frozen=True)
class TermDefaults:
    """What a source's TTL falls back to where it sets no override: its provider's retry
    window (and where it is documented), and the three settings. A process's values of these
    are its TTL terms' fingerprint (:mod:`core.ttl_fingerprint`)."""

    retry_window: timedelta
    citation: str
    queue_lag: timedelta
    clock_skew: timedelta
    replay_grace: timedelta

    @classmethod
    def of(cls, provider: str, settings: Settings, *, source_name: str = "?") -> TermDefaults:
        """``provider``'s window from the registry, the other three from ``settings``;
        TtlConfigError (``unknown_provider``) for a provider nobody registered here."""
        from core.providers import registry  # noqa: PLC0415 (the provider package imports every built-in provider module, ~40 ms of a CLI run that names no provider)

        try:
            window, citation = provider_retry_window(provider)
        except registry.UnknownProvider:
            raise TtlConfigError(
                f"source {source_name}: unknown provider {provider!r}", "unknown_provider"
            ) from None
        return cls(
            window,
            citation,
            settings.queue_lag_budget,
            settings.clock_skew_allowance,
            settings.manual_replay_grace,
        )


def dedup_terms(
    provider: str, overrides: TtlOverrides, settings: Settings, *, source_name: str = "?"
) -> DedupTtl:
    """The four terms and where each came from, without the coverage check (``ttl explain``
    shows a refused configuration too; maintenance sizes partitions from it)."""
    defaults = TermDefaults.of(provider, settings, source_name=source_name)
    return terms_from(provider, overrides, defaults, source_name=source_name)


def terms_from(
    provider: str, overrides: TtlOverrides, defaults: TermDefaults, *, source_name: str = "?"
) -> DedupTtl:
    """:func:`dedup_terms` from given defaults (another process's, recorded in its
    fingerprint) rather than this process's registry and settings."""
    named = {
        "retry_window": (defaults.retry_window, f"provider default ({defaults.citation})"),
        "queue_lag": (defaults.queue_lag, "setting WEBHOOKS_QUEUE_LAG_BUDGET"),
        "clock_skew": (defaults.clock_skew, "setting WEBHOOKS_CLOCK_SKEW_ALLOWANCE"),
        "replay_grace": (defaults.replay_grace, "setting WEBHOOKS_MANUAL_REPLAY_GRACE"),
    }
    terms = []
    for name in TERM_NAMES:
        override = getattr(overrides, name)
        if override is not None:
            if override < timedelta():
                raise TtlConfigError(
                    f"source {source_name}: {name} must not be negative", "negative_term"
                )
            terms.append(TtlTerm(name, override, "source override"))
        else:
            value, origin = named[name]
            if value < timedelta():
                raise TtlConfigError(f"{origin}: {name} must not be negative", "negative_term")
            terms.append(TtlTerm(name, value, origin))
    return DedupTtl(provider, tuple(terms), defaults.retry_window)


def derive_ttl(
    provider: str, overrides: TtlOverrides, settings: Settings, *, source_name: str = "?"
) -> DedupTtl:
    """Sum the four terms; refuse a TTL that does not exceed the retry window in force."""
    ttl = dedup_terms(provider, overrides, settings, source_name=source_name)
    if not ttl.covers_retries:
        raise TtlConfigError(
            f"source {source_name}: dedup TTL {ttl.describe()} is not above the {provider} "
            f"retry window {format_duration(ttl.retry_window)}; a late retry would run twice",
            "ttl_not_above_retry_window",
        )
    return ttl


@dataclass(frozen=True)
class EffectiveTtl:
    """The TTL receipts are written with, and whether it had to be raised."""

    terms: DedupTtl
    total: timedelta
    raised: bool

    def warning(self) -> str | None:
        if not self.raised:
            return None
        return (
            f"dedup TTL {format_duration(self.terms.total)} is not above the retry window "
            f"{format_duration(self.terms.retry_window)}: raised to {format_duration(self.total)}"
        )


def effective_ttl(
    provider: str, overrides: TtlOverrides, settings: Settings, *, source_name: str = "?"
) -> EffectiveTtl:
    """The TTL the receiver and the workers use. A source whose terms no longer cover its
    retry window (a setting or the provider's documented window changed after the source
    was created, which :func:`derive_ttl` would have refused) is never answered with an
    error, which would lose its events: its receipts get the minimum safe TTL, the retry
    window in force plus the clock-skew allowance (at least :data:`RAISED_MARGIN_FLOOR`), and
    ``raised`` says so for the report, the metric and ``webhooks sources list``."""
    terms = dedup_terms(provider, overrides, settings, source_name=source_name)
    return effective_from(terms, settings.clock_skew_allowance)


def effective_from(
    terms: DedupTtl, clock_skew_allowance: timedelta, margin_floor: timedelta | None = None
) -> EffectiveTtl:
    """:func:`effective_ttl` of given terms: raised to the retry window in force plus the
    margin, ``max(clock_skew_allowance, margin_floor)``, when they do not cover it."""
    if terms.covers_retries:
        return EffectiveTtl(terms, terms.total, raised=False)
    floor = RAISED_MARGIN_FLOOR if margin_floor is None else margin_floor
    margin = max(clock_skew_allowance, floor)
    return EffectiveTtl(terms, terms.retry_window + margin, raised=True)


def expires_at(occurred_at: datetime | None, received_at: datetime, ttl: timedelta) -> datetime:
    """Deterministic expiry of an event's receipt: ``anchor + ttl``.

    The anchor is the provider's event time when the format carries one (Stripe ``created``,
    Slack ``event_time``, a Standard Webhooks / Svix payload ``timestamp``, a generic source's
    configured time field, all inside the signed body): every retry of the event carries the
    same time, so every retry computes the same ``expires_at``, and the retry window, which
    providers count from the event, is measured from the same instant. Per-attempt times
    (Stripe ``t``, ``webhook-timestamp``, Slack's request timestamp) are never the anchor, nor
    is a time the signature does not cover (``EventMeta.time_signed``: the receiver passes
    None, or a replay could back-date it so its receipt expires at once).

    Otherwise (GitHub, Shopify, Adyen, a generic source without a time field)
    the anchor is the first arrival: retries serialise on the receiver's
    per-(scope, event_id) lock, find that receipt live and keep it, so its ``expires_at`` is
    the one every retry sees. The first arrival is never earlier than the event, so this only
    lengthens protection.

    Two event times are not trusted and fall back to the arrival anchor: one so old that
    ``event time + ttl`` is already past (the sender's contract for it is over, so the
    delivery is new work), and one more than :data:`MAX_EVENT_TIME_LEAD` ahead of our clock.
    Either way, a live receipt of the same event still deduplicates it under the lock.
    """
    if occurred_at is not None and occurred_at <= received_at + MAX_EVENT_TIME_LEAD:
        anchored = occurred_at + ttl
        if anchored > received_at:
            return anchored
    return received_at + ttl
