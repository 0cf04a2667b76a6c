"""Issue 38 item 2: retry-window awareness, end to end. Real receiver processes (killed with
SIGKILL, or cut off from Postgres by a proxy), the real ``webhooks gaps`` and ``webhooks
reconcile`` CLIs, real Postgres; local stand-ins only for the providers' APIs. Time moves by
moving the recorded heartbeats back on the database's clock, never by sleeping."""

from __future__ import annotations

import json
import secrets
import shutil
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import psycopg
import pytest
from playwright.sync_api import sync_playwright
from sqlalchemy.orm import Session, sessionmaker

from core.settings import Settings
from tests.conftest import test_env
from tests.factories import MadeSource, make_source
from tests.fake_providers import FakeGitHub, FakeStripe, serving
from tests.leakcheck import remember
from tests.netproxy import CuttableProxy
from tests.operators_support import cli
from tests.processes import receiver
from tests.signing import sign_github, sign_stripe
from tests.workers import wait_for

PERIOD = "1s"  # the receivers' heartbeat here: a gap is seen after two of them
CHROMIUM = "/usr/bin/chromium"  # as tests/test_console.py drives it
TOKEN = "adm_gaps_" + secrets.token_urlsafe(24)
remember(TOKEN)


@pytest.fixture
def only_these_sources(settings: Settings) -> Iterator[None]:
    """The gaps of this test alone: no heartbeat or error count of an earlier test, and the
    sources other tests left active set aside (restored after)."""
    with psycopg.connect(settings.psycopg_dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM intake_heartbeats")
        conn.execute("DELETE FROM intake_errors")
        others = [r[0] for r in conn.execute("UPDATE sources SET active = false WHERE active"
                                             " RETURNING id")]  # fmt: skip
    try:
        yield
    finally:
        with psycopg.connect(settings.psycopg_dsn, autocommit=True) as conn:
            conn.execute("UPDATE sources SET active = true WHERE id = ANY(%s)", (others,))


def _sql(settings: Settings, statement: str, *params: Any) -> list[Any]:
    with psycopg.connect(settings.psycopg_dsn, autocommit=True) as conn:
        cur = conn.execute(statement, params or None)
        return cur.fetchall() if cur.description else []


def _gaps(*args: str) -> dict[str, Any]:
    done = cli("gaps", "--json", *args, env=test_env(WEBHOOKS_INTAKE_HEARTBEAT_PERIOD=PERIOD))
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def _at(value: str) -> datetime:
    return datetime.fromisoformat(value)


def _keyed(source: MadeSource, *config: str, key: str) -> None:
    args = [arg for c in config for arg in ("--config", c)]
    done = cli("sources", "update", source.name, "--api-key", key, *args, env=test_env())
    assert done.returncode == 0, done.stderr


def test_a_receiver_killed_while_senders_keep_sending_is_a_gap_with_each_provider_s_verdict(
    settings: Settings, sessions: sessionmaker[Session], only_these_sources: None
) -> None:
    """A receiver is killed (SIGKILL) while Stripe and GitHub keep sending (connection
    refused), stays down (its heartbeat moved an hour back: the hour it was down), and a new
    one starts. ``webhooks gaps`` names the range from the dead receiver's last beat to the
    new one's first, and per source: Stripe retries until the range's start + 3 days, GitHub
    does not retry (only reconciliation), Shopify retries until + 4 hours; five hours later
    Shopify has given up on the range's first events and Stripe still retries. ``webhooks reconcile`` without SOURCE then
    recovers GitHub (no retry: the earliest deadline) before Stripe, each missing event once,
    and names Shopify (no credential) as not recoverable."""
    stripe_api = FakeStripe(f"rk_test_{uuid.uuid4().hex}")
    github_api = FakeGitHub(f"ghp_{uuid.uuid4().hex}", "repos/octo/hello/hooks/42")
    remember(stripe_api.api_key, github_api.token)
    # Created in an order unlike the deadlines': Stripe, Shopify, GitHub.
    stripe = make_source(sessions, settings, provider="stripe", routes=[{"handler": "log"}])
    shopify = make_source(sessions, settings, provider="shopify", routes=[{"handler": "log"}])
    github = make_source(sessions, settings, provider="github", routes=[{"handler": "log"}])
    remember(stripe.secret, shopify.secret, github.secret)
    env = {"WEBHOOKS_INTAKE_HEARTBEAT_PERIOD": PERIOD}

    def send_stripe(url: str, event_id: str) -> httpx.Response:
        headers, body = sign_stripe(stripe.secret, event_id=event_id)
        return httpx.post(f"{url}/webhooks/{stripe.public_id}", headers=headers, content=body)

    with serving(stripe_api), serving(github_api):
        _keyed(stripe, f"api_base={stripe_api.url}", f"endpoint_id={stripe_api.endpoint_id}",
               key=stripe_api.api_key)  # fmt: skip
        _keyed(github, f"api_base={github_api.url}", f"hook={github_api.hook}",
               key=github_api.token)  # fmt: skip

        with receiver(**env) as first:
            paid = f"evt_{uuid.uuid4().hex[:20]}"
            assert send_stripe(first.url, paid).status_code == 202
            wait_for(lambda: _sql(settings, "SELECT 1 FROM intake_heartbeats"), timeout=30,
                     what="the receiver's first heartbeat")  # fmt: skip
            first.proc.kill()
            first.proc.wait()
        # The senders keep sending to a receiver that is gone: refused, nothing recorded.
        lost_stripe = f"evt_{uuid.uuid4().hex[:20]}"
        with pytest.raises(httpx.ConnectError):
            send_stripe(first.url, lost_stripe)
        # It stayed down an hour: its segment moved an hour back on the database's clock.
        [(dead_last_seen,)] = _sql(
            settings,
            "UPDATE intake_heartbeats SET started_at = started_at - interval '1 hour',"
            " last_seen = last_seen - interval '1 hour' RETURNING last_seen",
        )
        # What the providers sent meanwhile (their own lists, which reconciliation reads).
        half_an_hour_ago = int(time.time()) - 1800
        stripe_api.add_event(lost_stripe, half_an_hour_ago)
        lost_guid = str(uuid.uuid4())
        github_api.add_delivery(lost_guid, datetime.now(UTC) - timedelta(minutes=30), status_code=0)

        with receiver(**env, WEBHOOKS_ADMIN_TOKENS=f"dora:{TOKEN}") as second:
            wait_for(lambda: len(_sql(settings, "SELECT 1 FROM intake_heartbeats")) == 2,
                     timeout=30, what="the new receiver's first heartbeat")  # fmt: skip
            [(restarted,)] = _sql(settings, "SELECT max(started_at) FROM intake_heartbeats")

            view = _gaps()
            [gap] = view["gaps"]
            assert gap["kind"] == "no_receiver_seen"
            assert _at(gap["start"]) == dead_last_seen
            assert _at(gap["end"]) == restarted
            assert view["resolution_s"] == 2.0
            assert "never reached us" in view["invisible"]
            verdicts = {s["provider"]: s for s in view["sources"]}
            assert set(verdicts) == {"stripe", "shopify", "github"}
            assert verdicts["stripe"]["verdict"] == "retrying"
            assert _at(verdicts["stripe"]["deadline"]) == dead_last_seen + timedelta(days=3)
            assert verdicts["shopify"]["verdict"] == "retrying"
            assert _at(verdicts["shopify"]["deadline"]) == dead_last_seen + timedelta(hours=4)
            assert verdicts["github"]["verdict"] == "no_retry"
            assert "only reconciliation" in verdicts["github"]["says"]
            assert [s["provider"] for s in view["sources"]] == ["github", "shopify", "stripe"]

            text = cli("gaps", env=test_env(WEBHOOKS_INTAKE_HEARTBEAT_PERIOD=PERIOD))
            assert text.returncode == 0, text.stderr
            out = " ".join(text.stdout.split())
            assert "no receiver seen" in out
            assert f"retries until {dead_last_seen + timedelta(days=3):%Y-%m-%d %H:%M:%S}Z" in out
            assert "does not retry by itself: only reconciliation recovers it" in out
            assert "never reached us" in out
            [(receipt, occurred)] = _sql(
                settings, "SELECT id, occurred_at FROM receipts WHERE event_id = %s", paid
            )
            retried = (
                f"until {occurred + timedelta(days=3):%Y-%m-%d %H:%M:%S} UTC"
                " (stripe's documented window)"
            )
            _console_shows(second.admin_url, dead_last_seen, receipt, retried)
            bad = cli("gaps", "--since", "soon", env=test_env())
            assert bad.returncode != 0
            assert len(bad.stderr.strip().splitlines()) == 1

            # Five hours later (the whole history moved back four more): Shopify gave up.
            _sql(
                settings,
                "UPDATE intake_heartbeats SET started_at = started_at - interval '4 hours',"
                " last_seen = last_seen - interval '4 hours' WHERE last_seen < %s",
                restarted,
            )
            # (The range now runs from five hours ago to the restart: Shopify gave up on its
            # first events and still retries those of its last four hours.)
            later = {s["provider"]: s for s in _gaps()["sources"]}
            assert later["shopify"]["verdict"] == "giving_up"
            assert "gave up on the range's first events" in later["shopify"]["says"]
            assert "only the sender can resend it" in later["shopify"]["says"]
            assert later["stripe"]["verdict"] == "retrying"

            def redeliver(delivery: dict[str, Any]) -> None:
                headers, body = sign_github(
                    github.secret, event_id=delivery["guid"], event_type="issues.opened"
                )
                answer = httpx.post(
                    f"{second.url}/webhooks/{github.public_id}", headers=headers, content=body
                )
                assert answer.status_code == 202, answer.text

            github_api.on_redeliver = redeliver
            done = cli("reconcile", "--json", env=test_env(), timeout=120)
            assert done.returncode == 0, done.stderr
            run = json.loads(done.stdout)
            order = [(s["provider"], s["recoverable"]) for s in run["sources"]]
            assert order == [("github", True), ("shopify", False), ("stripe", True)]
            recovered = {s["provider"]: s["report"] for s in run["sources"] if s["report"]}
            assert [m["event_id"] for m in recovered["github"]["missing"]] == [lost_guid]
            assert recovered["github"]["recovered"] == 1
            assert [m["event_id"] for m in recovered["stripe"]["missing"]] == [lost_stripe]
            assert recovered["stripe"]["recovered"] == 1
            # The order the providers' APIs were asked in: GitHub's redelivery first.
            asked_github = max(s.at for s in github_api.seen if s.method == "POST")
            asked_stripe = min(s.at for s in stripe_api.events_requests())
            assert asked_github < asked_stripe

    received = dict(_sql(
        settings,
        "SELECT event_id, arrived_via FROM receipts WHERE source_id = ANY(%s)",
        [stripe.id, github.id],
    ))  # fmt: skip
    assert received[lost_stripe] == "reconcile"
    assert received[lost_guid] == "webhook"  # the signed redelivery
    assert _sql(settings, "SELECT count(*) FROM receipts WHERE event_id = ANY(%s)",
                [lost_stripe, lost_guid]) == [(2,)]  # fmt: skip


def _console_shows(admin_url: str, start: datetime, receipt: int, retried: str) -> None:
    """The console's Gaps page, in a real chromium: the range and each source's verdict; and
    an event's page: until when its sender retries it."""
    if shutil.which(CHROMIUM) is None:
        pytest.skip(f"{CHROMIUM} is missing: run `make install` (as root)")
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            page = browser.new_page()
            page.goto(f"{admin_url}/console/login")
            page.fill("#token", TOKEN)
            page.click("button[type=submit]")
            page.wait_for_url(f"{admin_url}/console/")
            page.click("nav >> text=Gaps")
            page.wait_for_url(f"{admin_url}/console/gaps")
            rows = page.locator("#gaps tbody tr")
            assert rows.count() == 1
            assert rows.first.get_attribute("data-kind") == "no_receiver_seen"
            assert f"{start:%Y-%m-%d %H:%M}" in rows.first.inner_text()
            verdicts = {
                r.get_attribute("data-verdict"): r.locator(".says").inner_text()
                for r in page.locator("#gap-sources tbody tr").all()
            }
            assert set(verdicts) == {"no_retry", "retrying"}
            assert "only reconciliation recovers it" in verdicts["no_retry"]
            assert "never reached us" in page.locator("#invisible").inner_text()
            page.goto(f"{admin_url}/console/gaps?since=soon")
            assert page.locator("#message").is_visible()
            page.goto(f"{admin_url}/console/events/{receipt}")
            assert page.locator("#sender-retries").inner_text() == retried
        finally:
            browser.close()


def test_a_receiver_cut_off_from_postgres_answers_503_and_its_counts_show_as_a_gap(
    settings: Settings, sessions: sessionmaker[Session], only_these_sources: None
) -> None:
    """The database unreachable (a proxy cut between receiver and Postgres): each webhook is
    answered 503; the receiver counts them in memory and, once Postgres answers again, its
    heartbeat adds them to intake_errors; ``webhooks gaps`` shows that minute as "database
    unreachable" for the source, with the count, and Stripe's verdict."""
    source = make_source(sessions, settings, provider="stripe", routes=[{"handler": "log"}])
    remember(source.secret)
    proxy = CuttableProxy(5432)
    db = settings.database_name()
    try:
        with receiver(
            WEBHOOKS_DATABASE_URL=f"postgresql://postgres@127.0.0.1:{proxy.port}/{db}",
            WEBHOOKS_DB_CONNECT_TIMEOUT="1",
            WEBHOOKS_DB_ANSWER_TIMEOUT="0.9",
            WEBHOOKS_INTAKE_HEARTBEAT_PERIOD=PERIOD,
        ) as rcv:
            url = f"{rcv.url}/webhooks/{source.public_id}"
            headers, body = sign_stripe(source.secret, event_id=f"evt_{uuid.uuid4().hex[:20]}")
            assert httpx.post(url, headers=headers, content=body).status_code == 202
            proxy.cut()
            refused = []
            for _ in range(3):
                headers, body = sign_stripe(source.secret, event_id=f"evt_{uuid.uuid4().hex}")
                refused.append(httpx.post(url, headers=headers, content=body).status_code)
            assert refused == [503, 503, 503]
            proxy.restore()
            rows = wait_for(
                lambda: _sql(settings, "SELECT source, kind, sum(count)::int FROM intake_errors"
                                       " GROUP BY 1, 2"),
                timeout=30, what="the receiver's error counts, once Postgres answers",
            )  # fmt: skip
            assert rows == [(source.public_id, "database_unreachable", 3)]
            view = _gaps("--since", "1h")
            # The receiver was up throughout: whatever its failed beats left is the database
            # unreachable (for every source), never a receiver down.
            assert "no_receiver_seen" not in {g["kind"] for g in view["gaps"]}
            errors = [g for g in view["gaps"] if g["errors"]]
            assert [(g["source"], g["kind"], g["errors"]) for g in errors] == [
                (source.public_id, "database_unreachable", 3)
            ]
            [standing] = [s for s in view["sources"] if s["errors"]]
            assert standing["verdict"] == "retrying"
            assert _at(standing["deadline"]) == _at(errors[0]["start"]) + timedelta(days=3)
    finally:
        proxy.close()


def test_maintenance_prunes_heartbeats_and_counts_past_every_retry_window(
    settings: Settings, sessions: sessionmaker[Session], engine: Any, only_these_sources: None
) -> None:
    """Kept: the longest retry window of the active sources' providers (Shopify 4 h, Stripe
    3 d here) plus a day, by the database's clock; older rows are removed, younger kept."""
    from tasks.horizon import prune_intake_gaps  # noqa: PLC0415 (the worker's side)

    make_source(sessions, settings, provider="shopify", routes=[])
    make_source(sessions, settings, provider="stripe", routes=[])
    for age in ("3 days 23 hours", "4 days 1 hour"):
        _sql(
            settings,
            "INSERT INTO intake_heartbeats (host, pid, started_at, last_seen)"
            " VALUES ('h', 1, now() - CAST(%s AS interval), now() - CAST(%s AS interval))",
            age,
            age,
        )
        _sql(
            settings,
            "INSERT INTO intake_errors (source, minute, kind, count)"
            " VALUES ('unknown', date_trunc('minute', now() - CAST(%s AS interval)),"
            " 'errors_answered', 1)",
            age,
        )
    assert prune_intake_gaps(engine, None) == 2
    kept = _sql(settings, "SELECT now() - last_seen FROM intake_heartbeats")
    assert [k[0] < timedelta(days=4) for k in kept] == [True]
    assert len(_sql(settings, "SELECT 1 FROM intake_errors")) == 1
    # A day later (a pinned clock), the other row is past the window too.
    [(now,)] = _sql(settings, "SELECT now()")
    assert prune_intake_gaps(engine, now + timedelta(days=1)) == 2
    assert _sql(settings, "SELECT count(*) FROM intake_heartbeats") == [(0,)]


def test_each_receipt_says_until_when_its_provider_retries_it(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    """``events show``: a Stripe event is retried until its own (signed) time + 3 days; a
    GitHub one is never retried by GitHub itself."""
    from tests.factories import accept_event  # noqa: PLC0415

    stripe = make_source(sessions, settings, provider="stripe", routes=[])
    github = make_source(sessions, settings, provider="github", routes=[])
    occurred = datetime(2026, 12, 1, 10, 0, 0, tzinfo=UTC)
    paid, _ = accept_event(settings, stripe, occurred_at=occurred)
    pushed, _ = accept_event(settings, github)
    shown = cli("events", "show", paid, "--source", stripe.public_id, "--json", env=test_env())
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["sender_retries"].startswith(
        "until 2026-12-04 10:00:00 UTC (stripe's documented window)"
    )
    text = cli("events", "show", pushed, "--source", github.public_id, env=test_env())
    assert text.returncode == 0, text.stderr
    assert "retried:   never by itself" in text.stdout


def test_reconcile_without_source_refuses_since_and_without_a_gap_asks_no_provider(
    settings: Settings, sessions: sessionmaker[Session], only_these_sources: None
) -> None:
    """``--since`` without SOURCE: one line naming its docs section. No gap recorded: nothing
    to recover, no provider asked (a keyed Stripe source's stand-in API sees no request)."""
    done = cli("reconcile", "--since", "1h", env=test_env())
    assert done.returncode != 0
    [line] = done.stderr.strip().splitlines()
    assert "--since needs a SOURCE" in line
    assert "docs/provider-side-gaps.md#webhooks-reconcile-without-source" in line

    api = FakeStripe(f"rk_test_{uuid.uuid4().hex}")
    remember(api.api_key)
    stripe = make_source(sessions, settings, provider="stripe", routes=[])
    with serving(api):
        _keyed(stripe, f"api_base={api.url}", f"endpoint_id={api.endpoint_id}", key=api.api_key)
        _sql(settings, "INSERT INTO intake_heartbeats (host, pid) VALUES ('h', 1)")
        done = cli("reconcile", "--json", env=test_env())
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["sources"] == []
        text = cli("reconcile", env=test_env())
        assert "no intake gap since" in text.stdout
        assert api.seen == []
