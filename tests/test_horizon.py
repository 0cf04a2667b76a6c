"""The horizon is re-checked (issue 35 item 3, its first half): every provider's retry window
carries the day it was last verified against its cited page; a window verified longer ago than
WEBHOOKS_HORIZON_REVIEW_AFTER (or never: a plug-in that states no day) is a review task,
listed by ``webhooks ttl check`` (a real subprocess, with bad input too) and exported by a real
worker's maintenance run as gauges. The check itself is pure, with ``today`` pinned here."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from datetime import UTC, date, datetime, timedelta, timezone
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from core.horizon import WindowReview, due, review, review_one, utc_day
from core.providers import BUILTIN_PROVIDERS, Provider, ProviderPluginError, registry
from core.providers import descriptions as provider_descriptions
from core.settings import SettingsError, load_settings
from tasks import horizon as maintenance_horizon
from tests.conftest import BASE_ENV, BIN, free_port, make_settings, test_env, wait_for_port
from tests.workers import Broker, running_worker, scrape_metrics, wait_for, worker_settings

# The day each built-in window was set (and last checked): the commit that introduced it
# (git log -S on its citation; none has changed since). See docs/providers.md.
FIRST = ("stripe", "github", "shopify", "slack", "standard", "svix", "hmac")  # 90fe8c5
SET_ON = dict.fromkeys(FIRST, date(2026, 11, 30))
LATER = date(2026, 12, 1)  # 040da34 and 37db7f0: every other built-in
HALF_YEAR = timedelta(days=180)
DUE_EXIT = 3


def _set_on(name: str) -> date:
    return SET_ON.get(name, LATER)


def _provider(name: str, verified_on: date | None) -> Provider:
    github = registry.get("github")
    return Provider(
        name=name,
        authenticate=github.authenticate,
        extract=github.extract,
        retry_window=timedelta(hours=2),
        citation=f"https://{name}.example/webhooks#retries",
        signed="body only",
        tolerance=None,
        verified_on=verified_on,
    )


# The pure check ------------------------------------------------------------------------------


def test_every_builtin_window_states_the_day_it_was_verified() -> None:
    for name in BUILTIN_PROVIDERS:
        verified = registry.get(name).verified_on
        assert type(verified) is date, name  # a day, not a datetime, never missing
        assert verified == _set_on(name), name


def test_a_window_is_due_strictly_after_review_after_and_not_on_the_day() -> None:
    builtins = [registry.get(name) for name in BUILTIN_PROVIDERS]
    # 180 days after 2026-11-30: the oldest windows are exactly review_after old, not yet due.
    on_the_day = review(builtins, date(2027, 5, 29), HALF_YEAR)
    assert [r.provider for r in on_the_day] == list(BUILTIN_PROVIDERS)  # the registry's order
    assert due(on_the_day) == ()
    stripe = on_the_day[0]
    assert (stripe.age_days, stripe.due, stripe.reason) == (180, False, "verified 180 days ago")
    assert stripe.retry_window == timedelta(days=3)
    assert stripe.citation == registry.get("stripe").citation
    # A day later the seven windows set on 2026-11-30 are due; those of 2026-12-01 are not.
    next_day = review(builtins, date(2027, 5, 30), HALF_YEAR)
    assert [r.provider for r in due(next_day)] == list(FIRST)
    assert due(next_day)[0].reason == "verified 181 days ago, over 180"
    assert {r.age_days for r in next_day if not r.due} == {180}
    # And the day after, every one.
    assert len(due(review(builtins, date(2027, 5, 31), HALF_YEAR))) == len(BUILTIN_PROVIDERS)
    # A shorter review period makes them due sooner: the setting, not a constant, decides.
    assert len(due(review(builtins, date(2026, 12, 8), timedelta(days=7)))) == len(FIRST)


def test_never_verified_and_a_day_after_today_are_due_and_listed_first() -> None:
    today = date(2027, 1, 10)
    plugins = [
        _provider("fresh", date(2027, 1, 1)),
        _provider("old", date(2026, 1, 1)),
        _provider("older", date(2025, 1, 1)),
        _provider("never", None),
        _provider("typo", date(2072, 1, 9)),
    ]
    reviews = review(plugins, today, HALF_YEAR)
    never = reviews[3]
    assert never == WindowReview(
        provider="never",
        retry_window=timedelta(hours=2),
        citation="https://never.example/webhooks#retries",
        verified_on=None,
        age_days=None,
        due=True,
        reason="never verified",
    )
    assert reviews[4].due
    assert reviews[4].age_days == -16435
    assert reviews[4].reason == "verified_on 2072-01-09 is after today (2027-01-10)"
    assert not reviews[0].due
    assert [r.provider for r in due(reviews)] == ["never", "older", "old", "typo"]
    with pytest.raises(ValueError, match="positive"):
        review(plugins, today, timedelta(0))


def test_the_day_is_the_utc_day_of_the_clocks_instant() -> None:
    # 23:30 at UTC-5 is already the next day in UTC; ages count in UTC days.
    late = datetime(2027, 5, 29, 23, 30, tzinfo=timezone(timedelta(hours=-5)))
    assert utc_day(late) == date(2027, 5, 30)
    assert review_one(registry.get("stripe"), utc_day(late), HALF_YEAR).due
    with pytest.raises(ValueError, match="aware"):
        utc_day(datetime(2027, 5, 29, 12))  # noqa: DTZ001 (the naive instant refused)


# Where the day is declared --------------------------------------------------------------------


def _row(**changes: Any) -> dict[str, Any]:
    row = dict(provider_descriptions.table()["stripe"])
    row.update(changes)
    return {key: value for key, value in row.items() if value is not None}


@pytest.mark.parametrize(
    ("verified_on", "message"),
    [
        (None, r"missing \['verified_on'\]"),
        (datetime(2026, 11, 30, tzinfo=UTC), "verified_on must be a date"),
        ("2026-11-30", "verified_on must be a date"),
    ],
)
def test_a_builtin_row_without_a_day_stops_the_import(
    monkeypatch: pytest.MonkeyPatch, verified_on: object, message: str
) -> None:
    rows = {"stripe": _row(verified_on=verified_on)}
    monkeypatch.setattr(provider_descriptions, "table", lambda: rows)
    stripe = registry.get("stripe")
    with pytest.raises(ValueError, match=message):
        provider_descriptions.described("stripe", stripe.authenticate, stripe.extract)


def _ep(name: str, value: str) -> EntryPoint:
    return EntryPoint(name=name, value=value, group=registry.ENTRY_POINT_GROUP)


def test_a_plugin_may_leave_the_day_unset_but_not_state_a_wrong_one() -> None:
    here = sys.modules[__name__]
    here.NEVER = _provider("never", None)  # type: ignore[attr-defined]
    here.DATED = _provider("dated", date(2026, 10, 1))  # type: ignore[attr-defined]
    here.TEXT = _provider("text", "2026-10-01")  # type: ignore[arg-type, attr-defined]
    here.STAMP = _provider("stamp", datetime(2026, 10, 1, tzinfo=UTC))  # type: ignore[attr-defined]
    found = registry.load(
        discover=lambda: [_ep("never", f"{__name__}:NEVER"), _ep("dated", f"{__name__}:DATED")]
    )
    assert found["never"].verified_on is None
    assert found["dated"].verified_on == date(2026, 10, 1)
    for name, attribute in (("text", "TEXT"), ("stamp", "STAMP")):
        with pytest.raises(ProviderPluginError, match=r"verified_on must be a datetime\.date"):
            registry.load(discover=lambda n=name, a=attribute: [_ep(n, f"{__name__}:{a}")])  # type: ignore[misc]


# The setting ---------------------------------------------------------------------------------


def test_review_after_is_a_typed_setting_of_whole_days(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in BASE_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("WEBHOOKS_HORIZON_REVIEW_AFTER", raising=False)
    assert load_settings(_env_file=None).horizon_review_after == HALF_YEAR
    monkeypatch.setenv("WEBHOOKS_HORIZON_REVIEW_AFTER", "90d")
    assert load_settings(_env_file=None).horizon_review_after == timedelta(days=90)
    for bad in ("36h", "0d", "PT36H", "180"):  # a plain number is seconds
        monkeypatch.setenv("WEBHOOKS_HORIZON_REVIEW_AFTER", bad)
        with pytest.raises(SettingsError, match="WEBHOOKS_HORIZON_REVIEW_AFTER must be a whole"):
            load_settings(_env_file=None)
    for bad in ("soon", "-5d"):
        monkeypatch.setenv("WEBHOOKS_HORIZON_REVIEW_AFTER", bad)
        with pytest.raises(SettingsError, match="WEBHOOKS_HORIZON_REVIEW_AFTER: not a duration"):
            load_settings(_env_file=None)


def test_maintenance_records_each_window_as_two_gauges() -> None:
    settings = make_settings(horizon_review_after=HALF_YEAR)
    reviews = maintenance_horizon.record(settings, date(2027, 5, 30))
    assert len(reviews) == len(registry.names())

    def sample(name: str, provider: str) -> float | None:
        return REGISTRY.get_sample_value(name, {"provider": provider})

    assert sample("webhooks_provider_window_verified_age_days", "stripe") == 181
    assert sample("webhooks_provider_window_review_due", "stripe") == 1
    assert sample("webhooks_provider_window_verified_age_days", "resend") == 180
    assert sample("webhooks_provider_window_review_due", "resend") == 0


# webhooks ttl check, a real subprocess -------------------------------------------------------


def _check(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    # The windows alone (the live processes' half: tests/test_ttl_fingerprint.py).
    return subprocess.run(
        [str(BIN / "webhooks"), "ttl", "check", "--windows-only", *args],
        env=test_env(**{"COLUMNS": "80", **env}),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_ttl_check_lists_the_windows_due_and_exits_3() -> None:
    nothing = _check("--as-of", "2027-05-29")
    assert nothing.returncode == 0, nothing.stderr
    said = " ".join(nothing.stdout.split())  # prose wraps at the terminal's width
    assert said == (
        f"None of {len(BUILTIN_PROVIDERS)} retry windows is due for review on 2027-05-29; "
        "the oldest, stripe's, verified 180 days ago."
    )

    listed = _check("--as-of", "2027-05-30", "--json")
    assert listed.returncode == DUE_EXIT, listed.stderr
    view = json.loads(listed.stdout)
    assert view["as_of"] == "2027-05-30"
    assert view["review_after_days"] == 180
    assert view["checked"] == len(BUILTIN_PROVIDERS)
    assert view["due"] == list(FIRST)
    stripe = view["windows"][0]
    assert stripe == {
        "provider": "stripe",
        "builtin": True,
        "retry_window": "3d",
        "retry_window_s": 259200,
        "citation": registry.get("stripe").citation,
        "verified_on": "2026-11-30",
        "age_days": 181,
        "due": True,
        "reason": "verified 181 days ago, over 180",
    }
    # --all: every window, each saying whether it is due.
    every = json.loads(_check("--as-of", "2027-05-30", "--json", "--all").stdout)["windows"]
    assert [w["provider"] for w in every] == list(BUILTIN_PROVIDERS)
    assert [w["provider"] for w in every if w["due"]] == list(FIRST)


def test_ttl_check_reads_well_in_80_columns() -> None:
    human = _check("--as-of", "2027-06-01")
    assert human.returncode == DUE_EXIT, human.stderr
    lines = human.stdout.splitlines()
    citations = {registry.get(name).citation for name in BUILTIN_PROVIDERS}
    for line in lines:
        # A citation is on a line of its own, whole (a URL is never cut); the rest fits.
        assert line.strip() in citations or len(line.rstrip()) <= 80, line
    for name in BUILTIN_PROVIDERS:
        row = next(line for line in lines if line.startswith(f"{name} "))
        assert row.split() == [
            name, _format_window(name), str(_set_on(name)), f"{(date(2027, 6, 1) - _set_on(name)).days}d"
        ]  # fmt: skip
        assert f"  {registry.get(name).citation}" in lines
    assert lines[1].split() == ["provider", "window", "verified", "on", "age"]
    assert "verified_on" in human.stdout  # says how to re-verify
    assert "docs/providers.md" in human.stdout


def _format_window(name: str) -> str:
    from core.durations import format_duration  # noqa: PLC0415

    return format_duration(registry.get(name).retry_window)


def test_ttl_check_today_comes_from_the_clock_and_the_setting_decides() -> None:
    before = datetime.now(UTC).date()
    result = _check("--json", WEBHOOKS_HORIZON_REVIEW_AFTER="1d")
    after = datetime.now(UTC).date()
    assert result.returncode == DUE_EXIT, result.stderr
    view = json.loads(result.stdout)
    assert view["as_of"] in (before.isoformat(), after.isoformat())
    assert view["review_after_days"] == 1
    assert view["due"] == list(BUILTIN_PROVIDERS)  # every built-in is over a day old
    # A review period longer than any age so far: none due, exit 0.
    assert _check(WEBHOOKS_HORIZON_REVIEW_AFTER="36500d").returncode == 0


@pytest.mark.parametrize(
    ("args", "env", "code", "message"),
    [
        (["--as-of", "2027-13-01"], {}, 2, "Invalid value for '--as-of'"),
        (["--as-of", "tomorrow"], {}, 2, "is not a day (YYYY-MM-DD)"),
        (["--since", "2d"], {}, 2, "No such option"),
        ([], {"WEBHOOKS_HORIZON_REVIEW_AFTER": "12h"}, 1, "WEBHOOKS_HORIZON_REVIEW_AFTER must be"),
        ([], {"WEBHOOKS_HORIZON_REVIEW_AFTER": "soon"}, 1, "WEBHOOKS_HORIZON_REVIEW_AFTER"),
    ],
)
def test_ttl_check_refuses_bad_input_in_one_message(
    args: list[str], env: Mapping[str, str], code: int, message: str
) -> None:
    result = _check(*args, **env)
    assert result.returncode == code, result.stdout + result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def _never_verified_plugin(root: Path) -> Path:
    """A plug-in distribution (dist-info with its entry point, and its module) in ``root``,
    for a subprocess's PYTHONPATH: its Provider states no verified_on."""
    site = root / "site"
    (site / "horizon_acme-1.0.dist-info").mkdir(parents=True)
    (site / "horizon_acme-1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: horizon-acme\nVersion: 1.0\n"
    )
    (site / "horizon_acme-1.0.dist-info" / "entry_points.txt").write_text(
        "[webhooks.providers]\nacme = horizon_acme:PROVIDER\n"
    )
    (site / "horizon_acme.py").write_text(
        textwrap.dedent(
            """
            from datetime import timedelta

            from core.providers import Provider
            from core.providers.github import PROVIDER as GITHUB

            PROVIDER = Provider(
                name="acme",
                authenticate=GITHUB.authenticate,
                extract=GITHUB.extract,
                retry_window=timedelta(hours=2),
                citation="https://acme.example/docs/webhooks#retries",
                signed="body only",
                tolerance=None,
            )
            """
        )
    )
    return site


def test_ttl_check_lists_a_never_verified_plugin_first(tmp_path: Path) -> None:
    site = _never_verified_plugin(tmp_path)
    result = _check("--as-of", "2026-12-02", PYTHONPATH=str(site))
    assert result.returncode == DUE_EXIT, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"1 of {len(BUILTIN_PROVIDERS) + 1} retry windows due")
    assert lines[2].split() == ["acme", "(plug-in)", "2h", "never", "-"]
    assert lines[3] == "  https://acme.example/docs/webhooks#retries"
    view = json.loads(_check("--json", "--as-of", "2026-12-02", PYTHONPATH=str(site)).stdout)
    assert view["due"] == ["acme"]
    assert view["windows"][0]["verified_on"] is None
    assert view["windows"][0]["reason"] == "never verified"


# A real worker's maintenance run exports the gauges -----------------------------------------


def _scrape(port: int) -> dict[tuple[str, str], float]:
    """The provider-window gauges of a real worker's /metrics, by (name, provider)."""
    return {
        (name, dict(labels).get("provider", "")): value
        for (name, labels), value in scrape_metrics(port).items()
        if name.startswith("webhooks_provider_window_")
    }


def _expected(today: date, after: int) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    for name in BUILTIN_PROVIDERS:
        age = (today - _set_on(name)).days
        out["webhooks_provider_window_verified_age_days", name] = age
        out["webhooks_provider_window_review_due", name] = float(age > after)
    out["webhooks_provider_window_verified_age_days", "acme"] = float("inf")
    out["webhooks_provider_window_review_due", "acme"] = 1.0
    return out


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_worker_exports_the_windows_due_after_maintenance(tmp_path: Path) -> None:
    # A review period that puts the boundary between the two days the built-ins were set on:
    # those of 2026-11-30 are one day over it, those of 2026-12-01 exactly on it (not due).
    before = datetime.now(UTC).date()
    after_days = (before - LATER).days
    assert after_days >= 1, "this test needs a clock after 2026-12-01"
    site = _never_verified_plugin(tmp_path)
    port = free_port()
    broker = Broker(worker_settings())
    try:
        with running_worker(
            "horizon",
            tmp_path,
            pool="prefork",
            concurrency=1,
            worker_metrics_port=port,
            metrics_dir=str(tmp_path / "metrics"),
            admission=False,
            horizon_review_after=timedelta(days=after_days),
            extra_env={"PYTHONPATH": f"{test_env()['PYTHONPATH']}:{site}"},
        ) as worker:
            wait_for_port(port, worker.proc)
            assert _scrape(port) == {}  # nothing before maintenance runs
            broker.maintenance()

            def measured() -> dict[tuple[str, str], float] | None:
                samples = _scrape(port)
                return (
                    samples if ("webhooks_provider_window_review_due", "acme") in samples else None
                )

            samples = wait_for(measured, timeout=60, what="the maintenance run's horizon gauges")
    finally:
        broker.close()
    end = datetime.now(UTC).date()
    assert samples in (_expected(before, after_days), _expected(end, after_days))
    if before == end:
        assert samples["webhooks_provider_window_review_due", "stripe"] == 1
        assert samples["webhooks_provider_window_review_due", "resend"] == 0


def test_providers_show_says_when_the_window_was_verified(tmp_path: Path) -> None:
    site = str(_never_verified_plugin(tmp_path))

    def show(name: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(BIN / "webhooks"), "providers", "show", name, *args],
            env=test_env(COLUMNS="80", PYTHONPATH=site),
            capture_output=True,
            text=True,
            timeout=60,
        )

    assert json.loads(show("stripe", "--json").stdout)["verified_on"] == "2026-11-30"
    assert json.loads(show("acme", "--json").stdout)["verified_on"] is None
    assert "verified:   2026-11-30 (webhooks ttl check)" in show("stripe").stdout.splitlines()
    assert "verified:   never (webhooks ttl check)" in show("acme").stdout.splitlines()
