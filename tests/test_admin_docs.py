"""Issue 20 item 6: the admin docs open in a browser with the token in the URL.

``http://any:TOKEN@127.0.0.1:8001/admin/docs`` showed "Failed to load API definition": the
page's relative schema URL resolved to one carrying the credentials, and browsers refuse to
fetch such a URL. The page now fetches from ``location.origin`` and its answer sets a session
cookie (HMAC of the token's name and expiry, keyed by the token) that opens the docs' own
paths, never the API. Tested in headless Chromium against the real receiver, and over HTTP.
"""

from __future__ import annotations

import hashlib
import hmac
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from ingest.admin import create_admin_app
from ingest.admin.guard import DOCS_COOKIE, DOCS_SESSION_SECONDS
from tests.conftest import make_settings
from tests.leakcheck import remember
from tests.operators_support import ops_receiver
from tests.processes import Receiver

pytestmark = pytest.mark.timeout(180)

TOKEN = "docs-" + uuid.uuid4().hex + uuid.uuid4().hex
OTHER = "other-" + uuid.uuid4().hex + uuid.uuid4().hex
remember(TOKEN)
remember(OTHER)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def plane() -> Iterator[Receiver]:
    with ops_receiver(None, WEBHOOKS_ADMIN_TOKENS=f"ops:{TOKEN},other:{OTHER}") as running:
        yield running


def _bad_mac(session: str) -> str:
    """The session with its MAC's last hex digit changed (always changed: a MAC that ends in
    0 made a fixed ``+ "0"`` the valid session again, one run in 16)."""
    return session[:-1] + ("1" if session.endswith("0") else "0")


def _session(name: str, token: str, expires: int) -> str:
    key = hashlib.sha256(token.encode()).digest()
    mac = hmac.new(key, f"docs:{name}:{expires}".encode(), hashlib.sha256).hexdigest()
    return f"{name}.{expires}.{mac}"


@pytest.mark.skipif(CHROMIUM is None, reason="needs chromium (apt-get install chromium)")
def test_the_docs_load_their_schema_with_the_token_in_the_url(
    plane: Receiver, tmp_path: Path
) -> None:
    assert CHROMIUM is not None
    host_port = plane.admin_url.removeprefix("http://")
    dom = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--virtual-time-budget=10000",
            "--dump-dom",
            f"http://any:{TOKEN}@{host_port}/admin/docs",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    ).stdout
    assert "webhooks admin API" in dom, dom[:2000]
    assert "Failed to load API definition" not in dom
    assert "Fetch error" not in dom
    # The operations come from the schema, so it was fetched and rendered.
    for path in ("/replays", "/dead", "/deliveries/{delivery}"):
        assert f'data-path="{path}"' in dom


def test_the_docs_page_sets_a_session_that_opens_the_docs_only(plane: Receiver) -> None:
    page = httpx.get(f"{plane.admin_url}/admin/docs", auth=("any", TOKEN))
    assert page.status_code == 200
    assert "window.location.origin +" in page.text  # never a URL relative to user:token@
    cookie = page.headers["set-cookie"]
    for attribute in ("Path=/admin/", "HttpOnly", "SameSite=Strict"):
        assert attribute in cookie
    assert f"Max-Age={DOCS_SESSION_SECONDS}" in cookie
    assert TOKEN not in cookie
    value = cookie.split(";", 1)[0].split("=", 1)[1]
    jar = {DOCS_COOKIE: value}

    schema = httpx.get(f"{plane.admin_url}/admin/openapi.json", cookies=jar)
    assert schema.status_code == 200
    assert "/replays" in schema.json()["paths"]
    asset = httpx.get(f"{plane.admin_url}/admin/docs/assets/swagger-ui.css", cookies=jar)
    assert asset.status_code == 200
    # The cookie is not a credential for the API: a cross-site form could send it.
    for method, path in (("GET", "/admin/events"), ("POST", "/admin/replays")):
        refused = httpx.request(method, f"{plane.admin_url}{path}", cookies=jar, json={})
        assert refused.status_code == 401, path
    # Only a page answered after a login sets one.
    assert "set-cookie" not in httpx.get(f"{plane.admin_url}/admin/docs", cookies=jar).headers
    assert "set-cookie" not in httpx.get(f"{plane.admin_url}/admin/docs").headers


def test_a_forged_expired_or_foreign_session_opens_nothing(plane: Receiver) -> None:
    now = int(time.time())
    later = now + 600
    cases = {
        "expired": _session("ops", TOKEN, now - 1),
        "another token's key": _session("ops", OTHER, later),
        "renamed": _session("other", TOKEN, later),
        "unknown token": _session("ops", "docs-" + uuid.uuid4().hex * 2, later),
        "bad mac": _bad_mac(_session("ops", TOKEN, later)),
        "garbage": "ops.soon.x",
        "empty": "",
    }
    for case, value in cases.items():
        answer = httpx.get(f"{plane.admin_url}/admin/openapi.json", cookies={DOCS_COOKIE: value})
        assert answer.status_code == 401, case
        assert answer.headers["www-authenticate"].startswith("Basic"), case
    good = httpx.get(
        f"{plane.admin_url}/admin/openapi.json",
        cookies={DOCS_COOKIE: _session("ops", TOKEN, later)},
    )
    assert good.status_code == 200  # the forms above differ from a valid one in one part


# --- Secure (issue 34 item 7) ------------------------------------------------------------------


def _attributes(set_cookie: str) -> list[str]:
    return [part.strip().lower() for part in set_cookie.split(";")[1:]]


@contextmanager
def _served(**config: Any) -> Iterator[str]:
    """The admin plane (ops's token, no login budgets in the way) in a uvicorn server of this
    process, on a real socket, with ``config`` (and ``console_secure_cookies`` in it for the
    settings); its base URL."""
    secure = config.pop("console_secure_cookies", False)
    settings = make_settings(
        admin_tokens=f"ops:{TOKEN}", console_secure_cookies=secure, console_login_failures=1000
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(
        uvicorn.Config(create_admin_app(settings), log_config=None, lifespan="off", **config)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        for _ in range(200):
            if server.started:
                break
            thread.join(0.05)
        yield url
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def _docs_cookie(url: str, address: str = "127.0.0.1", **headers: str) -> list[str]:
    transport = httpx.HTTPTransport(local_address=address)
    with httpx.Client(transport=transport, timeout=10) as http:
        page = http.get(f"{url}/admin/docs", auth=("any", TOKEN), headers=headers)
    assert page.status_code == 200
    return _attributes(page.headers["set-cookie"])


def test_the_docs_cookie_is_not_secure_on_plain_http_whatever_the_client_claims(
    plane: Receiver,
) -> None:
    """``webhooks serve`` trusts no X-Forwarded-Proto: a client cannot make it believe https
    (the console's session cookie follows the same rule)."""
    for headers in ({}, {"X-Forwarded-Proto": "https"}):
        attributes = _docs_cookie(plane.admin_url, **headers)
        assert "httponly" in attributes
        assert "secure" not in attributes, headers


def test_the_docs_cookie_is_secure_with_the_consoles_setting() -> None:
    with _served(console_secure_cookies=True) as url:
        assert "secure" in _docs_cookie(url)
        login = httpx.get(f"{url}/console/login", timeout=10)  # the console's, the same rule
        assert "secure" in _attributes(login.headers["set-cookie"])


def test_the_docs_cookie_is_secure_behind_a_trusted_proxy_that_says_https() -> None:
    """uvicorn with --proxy-headers sets the request's scheme from X-Forwarded-Proto only for
    the proxy addresses --forwarded-allow-ips trusts; the cookie follows that scheme."""
    with _served(proxy_headers=True, forwarded_allow_ips="127.0.0.1") as url:
        assert "secure" in _docs_cookie(url, **{"X-Forwarded-Proto": "https"})
        assert "secure" not in _docs_cookie(url)  # the proxy says http
        # From an address the server does not trust, the header is ignored.
        assert "secure" not in _docs_cookie(url, "127.0.0.2", **{"X-Forwarded-Proto": "https"})
