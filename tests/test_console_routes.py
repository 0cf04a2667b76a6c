"""A route's transform and lane options changed on an existing route (issue 37's left-overs):
by the console (Playwright driving Debian's chromium against the real receiver) and by the
admin API (``PATCH /admin/routes/{id}``), with the checks of ``webhooks routes update``: a
bad expression is one error with its position and nothing is saved, no audit row either;
each change writes the CLI's audit row (``route.transform``, ``route.lanes``, before and
after) under the operator, ``via: console`` or ``api``."""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlencode

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core.settings import Settings
from tests.leakcheck import remember
from tests.operators_support import ops_receiver, source_with
from tests.processes import Receiver

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]
TOKEN = "adm_routes37_" + secrets.token_urlsafe(24)
remember(TOKEN)


@pytest.fixture(scope="module")
def rcv(ops: Settings) -> Iterator[Receiver]:
    with ops_receiver(None, WEBHOOKS_ADMIN_TOKENS=f"rita:{TOKEN}") as running:
        yield running


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if shutil.which(CHROMIUM) is None:  # make install installs it (Debian's chromium)
        pytest.skip(f"{CHROMIUM} is missing: run `make install` (as root)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser: Browser, rcv: Receiver) -> Iterator[Page]:
    ctx = browser.new_context()
    page = ctx.new_page()
    page.goto(f"{rcv.admin_url}/console/login")
    page.fill("#token", TOKEN)
    page.click("button[type=submit]")
    page.wait_for_url(f"{rcv.admin_url}/console/")
    yield page
    ctx.close()


def _route(engine: Engine, route_id: int) -> Any:
    with engine.connect() as conn:
        return conn.execute(
            text(
                "SELECT filter, transform, order_key, lane_on_dead, supersede FROM routes"
                " WHERE id = :r"
            ),
            {"r": route_id},
        ).one()


def _audits(engine: Engine, route_id: int) -> list[Any]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                text(
                    "SELECT action, operator, via, reason, target->'before' AS before,"
                    " target->'after' AS after FROM audit_log"
                    " WHERE (target->>'route')::bigint = :r AND action LIKE 'route.%' AND action <> 'route.add'"
                    " ORDER BY id"
                ),
                {"r": route_id},
            ).all()
        )


def _lanes(key: str | None, on_dead: str, supersede: bool) -> dict[str, Any]:
    return {"order_key": key, "lane_on_dead": on_dead, "supersede": supersede}


# -- the console ---------------------------------------------------------------------------


def test_the_console_sets_a_routes_transform_and_lanes_and_refuses_a_bad_order_key(
    page: Page, rcv: Receiver, ops: Settings, sessions: sessionmaker[Session], engine: Engine
) -> None:
    """On the routes page: the lanes form saves an order key, ``skip`` and supersede (one
    ``route.lanes`` audit row, before and after, the session's operator, ``via: console``),
    the transform form saves ``data_object`` (``route.transform``), and the page then shows
    them. An order key that does not parse is one error with its position: nothing saved,
    no audit row."""
    source = source_with(sessions, ops, "log")
    route = source.route_ids[0]
    routes_url = f"{rcv.admin_url}/console/routes"
    page.goto(routes_url)
    lanes = page.locator(f"tr[data-route='{route}'] form.route-lanes")
    lanes.locator("input[name=order_key]").fill("body.data.customer")
    lanes.locator("select[name=lane_on_dead]").select_option("skip")
    lanes.locator("input[name=supersede]").check()
    lanes.locator("input[name=reason]").fill("order per customer")
    lanes.locator("button:text-is('Set lanes')").click()
    page.wait_for_url(routes_url)
    assert tuple(_route(engine, route)) == (None, None, "body.data.customer", "skip", True)

    shaped = page.locator(f"tr[data-route='{route}'] form.route-transform")
    shaped.locator("select[name=transform]").select_option("data_object")
    shaped.locator("input[name=reason]").fill("only the object")
    shaped.locator("button:text-is('Set transform')").click()
    page.wait_for_url(routes_url)
    assert _route(engine, route).transform == "data_object"

    row = page.locator(f"tr[data-route='{route}']")
    expect(row.locator(".lanes")).to_have_text(
        "lanes: order key body.data.customer, on dead: skip, supersede"
    )
    expect(row.locator("form.route-transform select[name=transform]")).to_have_value("data_object")
    expect(row.locator("form.route-lanes input[name=supersede]")).to_be_checked()
    audited = [tuple(a) for a in _audits(engine, route)]
    assert audited == [
        (
            "route.lanes",
            "rita",
            "console",
            "order per customer",
            _lanes(None, "block", False),
            _lanes("body.data.customer", "skip", True),
        ),
        ("route.transform", "rita", "console", "only the object", None, "data_object"),
    ]

    # A bad order key: one error naming the position; the route and the audit unchanged.
    before, audits = tuple(_route(engine, route)), len(audited)
    lanes = page.locator(f"tr[data-route='{route}'] form.route-lanes")
    lanes.locator("input[name=order_key]").fill("body.(")
    lanes.locator("select[name=lane_on_dead]").select_option("block")
    lanes.locator("input[name=reason]").fill("typo")
    with page.expect_response(f"{rcv.admin_url}/console/routes/{route}/lanes") as answer:
        lanes.locator("button:text-is('Set lanes')").click()
    assert answer.value.status == 400
    message = page.locator("main").inner_text()
    assert message.count("order key refused") == 1, message
    assert "order key refused at position 5: unexpected '('" in message
    assert tuple(_route(engine, route)) == before
    assert len(_audits(engine, route)) == audits

    # Cleared from the same forms: the order key emptied (no supersede), no transform.
    page.goto(routes_url)
    lanes = page.locator(f"tr[data-route='{route}'] form.route-lanes")
    lanes.locator("input[name=order_key]").fill("")
    lanes.locator("input[name=supersede]").uncheck()
    lanes.locator("input[name=reason]").fill("unordered again")
    lanes.locator("button:text-is('Set lanes')").click()
    page.wait_for_url(routes_url)
    shaped = page.locator(f"tr[data-route='{route}'] form.route-transform")
    shaped.locator("select[name=transform]").select_option("")
    shaped.locator("input[name=reason]").fill("as received")
    shaped.locator("button:text-is('Set transform')").click()
    page.wait_for_url(routes_url)
    assert tuple(_route(engine, route)) == (None, None, None, "skip", False)


def test_the_console_refuses_supersede_on_a_source_without_a_signed_time(
    page: Page, rcv: Receiver, ops: Settings, sessions: sessionmaker[Session], engine: Engine
) -> None:
    """GitHub signs no event time: supersede is refused in one line, nothing saved (the
    order key given with it neither)."""
    source = source_with(sessions, ops, "log", provider="github")
    route = source.route_ids[0]
    page.goto(f"{rcv.admin_url}/console/routes")
    lanes = page.locator(f"tr[data-route='{route}'] form.route-lanes")
    lanes.locator("input[name=order_key]").fill("body.repository.id")
    lanes.locator("input[name=supersede]").check()
    lanes.locator("input[name=reason]").fill("try")
    with page.expect_response(f"{rcv.admin_url}/console/routes/{route}/lanes") as answer:
        lanes.locator("button:text-is('Set lanes')").click()
    assert answer.value.status == 400
    assert "github events carry no event time" in page.locator("main").inner_text()
    assert tuple(_route(engine, route)) == (None, None, None, "block", False)
    assert _audits(engine, route) == []


def _shown(page: Page) -> list[str]:
    """The public ids of the sources the routes page shows, in its order."""
    return [str(s.get_attribute("data-source")) for s in page.locator("section.source").all()]


def test_the_routes_page_shows_a_page_of_sources_newest_first_and_finds_them(
    page: Page, rcv: Receiver, ops: Settings, sessions: sessionmaker[Session], engine: Engine
) -> None:
    """27 sources: a search by a part of their name shows the newest 25 (with their routes'
    forms) and a link to the older ones; the next page the last 2 and a link back. An action
    taken on the second page returns to it (the form carries the view back, and only the
    view: a ``back`` naming another site leads to the routes page). A search holding ``%``
    or ``_`` matches them as characters; an unknown cursor is one clear error."""
    prefix = f"paged-{secrets.token_hex(4)}"
    made = [source_with(sessions, ops, "log", name=f"{prefix}-{i:02d}") for i in range(27)]
    newest_first = [m.public_id for m in reversed(made)]
    routes_url = f"{rcv.admin_url}/console/routes"
    page.goto(f"{routes_url}?q={prefix.upper()}")
    assert _shown(page) == newest_first[:25]
    assert page.locator("section.source form.route-lanes").count() == 25
    page.locator("a#next").click()
    page.wait_for_url(f"{routes_url}?q={prefix.upper()}&after={newest_first[24]}")
    assert _shown(page) == newest_first[25:]
    assert page.locator("a#next").count() == 0
    expect(page.locator("a#first")).to_have_attribute("href", f"/console/routes?q={prefix.upper()}")

    # Paused from the second page: back on the second page, the route paused.
    second = page.url
    route = made[0].route_ids[0]
    change = page.locator(f"tr[data-route='{route}'] form.route-change")
    change.locator("input[name=reason]").fill("maintenance")
    change.locator("button:text-is('Pause')").click()
    page.wait_for_url(second)
    with engine.connect() as conn:
        paused = conn.execute(
            text("SELECT paused_at IS NOT NULL FROM routes WHERE id = :r"), {"r": route}
        ).scalar_one()
    assert paused
    expect(page.locator(f"tr[data-route='{route}'] td.route-state")).to_contain_text("paused")

    # A back that names another site: only the view is read from it.
    change = page.locator(f"tr[data-route='{route}'] form.route-change")
    change.locator("input[name=back]").evaluate(
        "e => e.value = 'https://elsewhere.example/x?q=' + encodeURIComponent('https://elsewhere.example/')"
    )
    change.locator("input[name=reason]").fill("done")
    change.locator("button:text-is('Resume')").click()
    page.wait_for_url(f"{routes_url}")
    assert page.url == routes_url

    # `%` and `_` are characters of the search, not patterns.
    # As patterns, "<prefix>%" would match all 27 and "<prefix>_0" the first ten.
    for literal in (f"{prefix}%", f"{prefix}_0"):
        page.goto(f"{routes_url}?{urlencode({'q': literal})}")
        assert _shown(page) == []
        expect(page.locator("main")).to_contain_text(f"No source's name or id holds “{literal}”.")
    answer = page.goto(f"{routes_url}?after=src_nosuchsource")
    assert answer is not None
    assert answer.status == 404
    expect(page.locator("main")).to_contain_text("no such source 'src_nosuchsource'")


# -- the admin API -------------------------------------------------------------------------


def _patch(rcv: Receiver, route: int, body: dict[str, Any]) -> httpx.Response:
    return httpx.patch(
        f"{rcv.admin_url}/admin/routes/{route}",
        json=body,
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=10,
    )


def test_the_admin_api_changes_a_routes_filter_transform_and_lanes(
    rcv: Receiver, ops: Settings, sessions: sessionmaker[Session], engine: Engine
) -> None:
    """PATCH with the fields to change: each audited as the CLI does (``via: api``, the
    token's name), the answer is the route as GET shows it; null clears."""
    route = source_with(sessions, ops, "log").route_ids[0]
    answer = _patch(
        rcv,
        route,
        {
            "reason": "by api",
            "filter": "type == 'a'",
            "transform": "data_object",
            "order_key": "body.customer",
            "lane_on_dead": "skip",
            "supersede": True,
        },
    )
    assert answer.status_code == 200, answer.text
    view = answer.json()
    assert (view["filter"], view["transform"], view["order_key"]) == (
        "type == 'a'",
        "data_object",
        "body.customer",
    )
    assert (view["lane_on_dead"], view["supersede"]) == ("skip", True)
    assert tuple(_route(engine, route)) == (
        "type == 'a'",
        "data_object",
        "body.customer",
        "skip",
        True,
    )
    assert [tuple(a) for a in _audits(engine, route)] == [
        ("route.filter", "rita", "api", "by api", None, "type == 'a'"),
        ("route.transform", "rita", "api", "by api", None, "data_object"),
        (
            "route.lanes",
            "rita",
            "api",
            "by api",
            _lanes(None, "block", False),
            _lanes("body.customer", "skip", True),
        ),
    ]

    # Only what is given changes; null clears (supersede off first: it needs the key).
    answer = _patch(rcv, route, {"reason": "less", "transform": None, "supersede": False})
    assert answer.status_code == 200, answer.text
    answer = _patch(rcv, route, {"reason": "unordered", "order_key": None})
    assert answer.status_code == 200, answer.text
    assert tuple(_route(engine, route)) == ("type == 'a'", None, None, "skip", False)
    shown = httpx.get(
        f"{rcv.admin_url}/admin/routes/{route}",
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=10,
    ).json()
    assert (shown["transform"], shown["order_key"], shown["filter"]) == (None, None, "type == 'a'")


@pytest.mark.parametrize(
    ("body", "reason", "detail"),
    [
        ({"filter": "type == "}, "bad_filter", "filter refused at position 8: Incomplete"),
        ({"order_key": "body.("}, "bad_filter", "order key refused at position 5: unexpected"),
        ({"transform": "reshap"}, "bad_transform", "unknown transform 'reshap'"),
        ({"supersede": True}, "bad_source", "--supersede needs --order-key"),
        ({"lane_on_dead": "wait"}, "bad_input", "body.lane_on_dead: "),
        ({}, "bad_input", "nothing to change"),
    ],
)
def test_the_admin_api_refuses_a_bad_route_change_and_saves_nothing(
    rcv: Receiver,
    ops: Settings,
    sessions: sessionmaker[Session],
    engine: Engine,
    body: dict[str, Any],
    reason: str,
    detail: str,
) -> None:
    """Each refusal is a 400 with one detail (a position for an expression) and a reason;
    the good fields sent with the bad one are not saved either, and no audit row is written
    (the refused supersede comes after the filter and transform were set in the request's
    transaction: all rolled back)."""
    route = source_with(sessions, ops, "log").route_ids[0]
    before = tuple(_route(engine, route))
    good = {"filter": "type == 'ok'", "transform": "data_object"}
    answer = _patch(rcv, route, {"reason": "try", **good, **body} if body else {"reason": "t"})
    assert answer.status_code == 400, answer.text
    assert answer.json()["reason"] == reason
    assert detail in answer.json()["detail"]
    assert tuple(_route(engine, route)) == before
    assert _audits(engine, route) == []


def test_the_admin_api_route_change_needs_a_reason_and_a_route(
    rcv: Receiver, ops: Settings, sessions: sessionmaker[Session]
) -> None:
    route = source_with(sessions, ops, "log").route_ids[0]
    unreasoned = _patch(rcv, route, {"transform": "data_object"})
    assert unreasoned.status_code == 400
    assert unreasoned.json()["detail"].startswith("body.reason: ")
    missing = _patch(rcv, 9_000_000_000, {"reason": "x", "transform": "data_object"})
    assert missing.status_code == 404
    unauthenticated = httpx.patch(
        f"{rcv.admin_url}/admin/routes/{route}", json={"reason": "x"}, timeout=10
    )
    assert unauthenticated.status_code == 401
