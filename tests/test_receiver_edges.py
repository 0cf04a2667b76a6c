"""Edges of the public and admin inputs (issue 11, items 5 and 10), in-process over ASGI
against the real Postgres: source ids that cannot be ours cost no query and no body read,
unknown ids are cached as missing for a few seconds, and admin ids and durations beyond their
types' ranges answer 400 (never 422 nor 500)."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker
from starlette.applications import Starlette
from starlette.routing import Route

from core.clock import SystemClock
from core.crypto import SecretBox, public_id
from core.settings import Settings
from ingest import store as store_module
from ingest.admin import create_admin_app
from ingest.app import SOURCE_ID, Receiver
from ingest.store import NEGATIVE_CACHE_SECONDS, Store
from tasks.publisher import Publisher
from tests.conftest import make_settings
from tests.factories import make_source
from tests.leakcheck import remember

pytestmark = pytest.mark.timeout(60)


class FakeClock:
    """A monotonic clock the test moves by hand (nothing sleeps)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Probe:
    """The receiver in-process with its lookups and database checkouts counted."""

    def __init__(self, settings: Settings, clock: FakeClock) -> None:
        self.store = Store(
            settings, SecretBox(settings.secret_key.get_secret_value()), monotonic=clock
        )
        self.publisher = Publisher(settings)
        self.receiver = Receiver(settings, SystemClock(), self.store, self.publisher)
        self.lookups = 0
        self.queries = 0
        lookup, checkout = self.store.source, self.store.pool.connection

        async def counted_lookup(public_id: str, *, refresh: bool = False) -> Any:
            self.lookups += 1
            return await lookup(public_id, refresh=refresh)

        def counted_checkout(*args: Any, **kwargs: Any) -> Any:
            self.queries += 1
            return checkout(*args, **kwargs)

        self.store.source = counted_lookup  # type: ignore[method-assign]
        self.store.pool.connection = counted_checkout  # type: ignore[method-assign]
        self.app = Starlette(
            routes=[Route("/webhooks/{source_id}", self.receiver.receive, methods=["POST"])]
        )

    async def post(self, source_id: str, body: bytes = b"{}") -> tuple[int, bool]:
        """POST ``body`` as a stream; the status and whether any of the body was read."""
        consumed = False

        async def stream() -> AsyncIterator[bytes]:
            nonlocal consumed
            consumed = True
            yield body

        transport = httpx.ASGITransport(app=self.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://receiver") as client:
            response = await client.post(f"/webhooks/{source_id}", content=stream())
        return response.status_code, consumed


def run(settings: Settings, clock: FakeClock, scenario: Callable[[Probe], Awaitable[None]]) -> None:
    probe = Probe(settings, clock)

    async def main() -> None:
        await probe.store.open()
        try:
            await scenario(probe)
        finally:
            await probe.store.close()
            probe.publisher.close()

    asyncio.run(main())


def test_the_source_id_pattern_matches_every_id_we_issue() -> None:
    assert all(SOURCE_ID.fullmatch(public_id("src")) for _ in range(2000))


MALFORMED = [
    "sec_" + "a" * 20,  # wrong prefix
    "SRC_" + "a" * 20,
    "src_" + "a" * 19,  # wrong length
    "src_" + "a" * 21,
    "src_" + "a" * 19 + "-",  # characters public_id never emits
    "src_" + "a" * 19 + "_",
    "src_" + "a" * 19 + "%C3%A9",  # é
    "src_" + "a" * 19 + "%00",
    "src_" + "a" * 19 + "%20",
    "src_doesnotexist",
    "src_" + "a" * 5000,  # very long
    "x",
]


def test_ids_that_cannot_be_ours_are_404_without_a_query_or_reading_the_body(
    settings: Settings,
) -> None:
    async def scenario(probe: Probe) -> None:
        for bad in MALFORMED:
            status, consumed = await probe.post(bad, b"x" * (settings.max_body_bytes + 10))
            assert (bad, status, consumed) == (bad, 404, False)
        assert (probe.lookups, probe.queries) == (0, 0)

    run(settings, FakeClock(), scenario)


def test_unknown_ids_are_cached_as_missing_for_a_few_seconds(settings: Settings) -> None:
    clock = FakeClock()

    async def scenario(probe: Probe) -> None:
        unknown = public_id("src")
        status, consumed = await probe.post(unknown)
        assert (status, consumed, probe.queries) == (404, False, 1)
        # Within the cache time: no further query, however many requests.
        for _ in range(20):
            clock.now += NEGATIVE_CACHE_SECONDS / 100
            assert await probe.post(unknown) == (404, False)
        assert probe.queries == 1
        # Another unknown id costs its own query.
        assert await probe.post(public_id("src")) == (404, False)
        assert probe.queries == 2

    run(settings, clock, scenario)


def test_a_created_source_is_found_once_the_negative_entry_expires_end_to_end(
    sessions: sessionmaker[Session], settings: Settings, engine: Engine
) -> None:
    """The real sequence: a request for the id, then the source is created with that id."""
    clock = FakeClock()
    made = make_source(sessions, settings)
    remember(made.secret)
    hidden = made.public_id
    parked = public_id("src")
    with engine.begin() as conn:  # the source does not exist under its id yet
        conn.execute(
            text("UPDATE sources SET public_id = :p WHERE id = :i"), {"p": parked, "i": made.id}
        )

    async def scenario(probe: Probe) -> None:
        assert await probe.post(hidden) == (404, False)
        with engine.begin() as conn:  # created now
            conn.execute(
                text("UPDATE sources SET public_id = :p WHERE id = :i"), {"p": hidden, "i": made.id}
            )
        clock.now += NEGATIVE_CACHE_SECONDS / 2
        assert await probe.post(hidden) == (404, False)  # still cached as missing
        clock.now += NEGATIVE_CACHE_SECONDS / 2
        assert await probe.post(hidden) == (401, True)  # found
        assert probe.queries == 2

    run(settings, clock, scenario)


def test_known_sources_keep_413_and_410(
    sessions: sessionmaker[Session], settings: Settings, engine: Engine
) -> None:
    made = make_source(sessions, settings)
    remember(made.secret)
    disabled = make_source(sessions, settings)
    remember(disabled.secret)
    with engine.begin() as conn:
        conn.execute(text("UPDATE sources SET active = false WHERE id = :i"), {"i": disabled.id})

    async def scenario(probe: Probe) -> None:
        status, consumed = await probe.post(made.public_id, b"x" * (settings.max_body_bytes + 1))
        assert (status, consumed) == (413, True)
        assert await probe.post(disabled.public_id) == (410, False)

    run(settings, FakeClock(), scenario)


def test_the_negative_cache_is_bounded(settings: Settings) -> None:
    clock = FakeClock()

    async def scenario(probe: Probe) -> None:
        for n in range(store_module.CACHE_MAX_ENTRIES + 5):
            probe.store._missing[f"src_{n:020d}"] = clock.now  # noqa: SLF001
        assert await probe.post(public_id("src")) == (404, False)
        assert len(probe.store._missing) == 1  # noqa: SLF001

    run(settings, clock, scenario)


# --- the admin API: inputs beyond their types' ranges ------------------------------------

ADMIN_TOKEN = "adm_" + secrets.token_urlsafe(32)
remember(ADMIN_TOKEN)
TOO_BIG = "99999999999999999999999"
BIGINT_MAX = 2**63 - 1


class Admin:
    """The admin plane in-process over ASGI, guard included (an app exception would answer
    500, not raise); paths are under /admin."""

    def __init__(self) -> None:
        self.app = create_admin_app(make_settings(admin_token=ADMIN_TOKEN))

    def request(self, method: str, path: str, body: Any = None) -> httpx.Response:
        async def call() -> httpx.Response:
            transport = httpx.ASGITransport(app=self.app, raise_app_exceptions=False)
            async with httpx.AsyncClient(
                transport=transport,
                base_url="http://admin",
                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
            ) as client:
                return await client.request(method, f"/admin{path}", json=body)

        return asyncio.run(call())

    def get(self, path: str) -> httpx.Response:
        return self.request("GET", path)

    def post(self, path: str, body: Any) -> httpx.Response:
        return self.request("POST", path, body)


@pytest.fixture(scope="module")
def admin() -> Admin:
    return Admin()


@pytest.mark.parametrize(
    "path",
    [
        f"/events/{TOO_BIG}",
        f"/events/{BIGINT_MAX + 1}",
        f"/events/receipt:{TOO_BIG}",
        f"/events/delivery:{TOO_BIG}",
        "/events/receipt:%C2%B2",  # a superscript two: isdigit() yet no int
        "/events/delivery:%D9%A1",  # an Arabic-Indic one
        f"/deliveries/{TOO_BIG}",
        f"/deliveries/delivery:{TOO_BIG}",
        "/deliveries/%C2%B2",
        f"/replays/{TOO_BIG}",
        f"/replays/{BIGINT_MAX + 1}",
        "/replays/-1",
        f"/events?limit={TOO_BIG}",
        f"/replays?limit={TOO_BIG}",
        "/events?since=99999999d",
        "/events?until=99999999d",
        "/events?since=99999999999999999999999999999999999999",
        "/events?since=P99999999W",
        "/events?since=1e400",
        "/events?since=0001-01-01T00:00:00%2B14:00",
        "/events?since=9999-12-31T23:59:59-14:00",
        "/events?since=" + "9" * 5000,
        "/events/" + "9" * 5000,
        "/events/receipt:" + "9" * 5000,
        "/deliveries/" + "9" * 5000,
        # Postgres text cannot hold NUL: refused before a query fails.
        "/events/%00",
        "/events/event:a%00",
        "/events?source=%00",
        "/events?type=a%00",
        "/dead?source=%00",
    ],
)
def test_admin_ids_limits_times_and_nul_bytes_beyond_their_ranges_are_400(
    admin: Admin, path: str
) -> None:
    response = admin.get(path)
    assert response.status_code == 400, (path, response.status_code, response.text)
    assert response.json()["reason"]


@pytest.mark.parametrize(
    "body",
    [
        {"reason": "r", "ids": [int(TOO_BIG)]},
        {"reason": "r", "ids": [BIGINT_MAX + 1]},
        {"reason": "r", "ids": [0]},
        {"reason": "r", "source": "x", "since": "99999999d"},
        {"reason": "r", "source": "x", "until": "99999999999999999999w"},
        {"reason": "r\u0000", "ids": [1]},
        {"reason": "r", "source": "\u0000"},
        {"reason": "r", "operator": "someone", "ids": [1]},  # the token's name is the operator
    ],
)
def test_admin_replay_inputs_beyond_their_ranges_are_400(
    admin: Admin, body: dict[str, Any]
) -> None:
    response = admin.post("/replays", {"dry_run": True, **body})
    assert response.status_code == 400, (body, response.status_code, response.text)
    assert response.json()["reason"]


def test_the_largest_ids_still_answer_404(admin: Admin) -> None:
    for path in (
        f"/events/receipt:{BIGINT_MAX}",
        f"/deliveries/{BIGINT_MAX}",
        f"/replays/{BIGINT_MAX}",
    ):
        assert admin.get(path).status_code == 404, path
