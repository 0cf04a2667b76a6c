"""Reconciliation (issue 22): the real ``webhooks`` CLI against a local fake of Stripe's API
(the ``stripe`` library pointed at ``api_base``), real Postgres, and the real receiver for
deduplication both ways."""

from __future__ import annotations

import json
import time
import uuid
from contextlib import ExitStack
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core.crypto import SecretBox
from core.settings import Settings
from tasks.reconcile.paging import (
    MAX_RECONNECTS,
    MAX_WAIT,
    MAX_WAITS,
    ApiError,
    Page,
    ProviderEvent,
    RateLimited,
    Unreachable,
    walk,
)
from tasks.reconcile.run import accept_recovered, load_target
from tests.conftest import free_port, test_env
from tests.factories import MadeSource, accept_event, make_source
from tests.fake_providers import FakeGitHub, FakeStripe, FakeSvix, serving
from tests.handlers_for_tests import EFFECTS_DDL
from tests.leakcheck import remember
from tests.operators_support import cli
from tests.processes import receiver
from tests.signing import new_secret, sign_github, sign_stripe, sign_svix
from tests.workers import BROKER_URL, CLAIMS_URL, flush_redis, running_worker, wait_for


def _key() -> str:
    key = f"rk_test_{uuid.uuid4().hex}"
    remember(key)
    return key


def _stripe_source(
    sessions: sessionmaker[Session], settings: Settings, fake: FakeStripe | None
) -> MadeSource:
    made = make_source(sessions, settings, provider="stripe", routes=[{"handler": "log"}])
    remember(made.secret)
    if fake is not None:
        done = cli(
            "sources", "update", made.name, "--api-key", fake.api_key,
            "--config", f"api_base={fake.url}", "--config", f"endpoint_id={fake.endpoint_id}",
            env=test_env(),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert fake.api_key not in done.stdout + done.stderr
        assert f"reconcile: api {fake.url}, key set, every off" in done.stdout
    return made


def _receipts(engine: Engine, source_id: int) -> dict[str, Any]:
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT r.event_id, r.arrived_via, r.body_digest IS NULL AS no_digest,"
                " r.payload, (SELECT count(*) FROM deliveries d WHERE d.receipt_id = r.id"
                " AND d.expires_at = r.expires_at) AS deliveries"
                " FROM receipts r WHERE r.source_id = :s"
            ),
            {"s": source_id},
        )
        return {r.event_id: r for r in rows}


def _conflicts(engine: Engine, source_id: int) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                text("SELECT count(*) FROM conflicts WHERE source_id = :s"), {"s": source_id}
            ).scalar_one()
        )


def _reconcile(source: str, *args: str) -> tuple[int, dict[str, Any], str]:
    done = cli("reconcile", source, "--json", *args, env=test_env(), timeout=120)
    view = json.loads(done.stdout) if done.stdout.strip() else {}
    return done.returncode, view, done.stderr


def test_reconcile_finds_exactly_the_missing_stripe_events_and_recovers_each_once(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings
) -> None:
    """12 events over 3 pages, 5 of them received as webhooks: a dry run lists the other 7
    and writes nothing; a run accepts each of the 7 once (deliveries, arrived_via reconcile,
    no digest) while waiting out a 429 as its Retry-After says; a second run finds nothing."""
    fake = FakeStripe(_key(), page_size=5, enabled_events=("invoice.paid", "customer.*"))
    with serving(fake):
        source = _stripe_source(sessions, settings, fake)
        now = int(time.time())
        ids = [f"evt_{uuid.uuid4().hex[:20]}" for _ in range(12)]
        for n, event_id in enumerate(ids):
            fake.add_event(event_id, now - 60 * (n + 1))
        # A type the endpoint does not subscribe to was never sent: never missing.
        fake.add_event(f"evt_{uuid.uuid4().hex[:20]}", now - 90, "charge.refunded")
        received = [*ids[::3][:4], ids[-1]]
        for event_id in received:
            accept_event(settings, source, event_id=event_id, event_type="invoice.paid")
        missing = sorted(set(ids) - set(received))
        before = _receipts(engine, source.id)

        code, view, err = _reconcile(source.name, "--dry-run")
        assert code == 0, err
        assert sorted(m["event_id"] for m in view["missing"]) == missing
        assert view["listed"] == 12
        assert view["pages"] == 3  # 13 events, 5 a page
        assert view["recovered"] == 0
        assert _receipts(engine, source.id).keys() == before.keys()

        fake.fail(len(fake.events_requests()) + 2, 429, {"Retry-After": "1"})
        code, view, err = _reconcile(source.public_id)
        assert code == 0, err
        assert sorted(m["event_id"] for m in view["missing"]) == missing
        assert view["recovered"] == 7
        assert view["rate_limited_waits"] == [1.0]
        requests = fake.events_requests()
        limited = next(i for i, s in enumerate(requests) if s.status == 429)
        assert requests[limited + 1].at - requests[limited].at >= 1.0
        assert requests[limited + 1].query == requests[limited].query  # the same page again

        rows = _receipts(engine, source.id)
        assert sorted(rows) == sorted(ids)
        for event_id in missing:
            assert rows[event_id].arrived_via == "reconcile"
            assert rows[event_id].no_digest
            assert rows[event_id].deliveries == 1
            assert json.loads(rows[event_id].payload)["id"] == event_id
        for event_id in received:
            assert rows[event_id].arrived_via == "webhook"
            assert not rows[event_id].no_digest
        shown = cli("events", "show", missing[0], "--source", source.public_id, env=test_env())
        assert shown.returncode == 0, shown.stderr
        assert [ln.split() for ln in shown.stdout.splitlines() if ln.startswith("via:")] == [
            ["via:", "reconcile"]
        ]

        code, view, err = _reconcile(source.name)
        assert code == 0, err
        assert view["missing"] == []
        assert view["recovered"] == 0
        after = _receipts(engine, source.id)
        assert {k: v.deliveries for k, v in after.items()} == dict.fromkeys(ids, 1)


def test_a_webhook_after_reconciliation_is_a_duplicate_and_so_is_the_reverse(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings
) -> None:
    fake = FakeStripe(_key())
    with serving(fake):
        source = _stripe_source(sessions, settings, fake)
        recovered_id = f"evt_{uuid.uuid4().hex[:20]}"
        created = int(time.time()) - 30
        fake.add_event(recovered_id, created)
        code, view, err = _reconcile(source.name)
        assert code == 0, err
        assert view["recovered"] == 1

        with receiver() as running:
            # Stripe's own body of the event: other bytes than the API's object.
            headers, body = sign_stripe(
                source.secret, event_id=recovered_id, event_type="invoice.paid", timestamp=created
            )
            answer = httpx.post(
                f"{running.url}/webhooks/{source.public_id}", headers=headers, content=body
            )
        assert answer.status_code == 200, answer.text
        assert answer.json()["status"] == "duplicate"

    # The reverse: the webhook arrives between the comparison and the recovery.
    webhook_id = f"evt_{uuid.uuid4().hex[:20]}"
    accept_event(settings, source, event_id=webhook_id, event_type="invoice.paid")
    box = SecretBox(settings.secret_key.get_secret_value())
    with sessions() as session:
        target = load_target(session, box, settings, source.public_id)
    event = ProviderEvent(
        webhook_id, "invoice.paid", datetime.now(UTC), b'{"id": "%s"}' % webhook_id.encode()
    )
    with psycopg.connect(settings.psycopg_dsn) as conn:
        assert accept_recovered(conn, settings, target, event) == ("duplicate", ())

    rows = _receipts(engine, source.id)
    assert {k: (v.arrived_via, v.deliveries) for k, v in rows.items()} == {
        recovered_id: ("reconcile", 1),
        webhook_id: ("webhook", 1),
    }
    assert _conflicts(engine, source.id) == 0


def test_a_500_stops_the_listing_keeps_what_came_before_and_exits_non_zero(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings
) -> None:
    fake = FakeStripe(_key(), page_size=2)
    with serving(fake):
        source = _stripe_source(sessions, settings, fake)
        now = int(time.time())
        ids = [f"evt_{uuid.uuid4().hex[:20]}" for _ in range(5)]
        for n, event_id in enumerate(ids):
            fake.add_event(event_id, now - 10 * (n + 1))
        fake.fail(2, 500)
        code, view, _ = _reconcile(source.name)
        assert code == 1
        assert view["error"] == "Stripe API error 500"
        assert view["pages"] == 1
        assert sorted(m["event_id"] for m in view["missing"]) == sorted(ids[:2])  # newest page
        assert view["recovered"] == 2
        human = cli("reconcile", source.name, "--max-pages", "1", env=test_env())
        assert human.returncode == 0, human.stderr
        assert "stopped after --max-pages pages with more to list" in human.stdout
        code, view, err = _reconcile(source.name)
        assert code == 0, err
        assert view["recovered"] == 3
    assert sorted(_receipts(engine, source.id)) == sorted(ids)


def test_bad_input_is_one_clear_line_and_changes_nothing(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings
) -> None:
    source = _stripe_source(sessions, settings, None)
    env = test_env()

    no_key = cli("reconcile", source.name, env=env)
    assert no_key.returncode == 1
    lines = no_key.stderr.strip().splitlines()
    assert len(lines) == 1, no_key.stderr
    assert "has no reconciliation credential" in lines[0]
    assert f"webhooks sources update {source.name} --api-key KEY" in lines[0]

    key = _key()
    refused = cli(
        "sources", "update", source.name, "--api-key", key,
        "--config", "api_base=http://api.example.com", env=env,
    )  # fmt: skip
    assert refused.returncode == 1
    assert "plain http is allowed only to loopback" in refused.stderr
    assert key not in refused.stdout + refused.stderr
    shown = json.loads(cli("sources", "show", source.name, "--json", env=env).stdout)
    assert shown["config"] == {}
    assert shown["reconcile"]["api_key"] == "not set"  # nothing changed, not even the key
    assert shown["reconcile"]["api_base"] == "https://api.stripe.com"

    for config, says in (
        ("api_base=ftp://127.0.0.1/", "must be an https:// URL"),
        ("api_base=https://user:pw@api.stripe.com", "must not carry credentials"),
    ):
        bad = cli("sources", "update", source.name, "--config", config, env=env)
        assert bad.returncode == 1
        assert says in bad.stderr

    ok = cli("sources", "update", source.name, "--api-key", "-", env=env, input_text=key + "\n")
    assert ok.returncode == 0, ok.stderr
    no_endpoint = cli("reconcile", source.name, env=env)
    assert no_endpoint.returncode == 1
    assert "names no Stripe webhook endpoint" in no_endpoint.stderr
    assert "--config endpoint_id=we_..." in no_endpoint.stderr
    long = cli("reconcile", source.name, "--since", "30d", env=env)
    assert long.returncode == 1
    assert "reaches past source" in long.stderr
    assert "dedup TTL" in long.stderr
    for args in (("sources", "show", source.name), ("sources", "show", source.name, "--json")):
        out = cli(*args, env=env)
        assert key not in out.stdout + out.stderr
        assert "key set" in out.stdout or '"api_key": "set"' in out.stdout

    shopify = make_source(sessions, settings, provider="shopify")
    remember(shopify.secret)
    other = cli("reconcile", shopify.name, env=env)
    assert other.returncode == 1
    assert "reconciliation supports github, stripe, svix, not 'shopify'" in other.stderr
    standard = make_source(sessions, settings, provider="standard")
    remember(standard.secret)
    option = cli("sources", "update", standard.name, "--config", "api_base=https://x.io", env=env)
    assert option.returncode == 1
    assert "option 'api_base' is for reconciliation" in option.stderr
    with engine.connect() as conn:
        stored = conn.execute(
            text("SELECT reconcile_ciphertext FROM sources WHERE id = :s"), {"s": source.id}
        ).scalar_one()
    assert key.encode() not in bytes(stored)  # encrypted at rest

    other_key = _key()
    signing_secret = new_secret("stripe")  # given, so never printed (a generated one is)
    remember(signing_secret)
    added = cli(
        "sources", "add", f"rec-{uuid.uuid4().hex[:8]}", "--provider", "stripe",
        "--secret", signing_secret,
        "--api-key", other_key, "--config", "endpoint_id=we_1Added",
        "--config", "api_base=http://127.0.0.1:9", "--reconcile-every", "off", "--json", env=env,
    )  # fmt: skip
    assert added.returncode == 0, added.stderr
    assert other_key not in added.stdout + added.stderr
    assert signing_secret not in added.stdout + added.stderr
    assert json.loads(added.stdout)["reconcile"] == {
        "supported": True,
        "api_base": "http://127.0.0.1:9",
        "api_key": "set",
        "every": "off",
        "last_run": None,
    }
    refused = cli(
        "sources", "add", f"rec-{uuid.uuid4().hex[:8]}", "--provider", "standard",
        "--api-key", other_key, env=env,
    )  # fmt: skip
    assert refused.returncode == 1
    assert "--api-key: a provider API credential is for reconciliation (github, stripe, svix)" in (
        refused.stderr
    )
    assert "not 'standard'" in refused.stderr


# The page walk's bounds (pure, with an injected sleep) ----------------------------------------


def _pages(script: list[Any]) -> Any:
    calls: list[str | None] = []

    def fetch(cursor: str | None) -> Page:
        calls.append(cursor)
        step = script.pop(0)
        if isinstance(step, Exception):
            raise step
        return step

    return fetch, calls


def _event(n: int) -> ProviderEvent:
    return ProviderEvent(f"evt_{n}", "t", datetime.now(UTC) - timedelta(minutes=n))


def test_walk_honours_retry_after_up_to_a_cap_and_a_bounded_number_of_times() -> None:
    slept: list[float] = []
    fetch, calls = _pages(
        [
            RateLimited(3.0),
            Page([_event(1)], "evt_1"),
            RateLimited(3600.0),
            RateLimited(None),
            Page([_event(2)], None),
        ]
    )
    listing = walk(fetch, max_pages=10, sleep=slept.append)
    assert slept == [3.0, MAX_WAIT, 8.0]  # as said; capped; none said: 2 s x 2^(waits so far)
    assert calls == [None, None, "evt_1", "evt_1", "evt_1"]
    assert [e.event_id for e in listing.events] == ["evt_1", "evt_2"]
    assert listing.error is None

    slept.clear()
    fetch, _ = _pages([RateLimited(0.5)] * (MAX_WAITS + 1))
    listing = walk(fetch, max_pages=10, sleep=slept.append)
    assert len(slept) == MAX_WAITS
    assert listing.error is not None
    assert listing.error.status == 429


def test_walk_tries_a_dropped_connection_again_a_bounded_number_of_times() -> None:
    """A connection refused or reset before an answer is tried again (the same page) after
    0.5, 1, 2 s, at most MAX_RECONNECTS times a run; an API error with no status that is not
    a dropped connection still stops the walk at once."""
    slept: list[float] = []
    fetch, calls = _pages(
        [
            Unreachable("Stripe API at x did not answer"),
            Page([_event(1)], "evt_1"),
            Unreachable("Stripe API at x did not answer"),
            Unreachable("Stripe API at x did not answer"),
            Page([_event(2)], None),
        ]
    )
    listing = walk(fetch, max_pages=10, sleep=slept.append)
    assert slept == [0.5, 1.0, 2.0]
    assert listing.reconnects == [0.5, 1.0, 2.0]
    assert calls == [None, None, "evt_1", "evt_1", "evt_1"]
    assert [e.event_id for e in listing.events] == ["evt_1", "evt_2"]
    assert listing.error is None

    slept.clear()
    fetch, calls = _pages([Unreachable("Stripe API at x did not answer")] * (MAX_RECONNECTS + 1))
    listing = walk(fetch, max_pages=10, sleep=slept.append)
    assert len(slept) == MAX_RECONNECTS
    assert len(calls) == MAX_RECONNECTS + 1
    assert isinstance(listing.error, Unreachable)
    assert listing.error.status is None

    fetch, calls = _pages([ApiError(None, "Stripe endpoint we_x subscribes to no event")])
    listing = walk(fetch, max_pages=10, sleep=pytest.fail)
    assert len(calls) == 1
    assert str(listing.error) == "Stripe endpoint we_x subscribes to no event"


def test_each_provider_reports_a_refused_connection_as_unreachable_and_a_500_as_an_error() -> None:
    """Nothing listens on the port: Unreachable (tried again by walk) for each provider's
    listing; an answer, even a 500, is an ApiError with its status (never tried again)."""
    from tasks.reconcile.github_api import deliveries_fetcher  # noqa: PLC0415
    from tasks.reconcile.stripe_api import events_fetcher  # noqa: PLC0415
    from tasks.reconcile.svix_api import messages_fetcher  # noqa: PLC0415

    since = datetime.now(UTC) - timedelta(hours=1)
    nobody = f"http://127.0.0.1:{free_port()}"
    fetchers = [
        events_fetcher("rk_test_x", nobody, since, "we_1Recon"),
        deliveries_fetcher("ghp_x", nobody, "repos/o/r/hooks/1", since),
        messages_fetcher("sk_x", nobody, "app_x", since),
    ]
    for fetch in fetchers:
        with pytest.raises(Unreachable) as refused:
            fetch(None)
        assert refused.value.status is None
        assert "did not answer" in str(refused.value)

    fake = FakeStripe(_key())
    fake.fail(1, 500)
    with serving(fake):
        fetch = events_fetcher(fake.api_key, fake.url, since, fake.endpoint_id)
        with pytest.raises(ApiError) as failed:
            fetch(None)
    assert not isinstance(failed.value, Unreachable)
    assert failed.value.status == 500


def test_walk_stops_after_max_pages_and_on_an_api_error() -> None:
    fetch, calls = _pages([Page([_event(n)], f"evt_{n}") for n in range(5)])
    listing = walk(fetch, max_pages=3, sleep=pytest.fail)
    assert listing.truncated
    assert listing.pages == 3
    assert len(calls) == 3

    fetch, _ = _pages([Page([_event(1)], "evt_1"), ApiError(503, "Stripe API error 503")])
    listing = walk(fetch, max_pages=3, sleep=pytest.fail)
    assert not listing.truncated
    assert [e.event_id for e in listing.events] == ["evt_1"]
    assert str(listing.error) == "Stripe API error 503"


# GitHub: redelivery through the hook deliveries API -------------------------------------------


def test_github_redelivers_exactly_the_failed_deliveries_without_a_receipt(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings
) -> None:
    """Six deliveries over three pages: two OK (received), one failed that we received all
    the same (GitHub timed out on our answer), one guid failed twice, two failed once, and one
    older than the window. Only the three failed guids without a receipt are redelivered, each
    once, its latest attempt; the signed webhooks then arrive at the real receiver; a second
    run asks nothing."""
    hook = "repos/octo/hello/hooks/42"
    fake = FakeGitHub(_key(), hook, page_size=2)
    source = make_source(sessions, settings, provider="github", routes=[{"handler": "log"}])
    remember(source.secret)
    now = datetime.now(UTC)
    guid = [str(uuid.uuid4()) for _ in range(7)]
    with serving(fake), receiver() as running:

        def redeliver(delivery: dict[str, Any]) -> None:
            headers, body = sign_github(
                source.secret, event_id=delivery["guid"], event_type="issues.opened"
            )
            answer = httpx.post(
                f"{running.url}/webhooks/{source.public_id}", headers=headers, content=body
            )
            assert answer.status_code == 202, answer.text

        fake.on_redeliver = redeliver
        for n in (0, 1):
            fake.add_delivery(guid[n], now - timedelta(minutes=50 + n), status_code=200)
            accept_event(settings, source, event_id=guid[n], event_type="issues.opened")
        fake.add_delivery(guid[2], now - timedelta(minutes=40), status_code=504)
        accept_event(settings, source, event_id=guid[2], event_type="issues.opened")
        fake.add_delivery(guid[3], now - timedelta(minutes=30), status_code=503)
        latest = fake.add_delivery(guid[3], now - timedelta(minutes=20), status_code=503)
        fourth = fake.add_delivery(guid[4], now - timedelta(minutes=10), status_code=401)
        fifth = fake.add_delivery(guid[5], now - timedelta(minutes=5), status_code=0)
        fake.add_delivery(guid[6], now - timedelta(days=2), status_code=503)

        keyed = cli("sources", "update", source.name, "--api-key", fake.token, env=test_env())
        assert keyed.returncode == 0, keyed.stderr
        code, _, err = _reconcile(source.name)
        assert code == 1
        assert "names no hook" in err
        done = cli(
            "sources", "update", source.name, "--config", f"api_base={fake.url}",
            "--config", f"hook={hook}", env=test_env(),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr

        code, view, err = _reconcile(source.name, "--since", "1d", "--dry-run")
        assert code == 0, err
        assert sorted(m["event_id"] for m in view["missing"]) == sorted(guid[3:6])
        assert fake.attempts() == []

        fake.fail(len(fake.seen) + 5, 429, {"Retry-After": "1"})  # the first redelivery
        code, view, err = _reconcile(source.name, "--since", "1d")
        assert code == 0, err
        assert view["recovered"] == 3
        assert view["rate_limited_waits"] == [1.0]
        assert sorted(fake.attempts()) == sorted(
            f"/{hook}/deliveries/{i}/attempts" for i in (latest, fourth, fifth)
        )

        code, view, err = _reconcile(source.name, "--since", "1d")
        assert code == 0, err
        assert view["missing"] == []
        assert len(fake.attempts()) == 3
    rows = _receipts(engine, source.id)
    assert sorted(rows) == sorted(guid[:6])
    assert {rows[g].arrived_via for g in guid[3:6]} == {"webhook"}  # the real signed webhook
    assert all(rows[g].deliveries == 1 for g in guid[:6])


# Svix: recover for the window -------------------------------------------------------------


def test_svix_recovers_the_window_once_and_the_resent_messages_arrive(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings
) -> None:
    fake = FakeSvix(f"sk_{uuid.uuid4().hex}", "app_2Q", "ep_7X", page_size=2)
    remember(fake.token)
    source = make_source(sessions, settings, provider="svix", routes=[{"handler": "log"}])
    remember(source.secret)
    now = datetime.now(UTC)
    ids = [f"msg_{uuid.uuid4().hex[:24]}" for _ in range(5)]
    with serving(fake), receiver() as running:
        answers: list[int] = []

        def resend(message: dict[str, Any]) -> None:
            headers, body = sign_svix(source.secret, event_id=message["id"])
            answer = httpx.post(
                f"{running.url}/webhooks/{source.public_id}", headers=headers, content=body
            )
            answers.append(answer.status_code)

        fake.on_recover = resend
        for n, msg_id in enumerate(ids):
            fake.add_message(msg_id, now - timedelta(minutes=10 * (n + 1)), failed=n in (1, 2, 4))
        for msg_id in (ids[0], ids[3], ids[4]):  # ids[4] failed at Svix, but reached us
            accept_event(settings, source, event_id=msg_id, event_type="invoice.paid")
        done = cli(
            "sources", "update", source.name, "--api-key", fake.token,
            "--config", f"api_base={fake.url}", "--config", "app_id=app_2Q",
            "--config", "endpoint_id=ep_7X", env=test_env(),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr

        code, view, err = _reconcile(source.name, "--dry-run")
        assert code == 0, err
        assert sorted(m["event_id"] for m in view["missing"]) == sorted(ids[1:3])
        assert view["pages"] == 3
        assert fake.recovers == []

        code, view, err = _reconcile(source.name)
        assert code == 0, err
        assert view["recovered"] == 2
        assert len(fake.recovers) == 1
        assert _when_z(fake.recovers[0]["since"]) == _when_z(view["since"])
        assert sorted(answers) == [200, 202, 202]  # ids[4] resent: a duplicate

        code, view, err = _reconcile(source.name)
        assert code == 0, err
        assert view["missing"] == []
        assert len(fake.recovers) == 1

        fake.fail(len(fake.seen) + 1, 500)
        code, view, _ = _reconcile(source.name)
        assert code == 1
        assert view["error"] == "Svix API error 500"
    rows = _receipts(engine, source.id)
    assert sorted(rows) == sorted(ids)
    assert all(r.deliveries == 1 for r in rows.values())


def _when_z(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).replace(microsecond=0)


# Beat's schedule ---------------------------------------------------------------------------


def test_beat_reconciles_each_due_source_once_a_period_and_leaves_fresh_events_to_webhooks(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings
) -> None:
    """The task's body on a worker's runtime (real Postgres, the fake API): only a source with
    --reconcile-every and a credential is claimed, once per period on the database's clock;
    an event created within the settle time is not recovered (its webhook is in flight)."""
    from core.messages import MAINTENANCE_QUEUE, RECONCILE_TASK  # noqa: PLC0415
    from tasks.config import celery_config  # noqa: PLC0415
    from tasks.reconcile.schedule import SETTLE, run_due  # noqa: PLC0415
    from tasks.runtime import build_runtime  # noqa: PLC0415

    conf = celery_config(settings)
    assert conf["beat_schedule"]["reconcile"]["task"] == RECONCILE_TASK
    assert conf["task_routes"][RECONCILE_TASK]["queue"] == MAINTENANCE_QUEUE

    fake = FakeStripe(_key())
    with serving(fake):
        scheduled = _stripe_source(sessions, settings, fake)
        unscheduled = _stripe_source(sessions, settings, fake)
        keyless = _stripe_source(sessions, settings, None)
        for made in (scheduled, keyless):
            done = cli("sources", "update", made.name, "--reconcile-every", "1h", env=test_env())
            assert done.returncode == 0, done.stderr
            warned = "warning: no reconciliation credential: beat skips" in done.stdout
            assert warned == (made is keyless)
        too_often = cli(
            "sources", "update", scheduled.name, "--reconcile-every", "10s", env=test_env()
        )
        assert too_often.returncode == 1
        assert "at least 1m" in too_often.stderr
        now = int(time.time())
        old, fresh = f"evt_{uuid.uuid4().hex[:20]}", f"evt_{uuid.uuid4().hex[:20]}"
        fake.add_event(old, now - 3600)
        fake.add_event(fresh, now - int(SETTLE.total_seconds()) // 2)

        rt = build_runtime(settings, worker="reconcile-test")
        try:
            assert run_due(rt) == [scheduled.public_id]
            assert run_due(rt) == []  # the period has not passed
            with engine.begin() as conn:  # the last run two hours ago
                conn.execute(
                    text(
                        "UPDATE sources SET reconciled_at = now() - interval '2 hours'"
                        " WHERE id = :s"
                    ),
                    {"s": scheduled.id},
                )
            assert run_due(rt) == [scheduled.public_id]
        finally:
            rt.close()
        assert {s.path for s in fake.seen} == {
            "/v1/events",
            f"/v1/webhook_endpoints/{fake.endpoint_id}",
        }
        assert len(fake.events_requests()) == 2
    rows = _receipts(engine, scheduled.id)
    assert {k: v.arrived_via for k, v in rows.items()} == {old: "reconcile"}
    assert _receipts(engine, unscheduled.id) == {}
    shown = json.loads(cli("sources", "show", scheduled.name, "--json", env=test_env()).stdout)
    assert shown["reconcile"]["every"] == "1h"
    assert shown["reconcile"]["last_run"] is not None


def test_a_scheduled_run_survives_connections_reset_before_an_answer(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings
) -> None:
    """The provider resets the run's first connection (the endpoint's request) and the first
    one of the events list: the run tries each again after its wait (injected, none slept)
    and recovers the missing event once, instead of failing until its next period."""
    from tasks.reconcile.schedule import run_due  # noqa: PLC0415
    from tasks.runtime import build_runtime  # noqa: PLC0415

    fake = FakeStripe(_key())
    with serving(fake, reset=(1, 3)):
        made = _stripe_source(sessions, settings, fake)
        done = cli("sources", "update", made.name, "--reconcile-every", "1h", env=test_env())
        assert done.returncode == 0, done.stderr
        old = f"evt_{uuid.uuid4().hex[:20]}"
        fake.add_event(old, int(time.time()) - 3600)
        with engine.begin() as conn:  # only this source is due (others may be, from before)
            conn.execute(
                text(
                    "UPDATE sources SET reconciled_at = now() WHERE id <> :s"
                    " AND reconcile_every_s IS NOT NULL"
                ),
                {"s": made.id},
            )
        assert fake.seen == []  # setting the source up asked nothing of the API
        rt = build_runtime(settings, worker="reconcile-reset-test")
        slept: list[float] = []
        try:
            assert run_due(rt, sleep=slept.append) == [made.public_id]
        finally:
            rt.close()
    assert slept == [0.5, 1.0]
    assert [s.path for s in fake.seen] == [
        f"/v1/webhook_endpoints/{fake.endpoint_id}",
        "/v1/events",
    ]
    rows = _receipts(engine, made.id)
    assert {k: (v.arrived_via, v.deliveries) for k, v in rows.items()} == {old: ("reconcile", 1)}


# The drill ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_drill_receiver_down_during_a_load_reconcile_recovers_each_missed_event_once(
    engine: Engine, sessions: sessionmaker[Session], settings: Settings, tmp_path: Path
) -> None:
    """60 Stripe events sent one after another to the real receiver; it is stopped after the
    20th and a new one started at the 40th, so the 20 sent in between are refused at the
    connection (the outage is counted in events, not waited out in seconds). One reconcile
    finds exactly those 20 and recovers them; a real worker runs every event's effect once;
    Stripe's late retries of the 20 are duplicates; replaying the whole window adds nothing."""
    with engine.begin() as conn:
        conn.execute(text(EFFECTS_DDL))
    flush_redis()
    env = test_env(WEBHOOKS_BROKER_URL=BROKER_URL, WEBHOOKS_REDIS_URL=CLAIMS_URL)
    fake = FakeStripe(_key(), page_size=25)
    source = make_source(sessions, settings, provider="stripe", routes=[{"handler": "effect"}])
    remember(source.secret)
    now = int(time.time())
    events = [(f"evt_{uuid.uuid4().hex[:20]}", now - 120 + n) for n in range(60)]
    missed: list[str] = []
    with (
        serving(fake),
        running_worker("drill", tmp_path, concurrency=4),
        httpx.Client(timeout=10) as client,
        ExitStack() as stack,
    ):
        done = cli(
            "sources", "update", source.name, "--api-key", fake.api_key,
            "--config", f"api_base={fake.url}", "--config", f"endpoint_id={fake.endpoint_id}",
            env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr

        def post(url: str, event_id: str, created: int) -> httpx.Response:
            headers, body = sign_stripe(
                source.secret, event_id=event_id, event_type="invoice.paid", timestamp=created
            )
            return client.post(f"{url}/webhooks/{source.public_id}", headers=headers, content=body)

        first = stack.enter_context(
            receiver(WEBHOOKS_BROKER_URL=BROKER_URL, WEBHOOKS_REDIS_URL=CLAIMS_URL)
        )
        url = first.url
        for n, (event_id, created) in enumerate(events):
            fake.add_event(event_id, created)  # Stripe has the event whatever happens next
            if n == 20:
                stack.close()  # the receiver goes down mid-load
            if n == 40:
                url = stack.enter_context(
                    receiver(WEBHOOKS_BROKER_URL=BROKER_URL, WEBHOOKS_REDIS_URL=CLAIMS_URL)
                ).url
            try:
                answer = post(url, event_id, created)
            except httpx.TransportError:
                missed.append(event_id)
                continue
            assert answer.status_code == 202, answer.text
        assert missed == [e for e, _ in events[20:40]]

        dry = cli("reconcile", source.name, "--dry-run", "--json", env=env)
        assert dry.returncode == 0, dry.stderr
        assert [m["event_id"] for m in json.loads(dry.stdout)["missing"]] == missed

        run = cli("reconcile", source.name, "--json", env=env)
        assert run.returncode == 0, run.stderr
        assert json.loads(run.stdout)["recovered"] == 20

        def all_succeeded() -> bool:
            with engine.connect() as conn:
                return bool(
                    conn.execute(
                        text(
                            "SELECT count(*) = 60 AND bool_and(status = 'succeeded')"
                            " FROM deliveries WHERE source_id = :s"
                        ),
                        {"s": source.id},
                    ).scalar()
                )

        wait_for(all_succeeded, timeout=120, what="the 60 deliveries to succeed")

        for event_id in missed:  # Stripe's own retries, once the receiver is back
            answer = post(url, event_id, dict(events)[event_id])
            assert answer.status_code == 200, answer.text
            assert answer.json()["status"] == "duplicate"

        again = cli("reconcile", source.name, "--json", env=env)
        assert again.returncode == 0, again.stderr
        assert json.loads(again.stdout)["missing"] == []

    with engine.connect() as conn:
        effects = conn.execute(
            text(
                "SELECT e.event_id, count(*) AS n FROM test_effects e"
                " JOIN deliveries d ON d.id = e.delivery_id WHERE d.source_id = :s"
                " GROUP BY e.event_id"
            ),
            {"s": source.id},
        ).all()
        via = dict(
            conn.execute(
                text(
                    "SELECT arrived_via, count(*) FROM receipts WHERE source_id = :s"
                    " GROUP BY arrived_via"
                ),
                {"s": source.id},
            ).all()
        )
    assert {e.event_id: e.n for e in effects} == dict.fromkeys((e for e, _ in events), 1)
    assert via == {"webhook": 40, "reconcile": 20}
    assert _conflicts(engine, source.id) == 0
