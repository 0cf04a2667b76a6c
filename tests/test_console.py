"""The operator console (issue 21) in a real browser: Playwright driving Debian's chromium
(headless, ``executable_path``, never ``playwright install``) against the real receiver
(``webhooks serve``, its admin plane serving ``/console/``) and a real Celery worker.

One browser, one receiver and one worker serve the whole module. Dead letters are made by
the worker running the demo's ``flaky`` handler (it fails until replayed), or moved to dead
with the guarded transitions (:func:`tests.operators_support.kill`) where only their number
matters; replays are then run by the console and processed by the worker.
"""

from __future__ import annotations

import secrets
import shutil
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
import redis
from playwright.sync_api import Browser, BrowserContext, Page, expect, sync_playwright
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core.clock import FrozenClock
from core.docs import TOPICS
from core.settings import Settings
from ingest.admin import AdminServer
from ingest.console.base import back_to
from ingest.console.sessions import SessionStore, digest
from models import breaker, transitions
from models.catalog import Change
from tests.conftest import REDIS, free_port, make_settings
from tests.factories import MadeSource
from tests.fake_providers import FakeStripe, serving
from tests.handlers_for_tests import EFFECTS_DDL
from tests.leakcheck import remember
from tests.operators_support import (
    OPS,
    WRAPPED,
    accept,
    cli,
    kill,
    ops_env,
    ops_receiver,
    retry,
    source_with,
    succeed,
)
from tests.processes import Receiver
from tests.signing import sign
from tests.workers import Broker, Worker, attempts, running_worker, wait_status

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
THROTTLE_REDIS = f"{REDIS}/3"  # the login buckets (tests/test_login_throttle.py's too)
TOKEN = "adm_console_" + secrets.token_urlsafe(24)
OTHER_TOKEN = "adm_console_other_" + secrets.token_urlsafe(24)
remember(TOKEN, OTHER_TOKEN)

if shutil.which(CHROMIUM) is None:  # make install installs it (Debian's chromium package)
    pytest.skip(f"{CHROMIUM} is missing: run `make install` (as root)", allow_module_level=True)


@pytest.fixture(scope="module")
def worker(
    ops: Settings, tmp_path_factory: pytest.TempPathFactory, engine: Engine
) -> Iterator[Worker]:
    with engine.begin() as conn:
        conn.execute(text(EFFECTS_DDL))
    with running_worker(
        "console", tmp_path_factory.mktemp("console-worker"), concurrency=2, **OPS
    ) as w:
        yield w


@pytest.fixture(scope="module")
def broker(ops: Settings) -> Iterator[Broker]:
    b = Broker(ops)
    yield b
    b.close()


@pytest.fixture(scope="module")
def api(ops: Settings) -> Iterator[Receiver]:
    with ops_receiver(None, WEBHOOKS_ADMIN_TOKENS=f"dora:{TOKEN},eve:{OTHER_TOKEN}") as running:
        yield running


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def context(browser: Browser) -> Iterator[BrowserContext]:
    ctx = browser.new_context()
    yield ctx
    ctx.close()


def login(ctx: BrowserContext, api: Receiver, token: str = TOKEN) -> Page:
    page = ctx.new_page()
    page.goto(f"{api.admin_url}/console/login")
    page.fill("#token", token)
    page.click("button[type=submit]")
    page.wait_for_url(f"{api.admin_url}/console/")
    return page


@pytest.fixture
def page(context: BrowserContext, api: Receiver) -> Page:
    return login(context, api)


def _dead_by_worker(
    ops: Settings, sessions: sessionmaker[Session], engine: Engine, broker: Broker, **kw: Any
) -> tuple[MadeSource, int]:
    source = source_with(sessions, ops, "flaky")
    [delivery] = accept(ops, source, **kw)
    broker.publish(delivery)
    wait_status(engine, delivery, "dead", timeout=30)
    return source, delivery


def _status(engine: Engine, ids: list[int]) -> dict[int, str]:
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT id, status FROM deliveries WHERE id = ANY(:ids)"), {"ids": ids}
        )
        return {r.id: r.status for r in rows}


# access ---------------------------------------------------------------------------------------


def test_no_session_leads_to_login_a_wrong_token_is_refused_and_logout_ends_the_session(
    context: BrowserContext, api: Receiver
) -> None:
    page = context.new_page()
    for path in ("/console/", "/console/events", "/console/dead", "/console/audit"):
        page.goto(f"{api.admin_url}{path}")
        assert page.url == f"{api.admin_url}/console/login", path
    page.fill("#token", TOKEN + "x")
    with page.expect_response(lambda r: r.url.endswith("/console/login")) as answer:
        page.click("button[type=submit]")
    assert answer.value.status == 401
    assert page.inner_text("#message") == "wrong token"
    assert context.cookies()
    assert not [c for c in context.cookies() if c["name"] == "wh_console"]

    page.fill("#token", TOKEN)
    page.click("button[type=submit]")
    page.wait_for_url(f"{api.admin_url}/console/")
    assert page.inner_text("header .who") == "dora"
    [cookie] = [c for c in context.cookies() if c["name"] == "wh_console"]
    assert cookie["httpOnly"] is True
    assert cookie["sameSite"] == "Strict"
    assert cookie["secure"] is False  # plain http on loopback (Secure on https)
    # The session works from another client too (the cookie is the whole credential)...
    jar = {"wh_console": cookie["value"]}
    served = httpx.get(f"{api.admin_url}/console/events", cookies=jar, follow_redirects=False)
    assert served.status_code == 200
    # ...but not for /admin: the API still demands its bearer token.
    assert httpx.get(f"{api.admin_url}/admin/events", cookies=jar).status_code == 401

    page.click("header .logout button")
    page.wait_for_url(f"{api.admin_url}/console/login")
    page.goto(f"{api.admin_url}/console/events")
    assert page.url == f"{api.admin_url}/console/login"
    # Logout ended the session on the server: the old cookie no longer opens anything.
    after = httpx.get(f"{api.admin_url}/console/events", cookies=jar, follow_redirects=False)
    assert after.status_code == 303
    assert after.headers["location"] == "/console/login"


def test_a_session_expires_after_its_idle_timeout_and_with_its_token() -> None:
    clock = FrozenClock(datetime(2026, 1, 1, tzinfo=UTC))
    store = SessionStore(clock, timedelta(minutes=30))
    valid = {digest("t1")}
    sid, made = store.create("dora", digest("t1"))
    clock.advance(timedelta(minutes=29))
    assert store.get(sid, valid) is made  # used: its idle time starts again
    clock.advance(timedelta(minutes=29))
    assert store.get(sid, valid) is made
    clock.advance(timedelta(minutes=30))
    assert store.get(sid, valid) is None  # idle 30 minutes: gone
    assert store.get(sid, valid) is None
    sid2, _ = store.create("dora", digest("t1"))
    assert store.get(sid2, set()) is None  # its token was removed from the configuration
    assert store.get(sid2, valid) is None
    assert store.get("not-a-session", valid) is None


def test_a_throttled_login_says_how_long_to_wait_then_lets_the_operator_in(
    browser: Browser,
) -> None:
    """Issue 34 item 7, in the browser: the admin server ``webhooks serve`` runs (in this
    process, its clock frozen: the login buckets' scripts take it as Redis' clock)."""
    clock = FrozenClock(datetime.now(UTC))
    buckets = redis.Redis.from_url(THROTTLE_REDIS)
    buckets.flushdb()
    settings = make_settings(
        admin_tokens=f"dora:{TOKEN}",
        redis_url=THROTTLE_REDIS,
        console_login_failures=2,
        console_login_global_failures=60,
    )
    port = free_port()
    server = AdminServer(settings, host="127.0.0.1", port=port, clock=clock)
    server.start()
    ctx = browser.new_context()
    try:
        for _ in range(200):
            if server.server.started:
                break
            server.thread.join(0.05)
        url = f"http://127.0.0.1:{port}"
        page = ctx.new_page()
        page.goto(f"{url}/console/login")
        for token, status in ((TOKEN + "x", 401), (TOKEN + "y", 401), (TOKEN, 429)):
            page.fill("#token", token)
            with page.expect_response(lambda r: r.url.endswith("/console/login")) as answer:
                page.click("button[type=submit]")
            assert answer.value.status == status
        assert answer.value.headers["retry-after"] == "30"  # a minute / 2
        assert page.inner_text("#message") == (
            "too many failed logins from this address: wait 30 seconds before trying again"
        )
        assert not [c for c in ctx.cookies() if c["name"] == "wh_console"]
        clock.advance(timedelta(seconds=30))
        page.fill("#token", TOKEN)
        page.click("button[type=submit]")
        page.wait_for_url(f"{url}/console/")
        assert page.inner_text("header .who") == "dora"
    finally:
        ctx.close()
        server.stop()
        buckets.flushdb()
        buckets.close()


def test_security_headers_on_every_page(context: BrowserContext, api: Receiver) -> None:
    page = context.new_page()
    for response in (
        page.goto(f"{api.admin_url}/console/login"),
        httpx.get(f"{api.admin_url}/console/static/console.css"),
    ):
        assert response is not None
        headers = response.headers
        csp = headers["content-security-policy"]
        assert "default-src 'self'" in csp
        assert "script-src 'self'" in csp
        assert "unsafe-inline" not in csp
        assert headers["x-frame-options"] == "DENY"
        assert headers["referrer-policy"] == "no-referrer"
    logged = login(context, api)
    response = logged.goto(f"{api.admin_url}/console/")
    assert response is not None
    assert "unsafe-inline" not in response.headers["content-security-policy"]
    assert response.headers["x-frame-options"] == "DENY"
    # No inline script anywhere: every <script> has a src on this origin.
    scripts = logged.eval_on_selector_all("script", "els => els.map(e => [e.src, e.text])")
    assert scripts == [[f"{api.admin_url}/console/static/console.js", ""]]


def test_a_post_without_its_csrf_token_is_403_and_changes_nothing(
    page: Page, api: Receiver, ops: Settings, sessions: sessionmaker[Session], engine: Engine
) -> None:
    source = source_with(sessions, ops, "log")
    [delivery] = accept(ops, source)
    kill(sessions, [delivery])
    route = source.route_ids[0]
    request = page.context.request  # the logged-in browser's cookies, no form token
    posts: list[tuple[str, dict[str, str]]] = [
        ("/console/dead/preview", {"action": "replay", "ids": str(delivery)}),
        (f"/console/routes/{route}/pause", {"reason": "csrf test"}),
        (f"/console/sources/{source.public_id}/disable", {"reason": "csrf test"}),
        ("/console/sources/new", {"name": "csrf-test", "provider": "stripe"}),
        (f"/console/sources/{source.public_id}/routes", {"handler": "log"}),
        (f"/console/routes/{route}/limits", {"rate": "5/s", "reason": "csrf test"}),
        (f"/console/routes/{route}/filter", {"filter": "`false`", "reason": "csrf test"}),
        (f"/console/routes/{route}/transform", {"transform": "data_object", "reason": "csrf"}),
        (f"/console/routes/{route}/lanes", {"order_key": "body.id", "reason": "csrf test"}),
        ("/console/logout", {}),
    ]
    for path, form in posts:
        for extra in ({}, {"csrf": "wrong"}):
            answer = request.post(f"{api.admin_url}{path}", form={**form, **extra})
            assert answer.status == 403, (path, extra)
    # Without a session at all: 403 too, not a redirect that could be followed.
    bare = httpx.post(f"{api.admin_url}/console/routes/{route}/pause", data={"reason": "x"})
    assert bare.status_code == 403
    # The login form has its own token.
    assert httpx.post(f"{api.admin_url}/console/login", data={"token": TOKEN}).status_code == 403
    with engine.connect() as conn:
        paused, active = conn.execute(
            text(
                "SELECT r.paused_at IS NOT NULL, s.active FROM routes r JOIN sources s"
                " ON s.id = r.source_id WHERE r.id = :r"
            ),
            {"r": route},
        ).one()
        audited = conn.execute(
            text("SELECT count(*) FROM audit_log WHERE target->>'source' = :s AND via = 'console'"),
            {"s": source.public_id},
        ).scalar_one()
    assert (paused, active, audited) == (False, True, 0)
    assert _status(engine, [delivery]) == {delivery: "dead"}
    # Still logged in (logout without the token did nothing).
    page.goto(f"{api.admin_url}/console/audit")
    assert page.url == f"{api.admin_url}/console/audit"
    # Bad input with the right token: a clear 400, nothing changed (Postgres text holds no NUL).
    csrf = page.input_value("header .logout input[name=csrf]")
    assert request.get(f"{api.admin_url}/console/events?source=a%00b").status == 400
    nul = request.post(
        f"{api.admin_url}/console/routes/{route}/pause", form={"csrf": csrf, "reason": "a\x00b"}
    )
    assert nul.status == 400
    assert "NUL characters are not allowed" in nul.text()
    with engine.connect() as conn:
        paused = conn.execute(
            text("SELECT paused_at IS NOT NULL FROM routes WHERE id = :r"), {"r": route}
        ).scalar_one()
    assert paused is False


def _audit_after(engine: Engine, first: int, *actions: str) -> list[Any]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                text(
                    "SELECT id, operator, action, target, reason, via FROM audit_log"
                    " WHERE id > :first AND action = ANY(:actions) ORDER BY id"
                ),
                {"first": first, "actions": list(actions)},
            ).all()
        )


def _last_audit_id(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT coalesce(max(id), 0) FROM audit_log")).scalar_one())


def test_logins_are_audited_with_the_client_address_and_never_the_token(
    context: BrowserContext, api: Receiver, engine: Engine
) -> None:
    """Issue 34 item 5: a refused token (``login.failed``) and a login (``login``, the
    token's name) each write an audit row with the client's address; no row holds a token,
    right or wrong; the audit page lists them."""
    first = _last_audit_id(engine)
    page = context.new_page()
    page.goto(f"{api.admin_url}/console/login")
    page.fill("#token", TOKEN[:-1])  # a typo of the right token
    with page.expect_response(lambda r: r.url.endswith("/console/login")) as answer:
        page.click("button[type=submit]")
    assert answer.value.status == 401
    page.fill("#token", TOKEN)
    page.click("button[type=submit]")
    page.wait_for_url(f"{api.admin_url}/console/")
    rows = _audit_after(engine, first, "login", "login.failed")
    assert [(r.operator, r.action, r.target, r.via) for r in rows] == [
        ("anonymous", "login.failed", {"client": "127.0.0.1"}, "console"),
        ("dora", "login", {"client": "127.0.0.1", "token_name": "dora"}, "console"),
    ]
    with engine.connect() as conn:
        every = conn.execute(text("SELECT CAST(audit_log AS text) FROM audit_log")).scalars()
        assert not [row for row in every if TOKEN[:-1] in row or OTHER_TOKEN[:-1] in row]
    page.goto(f"{api.admin_url}/console/audit?action=login")
    listed = page.locator("#audit tbody tr")
    ids = {int(i or 0) for i in listed.evaluate_all("rs => rs.map(r => r.dataset.id)")}
    assert {r.id for r in rows} <= ids


def test_a_login_that_cannot_be_audited_starts_no_session(browser: Browser) -> None:
    """The database down (here: a port nobody listens on): the right token is answered 503
    and no session starts (no unaudited login); a wrong one is still 401 (its log line is the
    record)."""
    buckets = redis.Redis.from_url(THROTTLE_REDIS)
    buckets.flushdb()
    settings = make_settings(
        admin_tokens=f"dora:{TOKEN}",
        redis_url=THROTTLE_REDIS,
        database_url=f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/nowhere",
    )
    port = free_port()
    server = AdminServer(settings, host="127.0.0.1", port=port)
    server.start()
    ctx = browser.new_context()
    try:
        for _ in range(200):
            if server.server.started:
                break
            server.thread.join(0.05)
        url = f"http://127.0.0.1:{port}"
        page = ctx.new_page()
        page.goto(f"{url}/console/login")
        for token, status in ((TOKEN + "x", 401), (TOKEN, 503)):
            page.fill("#token", token)
            with page.expect_response(lambda r: r.url.endswith("/console/login")) as answer:
                page.click("button[type=submit]")
            assert answer.value.status == status
        assert "every login is audited" in page.inner_text("#message")
        assert not [c for c in ctx.cookies() if c["name"] == "wh_console"]
        page.goto(f"{url}/console/")
        assert page.url == f"{url}/console/login"
    finally:
        ctx.close()
        server.stop()
        buckets.flushdb()
        buckets.close()


def test_every_console_action_that_changes_data_is_audited(
    page: Page, api: Receiver, ops: Settings, sessions: sessionmaker[Session], engine: Engine
) -> None:
    """Issue 34 item 5: the console's POST actions are exactly these, and each one that
    changes data writes an audit row under the session's operator (``via: console``): a
    route disabled, enabled (here), paused, resumed, removed (test_routes_pause_resume...),
    a source disabled and enabled (here), dead letters replayed (a ``replays`` row) or
    discarded, a replay cancelled, a login, a source created, a route added, a route's
    limits set (test_a_source_and_its_routes_are_created_and_limited_from_the_page), a
    route's filter set (tests/test_route_filters.py), its transform or lanes set
    (tests/test_console_routes.py)."""
    from ingest.console.app import create_console
    from ingest.plane import OperatorTokens, PlaneState

    app: Any = create_console(PlaneState(ops, FrozenClock(datetime.now(UTC)), OperatorTokens({})))
    posts = sorted(r.path for r in app.app.routes if "POST" in (getattr(r, "methods", None) or ()))
    assert posts == [
        "/dead/confirm",  # replay (replays row) or discard (audit_log + audit_discarded)
        "/dead/preview",  # reads only
        "/login",  # login, login.failed
        "/logout",  # ends this process's session: nothing stored
        "/replays/{replay}/cancel",  # replay.cancel
        "/routes/{route}/filter",  # route.filter (tests/test_route_filters.py)
        "/routes/{route}/lanes",  # route.lanes (tests/test_console_routes.py)
        "/routes/{route}/limits",  # route.limits
        "/routes/{route}/transform",  # route.transform (tests/test_console_routes.py)
        "/routes/{route}/{action}",  # route.enable|disable|pause|resume|remove
        "/sources/new",  # source.add
        "/sources/{source}/routes",  # route.add
        "/sources/{source}/{action}",  # source.enable|disable
    ]
    source = source_with(sessions, ops, "log")
    route = source.route_ids[0]
    first = _last_audit_id(engine)
    for button, reason in (("Disable", "route off"), ("Enable", "route on")):
        page.goto(f"{api.admin_url}/console/routes")
        row = page.locator(f"tr[data-route='{route}'] form.route-change")
        row.locator("input[name=reason]").fill(reason)
        row.locator(f"button:text-is('{button}')").click()
        page.wait_for_url(f"{api.admin_url}/console/routes")
    for button, reason in (("Disable source", "source off"), ("Enable source", "source on")):
        section = page.locator(f"section[data-source='{source.public_id}']")
        section.locator("form.inline input[name=reason]").first.fill(reason)
        section.locator(f"button:text-is('{button}')").click()
        page.wait_for_url(f"{api.admin_url}/console/routes")
    rows = _audit_after(
        engine, first, "route.disable", "route.enable", "source.disable", "source.enable"
    )
    assert [(r.action, r.operator, r.reason, r.via) for r in rows] == [
        ("route.disable", "dora", "route off", "console"),
        ("route.enable", "dora", "route on", "console"),
        ("source.disable", "dora", "source off", "console"),
        ("source.enable", "dora", "source on", "console"),
    ]
    assert rows[0].target["route"] == route
    assert rows[2].target["source"] == source.public_id


def test_a_test_event_says_so_on_its_page(
    page: Page, api: Receiver, ops: Settings, sessions: sessionmaker[Session]
) -> None:
    """Issue 34 item 5: ``webhooks send`` through the real receiver; its event page shows
    ``arrived via: test`` (and a provider's event ``webhook``)."""
    source = source_with(sessions, ops, "log")
    accept(ops, source, event_id="evt_from_provider")
    sent = cli("send", source.public_id, "--id", "evt_from_send", "--url", api.url, env=ops_env())
    assert sent.returncode == 0, sent.stderr
    for event_id, via in (("evt_from_send", "test"), ("evt_from_provider", "webhook")):
        page.goto(f"{api.admin_url}/console/events?source={source.public_id}&q={event_id}")
        expect(page.locator("#event-id")).to_have_text(event_id)
        assert page.locator("#arrived-via .pill").inner_text() == via
        assert ("webhooks send" in page.inner_text("#arrived-via")) == (via == "test")


# pages ----------------------------------------------------------------------------------------


def test_filter_events_open_an_event_a_delivery_and_its_attempt_history(
    page: Page,
    api: Receiver,
    worker: Worker,
    broker: Broker,
    ops: Settings,
    sessions: sessionmaker[Session],
    engine: Engine,
) -> None:
    source, dead = _dead_by_worker(ops, sessions, engine, broker, event_type="invoice.failed")
    accept(ops, source, event_type="order.created")
    accept(ops, source, event_type="invoice.paid")
    base = f"{api.admin_url}/console/events"
    page.goto(base)
    page.fill("input[name=source]", source.name)
    page.fill("input[name=type]", "invoice.*")
    page.click("#event-filters button[type=submit]")
    page.wait_for_url(f"{base}?*")
    types = page.locator("#events tbody td.type").all_inner_texts()
    assert sorted(types) == ["invoice.failed", "invoice.paid"]
    page.select_option("select[name=status]", "dead")
    page.click("#event-filters button[type=submit]")
    page.wait_for_load_state()
    assert page.locator("#events tbody td.type").all_inner_texts() == ["invoice.failed"]

    page.click("#events tbody a")
    assert page.inner_text("#event-type") == "invoice.failed"
    assert '"type": "invoice.failed"' in page.inner_text("#payload")  # pretty-printed
    assert "Content-Type: application/json" in page.inner_text("#headers")
    page.click(f"#deliveries a:text-is('{dead}')")
    page.wait_for_url(f"{api.admin_url}/console/deliveries/{dead}")
    assert page.inner_text("#status") == "dead"
    rows = page.locator("#attempts tr.attempt")
    assert rows.count() == 1
    cells = rows.first.locator("td").all_inner_texts()
    assert cells[0] == "1"
    assert cells[3] == "dead"
    assert "PermanentError" in cells[5]
    assert page.inner_text("#idempotency-key").strip() not in ("", "-")
    link = rows.first.locator("a").get_attribute("href")
    assert link == f"/console/deliveries/{dead}/attempts/1/flower"

    # Searching by receipt id or event id opens the event.
    with engine.connect() as conn:
        receipt, event_id = conn.execute(
            text("SELECT r.id, r.event_id FROM deliveries d JOIN receipts r ON r.id = d.receipt_id"
                 " WHERE d.id = :d"),
            {"d": dead},
        ).one()  # fmt: skip
    for q in (f"receipt:{receipt}", event_id):
        page.goto(f"{base}?q={q}")
        assert page.url == f"{api.admin_url}/console/events/{receipt}"


def test_a_delivery_whose_lease_was_taken_over_names_the_possible_repeat(
    page: Page, api: Receiver, ops: Settings, sessions: sessionmaker[Session]
) -> None:
    """Attempt 1's worker was lost holding the lease (its claim, then nothing); attempt 2 took
    the lease over and succeeded: the page names attempt 1 as a call that may have reached the
    downstream too, and why. A delivery with one attempt names none."""
    source = source_with(sessions, ops, "log")
    [lost, alone] = accept(ops, source, event_type="lease.lost") + accept(ops, source)
    start = datetime.now(UTC) - timedelta(hours=1)
    lease = timedelta(seconds=ops.processing_ttl)
    for at in (start, start + lease + timedelta(seconds=1)):  # the second finds it crashed
        with sessions() as session, session.begin():
            found = transitions.claim(
                session, lost, now=at, lease=lease, max_redeliveries=3, worker=f"w-{at:%S}"
            )
            assert found is not None
    with sessions() as session, session.begin():
        transitions.succeed(session, found, now=start + lease + timedelta(seconds=2))
    page.goto(f"{api.admin_url}/console/deliveries/{lost}")
    outcomes = page.locator("#attempts tr.attempt td:nth-child(4)").all_inner_texts()
    assert outcomes == ["crashed", "succeeded"]
    windows = page.locator("#repeat-windows li").all_inner_texts()
    assert len(windows) == 1
    assert windows[0].startswith("attempt 1: lease taken over")
    page.goto(f"{api.admin_url}/console/deliveries/{alone}")
    assert page.locator("#repeat-windows").count() == 0


def test_a_delivery_shows_the_result_reference_its_handler_returned(
    page: Page, api: Receiver, ops: Settings, sessions: sessionmaker[Session]
) -> None:
    """A success recorded with a result reference (issue 35 item 1) shows it on the delivery's
    page and in its event's deliveries, as text (escaped: a handler's text is not markup)."""
    source = source_with(sessions, ops, "log")
    [done] = accept(ops, source)
    at = datetime.now(UTC) - timedelta(minutes=5)
    lease = timedelta(seconds=ops.processing_ttl)
    with sessions() as session, session.begin():
        found = transitions.claim(
            session, done, now=at, lease=lease, max_redeliveries=3, worker="w-ref"
        )
        assert found is not None
        transitions.succeed(session, found, now=at, result_ref="<b>ord_42</b>")
    page.goto(f"{api.admin_url}/console/deliveries/{done}")
    expect(page.locator("#result-ref")).to_have_text("<b>ord_42</b>")
    # Never replayed: no count "since the last replay" (a replayed one's page has it).
    assert "since the last replay" not in page.inner_text("dl.facts")
    assert page.locator("#result-ref b").count() == 0
    page.locator("dl.facts a").first.click()
    expect(page.locator("#deliveries .result-ref")).to_have_text("<b>ord_42</b>")


def test_events_are_paged_with_a_cursor(
    page: Page, api: Receiver, ops: Settings, sessions: sessionmaker[Session]
) -> None:
    source = source_with(sessions, ops, "log")
    now = datetime.now(UTC)
    for i in range(57):
        accept(ops, source, event_id=f"evt_page_{i:03d}", now=now - timedelta(seconds=i))
    page.goto(f"{api.admin_url}/console/events?source={source.public_id}")
    seen = page.locator("#events tbody td.mono").all_inner_texts()
    page.click("#next")
    page.wait_for_load_state()
    seen += page.locator("#events tbody td.mono").all_inner_texts()
    assert page.locator("#next").count() == 0
    assert seen == [f"evt_page_{i:03d}" for i in range(57)]  # newest first, each once


def test_replay_one_dead_letter_from_its_page_and_watch_it_succeed(
    page: Page,
    api: Receiver,
    worker: Worker,
    broker: Broker,
    ops: Settings,
    sessions: sessionmaker[Session],
    engine: Engine,
) -> None:
    _source, dead = _dead_by_worker(ops, sessions, engine, broker)
    page.goto(f"{api.admin_url}/console/deliveries/{dead}")
    page.click("#replay-one")
    assert page.inner_text("#preview-count") == "1"
    page.fill("#reason", "flaky handler fixed")
    page.click("#confirm-button")
    page.wait_for_url(f"{api.admin_url}/console/replays/*")
    # The page refreshes itself while the replay runs.
    expect(page.locator("#replay-status")).to_have_text("done", timeout=30_000)
    assert page.inner_text("#replay-done") == "1"
    wait_status(engine, dead, "succeeded", timeout=30)
    page.goto(f"{api.admin_url}/console/deliveries/{dead}")
    assert page.inner_text("#status") == "succeeded"
    assert "(1 since the last replay)" in page.inner_text("dl.facts")
    history = page.locator("#attempts tbody tr").all_inner_texts()
    assert len(history) == 3
    assert "dead" in history[0]
    assert "replay #" in history[1]
    assert "by dora (console)" in history[1]
    assert "flaky handler fixed" in history[1]
    assert "succeeded" in history[2]
    assert [a.outcome for a in attempts(engine, dead)] == ["dead", "succeeded"]


def test_bulk_replay_by_filter_replays_exactly_the_previewed_rows(
    page: Page,
    api: Receiver,
    worker: Worker,
    ops: Settings,
    sessions: sessionmaker[Session],
    engine: Engine,
) -> None:
    source = source_with(sessions, ops, "flaky")
    matching = [d for _ in range(4) for d in accept(ops, source, event_type="bulk.failed")]
    other = accept(ops, source, event_type="other.failed")
    kill(sessions, matching + other)
    with engine.connect() as conn:
        dead_matching = conn.execute(
            text(
                "SELECT count(*) FROM deliveries d JOIN receipts r ON r.id = d.receipt_id"
                " WHERE d.source_id = :s AND d.status = 'dead' AND r.event_type LIKE 'bulk.%'"
            ),
            {"s": source.id},
        ).scalar_one()
    page.goto(f"{api.admin_url}/console/dead?source={source.public_id}&type=bulk.*")
    assert page.locator("#dead tbody input.pick").count() == 4
    page.check("#scope-all")
    page.click("#preview-replay")
    assert int(page.inner_text("#preview-count")) == dead_matching == 4
    assert page.locator("#sample tbody tr").count() == 4
    page.fill("#reason", "bulk: downstream back")
    page.fill("#rate", "50")
    page.click("#confirm-button")
    page.wait_for_url(f"{api.admin_url}/console/replays/*")
    replay_id = int(page.url.rsplit("/", 1)[1])
    expect(page.locator("#replay-status")).to_have_text("done", timeout=30_000)
    for d in matching:
        wait_status(engine, d, "succeeded", timeout=30)
    assert _status(engine, other) == {other[0]: "dead"}  # not matching: untouched
    with engine.connect() as conn:
        row = conn.execute(text("SELECT * FROM replays WHERE id = :i"), {"i": replay_id}).one()
    assert (row.operator, row.reason, row.via, row.status) == (
        "dora", "bulk: downstream back", "console", "done",
    )  # fmt: skip
    assert (row.planned, row.replayed, row.skipped) == (4, 4, 0)
    assert row.filter == {"source": source.public_id, "type": "bulk.*", "status": "dead"}
    # The audit page shows it under the operator.
    page.goto(f"{api.admin_url}/console/audit?operator=dora&action=replay")
    audited = page.locator(f"#audit tr[data-kind=replay][data-id='{replay_id}']")
    assert audited.locator("td.operator").inner_text() == "dora"
    assert audited.locator("td.reason").inner_text() == "bulk: downstream back"
    page.goto(f"{api.admin_url}/console/audit?operator=eve")
    assert page.locator(f"#audit tr[data-id='{replay_id}']").count() == 0


def test_a_bulk_confirmation_replays_the_frozen_preview_not_rows_dead_since(
    page: Page,
    api: Receiver,
    worker: Worker,
    ops: Settings,
    sessions: sessionmaker[Session],
    engine: Engine,
) -> None:
    """The preview freezes the matching ids (the sample shows the first 10 of 12); a delivery
    that dies after the preview, matching the same filter, is not part of the replay."""
    source = source_with(sessions, ops, "flaky")
    matching = [d for _ in range(12) for d in accept(ops, source, event_type="frozen.failed")]
    kill(sessions, matching)
    page.goto(f"{api.admin_url}/console/dead?source={source.public_id}&type=frozen.*")
    page.check("#scope-all")
    page.click("#preview-replay")
    assert page.inner_text("#preview-count") == "12"
    assert page.locator("#sample tbody tr").count() == 10
    late = accept(ops, source, event_type="frozen.failed")
    kill(sessions, late)  # matches the filter now, after the preview
    page.fill("#reason", "frozen: downstream back")
    page.fill("#rate", "50")
    page.click("#confirm-button")
    page.wait_for_url(f"{api.admin_url}/console/replays/*")
    replay_id = int(page.url.rsplit("/", 1)[1])
    expect(page.locator("#replay-status")).to_have_text("done", timeout=30_000)
    for d in matching:
        wait_status(engine, d, "succeeded", timeout=30)
    assert _status(engine, late) == {late[0]: "dead"}
    with engine.connect() as conn:
        row = conn.execute(text("SELECT * FROM replays WHERE id = :i"), {"i": replay_id}).one()
    assert (row.planned, row.replayed, row.skipped) == (12, 12, 0)


def test_a_running_replay_can_be_cancelled(
    page: Page, api: Receiver, ops: Settings, sessions: sessionmaker[Session], engine: Engine
) -> None:
    source = source_with(sessions, ops, "log")
    ids = [d for _ in range(6) for d in accept(ops, source, event_type="slow.replay")]
    kill(sessions, ids)
    page.goto(f"{api.admin_url}/console/dead?source={source.public_id}")
    page.check("#select-all")
    page.click("#preview-replay")
    assert page.inner_text("#preview-count") == "6"
    page.fill("#reason", "cancel me")
    page.fill("#rate", "0.5")  # one every two seconds
    page.click("#confirm-button")
    page.wait_for_url(f"{api.admin_url}/console/replays/*")
    page.click("#cancel")
    expect(page.locator("#replay-status")).to_have_text("cancelled", timeout=15_000)
    replay_id = int(page.url.rsplit("/", 1)[1])
    with engine.connect() as conn:
        row = conn.execute(text("SELECT * FROM replays WHERE id = :i"), {"i": replay_id}).one()
    assert row.status == "cancelled"
    assert row.ended_at is not None
    still_dead = [d for d, st in _status(engine, ids).items() if st == "dead"]
    assert row.replayed < 6
    assert len(still_dead) == 6 - row.replayed  # what it did not reach stays dead
    # Issue 34 item 5: the cancel is audited, under the operator who pressed it.
    with engine.connect() as conn:
        audited = conn.execute(
            text("SELECT operator, via FROM audit_log WHERE action = 'replay.cancel'"
                 " AND target = CAST(:t AS jsonb)"),
            {"t": f'{{"replay": {replay_id}}}'},
        ).all()  # fmt: skip
    assert [tuple(a) for a in audited] == [("dora", "console")]


def test_discard_with_a_reason_is_audited_under_the_operator(
    context: BrowserContext, api: Receiver, ops: Settings, sessions: sessionmaker[Session],
    engine: Engine,
) -> None:  # fmt: skip
    page = login(context, api, OTHER_TOKEN)  # eve
    source = source_with(sessions, ops, "log")
    [d1] = accept(ops, source)
    [d2] = accept(ops, source)
    kill(sessions, [d1, d2])
    page.goto(f"{api.admin_url}/console/dead?source={source.public_id}")
    page.check(f"#dead input.pick[value='{d1}']")
    page.click("#preview-discard")
    assert page.inner_text("#preview-count") == "1"
    plan = page.input_value("#confirm input[name=plan]")
    csrf = page.input_value("#confirm input[name=csrf]")
    page.fill("#reason", "test junk")
    page.click("#confirm-button")
    assert "Discarded 1 of 1 planned" in page.inner_text("#result")
    assert _status(engine, [d1, d2]) == {d1: "discarded", d2: "dead"}
    with engine.connect() as conn:
        row = conn.execute(
            text("SELECT * FROM audit_log WHERE action = 'discard' AND target = CAST(:t AS jsonb)"),
            {"t": f'{{"ids": [{d1}]}}'},
        ).one()
    assert (row.operator, row.reason, row.via, row.count) == ("eve", "test junk", "console", 1)
    # A preview is confirmed once: the same plan again is refused, and another operator's
    # session cannot confirm it either.
    again = page.context.request.post(
        f"{api.admin_url}/console/dead/confirm",
        form={"csrf": csrf, "plan": plan, "reason": "again"},
    )
    assert again.status == 400
    assert "expired or was already confirmed" in again.text()
    with engine.connect() as conn:
        count = conn.execute(
            text("SELECT count(*) FROM audit_log WHERE action = 'discard' AND reason = 'again'")
        ).scalar_one()
    assert count == 0


def test_routes_pause_resume_and_remove_follow_the_cli_rules(
    page: Page, api: Receiver, ops: Settings, sessions: sessionmaker[Session], engine: Engine
) -> None:
    source = source_with(sessions, ops, "log")
    [delivery] = accept(ops, source)
    kill(sessions, [delivery])
    route = source.route_ids[0]
    page.goto(f"{api.admin_url}/console/routes")
    row = page.locator(f"tr[data-route='{route}']")
    row.locator("form.route-change input[name=reason]").fill("downstream maintenance")
    row.locator("button:text-is('Pause')").click()
    page.wait_for_url(f"{api.admin_url}/console/routes")
    row = page.locator(f"tr[data-route='{route}']")
    assert "paused" in row.locator("td.route-state").inner_text()
    assert "downstream maintenance" in row.locator("td.route-state").inner_text()
    row.locator("form.route-change input[name=reason]").fill("back")
    row.locator("button:text-is('Resume')").click()
    page.wait_for_url(f"{api.admin_url}/console/routes")
    row = page.locator(f"tr[data-route='{route}']")
    assert row.locator("td.route-state").inner_text() == "active"
    # A route with a dead letter cannot be removed (the CLI's rule): refused, nothing changed.
    row.locator("form.route-change input[name=reason]").fill("cleanup")
    with page.expect_response(lambda r: r.url.endswith(f"/routes/{route}/remove")) as answer:
        row.locator("button:text-is('Remove')").click()
    assert answer.value.status == 409
    assert "still has 1 dead" in page.inner_text("#message")
    # The refusal links back to where the operator was (the console sends no Referer).
    assert page.inner_text("#back") == "Back to the sources and routes"
    page.click("#back")
    page.wait_for_url(f"{api.admin_url}/console/routes")
    with engine.connect() as conn:
        actions = conn.execute(
            text("SELECT action, operator, reason, via FROM audit_log"
                 " WHERE target->>'route' = :r AND via = 'console' ORDER BY id"),
            {"r": str(route)},
        ).all()  # fmt: skip
        exists = conn.execute(text("SELECT count(*) FROM routes WHERE id = :r"), {"r": route})
        assert exists.scalar_one() == 1
    assert [tuple(a) for a in actions] == [
        ("route.pause", "dora", "downstream maintenance", "console"),
        ("route.resume", "dora", "back", "console"),
    ]


def test_an_open_watchdog_finding_is_a_banner_on_the_overview_and_the_source_until_closed(
    page: Page, api: Receiver, ops: Settings, sessions: sessionmaker[Session]
) -> None:
    """Issue 38 item 1: a Stripe endpoint disabled at the provider (a local stand-in of its
    API), found by `webhooks sources check`, shows on the overview, the source's overview and
    its section of the sources page; enabled again and checked, the banner is gone."""
    key = f"rk_test_{secrets.token_hex(12)}"
    remember(key)
    fake = FakeStripe(key)
    source = source_with(sessions, ops, "log", provider="stripe")
    with serving(fake):
        updated = cli(
            "sources", "update", source.name, "--api-key", key,
            "--config", f"api_base={fake.url}", "--config", f"endpoint_id={fake.endpoint_id}",
            env=ops_env(),
        )  # fmt: skip
        assert updated.returncode == 0, updated.stderr
        fake.endpoint_status = "disabled"
        assert cli("sources", "check", source.name, env=ops_env()).returncode == 1
        finding = f"[data-finding='{source.public_id}:disabled']"
        for path in ("/console/", f"/console/?source={source.public_id}"):
            page.goto(f"{api.admin_url}{path}")
            banner = page.locator(f"[role=alert]:has({finding})")
            expect(banner).to_be_visible()
            said = page.locator(finding).inner_text()
            assert f"{source.name} disabled since" in said
            assert "stripe has the endpoint disabled" in said
            assert banner.locator("a[href*='provider-side']").count() == 1
        page.goto(f"{api.admin_url}/console/routes")
        expect(page.locator(f"section[data-source='{source.public_id}'] {finding}")).to_be_visible()

        fake.endpoint_status = "enabled"
        assert cli("sources", "check", source.name, env=ops_env()).returncode == 0
        for path in ("/console/", f"/console/?source={source.public_id}", "/console/routes"):
            page.goto(f"{api.admin_url}{path}")
            expect(page.locator(finding)).to_have_count(0)


@pytest.mark.parametrize(
    ("path", "back"),
    [
        ("/console/replays/7/cancel", ("/console/replays/7", "replay 7")),
        ("/console/dead/confirm", ("/console/dead", "the dead letters")),
        ("/console/events/999", ("/console/events", "the events")),
        ("/console/ledger", ("/console/events", "the events")),
        ("/console/sources/src_x/pause", ("/console/routes", "the sources and routes")),
        ("/console/nowhere", ("/console/", "the overview")),
        ("/console/", ("/console/", "the overview")),
    ],
)
def test_a_refusal_links_back_to_the_page_it_came_from(path: str, back: tuple[str, str]) -> None:
    assert back_to(path) == back


def test_the_docs_are_one_click_away_and_a_refusal_links_to_its_section(
    page: Page, api: Receiver
) -> None:
    """Issue 36 item 4: the nav's Docs, a refusal's link to the section explaining it, the
    section's anchor on the rendered page, and the page's pictures served under the CSP."""
    page.click("nav >> text=Docs")
    page.wait_for_url(f"{api.admin_url}/console/docs")
    page.click("#docs-pages >> text=Operating it")
    assert page.locator("#docs h1").inner_text() == "Operating it"
    shots = page.locator("#docs img")
    assert shots.count() >= 5
    first = shots.first
    first.scroll_into_view_if_needed()
    assert first.evaluate("img => img.complete && img.naturalWidth > 0")
    refused = page.goto(f"{api.admin_url}/console/replays/999999")
    assert refused is not None
    assert refused.status == 404
    link = page.locator("#doc")
    topic = TOPICS["dead-letters"]
    assert link.get_attribute("href") == topic.href
    link.click()
    page.wait_for_url(f"{api.admin_url}{topic.href}")
    assert page.locator(f"#{topic.anchor}").inner_text() == topic.heading
    missing = page.goto(f"{api.admin_url}/console/docs/..%2Fpyproject")
    assert missing is not None
    assert missing.status == 404
    assert httpx.get(f"{api.admin_url}/console/docs/operating").status_code in {302, 303, 307}


def _series(page: Page, chart: str, series: str) -> list[str]:
    values = page.locator(f'figure[data-chart="{chart}"] g[data-series="{series}"]')
    return (values.get_attribute("data-values") or "").split(",")


def test_the_overview_charts_a_seeded_hour_per_source_and_route(
    page: Page, api: Receiver, ops: Settings, sessions: sessionmaker[Session]
) -> None:
    """Issue 36 item 4: accepted, succeeded, retried and dead per minute over the last hour
    and day, and the receipt-to-success p50 and p99, as inline SVG from the database, for a
    source and for a route."""
    source = source_with(sessions, ops, "log")
    now = datetime.now(UTC)
    ago = [now - timedelta(minutes=m) for m in (50, 30, 30, 10)]
    first, second, third, fourth = (accept(ops, source, now=at)[0] for at in ago)
    succeed(sessions, [first], at=ago[0] + timedelta(seconds=60))
    succeed(sessions, [second], at=ago[1] + timedelta(seconds=90))
    retry(sessions, [third], at=ago[2] + timedelta(minutes=5))
    kill(sessions, [fourth], at=ago[3] + timedelta(minutes=5))
    for scope in (f"source={source.public_id}", f"route={source.route_ids[0]}"):
        page.goto(f"{api.admin_url}/console/?{scope}")
        assert page.locator("svg[role=img]").count() == 4  # events and lag, hour and day
        hour = {
            name: [int(v) for v in _series(page, "Events, last hour", name)]
            for name in ("accepted", "succeeded", "retrying", "dead")
        }
        assert all(len(values) == 60 for values in hour.values())
        assert {name: sum(values) for name, values in hour.items()} == {
            "accepted": 4,
            "succeeded": 2,
            "retrying": 1,
            "dead": 1,
        }
        # Each in its minute: 50, 30 (two) and 10 minutes ago; a success 1 minute after.
        accepted = [i for i, n in enumerate(hour["accepted"]) for _ in range(n)]
        assert [i - accepted[0] for i in accepted] == [0, 20, 20, 40]
        assert hour["succeeded"].index(1) - accepted[0] in (1, 2)
        assert sum(int(v) for v in _series(page, "Events, last day", "accepted")) == 4
        lag = [float(v) for v in _series(page, "Receipt to success, last hour", "p50") if v]
        assert len(lag) == 2
        for shown, seconds in zip(lag, (60, 90), strict=True):  # binned: within 4.4%
            assert abs(shown - seconds) <= 0.045 * seconds, lag
        assert "accepted: 4" in page.inner_text('figure[data-chart="Events, last hour"]')
    assert page.inner_text("#charts-of").startswith(f"Activity of route {source.route_ids[0]}")
    page.goto(f"{api.admin_url}/console/?source=src_nope")
    assert "no such source" in page.inner_text("#message")
    assert page.inner_text("#back") == "Back to the overview"


def test_a_source_and_its_routes_are_created_and_limited_from_the_page(
    page: Page, api: Receiver, engine: Engine
) -> None:
    """Issue 36 item 4: a source created in the page (its generated secret shown once, and it
    signs a webhook the receiver accepts), a route and a forward route added (the forward's
    signing secret shown once), a route's limits set; each audited under the operator, via
    the console. Bad input: a clear refusal, nothing created."""
    name = f"made-in-console-{secrets.token_hex(3)}"
    page.goto(f"{api.admin_url}/console/routes")
    page.click("#new-source summary")
    page.fill("#new-source input[name=name]", name)
    page.select_option("#new-source select[name=provider]", "stripe")
    with page.expect_response(lambda r: r.url.endswith("/console/sources/new")) as answer:
        page.click("#new-source button[type=submit]")
    assert answer.value.status == 201
    facts = dict(zip(page.locator("#created dt").all_inner_texts(),
                     page.locator("#created dd").all_inner_texts(), strict=True))  # fmt: skip
    public_id = facts["source id"]
    secret = page.inner_text("#secret").strip()
    remember(secret)
    assert secret.startswith("whsec_")
    assert facts["url path"] == f"/webhooks/{public_id}"
    headers, body = sign("stripe", secret, event_id="evt_console_made")
    sent = httpx.post(f"{api.url}/webhooks/{public_id}", headers=headers, content=body)
    assert (sent.status_code, sent.json()["status"]) == (202, "accepted"), sent.text

    page.click("#back")
    section = page.locator(f"section[data-source='{public_id}']")
    section.locator("details.create summary").click()
    section.locator("select[name=handler]").select_option("log")
    section.locator("input[name=events]").fill("invoice.*")
    section.locator("form.add-route button[type=submit]").click()
    assert page.inner_text("h1") == "Created: route " + page.inner_text("#created dd") + (
        ": log for invoice.*"
    )
    assert page.locator("#secret").count() == 0  # a log route has no secret
    page.click("#back")
    section = page.locator(f"section[data-source='{public_id}']")
    section.locator("details.create summary").click()
    section.locator("select[name=handler]").select_option("forward")
    section.locator("input[name=url]").fill("https://downstream.example/hooks")
    section.locator("form.add-route button[type=submit]").click()
    forward_id = int(page.inner_text("#created dd"))
    signing = page.inner_text("#secret").strip()
    remember(signing)
    assert signing.startswith("whsec_")

    page.click("#back")
    row = page.locator(f"tr[data-route='{forward_id}']")
    row.locator("input[name=rate]").fill("50/s")
    row.locator("input[name=max_in_flight]").fill("8")
    row.locator("form.route-limits input[name=reason]").fill("downstream asked for 50/s")
    row.locator("form.route-limits button").click()
    page.wait_for_url(f"{api.admin_url}/console/routes")
    with engine.connect() as conn:
        limits = conn.execute(
            text("SELECT rate_count, rate_period_s, max_in_flight FROM routes WHERE id = :r"),
            {"r": forward_id},
        ).one()
        audited = conn.execute(
            text(
                "SELECT action, operator, via FROM audit_log WHERE target->>'source' = :s"
                " ORDER BY id"
            ),
            {"s": public_id},
        ).all()
    assert tuple(limits) == (50, 1, 8)
    assert [tuple(a) for a in audited] == [
        ("source.add", "dora", "console"),
        ("route.add", "dora", "console"),
        ("route.add", "dora", "console"),
        ("route.limits", "dora", "console"),
    ]

    # Bad input: refused with the reason, nothing created or changed.
    csrf = page.input_value("header .logout input[name=csrf]")
    request = page.context.request
    for path, form, says in (
        ("/console/sources/new", {"name": "", "provider": "stripe"}, "name must not be empty"),
        ("/console/sources/new", {"name": name, "provider": "stripe"}, "already has a source"),
        ("/console/sources/new", {"name": "x", "provider": "nope"}, "nope"),
        (f"/console/sources/{public_id}/routes", {"handler": "no_such"}, "no_such"),
        (f"/console/sources/{public_id}/routes", {"handler": "forward"}, "url"),
        (f"/console/routes/{forward_id}/limits", {"rate": "fast", "reason": "x"}, "rate limit"),
    ):
        refused = request.post(f"{api.admin_url}{path}", form={"csrf": csrf, **form})
        assert refused.status == 400, (path, form)
        assert says in refused.text(), (path, refused.text())
    with engine.connect() as conn:
        count = conn.execute(
            text(
                "SELECT (SELECT count(*) FROM sources WHERE name IN (:n, 'x')),"
                " (SELECT count(*) FROM routes r JOIN sources s ON s.id = r.source_id"
                "  WHERE s.public_id = :s)"
            ),
            {"n": name, "s": public_id},
        ).one()
    assert tuple(count) == (1, 2)


def test_the_overview_counts_per_route_and_shows_pause_state(
    page: Page, api: Receiver, ops: Settings, sessions: sessionmaker[Session]
) -> None:
    source = source_with(sessions, ops, "log", "flaky")
    log_route, flaky_route = source.route_ids
    for i in range(3):
        accept(ops, source, event_type=f"count.{i}")
    with sessions() as s:
        flaky = s.scalars(
            text("SELECT id FROM deliveries WHERE route_id = :r ORDER BY id LIMIT 2"),
            {"r": flaky_route},
        ).all()
    kill(sessions, list(flaky))  # two of the flaky route's three deliveries dead
    with sessions() as s, s.begin():
        breaker.set_paused(s, log_route, True, Change("dora", "overview test"), now=None)
    page.goto(f"{api.admin_url}/console/")
    for window in ("hour", "day"):
        cells = page.locator(f"tr[data-window={window}][data-route='{flaky_route}'] td")
        # source, accepted, route, succeeded, retrying, dead, pending
        assert cells.all_inner_texts()[1:] == ["3", f"{flaky_route} flaky", "0", "0", "2", "1"]
        cells = page.locator(f"tr[data-window={window}][data-route='{log_route}'] td")
        assert cells.all_inner_texts()[5:] == ["0", "3"]
    state = page.locator(f"tr[data-state-route='{log_route}'] td").all_inner_texts()
    assert state[2:] == ["paused", "closed"]
    assert int(page.inner_text("#backlog")) >= 4  # these, and whatever other tests left
    assert page.locator("a[href='/metrics']").count() == 1


# attacker-controlled values ------------------------------------------------------------------

XSS_TYPE = "<img src=x onerror=alert('type')>"
XSS_BODY = "<script>alert('body')</script><img src=x onerror=alert('body2')>"
XSS_HEADER = "application/json; x=\"<script>alert('header')</script>\""


def test_xss_in_a_body_a_header_and_an_event_type_renders_as_text(
    page: Page, api: Receiver, ops: Settings, sessions: sessionmaker[Session], engine: Engine
) -> None:
    source = source_with(sessions, ops, "flaky", provider="standard")
    event_id = f"evt_xss_{uuid.uuid4().hex[:8]}"
    headers, body = sign(
        "standard", source.secret, event_id=event_id,
        body_obj={"type": XSS_TYPE, "data": {"note": XSS_BODY}},
    )  # fmt: skip
    headers["Content-Type"] = XSS_HEADER
    sent = httpx.post(f"{api.url}/webhooks/{source.public_id}", headers=headers, content=body)
    assert sent.status_code == 202, sent.text
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.goto(f"{api.admin_url}/console/events?source={source.public_id}")
    assert page.locator("#events td.type").all_inner_texts() == [XSS_TYPE]
    page.click("#events tbody a")
    assert page.inner_text("#event-type") == XSS_TYPE
    assert XSS_BODY in page.inner_text("#payload")
    assert XSS_HEADER in page.inner_text("#headers")
    with engine.connect() as conn:
        delivery = conn.execute(
            text("SELECT d.id FROM deliveries d JOIN receipts r ON r.id = d.receipt_id"
                 " WHERE r.event_id = :e"), {"e": event_id},
        ).scalar_one()  # fmt: skip
    wait_status(engine, delivery, "dead", timeout=30)  # the worker ran the flaky handler
    for path in (
        f"/console/deliveries/{delivery}",
        f"/console/dead?source={source.public_id}",
        "/console/",
    ):
        page.goto(f"{api.admin_url}{path}")
    page.goto(f"{api.admin_url}/console/dead?source={source.public_id}")
    page.check("#select-all")
    page.click("#preview-replay")
    assert XSS_TYPE in page.inner_text("#sample")
    assert page.locator("img").count() == 0  # no element was made of the payload
    assert page.locator("script").count() == 1  # ours only
    assert dialogs == []


def test_the_pages_fit_a_390_pixel_wide_phone(
    browser: Browser, api: Receiver, ops: Settings, sessions: sessionmaker[Session]
) -> None:
    source = source_with(sessions, ops, "log")
    [delivery] = accept(ops, source, event_type="phone." + "long_segment_" * 8)
    kill(sessions, [delivery], worker="celery@webhooks-worker-7f9c2d.internal:4242")
    ctx = browser.new_context(viewport={"width": 390, "height": 844})
    try:
        page = login(ctx, api)
        with sessions() as s:
            receipt = s.execute(
                text("SELECT receipt_id FROM deliveries WHERE id = :d"), {"d": delivery}
            ).scalar_one()
        for path in (
            "/console/",
            f"/console/events?source={source.public_id}",
            f"/console/events/{receipt}",
            f"/console/deliveries/{delivery}",
            f"/console/dead?source={source.public_id}",
            "/console/routes",
            "/console/audit",
            "/console/drift",
            "/console/login",
        ):
            page.goto(f"{api.admin_url}{path}")
            width = page.evaluate("document.scrollingElement.scrollWidth")
            assert width <= 390, (path, width)
            # Nothing breaks mid-word: a status pill and a worker's name stay on one line.
            assert page.evaluate(WRAPPED, ".pill, td.worker") == [], path
    finally:
        ctx.close()
