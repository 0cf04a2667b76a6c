"""The subscription watchdog (issue 38 item 1): the real ``webhooks sources check`` CLI and
beat's task body on a worker's runtime, against local stand-ins of Stripe's API (the
``stripe`` library pointed at ``api_base``), GitHub's (the documented hook object), Svix's and
Shopify's (the documented webhook resource, ``webhooks.json``), real Postgres, and Prometheus' own promtool evaluating the alert rules over the gauge's values."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core import metrics
from core import watchdog as judge
from core.settings import Settings
from tasks.watchdog import endpoints
from tests.conftest import test_env
from tests.factories import MadeSource, make_source
from tests.fake_providers import (
    FakeGitHub,
    FakeShopify,
    FakeStripe,
    FakeSvix,
    Scripted,
    serving,
)
from tests.leakcheck import remember
from tests.loopback import Loopback, Quiet
from tests.operators_support import cli

ALERTS = Path(__file__).resolve().parent.parent / "deploy" / "alerts.yml"
PROMTOOL = shutil.which("promtool")
HOOK = "repos/octo/hello/hooks/4242"


def _key(prefix: str) -> str:
    key = f"{prefix}_{uuid.uuid4().hex}"
    remember(key)
    return key


def _url(made: MadeSource) -> str:
    return f"https://hooks.example.com/webhooks/{made.public_id}"


def _source(
    sessions: sessionmaker[Session],
    settings: Settings,
    fake: FakeStripe | FakeGitHub | FakeSvix | FakeShopify,
    *,
    events: tuple[str, ...] = ("*",),
    api_key: str | None = None,
    api_base: str | None = None,
) -> MadeSource:
    """A source of ``fake``'s provider with one route per event glob, its API credential and
    its endpoint named; the fake posts to the source's URL (``endpoint_url``)."""
    routes = [{"handler": "log", "events": glob} for glob in events]
    if isinstance(fake, FakeStripe):
        provider, key, endpoint = "stripe", fake.api_key, [f"endpoint_id={fake.endpoint_id}"]
    elif isinstance(fake, FakeGitHub):
        provider, key, endpoint = "github", fake.token, [f"hook={HOOK}"]
    elif isinstance(fake, FakeShopify):
        provider, key, endpoint = "shopify", fake.token, [f"shop={fake.shop}"]
    else:
        provider, key = "svix", fake.token
        endpoint = [f"app_id={fake.app_id}", f"endpoint_id={fake.endpoint_id}"]
    made = make_source(sessions, settings, provider=provider, routes=routes)
    remember(made.secret)
    configs = [x for e in endpoint for x in ("--config", e)]
    done = cli(
        "sources", "update", made.name, "--api-key", api_key or key,
        "--config", f"api_base={api_base or fake.url}", *configs,
        "--config", f"endpoint_url={_url(made)}",
        env=test_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    if isinstance(fake, FakeGitHub):
        fake.hook_url = _url(made)
    elif isinstance(fake, FakeShopify):
        pass  # its subscriptions are the test's: fake.subscribe(topic, _url(made))
    else:
        fake.endpoint_url = _url(made)
    return made


def _check(source: str, *args: str, input_text: str | None = None) -> tuple[int, Any, str]:
    done = cli(
        "sources", "check", source, *args, env=test_env(), input_text=input_text, timeout=120
    )
    assert "Traceback" not in done.stderr + done.stdout
    view = json.loads(done.stdout) if "--json" in args and done.stdout.strip() else done.stdout
    return done.returncode, view, done.stderr


def _findings(engine: Engine, source_id: int) -> list[Any]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                text(
                    "SELECT id, kind, detail, opened_at, closed_at FROM subscription_findings"
                    " WHERE source_id = :s ORDER BY id"
                ),
                {"s": source_id},
            )
        )


def _open(engine: Engine, source_id: int) -> set[str]:
    return {r.kind for r in _findings(engine, source_id) if r.closed_at is None}


def _audits(engine: Engine, public_id: str) -> list[tuple[str, str, str]]:
    """(action, kind or result, operator) of the source's watchdog audit rows, in order."""
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT action, coalesce(target->>'kind', target->>'result'), operator"
                " FROM audit_log WHERE target->>'source' = :p"
                " AND (action LIKE 'finding.%' OR action = 'subscription.enable') ORDER BY id"
            ),
            {"p": public_id},
        )
        return [(r[0], r[1], r[2]) for r in rows]


def _gauge(public_id: str) -> dict[str, float]:
    return {
        s.labels["kind"]: s.value
        for family in metrics.SUBSCRIPTION_FINDINGS.collect()
        for s in family.samples
        if s.labels["source"] == public_id
    }


def _only_due(engine: Engine, source_id: int) -> None:
    """This source due for beat's check, every other one checked just now."""
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE sources SET watched_at = CASE WHEN id = :s THEN NULL ELSE now() END"),
            {"s": source_id},
        )


@pytest.fixture
def runtime(settings: Settings) -> Iterator[Any]:
    from tasks.runtime import build_runtime  # noqa: PLC0415

    rt = build_runtime(settings, worker="watchdog-test")
    try:
        yield rt
    finally:
        rt.close()


def _beat(engine: Engine, rt: Any, made: MadeSource) -> list[str]:
    from tasks.watchdog.schedule import run_due  # noqa: PLC0415

    _only_due(engine, made.id)
    return run_due(rt)


def _alerting(public_id: str, firing: dict[str, list[str]]) -> None:
    """promtool evaluates each watchdog alert's expression over this process's gauge samples
    of the source (held for 10 minutes): ``firing[alert]`` are the kinds it returns."""
    if PROMTOOL is None:
        pytest.skip("promtool is missing: `make install` installs it (Debian's prometheus)")
    rules = {
        r["alert"]: r
        for group in yaml.safe_load(ALERTS.read_text())["groups"]
        for r in group["rules"]
    }
    series = [
        {
            "series": f'webhooks_subscription_findings{{source="{public_id}", kind="{kind}",'
            f' instance="w1"}}',
            "values": f"{value:g}x10",
        }
        for kind, value in _gauge(public_id).items()
    ]
    tests = []
    for alert, kinds in firing.items():
        tests.append(
            {
                "expr": rules[alert]["expr"],  # the rule's own expression, unchanged
                "eval_time": "10m",
                "exp_samples": [
                    {"labels": _labels(alert, public_id, kind), "value": 1} for kind in kinds
                ],
            }
        )
    doc = {
        "rule_files": [str(ALERTS)],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "promql_expr_test": tests}],
    }
    path = Path(f"/tmp/watchdog-promtool-{uuid.uuid4().hex}.yml")  # noqa: S108
    path.write_text(yaml.safe_dump(doc))
    try:
        done = subprocess.run(  # noqa: S603
            [PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, check=False
        )
    finally:
        path.unlink()
    assert done.returncode == 0, done.stdout + done.stderr


def _labels(alert: str, public_id: str, kind: str) -> str:
    if alert == "WebhookSubscriptionCannotCheck":
        return f'{{source="{public_id}"}}'
    return f'{{kind="{kind}", source="{public_id}"}}'


# Stripe ---------------------------------------------------------------------------------------


def test_a_stripe_endpoint_turning_disabled_is_one_finding_until_it_is_enabled_again(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings, runtime: Any
) -> None:
    """Beat's check reads the endpoint; disabled at Stripe: one finding (opened once however
    often it is seen), its gauge, the alert's expression true, `sources check` exit 1; enabled
    again: closed, gauge 0, the expression false, exit 0; each change audited once."""
    fake = FakeStripe(_key("rk_test"), enabled_events=("invoice.paid", "invoice.created"))
    with serving(fake):
        made = _source(sessions, settings, fake, events=("invoice.*",))
        assert _beat(engine, runtime, made) == [made.public_id]
        assert _open(engine, made.id) == set()
        assert _beat(engine, runtime, made) == [made.public_id]

        fake.endpoint_status = "disabled"
        assert _beat(engine, runtime, made) == [made.public_id]
        assert _open(engine, made.id) == {"disabled"}
        assert _gauge(made.public_id) == {"disabled": 1.0}
        _alerting(made.public_id, {"WebhookSubscriptionFinding": ["disabled"]})
        code, view, _ = _check(made.name, "--json")
        assert code == 1
        assert [(f["source"], f["kind"]) for f in view["open"]] == [(made.public_id, "disabled")]
        assert view["checked"][0]["provider_view"]["status"] == "disabled"
        code, said, _ = _check(made.name)
        assert code == 1
        assert f"open: {made.public_id} ({made.name}) disabled since" in said
        assert "see docs/provider-side.md#the-subscription-watchdog" in said
        asked = len(fake.seen)
        code, view, _ = _check(made.name, "--stored", "--json")
        assert code == 1
        assert view["checked"] == []
        assert [f["kind"] for f in view["open"]] == ["disabled"]
        assert len(fake.seen) == asked  # --stored asks no provider
        assert len(_findings(engine, made.id)) == 1  # seen three times, opened once

        fake.endpoint_status = "enabled"
        code, view, _ = _check(made.name, "--json")
        assert code == 0
        assert view["open"] == []
        assert view["checked"][0]["closed"] == ["disabled"]
        assert _beat(engine, runtime, made) == [made.public_id]  # the tick sets the gauge
        assert _gauge(made.public_id) == {"disabled": 0.0}
        _alerting(made.public_id, {"WebhookSubscriptionFinding": []})
    [row] = _findings(engine, made.id)
    assert row.closed_at is not None
    assert row.closed_at > row.opened_at
    assert _audits(engine, made.public_id) == [
        ("finding.open", "disabled", "watchdog"),
        ("finding.close", "disabled", "watchdog"),
    ]
    # The check asks for the endpoint only: never events, never a change.
    assert {(s.method, s.path) for s in fake.seen} == {
        ("GET", f"/v1/webhook_endpoints/{fake.endpoint_id}")
    }


def test_an_endpoint_posting_elsewhere_or_no_longer_sending_a_routed_type_is_a_finding(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings, runtime: Any
) -> None:
    fake = FakeStripe(_key("rk_test"), enabled_events=("invoice.paid", "customer.created"))
    with serving(fake):
        made = _source(sessions, settings, fake, events=("invoice.paid", "customer.*"))
        assert _beat(engine, runtime, made) == [made.public_id]
        assert _open(engine, made.id) == set()

        fake.endpoint_url = "https://old-host.example.com/hooks"
        fake.enabled_events = ["customer.created"]  # invoice.paid dropped at Stripe
        assert _beat(engine, runtime, made) == [made.public_id]
        assert _open(engine, made.id) == {"url_mismatch", "events_missing"}
        details = {r.kind: r.detail for r in _findings(engine, made.id)}
        assert details["url_mismatch"] == (
            f"stripe posts to https://old-host.example.com/hooks, not {_url(made)}"
        )
        assert details["events_missing"].startswith("routes listen for invoice.paid;")
        assert _gauge(made.public_id) == {"url_mismatch": 1.0, "events_missing": 1.0}
        _alerting(
            made.public_id, {"WebhookSubscriptionFinding": ["events_missing", "url_mismatch"]}
        )
        code, view, _ = _check(made.public_id, "--json")
        assert code == 1
        assert {f["kind"] for f in view["open"]} == {"url_mismatch", "events_missing"}
        # --fix re-points nothing and subscribes to nothing: no call that changes anything.
        code, said, _ = _check(made.public_id, "--fix", "--yes")
        assert code == 1
        assert "nothing --fix can do" in said
        assert fake.endpoint_requests("POST") == []

        fake.endpoint_url = _url(made)
        fake.enabled_events = ["*"]
        assert _beat(engine, runtime, made) == [made.public_id]
        assert _open(engine, made.id) == set()
        assert _gauge(made.public_id) == {"url_mismatch": 0.0, "events_missing": 0.0}
        _alerting(made.public_id, {"WebhookSubscriptionFinding": []})
    assert sorted(_audits(engine, made.public_id)) == sorted(
        [
            ("finding.open", "url_mismatch", "watchdog"),
            ("finding.open", "events_missing", "watchdog"),
            ("finding.close", "url_mismatch", "watchdog"),
            ("finding.close", "events_missing", "watchdog"),
        ]
    )


def test_fix_reenables_a_disabled_stripe_endpoint_with_one_call_after_confirmation(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings
) -> None:
    fake = FakeStripe(_key("rk_test"))
    with serving(fake):
        made = _source(sessions, settings, fake)
        fake.endpoint_status = "disabled"
        code, said, _ = _check(made.name, "--fix", input_text="n\n")
        assert code == 1  # declined: aborted, nothing asked of Stripe
        assert "Re-enable" in said
        assert fake.endpoint_requests("POST") == []
        assert _open(engine, made.id) == {"disabled"}

        code, said, _ = _check(made.name, "--fix", "--reason", "endpoint fixed", input_text="y\n")
        assert code == 0, said
        assert f"re-enabled {made.public_id}'s endpoint at stripe" in said
        [post] = fake.endpoint_requests("POST")
        assert post.authorised
        assert fake.endpoint_status == "enabled"
        assert _open(engine, made.id) == set()
    assert _audits(engine, made.public_id) == [
        ("finding.open", "disabled", "watchdog"),
        ("subscription.enable", "enabled", _operator(engine, made.public_id)),
        ("finding.close", "disabled", "watchdog"),
    ]
    with engine.connect() as conn:
        reason = conn.execute(
            text(
                "SELECT reason FROM audit_log WHERE action = 'subscription.enable'"
                " AND target->>'source' = :p"
            ),
            {"p": made.public_id},
        ).scalar_one()
    assert reason == "endpoint fixed"


def _operator(engine: Engine, public_id: str) -> str:
    with engine.connect() as conn:
        found = conn.execute(
            text(
                "SELECT operator FROM audit_log WHERE action = 'subscription.enable'"
                " AND target->>'source' = :p"
            ),
            {"p": public_id},
        ).scalar_one()
    assert found
    assert found != "watchdog"
    return str(found)


def test_a_deleted_endpoint_is_a_finding_fix_never_recreates(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings
) -> None:
    fake = FakeStripe(_key("rk_test"))
    with serving(fake):
        made = _source(sessions, settings, fake)
        fake.endpoint_deleted = True
        code, view, _ = _check(made.name, "--json")
        assert code == 1
        assert [f["kind"] for f in view["open"]] == ["deleted"]
        code, said, _ = _check(made.name, "--fix", "--yes")
        assert code == 1
        assert "nothing --fix can do (findings: deleted)" in said
        assert fake.endpoint_requests("POST") == []
        assert all(s.method == "GET" for s in fake.seen)


# GitHub ---------------------------------------------------------------------------------------


def test_a_github_hook_turning_inactive_is_a_finding_and_fix_patches_it_once(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings, runtime: Any
) -> None:
    fake = FakeGitHub(_key("ghp"), HOOK)
    fake.events = ["issues", "push"]
    with serving(fake):
        made = _source(sessions, settings, fake, events=("issues.*", "push"))
        assert _beat(engine, runtime, made) == [made.public_id]
        assert _open(engine, made.id) == set()

        fake.active = False
        fake.last_response = {"code": 502, "status": "failed", "message": "Bad Gateway"}
        assert _beat(engine, runtime, made) == [made.public_id]
        assert _open(engine, made.id) == {"disabled"}
        [row] = _findings(engine, made.id)
        assert row.detail == "github has the hook inactive; last response: 502 failed"
        assert _gauge(made.public_id) == {"disabled": 1.0}
        _alerting(made.public_id, {"WebhookSubscriptionFinding": ["disabled"]})
        code, _, _ = _check(made.name)
        assert code == 1

        code, said, _ = _check(made.name, "--fix", "--yes")
        assert code == 0, said
        [patch] = fake.hook_requests("PATCH")
        assert patch.authorised
        assert fake.active is True
        assert _open(engine, made.id) == set()
        assert _beat(engine, runtime, made) == [made.public_id]
        assert _gauge(made.public_id) == {"disabled": 0.0}
        _alerting(made.public_id, {"WebhookSubscriptionFinding": []})

        fake.events = ["push"]  # issues no longer sent to us
        code, view, _ = _check(made.name, "--json")
        assert code == 1
        assert [f["kind"] for f in view["open"]] == ["events_missing"]
        assert view["open"][0]["detail"].startswith("routes listen for issues.*;")
    assert len(fake.hook_requests("PATCH")) == 1
    assert [a[:2] for a in _audits(engine, made.public_id)] == [
        ("finding.open", "disabled"),
        ("subscription.enable", "enabled"),
        ("finding.close", "disabled"),
        ("finding.open", "events_missing"),
    ]


# Svix -----------------------------------------------------------------------------------------


def test_a_disabled_svix_endpoint_and_its_filter_types_are_findings_fix_patches_it_once(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings, runtime: Any
) -> None:
    fake = FakeSvix(_key("sk"), "app_watch", "ep_watch")
    with serving(fake):
        made = _source(sessions, settings, fake, events=("invoice.paid",))
        assert _beat(engine, runtime, made) == [made.public_id]
        assert _open(engine, made.id) == set()  # filterTypes null: every type

        fake.disabled = True
        fake.filter_types = ["customer.created"]
        assert _beat(engine, runtime, made) == [made.public_id]
        assert _open(engine, made.id) == {"disabled", "events_missing"}
        _alerting(made.public_id, {"WebhookSubscriptionFinding": ["disabled", "events_missing"]})
        code, said, _ = _check(made.name, "--fix", "--yes")
        assert code == 1, said  # enabled again; the filter types are the operator's to fix
        assert f"re-enabled {made.public_id}'s endpoint at svix" in said
        [patch] = fake.endpoint_requests("PATCH")
        assert patch.authorised
        assert fake.disabled is False
        assert _open(engine, made.id) == {"events_missing"}

        fake.filter_types = ["invoice.paid", "customer.created"]
        code, _, _ = _check(made.name)
        assert code == 0
        fake.endpoint_deleted = True
        code, view, _ = _check(made.name, "--json")
        assert code == 1
        assert [f["kind"] for f in view["open"]] == ["deleted"]
    assert [a[:2] for a in _audits(engine, made.public_id)] == [
        ("finding.open", "disabled"),
        ("finding.open", "events_missing"),
        ("subscription.enable", "enabled"),
        ("finding.close", "disabled"),
        ("finding.close", "events_missing"),
        ("finding.open", "deleted"),
    ]


# Shopify --------------------------------------------------------------------------------------

SHOPIFY_TOPICS = ("orders/create", "orders/paid")


def _shopify_reads(fake: FakeShopify) -> list[Any]:
    return [s for s in fake.seen if s.path == "/admin/api/2025-10/webhooks.json"]


def test_a_deleted_shopify_subscription_is_a_finding_until_the_app_subscribes_again(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings, runtime: Any
) -> None:
    """Shopify deletes a subscription after 8 failed deliveries over 4 hours: beat's check
    lists the app's subscriptions (one call), a routed topic without one is a ``deleted``
    finding (gauge 1, the alert's expression true, `sources check` exit 1); subscribed again:
    closed (gauge 0, exit 0)."""
    fake = FakeShopify(_key("shpat"))
    with serving(fake):
        made = _source(sessions, settings, fake, events=SHOPIFY_TOPICS)
        for topic in SHOPIFY_TOPICS:
            fake.subscribe(topic, _url(made))
        fake.subscribe("products/update", "https://elsewhere.example.com/p")  # not routed
        assert _beat(engine, runtime, made) == [made.public_id]
        assert _open(engine, made.id) == set()

        fake.delete("orders/paid")
        assert _beat(engine, runtime, made) == [made.public_id]
        assert _open(engine, made.id) == {"deleted"}
        [row] = _findings(engine, made.id)
        assert row.detail == (
            "shopify has no subscription for orders/paid (Shopify deletes one after 8 failed"
            " deliveries over 4 hours)"
        )
        assert _gauge(made.public_id) == {"deleted": 1.0}
        _alerting(made.public_id, {"WebhookSubscriptionFinding": ["deleted"]})
        code, view, _ = _check(made.name, "--json")
        assert code == 1
        assert [(f["source"], f["kind"]) for f in view["open"]] == [(made.public_id, "deleted")]
        assert view["checked"][0]["provider_view"]["subscriptions"] == [
            {"topic": "orders/create", "address": _url(made)},
            {"topic": "products/update", "address": "https://elsewhere.example.com/p"},
        ]
        code, said, _ = _check(made.name)
        assert code == 1
        assert f"open: {made.public_id} ({made.name}) deleted since" in said
        assert len(_findings(engine, made.id)) == 1  # seen three times, opened once

        fake.subscribe("orders/paid", _url(made))
        code, view, _ = _check(made.name, "--json")
        assert code == 0
        assert view["checked"][0]["closed"] == ["deleted"]
        assert _beat(engine, runtime, made) == [made.public_id]
        assert _gauge(made.public_id) == {"deleted": 0.0}
        _alerting(made.public_id, {"WebhookSubscriptionFinding": []})
    assert _audits(engine, made.public_id) == [
        ("finding.open", "deleted", "watchdog"),
        ("finding.close", "deleted", "watchdog"),
    ]
    # Each check is one GET of the app's subscriptions with the access token; nothing else.
    reads = _shopify_reads(fake)
    assert len(reads) == len(fake.seen) == 6
    assert all(s.method == "GET" and s.authorised for s in reads)
    assert all(s.query == {"limit": ["250"]} for s in reads)


def test_a_shopify_subscription_posting_elsewhere_is_a_finding_and_fix_is_refused(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings
) -> None:
    fake = FakeShopify(_key("shpat"))
    fake.page_size = 2  # the subscriptions come in pages: the Link header is followed
    with serving(fake):
        made = _source(sessions, settings, fake, events=("orders/create", "refunds/*"))
        fake.subscribe("orders/create", "https://old-host.example.com/shopify")
        fake.subscribe("orders/updated", _url(made))
        fake.subscribe("app/uninstalled", _url(made))
        code, view, _ = _check(made.name, "--json")
        assert code == 1
        assert {f["kind"] for f in view["open"]} == {"url_mismatch", "events_missing"}
        details = {r.kind: r.detail for r in _findings(engine, made.id)}
        assert details["url_mismatch"] == (
            f"shopify posts orders/create to https://old-host.example.com/shopify, not {_url(made)}"
        )
        assert details["events_missing"] == (
            "routes listen for refunds/*; the app subscribes to app/uninstalled, orders/create,"
            " orders/updated"
        )
        assert len(_shopify_reads(fake)) == 2  # two pages of two

        asked = len(fake.seen)
        for args in (("--fix", "--yes"), ("--fix",)):
            done = cli("sources", "check", made.name, *args, env=test_env())
            assert done.returncode == 1
            assert "Traceback" not in done.stderr + done.stdout
            [line] = [x for x in done.stderr.splitlines() if x.strip()]
            assert "--fix cannot help a shopify source: Shopify has no disabled state" in line
        assert len(fake.seen) == asked  # refused before Shopify is asked anything
        assert _open(engine, made.id) == {"url_mismatch", "events_missing"}
        assert not [a for a in _audits(engine, made.public_id) if a[0] == "subscription.enable"]

        fake.delete("orders/create")
        fake.subscribe("orders/create", _url(made))
        fake.subscribe("refunds/create", _url(made))
        code, view, _ = _check(made.name, "--json")
        assert code == 0
        assert sorted(view["checked"][0]["closed"]) == ["events_missing", "url_mismatch"]


@pytest.mark.parametrize("status", [401, 403, 429, 503])
def test_a_shopify_api_that_refuses_or_fails_is_a_cannot_check_finding_without_a_traceback(
    status: int,
    engine: Engine,
    sessions: sessionmaker[Session],
    settings: Settings,
    runtime: Any,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """401 (the stored token revoked: the stand-in refuses it as Shopify does), 403, 429
    (with Retry-After), 503: a cannot_check finding naming the status, the other findings
    left as they were, one structured line, no traceback, no token anywhere."""
    fake = FakeShopify(_key("shpat"))
    with serving(fake):
        made = _source(sessions, settings, fake, events=SHOPIFY_TOPICS)
        fake.subscribe("orders/create", _url(made))
        assert _beat(engine, runtime, made) == [made.public_id]
        assert _open(engine, made.id) == {"deleted"}  # orders/paid has none

        good = fake.token
        if status == 401:
            fake.token = _key("shpat")
        else:
            fake.fail(len(fake.seen) + 1, status)
        capfd.readouterr()
        assert _beat(engine, runtime, made) == [made.public_id]
        out = capfd.readouterr()
        assert fake.seen[-1].status == status
        assert _open(engine, made.id) == {"deleted", "cannot_check"}
        detail = {r.kind: r.detail for r in _findings(engine, made.id)}["cannot_check"]
        assert f"({status})" in detail
        assert "Traceback" not in out.out + out.err
        assert "watchdog.cannot_check" in out.out + out.err
        assert good not in out.out + out.err + detail
        assert fake.token not in out.out + out.err + detail
        assert _gauge(made.public_id) == {"deleted": 1.0, "cannot_check": 1.0}
        _alerting(made.public_id, {"WebhookSubscriptionCannotCheck": ["cannot_check"]})
        code, said, err = _check(made.name)
        assert code == 1
        assert good not in said + err

        fake.token = good
        fake.subscribe("orders/paid", _url(made))
        assert _beat(engine, runtime, made) == [made.public_id]  # answered again: closed
        assert _open(engine, made.id) == set()
    assert len([r for r in _findings(engine, made.id) if r.kind == "cannot_check"]) == 1


def test_a_shopify_source_takes_an_access_token_and_a_shop_and_refuses_a_bad_one(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings
) -> None:
    made = make_source(sessions, settings, provider="shopify")
    remember(made.secret)
    token = _key("shpat")
    done = cli(
        "sources", "update", made.name, "--api-key", token, "--config", "shop=my-store",
        env=test_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert token not in done.stdout + done.stderr
    with engine.connect() as conn:
        config, sealed = conn.execute(
            text("SELECT config, reconcile_ciphertext FROM sources WHERE id = :s"),
            {"s": made.id},
        ).one()
    assert config["shop"] == "my-store.myshopify.com"
    assert sealed is not None
    assert token.encode() not in bytes(sealed)
    for config_arg, words in (
        ("shop=my-store.example.com", "option 'shop' must be NAME.myshopify.com"),
        ("hook=repos/a/b/hooks/1", "option 'hook' is not one of shopify's API options"),
    ):
        bad = cli("sources", "update", made.name, "--config", config_arg, env=test_env())
        assert bad.returncode == 1
        assert "Traceback" not in bad.stderr
        [line] = [x for x in bad.stderr.splitlines() if x.strip()]
        assert words in line, line
    with engine.connect() as conn:
        after = conn.execute(
            text("SELECT config FROM sources WHERE id = :s"), {"s": made.id}
        ).scalar_one()
    assert after == config  # nothing changed
    reconcile = cli("reconcile", made.name, env=test_env())
    assert reconcile.returncode == 1  # the token is the watchdog's: nothing is reconciled
    assert "reconciliation supports github, stripe, svix, not 'shopify'" in reconcile.stderr


# The API cannot say ---------------------------------------------------------------------------


def test_401_and_429_are_a_cannot_check_finding_and_leave_the_others_as_they_were(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings, runtime: Any
) -> None:
    fake = FakeStripe(_key("rk_test"))
    with serving(fake):
        made = _source(sessions, settings, fake)
        fake.endpoint_status = "disabled"
        assert _beat(engine, runtime, made) == [made.public_id]
        assert _open(engine, made.id) == {"disabled"}

        asked = len(fake.endpoint_requests())
        fake.endpoint_script[asked + 1] = Scripted(
            429,
            {"Retry-After": "30"},
            {"error": {"type": "rate_limit_error", "message": "scripted"}},
        )
        assert _beat(engine, runtime, made) == [made.public_id]
        assert _open(engine, made.id) == {"disabled", "cannot_check"}
        detail = {r.kind: r.detail for r in _findings(engine, made.id)}["cannot_check"]
        assert detail == "Stripe rate limited the check (429)"
        assert len(fake.endpoint_requests()) == asked + 1  # not retried: the next period is
        _alerting(
            made.public_id,
            {
                "WebhookSubscriptionFinding": ["disabled"],
                "WebhookSubscriptionCannotCheck": ["cannot_check"],
            },
        )

        good_key = fake.api_key
        fake.api_key = _key("rk_test")  # the stored key revoked at Stripe: 401
        code, view, _ = _check(made.name, "--json")
        assert code == 1
        assert {f["kind"] for f in view["open"]} == {"disabled", "cannot_check"}
        assert fake.seen[-1].status == 401
        assert good_key not in json.dumps(view)

        fake.api_key = good_key
        fake.endpoint_status = "enabled"
        code, view, _ = _check(made.name, "--json")
        assert code == 0
        assert sorted(view["checked"][0]["closed"]) == ["cannot_check", "disabled"]
    assert len([r for r in _findings(engine, made.id) if r.kind == "cannot_check"]) == 1


def test_a_hanging_api_is_cut_at_the_timeout_and_the_beat_keeps_its_period(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings, silent_port: int
) -> None:
    """The API accepts the connection and never answers: the check ends within
    WEBHOOKS_WATCH_TIMEOUT as a cannot_check finding, the task finishes (its last success
    set), and the source is not checked again before its period."""
    from tasks.runtime import build_runtime  # noqa: PLC0415
    from tasks.watchdog.schedule import run_due, watch_task  # noqa: PLC0415

    fake = FakeStripe(_key("rk_test"))
    with serving(fake):
        made = _source(sessions, settings, fake, api_base=f"http://127.0.0.1:{silent_port}")
    quick = settings.model_copy(update={"watch_timeout": timedelta(seconds=1)})
    rt = build_runtime(quick, worker="watchdog-hang-test")
    try:
        _only_due(engine, made.id)
        started = time.monotonic()
        assert watch_task(lambda: rt) == 1
        took = time.monotonic() - started
        assert 1.0 <= took < 5.0
        assert _open(engine, made.id) == {"cannot_check"}
        [row] = _findings(engine, made.id)
        assert row.detail == f"Stripe API at http://127.0.0.1:{silent_port} did not answer in time"
        last = [
            s.value
            for f in metrics.JOB_LAST_SUCCESS.collect()
            for s in f.samples
            if s.labels["job"] == "watchdog"
        ]
        assert last
        assert last[0] >= time.time() - 60
        assert watch_task(lambda: rt) == 0  # its period has not passed: not asked again
        with engine.begin() as conn:
            conn.execute(
                text(
                    "UPDATE sources SET watched_at = now() - :every - interval '1 second'"
                    " WHERE id = :s"
                ),
                {"every": quick.watch_every, "s": made.id},
            )
        assert watch_task(lambda: rt) == 1  # the next period
        # Two sources due, both hanging: a tick past its budget claims no new one; the
        # other stays due, for the next tick.
        with serving(fake):
            second = _source(sessions, settings, fake, api_base=f"http://127.0.0.1:{silent_port}")
        with engine.begin() as conn:
            conn.execute(
                text(
                    "UPDATE sources SET watched_at = CASE WHEN id = ANY(:both) THEN NULL"
                    " ELSE now() END"
                ),
                {"both": [made.id, second.id]},
            )
        started = time.monotonic()
        first = run_due(rt, budget=0.5)
        assert len(first) == 1
        assert time.monotonic() - started < 4.0
        assert run_due(rt, budget=0.5) == [
            next(iter({made.public_id, second.public_id} - set(first)))
        ]
        assert run_due(rt, budget=0.5) == []
    finally:
        rt.close()
    assert len(_findings(engine, made.id)) == 1
    assert _open(engine, second.id) == {"cannot_check"}


@pytest.mark.parametrize("status", [401, 403, 429, 503])
def test_a_github_api_that_refuses_or_fails_is_a_cannot_check_finding_without_a_traceback(
    status: int,
    engine: Engine,
    sessions: sessionmaker[Session],
    settings: Settings,
    runtime: Any,
    capfd: pytest.CaptureFixture[str],
) -> None:
    fake = FakeGitHub(_key("ghp"), HOOK)
    with serving(fake):
        made = _source(sessions, settings, fake)
        fake.fail(len(fake.seen) + 1, status)
        capfd.readouterr()
        assert _beat(engine, runtime, made) == [made.public_id]
        out = capfd.readouterr()
        assert _open(engine, made.id) == {"cannot_check"}
        [row] = _findings(engine, made.id)
        assert f"({status})" in row.detail
        assert "Traceback" not in out.out + out.err
        assert "watchdog.cannot_check" in out.out + out.err
        assert fake.token not in out.out + out.err + row.detail
        assert _gauge(made.public_id) == {"cannot_check": 1.0}
        _alerting(made.public_id, {"WebhookSubscriptionCannotCheck": ["cannot_check"]})
        assert _beat(engine, runtime, made) == [made.public_id]  # answered again: closed
        assert _open(engine, made.id) == set()


def test_racing_checks_open_a_finding_once_and_close_it_once(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings
) -> None:
    """Eight checks at once on real Postgres: one open row, one audit row; then eight
    closes: one close, one audit row."""
    import threading  # noqa: PLC0415

    from models.findings import record  # noqa: PLC0415

    made = make_source(sessions, settings, provider="stripe")
    barrier = threading.Barrier(8)
    found = [judge.Finding("disabled", "stripe has the endpoint disabled")]

    def one(findings: list[judge.Finding]) -> None:
        with sessions() as session, session.begin():
            session.execute(text("SELECT 1"))
            barrier.wait()
            record(session, made.id, made.public_id, findings, answered=True, via="beat")

    for findings in (found, []):
        threads = [threading.Thread(target=one, args=(findings,)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    [row] = _findings(engine, made.id)
    assert row.closed_at is not None
    assert _audits(engine, made.public_id) == [
        ("finding.open", "disabled", "watchdog"),
        ("finding.close", "disabled", "watchdog"),
    ]


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A loopback port whose connections the kernel accepts and nobody ever answers."""
    import socket  # noqa: PLC0415

    server = socket.create_server(("127.0.0.1", 0), backlog=16)
    try:
        yield int(server.getsockname()[1])
    finally:
        server.close()


# Bad input ------------------------------------------------------------------------------------


def test_bad_watchdog_input_is_one_clear_line_and_changes_nothing(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings
) -> None:
    other = make_source(sessions, settings, provider="standard")
    bare = make_source(sessions, settings, provider="stripe")  # no API credential
    for args, words in (
        (("sources", "check", "no-such-source"), "no-such-source"),
        (("sources", "check", bare.name), "is not watched: it has no API credential"),
        (("sources", "check", "--fix"), "--fix needs one SOURCE"),
        (
            ("sources", "check", other.name),
            "the watchdog reads stripe, github, svix, shopify endpoints",
        ),
    ):
        done = cli(*args, env=test_env())
        assert done.returncode == 1, args
        assert "Traceback" not in done.stderr
        [line] = [x for x in done.stderr.splitlines() if x.strip()]
        assert words in line, line
    assert _findings(engine, other.id) == []
    assert _findings(engine, bare.id) == []  # nothing recorded: no finding, no alert


# The judgement (pure) -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("provider", "glob", "events", "covered"),
    [
        ("stripe", "invoice.paid", ["*"], True),
        ("stripe", "invoice.paid", ["invoice.paid"], True),
        ("stripe", "invoice.paid", ["invoice.created"], False),
        ("stripe", "invoice.*", ["invoice.created"], True),
        ("stripe", "invoice.*", ["customer.created"], False),
        ("stripe", "*", ["customer.created"], True),
        ("stripe", "*", [], False),
        ("github", "issues.opened", ["issues"], True),
        ("github", "issues.*", ["push"], False),
        ("github", "push", ["push"], True),
        ("github", "pull_*", ["pull_request"], True),
        ("github", "*", ["*"], True),
    ],
)
def test_a_route_glob_is_covered_by_the_subscribed_types(
    provider: str, glob: str, events: list[str], covered: bool
) -> None:
    assert judge.covered(provider, glob, events) is covered


@pytest.mark.parametrize(
    ("globs", "subs", "kinds"),
    [
        (["orders/create"], [("orders/create", "https://h/w")], set()),
        (["orders/create"], [("orders/paid", "https://h/w")], {"deleted"}),
        (["orders/*"], [("orders/paid", "https://h/w")], set()),
        (["orders/*"], [("carts/create", "https://h/w")], {"events_missing"}),
        (["orders/*"], [], {"deleted"}),
        (["*"], [], {"deleted"}),
        (["orders/create"], [("orders/create", "https://x/y")], {"url_mismatch"}),
        # One subscription of the topic posts to us: the other one is someone else's.
        (["orders/create"], [("orders/create", "https://x/y"), ("orders/create", "https://h/w/")],
         set()),
        ([], [], set()),
    ],
)  # fmt: skip
def test_shopify_subscriptions_are_judged_per_routed_topic(
    globs: list[str], subs: list[tuple[str, str]], kinds: set[str]
) -> None:
    view = judge.View("enabled", None, tuple(t for t, _ in subs), subscriptions=tuple(subs))
    assert {f.kind for f in judge.judge("shopify", view, "https://h/w", globs)} == kinds


def test_the_expected_url_is_the_option_else_the_public_base() -> None:
    assert (
        judge.expected_url({"endpoint_url": "https://a/x"}, "https://b", "src_1") == "https://a/x"
    )
    assert judge.expected_url({}, "https://b/", "src_1") == "https://b/webhooks/src_1"
    assert judge.expected_url({}, None, "src_1") is None
    view = judge.View("enabled", "https://elsewhere/", ("*",))
    assert judge.judge("stripe", view, None, ["*"]) == []  # no URL known: not compared


# What each provider's reader makes of an answer that says nothing of the endpoint ----------

_BASE = "http://127.0.0.1:{port}"
_REFUSALS = [
    ("github", 401, {}, "GitHub refused the token (401): it needs admin:repo_hook"),
    ("github", 403, {}, "GitHub refused the token (403): it needs admin:repo_hook"),
    ("github", 403, {"x-ratelimit-remaining": "0"}, "GitHub rate limited the check (403)"),
    ("github", 429, {}, "GitHub rate limited the check (429)"),
    ("github", 500, {}, "GitHub API error (500)"),
    ("svix", 401, {}, "Svix refused the API token (401)"),
    ("svix", 429, {}, "Svix rate limited the check (429)"),
    ("svix", 502, {}, "Svix API error (502)"),
    ("shopify", 403, {}, "Shopify refused the access token (403): set the app's Admin API"),
    ("shopify", 404, {}, "Shopify API at {base} has no such shop or API version (404)"),
    ("shopify", 429, {}, "Shopify rate limited the check (429)"),
    ("shopify", 503, {}, "Shopify API error (503)"),
]


@pytest.mark.parametrize(("provider", "status", "headers", "said"), _REFUSALS)
def test_each_readers_refusals_are_cannot_check_with_the_status_and_one_line(
    provider: str, status: int, headers: dict[str, str], said: str
) -> None:
    """GitHub's, Svix's and Shopify's readers share one mapping of an answer that says
    nothing (401/403, 429, other errors; GitHub's 403 with no rate left is a rate limit):
    CannotCheck with the status and a line that names the provider, never the API's body."""

    class Answers(Quiet):
        def do_GET(self) -> None:
            body = b'{"message": "secret-looking API text"}'
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = Loopback(Answers)
    base = _BASE.format(port=server.port)
    reader = {
        "github": lambda: endpoints.github_view("t", base, "repos/o/r/hooks/1", **_OPEN),
        "svix": lambda: endpoints.svix_view("t", base, "app_1/ep_1", **_OPEN),
        "shopify": lambda: endpoints.shopify_view("t", base, "s.myshopify.com", **_OPEN),
    }[provider]
    try:
        with pytest.raises(endpoints.CannotCheck) as caught:
            reader()
    finally:
        server.close()
    assert caught.value.status == status
    assert str(caught.value).startswith(said.format(base=base)), str(caught.value)
    assert "secret-looking" not in str(caught.value)


_OPEN: dict[str, Any] = {"allow_private": True, "timeout": 5.0}
