"""Dedup TTL derivation and deterministic expiry (issue 5): the pure core, and ``ttl explain``."""

from __future__ import annotations

import json
import random
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from core.durations import format_duration
from core.providers import BUILTIN_PROVIDERS as PROVIDERS
from core.settings import Settings
from core.ttl import (
    MAX_EVENT_TIME_LEAD,
    TERM_NAMES,
    TtlConfigError,
    TtlOverrides,
    derive_ttl,
    expires_at,
    known_providers,
    provider_retry_window,
)
from tests.conftest import BIN, make_settings
from tests.conftest import test_env as subprocess_env
from tests.factories import MadeSource, make_source

NO_MARGIN = TtlOverrides(queue_lag=timedelta(0), clock_skew=timedelta(0), replay_grace=timedelta(0))


def test_every_provider_has_a_cited_retry_window() -> None:
    assert set(known_providers()) >= set(PROVIDERS)
    for provider in known_providers():
        window, citation = provider_retry_window(provider)
        assert window > timedelta(0), provider
        assert citation.strip(), provider


@pytest.mark.parametrize("provider", PROVIDERS)
def test_every_provider_default_ttl_is_the_sum_and_above_the_retry_window(provider: str) -> None:
    settings = make_settings()
    window, citation = provider_retry_window(provider)
    ttl = derive_ttl(provider, TtlOverrides(), settings, source_name="s")
    assert ttl.total > window
    assert ttl.total == (
        window
        + settings.queue_lag_budget
        + settings.clock_skew_allowance
        + settings.manual_replay_grace
    )
    assert [t.name for t in ttl.terms] == list(TERM_NAMES)
    origins = {t.name: t.origin for t in ttl.terms}
    assert origins["retry_window"] == f"provider default ({citation})"
    assert origins["queue_lag"] == "setting WEBHOOKS_QUEUE_LAG_BUDGET"
    assert origins["clock_skew"] == "setting WEBHOOKS_CLOCK_SKEW_ALLOWANCE"
    assert origins["replay_grace"] == "setting WEBHOOKS_MANUAL_REPLAY_GRACE"


def test_stripe_default_is_the_articles_worked_example() -> None:
    # 3 d retry window + 1 d queue lag + 10 min skew + 2 d replay grace.
    ttl = derive_ttl("stripe", TtlOverrides(), make_settings())
    assert ttl.total == timedelta(days=6, minutes=10)
    assert (
        ttl.describe()
        == "retry_window 3d + queue_lag 1d + clock_skew 10m + replay_grace 2d = 6d10m"
    )


def test_overrides_replace_their_terms_and_say_so() -> None:
    overrides = TtlOverrides(retry_window=timedelta(days=30), replay_grace=timedelta(days=5))
    ttl = derive_ttl("hmac", overrides, make_settings())
    values = {t.name: (t.value, t.origin) for t in ttl.terms}
    assert values["retry_window"] == (timedelta(days=30), "source override")
    assert values["replay_grace"] == (timedelta(days=5), "source override")
    assert values["queue_lag"][1] == "setting WEBHOOKS_QUEUE_LAG_BUDGET"
    assert ttl.total == timedelta(days=36, minutes=10)
    assert ttl.retry_window == timedelta(days=30)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_ttl_not_above_the_provider_window_is_refused_naming_source_and_terms(
    provider: str,
) -> None:
    window, _ = provider_retry_window(provider)
    for retry_window in (window, window / 2):
        overrides = TtlOverrides(
            retry_window=retry_window,
            queue_lag=NO_MARGIN.queue_lag,
            clock_skew=NO_MARGIN.clock_skew,
            replay_grace=NO_MARGIN.replay_grace,
        )
        with pytest.raises(TtlConfigError) as caught:
            derive_ttl(provider, overrides, make_settings(), source_name="billing-eu")
        message = str(caught.value)
        assert caught.value.reason == "ttl_not_above_retry_window"
        assert "source billing-eu" in message
        assert provider in message
        assert format_duration(window) in message
        for term in TERM_NAMES:
            assert term in message


@pytest.mark.parametrize("provider", PROVIDERS)
def test_settings_leaving_no_margin_refuse_every_provider_default(provider: str) -> None:
    settings = make_settings(
        queue_lag_budget=timedelta(0),
        clock_skew_allowance=timedelta(0),
        manual_replay_grace=timedelta(0),
    )
    with pytest.raises(TtlConfigError, match=f"source {provider}-src: dedup TTL retry_window"):
        derive_ttl(provider, TtlOverrides(), settings, source_name=f"{provider}-src")


def test_a_longer_configured_retry_window_must_be_covered_too() -> None:
    settings = make_settings()
    thirty = TtlOverrides(
        retry_window=timedelta(days=30),
        queue_lag=timedelta(0),
        clock_skew=timedelta(0),
        replay_grace=timedelta(0),
    )
    with pytest.raises(TtlConfigError, match="retry window 30d"):
        derive_ttl("hmac", thirty, settings, source_name="adyen")
    ok = TtlOverrides(
        retry_window=timedelta(days=30),
        queue_lag=timedelta(seconds=1),
        clock_skew=timedelta(0),
        replay_grace=timedelta(0),
    )
    assert derive_ttl("hmac", ok, settings).total == timedelta(days=30, seconds=1)


def test_negative_terms_and_unknown_providers_are_refused() -> None:
    with pytest.raises(TtlConfigError) as negative:
        derive_ttl(
            "stripe",
            TtlOverrides(queue_lag=timedelta(seconds=-1)),
            make_settings(),
            source_name="x",
        )
    assert negative.value.reason == "negative_term"
    assert "source x: queue_lag" in str(negative.value)
    with pytest.raises(TtlConfigError) as unknown:
        derive_ttl("pigeon", TtlOverrides(), make_settings(), source_name="x")
    assert unknown.value.reason == "unknown_provider"


# ------------------------------------------------------------------------------------------
# expires_at
# ------------------------------------------------------------------------------------------

T = datetime(2024, 2, 10, 12, 0, 0, tzinfo=UTC)
TTL = timedelta(days=6, minutes=10)


def test_every_retry_of_an_event_with_an_event_time_computes_the_same_expiry() -> None:
    rng = random.Random(5)
    occurred = T
    first = expires_at(occurred, occurred + timedelta(seconds=2), TTL)
    assert first == occurred + TTL
    for _ in range(500):
        # Retries arrive any time before the receipt expires, and even slightly before the
        # event time by our clock (sender clock ahead within the trusted lead).
        received = occurred + timedelta(
            seconds=rng.uniform(-MAX_EVENT_TIME_LEAD.total_seconds(), TTL.total_seconds() - 1)
        )
        assert expires_at(occurred, received, TTL) == first


def test_without_an_event_time_the_first_arrival_is_the_anchor() -> None:
    assert expires_at(None, T, TTL) == T + TTL


def test_an_event_time_whose_expiry_has_passed_anchors_on_arrival() -> None:
    occurred = T - TTL
    # Exactly at the old expiry the old anchor is already expired: new work, new expiry.
    assert expires_at(occurred, T, TTL) == T + TTL
    assert expires_at(occurred, T - timedelta(microseconds=1), TTL) == T
    assert expires_at(occurred - timedelta(days=30), T, TTL) == T + TTL


def test_an_event_time_far_ahead_of_our_clock_is_not_trusted() -> None:
    assert expires_at(T + MAX_EVENT_TIME_LEAD, T, TTL) == T + MAX_EVENT_TIME_LEAD + TTL
    beyond = T + MAX_EVENT_TIME_LEAD + timedelta(seconds=1)
    assert expires_at(beyond, T, TTL) == T + TTL
    assert expires_at(T + timedelta(days=400), T, TTL) == T + TTL


def test_expiry_is_always_after_arrival_and_at_most_lead_plus_ttl_later() -> None:
    rng = random.Random(7)
    for _ in range(1000):
        occurred = T + timedelta(seconds=rng.uniform(-30 * 86400, 2 * 86400))
        when = expires_at(occurred, T, TTL)
        assert T < when <= T + MAX_EVENT_TIME_LEAD + TTL


# ------------------------------------------------------------------------------------------
# webhooks ttl explain
# ------------------------------------------------------------------------------------------


@pytest.fixture
def explained_source(sessions: sessionmaker[Session], settings: Settings) -> Iterator[MadeSource]:
    made = make_source(
        sessions,
        settings,
        provider="stripe",
        ttl=TtlOverrides(replay_grace=timedelta(days=1)),
    )
    yield made
    with sessions() as session, session.begin():
        session.execute(text("DELETE FROM sources WHERE id = :id"), {"id": made.id})


def webhooks_cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "webhooks"), *args],
        env=subprocess_env(COLUMNS="200", **env),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_ttl_explain_prints_each_term_its_origin_and_the_sum(explained_source: MadeSource) -> None:
    done = webhooks_cli("ttl", "explain", explained_source.public_id)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()

    def row(term: str) -> str:
        return next(line for line in lines if f" {term} " in line)

    assert "3d" in row("retry_window")
    assert "259200" in row("retry_window")
    assert "provider default (https://docs.stripe.com/webhooks/process-undelivered-events)" in row(
        "retry_window"
    )
    assert "1d" in row("queue_lag")
    assert "setting WEBHOOKS_QUEUE_LAG_BUDGET" in row("queue_lag")
    assert "10m" in row("clock_skew")
    assert "setting WEBHOOKS_CLOCK_SKEW_ALLOWANCE" in row("clock_skew")
    assert "1d" in row("replay_grace")
    assert "source override" in row("replay_grace")
    assert "5d10m" in row("= dedup_ttl")
    assert str(5 * 86400 + 600) in row("= dedup_ttl")
    assert "above the stripe retry window (3d) by 2d10m" in done.stdout

    as_json = webhooks_cli("ttl", "explain", explained_source.name, "--json")
    assert as_json.returncode == 0, as_json.stderr
    view = json.loads(as_json.stdout)
    assert view["source"] == explained_source.public_id
    assert [(t["name"], t["seconds"]) for t in view["terms"]] == [
        ("retry_window", 3 * 86400),
        ("queue_lag", 86400),
        ("clock_skew", 600),
        ("replay_grace", 86400),
    ]
    assert [t["origin"] for t in view["terms"]][1:] == [
        "setting WEBHOOKS_QUEUE_LAG_BUDGET",
        "setting WEBHOOKS_CLOCK_SKEW_ALLOWANCE",
        "source override",
    ]
    assert view["dedup_ttl_seconds"] == sum(t["seconds"] for t in view["terms"])
    assert view["dedup_ttl"] == "5d10m"
    assert view["covers_retries"] is True


def test_ttl_explain_refused_configuration_exits_1_naming_source_and_terms(
    sessions: sessionmaker[Session], settings: Settings
) -> None:
    made = make_source(sessions, settings, provider="svix")
    try:
        done = webhooks_cli(
            "ttl",
            "explain",
            made.public_id,
            WEBHOOKS_QUEUE_LAG_BUDGET="PT0S",
            WEBHOOKS_CLOCK_SKEW_ALLOWANCE="PT0S",
            WEBHOOKS_MANUAL_REPLAY_GRACE="PT0S",
        )
        assert done.returncode == 1
        assert "retry_window" in done.stdout  # the terms are still shown
        assert f"source {made.name}: dedup TTL retry_window 1d3h35m5s" in done.stderr
        for term in TERM_NAMES:
            assert term in done.stderr
    finally:
        with sessions() as session, session.begin():
            session.execute(text("DELETE FROM sources WHERE id = :id"), {"id": made.id})


def test_ttl_explain_unknown_source_is_a_clean_error() -> None:
    done = webhooks_cli("ttl", "explain", "src_does_not_exist")
    assert done.returncode == 1
    assert "no such source" in done.stderr
    assert "Traceback" not in done.stderr
