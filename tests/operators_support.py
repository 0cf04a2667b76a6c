"""Helpers of the operator tests (issue 4): dead and succeeded deliveries, the CLI, the queue.

Deliveries are made by the receiver's own accept path (:func:`tests.factories.accept_event`)
and moved with the guarded transitions of :mod:`models.transitions`, exactly as a worker
would, so replays start from rows the pipeline could have produced.

The operator tests publish to Redis databases of their own (broker 8, claims 9; the other
suites use 10 to 15), so a worker started by another test module never consumes their
messages and queue lengths mean what they say.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import redis
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core.messages import DELIVERIES_QUEUE
from core.settings import Settings
from models import transitions
from tests.conftest import BIN, REDIS, make_settings
from tests.factories import MadeSource, accept_event, make_source
from tests.leakcheck import log_file, remember
from tests.processes import Receiver, receiver
from tests.workers import FAST, worker_env

OPS: dict[str, Any] = {
    "broker_url": f"{REDIS}/4",
    "redis_url": f"{REDIS}/5",
}


def ops_settings(**overrides: Any) -> Settings:
    return make_settings(**{**FAST, **OPS, **overrides})


def ops_env(**overrides: Any) -> dict[str, str]:
    """Environment of a CLI, receiver or worker subprocess of these tests."""
    return worker_env(**{**OPS, **overrides})


@contextmanager
def ops_receiver(admin_token: str | None, **env: str) -> Iterator[Receiver]:
    """The real receiver (``webhooks serve``) on the operator tests' broker; its admin API and
    /metrics are on ``admin_url``. ``admin_token`` None: unset (not empty)."""
    if admin_token is not None:
        env["WEBHOOKS_ADMIN_TOKEN"] = admin_token
    with receiver(
        WEBHOOKS_BROKER_URL=OPS["broker_url"], WEBHOOKS_REDIS_URL=OPS["redis_url"], **env
    ) as running:
        yield running


def source_with(
    sessions: sessionmaker[Session], settings: Settings, *handlers: str, **kwargs: Any
) -> MadeSource:
    made = make_source(
        sessions, settings, routes=[{"handler": h} for h in handlers or ("log",)], **kwargs
    )
    remember(made.secret)
    return made


def accept(
    settings: Settings, source: MadeSource, *, event_type: str = "test.event", **kwargs: Any
) -> list[int]:
    """Accept one event; returns its delivery ids."""
    _, outcome = accept_event(settings, source, event_type=event_type, **kwargs)
    assert outcome.status == "accepted", outcome
    return list(outcome.delivery_ids)


def _claim(
    session: Session, delivery_id: int, now: datetime, worker: str = "test:0"
) -> transitions.Claim:
    found = transitions.claim(
        session, delivery_id, now=now, lease=timedelta(minutes=5), max_redeliveries=3,
        worker=worker,
    )  # fmt: skip
    assert found is not None, f"delivery {delivery_id} could not be claimed"
    return found


def kill(
    sessions: sessionmaker[Session],
    ids: list[int],
    *,
    reason: str = "permanent",
    worker: str = "test:0",
    at: datetime | None = None,
) -> None:
    """pending -> processing -> dead, as a worker (named ``worker``) whose handler failed
    permanently (``at``: when; now by default)."""
    now = at or datetime.now(UTC)
    with sessions() as session, session.begin():
        for delivery_id in ids:
            found = _claim(session, delivery_id, now, worker)
            transitions.kill(
                session, found, now=now, reason=reason, error_class="PermanentError",
                error="tests.handlers:1",
            )  # fmt: skip


def succeed(sessions: sessionmaker[Session], ids: list[int], *, at: datetime | None = None) -> None:
    now = at or datetime.now(UTC)
    with sessions() as session, session.begin():
        for delivery_id in ids:
            transitions.succeed(session, _claim(session, delivery_id, now), now=now)


def retry(sessions: sessionmaker[Session], ids: list[int], *, at: datetime) -> None:
    """pending -> processing -> retrying at ``at``, due an hour later."""
    with sessions() as session, session.begin():
        for delivery_id in ids:
            transitions.retry_later(
                session, _claim(session, delivery_id, at), now=at,
                next_attempt_at=at + timedelta(hours=1), error_class="HTTPError",
                error="503 from the downstream",
            )  # fmt: skip


def status_of(engine: Engine, ids: list[int]) -> dict[int, str]:
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT id, status FROM deliveries WHERE id = ANY(:ids)"), {"ids": ids}
        )
        return {r.id: r.status for r in rows}


def replay_rows(engine: Engine, **where: Any) -> list[Any]:
    clause = " AND ".join(f"{k} = :{k}" for k in where) or "true"
    with engine.connect() as conn:
        return list(conn.execute(text(f"SELECT * FROM replays WHERE {clause} ORDER BY id"), where))  # noqa: S608


def queue_length(settings: Settings) -> int:
    client = redis.Redis.from_url(settings.broker_url)
    try:
        return int(client.llen(DELIVERIES_QUEUE))
    finally:
        client.close()


def queued_messages(settings: Settings) -> list[list[int]]:
    """The delivery ids of each queued message (kombu's JSON envelope; Celery protocol 2
    body): one id, or a list of them (a message of several deliveries)."""
    import base64  # noqa: PLC0415
    import json  # noqa: PLC0415

    client = redis.Redis.from_url(settings.broker_url)
    try:
        raw = client.lrange(DELIVERIES_QUEUE, 0, -1)
    finally:
        client.close()
    messages: list[list[int]] = []
    for item in raw:
        envelope = json.loads(item)
        args, _kwargs, _embed = json.loads(base64.b64decode(envelope["body"]))
        messages.append([int(i) for i in args[0]] if isinstance(args[0], list) else [int(args[0])])
    return messages


def queued_ids(settings: Settings) -> list[int]:
    """Delivery ids in the queued messages, every message's in turn."""
    return [i for message in queued_messages(settings) for i in message]


def flush(settings: Settings) -> None:
    for url in (settings.broker_url, settings.redis_url):
        client = redis.Redis.from_url(url)
        try:
            client.flushdb()
        finally:
            client.close()


_cli_runs = iter(range(1_000_000))


def cli(
    *args: str, env: dict[str, str], input_text: str | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run the real ``webhooks`` console script; its output is kept for the leak check."""
    proc = subprocess.run(  # noqa: S603
        [str(BIN / "webhooks"), *args],
        env=env,
        input=input_text,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    log_file(f"cli-{next(_cli_runs)}").write_text(proc.stdout + proc.stderr)
    return proc


CSRF = re.compile(r'name="csrf" value="([^"]+)"')


def console_login(http: httpx.Client, url: str, token: str) -> httpx.Response:
    """The login form as a browser posts it: the page's CSRF token and its cookie."""
    page = http.get(f"{url}/console/login")
    csrf = CSRF.search(page.text)
    assert csrf is not None, page.text
    assert "wh_console_login" in page.cookies  # kept in the client's jar, sent back below
    return http.post(
        f"{url}/console/login",
        data={"csrf": csrf.group(1), "token": token},
        follow_redirects=False,
    )


# A page's elements matching a selector that the browser laid out on several lines (their
# texts): for page.evaluate(WRAPPED, selector).
WRAPPED = """(selector) => [...document.querySelectorAll(selector)].filter((el) => {
    const range = document.createRange();
    range.selectNodeContents(el);
    return new Set([...range.getClientRects()].map((r) => Math.round(r.top))).size > 1;
}).map((el) => el.textContent)"""
