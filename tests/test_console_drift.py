"""Issue 38 item 3: the console's Drift page, in a real browser (Playwright driving Debian's
chromium, as tests/test_console.py does) against the real receiver's admin plane: the open
findings of every source and of one, a key that is markup shown as text, accepted findings
gone from the page, an unknown source refused in one line."""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from playwright.sync_api import Browser, Page, sync_playwright
from sqlalchemy.orm import Session, sessionmaker

from core.settings import Settings
from models import drift, pg
from tests.factories import accept_event
from tests.leakcheck import remember
from tests.operators_support import ops_receiver, ops_settings, source_with
from tests.processes import Receiver

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]
TOKEN = "adm_drift_" + secrets.token_urlsafe(24)
remember(TOKEN)
MARKUP_KEY = "<img src=x onerror=alert(1)>"

if shutil.which(CHROMIUM) is None:
    pytest.skip(f"{CHROMIUM} is missing: run `make install` (as root)", allow_module_level=True)


@pytest.fixture(scope="module")
def api() -> Iterator[Receiver]:
    with ops_receiver(None, WEBHOOKS_ADMIN_TOKENS=f"dora:{TOKEN}") as running:
        yield running


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


def login(browser: Browser, api: Receiver) -> Page:
    page = browser.new_context().new_page()
    page.goto(f"{api.admin_url}/console/login")
    page.fill("#token", TOKEN)
    page.click("button[type=submit]")
    page.wait_for_url(f"{api.admin_url}/console/")
    return page


def learn(settings: Settings) -> None:
    with pg.connect(settings) as conn:
        drift.learn_due(conn, every=timedelta(0), sample=20, absent=timedelta(days=7))


def test_the_drift_page_lists_the_open_findings_and_drops_accepted_ones(
    browser: Browser, api: Receiver, sessions: sessionmaker[Session]
) -> None:
    ops = ops_settings()
    one, other = source_with(sessions, ops, "log"), source_with(sessions, ops, "log")
    now = datetime.now(UTC) - timedelta(minutes=2)  # settled: learning reads them
    for source in (one, other):
        accept_event(ops, source, event_type="charge.ok", body={"data": {"n": 1}}, now=now)
    learn(ops)
    accept_event(ops, one, event_type="charge.ok", body={"data": {"n": "1"}}, now=now)
    accept_event(
        ops, other, event_type="charge.ok", body={"data": {"n": 1, MARKUP_KEY: 2}}, now=now
    )
    learn(ops)

    page = login(browser, api)
    page.click("nav >> text=Drift")
    page.wait_for_url(f"{api.admin_url}/console/drift")
    rows = page.locator("#drift tbody tr")
    seen = {
        (r.locator("td.path").inner_text(), r.locator("td.kind").inner_text()) for r in rows.all()
    }
    assert ("data.n", "type_changed") in seen
    assert (f"data.{MARKUP_KEY}", "new_path") in seen  # markup shown as text, never run
    assert page.locator("#drift img").count() == 0

    page.goto(f"{api.admin_url}/console/drift?source={one.public_id}")
    assert [r.locator("td.path").inner_text() for r in rows.all()] == ["data.n"]

    with pg.connect(ops) as conn:
        drift.accept(conn, other.public_id, event_type=None, operator="dora", reason="v2 payloads")
    page.goto(f"{api.admin_url}/console/drift?source={other.name}")
    assert rows.count() == 1
    assert rows.first.inner_text() == "no open drift findings"

    refused = page.goto(f"{api.admin_url}/console/drift?source=no-such-source")
    assert refused is not None
    assert refused.status == 404
    assert "no such source" in page.locator("#message").inner_text()
