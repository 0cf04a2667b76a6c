"""Issue 34 item 7: failed admin logins are throttled per client address and in all.

Against real admin servers over HTTP: :class:`ingest.admin.AdminServer` (the class ``webhooks
serve`` runs) in this process with a :class:`FrozenClock`, which the Redis scripts take as
Redis' clock (:func:`core.clock.pinned`), so time moves without a sleep; and ``webhooks
serve`` itself on Redis' own clock. Clients come from several loopback addresses (127.0.0.2,
127.0.0.3, ...: every 127/8 address is this host) to stand for several clients.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import orjson
import pytest
import redis
from prometheus_client import REGISTRY
from structlog.testing import capture_logs

from core.clock import Clock, FrozenClock
from core.settings import Settings
from ingest.admin import AdminServer
from ingest.plane import OperatorTokens
from models.login_throttle import LoginThrottle, client_key
from tests.conftest import REDIS, free_port, make_settings
from tests.leakcheck import remember
from tests.operators_support import console_login
from tests.processes import receiver

pytestmark = pytest.mark.timeout(120)

THROTTLE_REDIS = f"{REDIS}/3"  # the login buckets of these tests only
TOKEN = "ops_" + secrets.token_urlsafe(32)
CI_TOKEN = "ci_" + secrets.token_urlsafe(32)
remember(TOKEN, CI_TOKEN)
DEFAULT_PER_CLIENT = Settings.model_fields["console_login_failures"].default
DEFAULT_GLOBAL = Settings.model_fields["console_login_global_failures"].default


def test_the_defaults_are_five_per_address_and_sixty_in_all() -> None:
    assert (DEFAULT_PER_CLIENT, DEFAULT_GLOBAL) == (5, 60)  # what the tests below count on


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture(autouse=True)
def clean_buckets() -> Iterator[None]:
    client = redis.Redis.from_url(THROTTLE_REDIS)
    client.flushdb()
    yield
    client.flushdb()
    client.close()


@pytest.fixture
def clock() -> FrozenClock:
    return FrozenClock(datetime.now(UTC))


@contextmanager
def plane(clock: Clock | None = None, **overrides: Any) -> Iterator[str]:
    """A served admin plane (named tokens ops and ci, the login budgets' defaults unless
    overridden); its base URL."""
    values: dict[str, Any] = {
        "admin_tokens": f"ops:{TOKEN},ci:{CI_TOKEN}",
        "redis_url": THROTTLE_REDIS,
        # The production defaults (the suite's environment raises them: tests/conftest.py).
        "console_login_failures": DEFAULT_PER_CLIENT,
        "console_login_global_failures": DEFAULT_GLOBAL,
        **overrides,
    }
    port = free_port()
    server = AdminServer(make_settings(**values), host="127.0.0.1", port=port, clock=clock)
    server.start()
    try:
        for _ in range(200):
            if server.server.started:
                break
            server.thread.join(0.05)  # uvicorn is still starting
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def client(address: str) -> httpx.Client:
    """An HTTP client whose connections come from ``address`` (a loopback address)."""
    return httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=10)


class Compared:
    """Counts the token comparisons of every admin plane in this process."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        original: Callable[..., Any] = OperatorTokens.match

        def counting(tokens: OperatorTokens, given: bytes | None) -> Any:
            self.calls += 1
            return original(tokens, given)

        monkeypatch.setattr(OperatorTokens, "match", counting)


def test_failed_console_logins_are_throttled_per_address_and_the_page_says_how_long(
    clock: FrozenClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    compared = Compared(monkeypatch)
    before = sample("webhooks_logins_throttled_total", scope="client", via="console")
    with plane(clock) as url, client("127.0.0.2") as attacker, client("127.0.0.3") as operator:
        for _ in range(5):  # the address's five failures at once
            assert console_login(attacker, url, TOKEN + "x").status_code == 401
        assert compared.calls == 5
        with capture_logs() as logs:
            refused = console_login(attacker, url, TOKEN)  # even the right token: not compared
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "12"  # a minute / 5
        assert "wait 12 seconds before trying again" in refused.text
        assert "from this address" in refused.text
        assert "wh_console=" not in refused.headers.get("set-cookie", "")
        assert compared.calls == 5
        assert sample("webhooks_logins_throttled_total", scope="client", via="console") == (
            before + 1
        )
        [line] = [entry for entry in logs if entry["event"] == "login.throttled"]
        assert (line["client"], line["scope"], line["retry_after"]) == ("127.0.0.2", "client", 12)
        assert (line["store"], line["via"]) == ("redis", "console")
        assert TOKEN not in orjson.dumps(logs, default=str).decode()

        # Another address is not held back by these failures.
        assert console_login(operator, url, TOKEN).status_code == 303

        clock.advance(timedelta(seconds=11))
        assert console_login(attacker, url, TOKEN).headers["retry-after"] == "1"
        clock.advance(timedelta(seconds=1))
        assert console_login(attacker, url, TOKEN + "x").status_code == 401  # one more
        assert console_login(attacker, url, TOKEN).status_code == 429
        clock.advance(timedelta(seconds=12))
        logged_in = console_login(attacker, url, TOKEN)
        assert logged_in.status_code == 303
        assert logged_in.headers["location"] == "/console/"
        # A success costs nothing: the slot it used is still there for a failure.
        assert console_login(attacker, url, TOKEN + "x").status_code == 401
        assert console_login(attacker, url, TOKEN + "x").status_code == 429


def test_the_global_budget_stops_many_addresses_and_frees_a_slot_soon_after(
    clock: FrozenClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    compared = Compared(monkeypatch)
    before = sample("webhooks_logins_throttled_total", scope="global", via="console")
    with plane(clock, console_login_global_failures=10) as url:
        for n in (2, 3):  # two addresses, five failures each: the global ten
            with client(f"127.0.0.{n}") as attacker:
                for _ in range(5):
                    assert console_login(attacker, url, "guess-" + TOKEN).status_code == 401
        with client("127.0.0.4") as attacker:  # a third address: its own bucket is empty
            assert console_login(attacker, url, "guess-" + TOKEN).status_code == 429
        assert compared.calls == 10
        with client("127.0.0.5") as operator:
            # While the attack lasts the operator waits too: the global cap's design.
            held = console_login(operator, url, TOKEN)
            assert held.status_code == 429
            assert held.headers["retry-after"] == "6"  # a minute / 10
            assert "from all addresses" in held.text
            assert compared.calls == 10
            # The attack stops: within one interval there is a slot, and the right token
            # costs nothing (the operator's next attempt is as free as before).
            clock.advance(timedelta(seconds=6))
            assert console_login(operator, url, TOKEN).status_code == 303
            assert console_login(operator, url, TOKEN).status_code == 303
    assert sample("webhooks_logins_throttled_total", scope="global", via="console") == before + 2


def test_the_api_bearer_token_and_the_docs_password_share_the_budget(
    clock: FrozenClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The API and the docs guess the same tokens: without this, a throttled console would
    send the guesses to ``/admin`` instead."""
    with plane(clock) as url, client("127.0.0.2") as attacker, client("127.0.0.3") as ci:
        for _ in range(3):
            wrong = attacker.get(f"{url}/admin/events", headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401
        docs = attacker.get(f"{url}/admin/docs", auth=("any", "nope"))
        assert docs.status_code == 401
        assert console_login(attacker, url, "nope").status_code == 401  # the fifth
        compared = Compared(monkeypatch)
        refused = attacker.get(f"{url}/admin/events", headers={"Authorization": f"Bearer {TOKEN}"})
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "12"
        assert refused.json()["reason"] == "throttled"
        assert "wait 12 seconds" in refused.json()["detail"]
        assert attacker.get(f"{url}/admin/docs", auth=("any", TOKEN)).status_code == 429
        assert console_login(attacker, url, TOKEN).status_code == 429
        assert compared.calls == 0
        # No credential at all is no guess: a plain 401, as before.
        assert attacker.get(f"{url}/admin/events").status_code == 401
        # Successes cost nothing: a busy API client is never throttled by its own requests.
        for _ in range(20):
            ok = ci.get(f"{url}/admin/replays", headers={"Authorization": f"Bearer {CI_TOKEN}"})
            assert ok.status_code == 200, ok.text


def test_every_admin_process_shares_the_budgets_on_redis_clock() -> None:
    """Two admin planes (as two processes or hosts would run) on one Redis, unpinned: the
    scripts read Redis' TIME, and failures at either count against both."""
    with plane() as first, plane() as second, client("127.0.0.2") as attacker:
        for url in (first, second, first, second, first):
            assert console_login(attacker, url, TOKEN + "x").status_code == 401
        held = console_login(attacker, second, TOKEN)
        assert held.status_code == 429
        assert held.headers["retry-after"] in ("11", "12")  # Redis' time has moved a little
        buckets = redis.Redis.from_url(THROTTLE_REDIS)
        seconds, micros = buckets.time()
        now_ms = seconds * 1000 + micros / 1000
        tat = float(buckets.get("login:c:127.0.0.2") or 0)
        buckets.close()
        assert 59_000 < tat - now_ms <= 60_000  # five failures ahead of Redis' clock


def test_redis_unreachable_the_process_keeps_the_budgets(
    clock: FrozenClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    nowhere = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    compared = Compared(monkeypatch)
    with plane(clock, redis_url=nowhere) as url, client("127.0.0.2") as attacker:
        for _ in range(5):
            assert console_login(attacker, url, TOKEN + "x").status_code == 401
        with capture_logs() as logs:
            refused = console_login(attacker, url, TOKEN)
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "12"
        assert compared.calls == 5
        [line] = [entry for entry in logs if entry["event"] == "login.throttled"]
        assert line["store"] == "process"
        clock.advance(timedelta(seconds=12))
        assert console_login(attacker, url, TOKEN).status_code == 303


def test_the_buckets_in_memory_follow_the_same_rules() -> None:
    """The fallback alone (no Redis at all): failures only, the global bucket, IPv6."""
    clock = FrozenClock(datetime(2026, 1, 1, tzinfo=UTC))
    throttle = LoginThrottle(None, clock, per_client=2, overall=3)
    a, b = client_key("2001:db8::1"), client_key("2001:db8::2")
    assert a == b == "2001:db8::/64"  # one host's /64
    assert client_key("::ffff:10.0.0.1") == "10.0.0.1"
    assert client_key(None) == "unknown"
    for _ in range(5):  # successes: checked, never charged
        assert throttle.check(a).allowed
    first = throttle.check(a)
    assert first.store == "process"
    throttle.failed(a, first)
    throttle.failed(a, throttle.check(a))
    held = throttle.check(b)
    assert (held.allowed, held.scope, held.retry_after) == (False, "client", 30)
    throttle.failed("10.0.0.9", throttle.check("10.0.0.9"))  # the third failure in all
    full = throttle.check("10.0.0.8")
    assert (full.allowed, full.scope, full.retry_after) == (False, "global", 20)
    clock.advance(timedelta(seconds=20))
    assert throttle.check("10.0.0.8").allowed


def test_a_throttled_login_is_counted_and_logged_by_webhooks_serve() -> None:
    """The real receiver, several processes: its /metrics (the supervisor runs the admin
    plane) shows the counter, and its log has one line per refusal, never the token."""
    with (
        receiver(
            workers=2,
            WEBHOOKS_ADMIN_TOKENS=f"ops:{TOKEN}",
            WEBHOOKS_REDIS_URL=THROTTLE_REDIS,
            WEBHOOKS_CONSOLE_LOGIN_FAILURES="1",
        ) as running,
        client("127.0.0.2") as attacker,
    ):
        url = running.admin_url
        assert console_login(attacker, url, TOKEN + "x").status_code == 401
        assert console_login(attacker, url, TOKEN).status_code == 429
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        assert attacker.get(f"{url}/admin/events", headers=bearer).status_code == 429
        exposed = httpx.get(f"{url}/metrics", timeout=10).text
        assert 'webhooks_logins_throttled_total{scope="client",via="console"} 1.0' in exposed
        assert 'webhooks_logins_throttled_total{scope="client",via="api"} 1.0' in exposed
    lines = [
        orjson.loads(line)
        for line in running.log_path.read_text().splitlines()
        if line.startswith("{") and '"login.throttled"' in line
    ]
    assert [(x["via"], x["scope"], x["client"]) for x in lines] == [
        ("console", "client", "127.0.0.2"),
        ("api", "client", "127.0.0.2"),
    ]
    assert TOKEN not in running.log_path.read_text()


def test_the_console_takes_a_token_as_the_setting_writes_it_name_colon_token() -> None:
    """Issue 36: pasting the ``.env`` value ``ops:TOKEN`` at the login said "wrong token". It
    signs in as ops; another token's name before the colon is a wrong token, refused and
    counted like any other."""
    with plane() as url, client("127.0.0.4") as http:
        refused = console_login(http, url, f"ci:{TOKEN}")
        assert refused.status_code == 401
        assert "wrong token" in refused.text
        assert console_login(http, url, f"ops:{TOKEN}").status_code == 303
        page = http.get(f"{url}/console/")
        assert page.status_code == 200
        assert '<span class="who">ops</span>' in page.text
