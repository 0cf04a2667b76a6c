"""Route filters (issue 37 item 1): ``webhooks routes add|update --filter EXPR``, a JMESPath
predicate over the event's body, type and headers.

The language's cases are pure (core.filters). The rest runs the real thing: the ``webhooks``
CLI, the receiver (``webhooks serve``) with its console and /metrics, a Celery worker, real
Postgres and Redis. A route whose filter does not match an event gets a ``filtered``
delivery: no broker message, no attempt, shown by ``events show``, the console's event page
and ``webhooks_filtered_total``; replayed only when named by its id.
"""

from __future__ import annotations

import asyncio
import html
import json
import re
import secrets as pysecrets
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import orjson
import psycopg
import pytest
from alembic import command
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core.crypto import SecretBox
from core.docs import TOPICS
from core.filters import (
    FilterError,
    FiltersChanged,
    RouteFilter,
    Verdict,
    compile_filter,
    decide,
    document,
    evaluate,
)
from core.settings import Settings
from ingest.filtering import accept_judged
from ingest.store import Store
from models import queue_lag
from models.accept import (
    ACCEPT_MANY_SQL,
    NewReceipt,
    Outcome,
    accept_many_params,
    decide_many,
)
from models.db import alembic_config
from tasks.reconcile.paging import ProviderEvent
from tasks.reconcile.run import accept_recovered, load_target
from tests.conftest import TEST_DB
from tests.factories import MadeSource, make_source
from tests.leakcheck import remember
from tests.operators_support import (
    CSRF,
    OPS,
    cli,
    console_login,
    flush,
    ops_env,
    ops_receiver,
    queued_ids,
)
from tests.processes import Receiver
from tests.retention_support import own_database
from tests.signing import sign
from tests.workers import (
    attempts,
    json_log_lines,
    running_worker,
    scrape_metrics,
    wait_for,
    wait_status,
)

TOKEN = "adm_filters_" + pysecrets.token_urlsafe(24)
remember(TOKEN)

NO_GRACE = timedelta(0)
BIG = "body.data.object.amount >= `1000` && type == 'charge.succeeded'"


# -- the language (pure) -------------------------------------------------------------------


DOC = document(
    orjson.dumps(
        {
            "data": {"object": {"amount": 1500, "currency": "eur", "tags": ["vip", "eu"]}},
            "livemode": False,
        }
    ),
    "charge.succeeded",
    {
        "Stripe-Signature": "t=1,v1=abc",
        "Authorization": "Bearer x",
        "X-Api-Key": "k",
        "Webhooks-Test-Send": "mark",
        "User-Agent": "Stripe/1.0",
        "X-Shop-Domain": "shop.example",
    },
)


@pytest.mark.parametrize(
    ("expression", "matched"),
    [
        ("type == 'charge.succeeded'", True),  # equality
        ("type != 'charge.succeeded'", False),
        ("body.data.object.amount >= `1000`", True),  # comparisons
        ("body.data.object.amount < `1000`", False),
        ("contains(['eur', 'usd'], body.data.object.currency)", True),  # membership
        ("contains(body.data.object.tags, 'vip')", True),
        ("body.data.object.refunded != `null`", False),  # existence
        ("body.data.object.amount != `null`", True),
        ("matches(type, '^charge\\.(succeeded|failed)$')", True),  # pattern
        ("matches(body.data.object.currency, '^us')", False),
        (BIG, True),  # and / or / not
        ("type == 'x' || body.livemode == `false`", True),
        ("!(body.livemode)", True),
        ("headers.\"user-agent\" == 'Stripe/1.0'", True),
        ("body.data.object.currency > `5`", False),  # fails on this event: no match
    ],
)
def test_the_filter_language(expression: str, matched: bool) -> None:
    verdict = evaluate(7, expression, DOC)
    assert verdict.matched is matched
    if not matched:
        assert verdict.reason is not None
        assert verdict.reason.startswith("route 7: filter")
        assert "1500" not in verdict.reason
        assert "eur" not in verdict.reason


def test_a_pattern_that_backtracks_on_the_body_is_cut_off_as_a_failure() -> None:
    """matches() runs on the receiver's event loop over the sender's payload: a pattern that
    backtracks catastrophically on some body (with Python's re, (a|aa)+$ over 40 'a' and a 'b'
    takes minutes) stops at core.filters.MATCH_TIMEOUT_S and the event does not match."""
    doc = {"body": {"name": "a" * 40 + "b"}, "type": "x", "headers": {}}
    verdict = evaluate(3, "matches(body.name, '(a|aa)+$')", doc)
    assert verdict.matched is False
    assert verdict.reason == "route 3: filter failed on this event (TimeoutError)"
    # The same pattern on a body it does not backtrack on still decides.
    assert evaluate(3, "matches(body.name, '(a|aa)+$')", {**doc, "body": {"name": "aaa"}}).matched


def test_a_filter_never_sees_a_credential_header() -> None:
    assert set(DOC["headers"]) == {"user-agent", "x-shop-domain"}
    for name in ("stripe-signature", "authorization", "x-api-key", "webhooks-test-send"):
        assert evaluate(1, f'headers."{name}" != `null`', DOC).matched is False


@pytest.mark.parametrize(
    ("expression", "position", "words"),
    [
        ("body.amount >= `1000` &&", 24, "Incomplete expression"),
        ("body.amount >= == 3", 15, "unexpected '=='"),
        ('body."amount', 5, "Unclosed"),
        ("body.amount = 3", 12, "Unknown token"),
        ("nope(body)", 0, "unknown function nope()"),
        ("contains(type)", 0, "contains() takes 2 arguments, given 1"),
        ("body.nope && nope (type)", 13, "unknown function nope()"),  # the call, not the field
        ("body.contains && contains(type)", 17, "contains() takes 2 arguments"),
        ("matches(type, '[a')", 17, "bad pattern"),  # where ']' is missing
        ("   ", 0, "empty expression"),
    ],
)
def test_a_bad_filter_is_refused_with_its_position(
    expression: str, position: int, words: str
) -> None:
    with pytest.raises(FilterError) as refused:
        compile_filter(expression)
    assert refused.value.position == position
    assert words in str(refused.value)
    assert f"at position {position}" in str(refused.value)
    assert "\n" not in str(refused.value)


def test_only_the_filters_of_the_events_type_are_judged() -> None:
    filters = (RouteFilter(1, "invoice.*", "`false`"), RouteFilter(2, "charge.?ucceeded", "`true`"))
    verdicts = decide(filters, b"not json", "charge.succeeded", {})
    assert [(v.route_id, v.matched) for v in verdicts] == [(2, True)]
    assert decide(filters, b"{}", "customer.created", {}) == ()


# -- the accept statement ------------------------------------------------------------------


def _receipt(source: MadeSource, event_type: str = "charge.succeeded") -> NewReceipt:
    now = datetime.now(UTC)
    body = b'{"data": {"object": {"amount": 5}}}'
    return NewReceipt(
        source_id=source.id,
        secret_id=source.secret_id,
        event_id=f"evt_{uuid.uuid4().hex}",
        event_type=event_type,
        occurred_at=None,
        expires_at=now + timedelta(days=4),
        received_at=now,
        digest=b"d" * 32,
        content_type="application/json",
        payload=body,
        ttl=timedelta(days=4),
    )


def test_the_batch_accept_writes_filtered_and_refuses_an_unjudged_filter(
    sessions: sessionmaker[Session], settings: Settings, engine: Engine
) -> None:
    made = make_source(
        sessions,
        settings,
        provider="stripe",
        routes=[{"handler": "log", "filter": BIG}, {"handler": "log"}],
    )
    filtered_route, plain_route = made.route_ids
    receipt = _receipt(made)
    with psycopg.connect(settings.psycopg_dsn, autocommit=True) as conn:
        # Not judged: nothing is written, the element answers stale.
        rows = conn.execute(ACCEPT_MANY_SQL, accept_many_params([receipt], NO_GRACE)).fetchall()
        assert [o.status for o in decide_many([receipt], rows)] == ["stale"]
        # Judged against another text than the route holds: stale too.
        stale = evaluate(filtered_route, "type == 'x'", document(receipt.payload, "t", {}))
        judged_old = _with(receipt, stale)
        rows = conn.execute(ACCEPT_MANY_SQL, accept_many_params([judged_old], NO_GRACE)).fetchall()
        assert [o.status for o in decide_many([judged_old], rows)] == ["stale"]
        with engine.connect() as c:
            assert (
                c.execute(
                    text("SELECT count(*) FROM receipts WHERE source_id = :s"), {"s": made.id}
                ).scalar_one()
                == 0
            )
        # Judged as it stands: the filtered route's delivery is written filtered, not returned.
        verdict = evaluate(filtered_route, BIG, document(receipt.payload, receipt.event_type, {}))
        judged = _with(receipt, verdict)
        rows = conn.execute(ACCEPT_MANY_SQL, accept_many_params([judged], NO_GRACE)).fetchall()
        [outcome] = decide_many([judged], rows)
    assert outcome.status == "accepted"
    assert outcome.filtered_routes == (filtered_route,)
    with engine.connect() as c:
        found = c.execute(
            text(
                "SELECT id, route_id, status, last_error_class, last_error, next_attempt_at"
                " FROM deliveries WHERE receipt_id = :r ORDER BY route_id"
            ),
            {"r": outcome.receipt_id},
        ).all()
    assert [(r.route_id, r.status) for r in found] == [
        (filtered_route, "filtered"),
        (plain_route, "pending"),
    ]
    assert found[0].last_error_class == "filtered"
    assert found[0].last_error == f"route {filtered_route}: filter did not match"
    assert found[0].next_attempt_at is None  # the sweeper never picks it
    assert outcome.delivery_ids == (found[1].id,)


def test_a_filter_changed_again_while_the_receiver_rereads_is_unavailable(
    sessions: sessionmaker[Session], settings: Settings, engine: Engine
) -> None:
    """The receiver judges, the accept answers stale, the receiver reads the routes again and
    judges once more; when an operator changed the filter yet again in between, the second
    accept is stale too: FiltersChanged (the receiver answers 503 and the sender retries), and
    nothing of the event is written. One change only: the second accept writes."""
    made = make_source(
        sessions, settings, provider="stripe", routes=[{"handler": "log", "filter": BIG}]
    )
    [route] = made.route_ids
    filters = iter([f"{BIG} || type == 'a'", f"{BIG} || type == 'b'", f"{BIG} || type == 'c'"])

    def change_filter() -> None:  # an operator's update, committed between two statements
        with engine.begin() as c:
            c.execute(
                text("UPDATE routes SET filter = :f WHERE id = :r"),
                {"f": next(filters), "r": route},
            )

    async def scenario(changes: int, receipt: NewReceipt) -> list[Outcome]:
        store = Store(settings, SecretBox(settings.secret_key.get_secret_value()))
        await store.open()
        try:
            source = await store.source(made.public_id)
            assert source is not None
            left = [changes]

            async def run(judged: list[NewReceipt]) -> list[Outcome]:
                if left[0]:
                    left[0] -= 1
                    change_filter()
                return await store.accept_all(judged)

            return await accept_judged(store, source, [receipt], {}, run)
        finally:
            await store.close()

    twice = _receipt(made)
    with pytest.raises(FiltersChanged, match="changed twice"):
        asyncio.run(scenario(2, twice))
    once = _receipt(made)
    [outcome] = asyncio.run(scenario(1, once))
    assert outcome.status == "accepted"
    with engine.connect() as c:
        written = (
            c.execute(text("SELECT event_id FROM receipts WHERE source_id = :s"), {"s": made.id})
            .scalars()
            .all()
        )
    assert written == [once.event_id]  # the event changed twice under it: nothing written


def _with(receipt: NewReceipt, *verdicts: Verdict) -> NewReceipt:
    return replace(receipt, verdicts=tuple(verdicts))


# -- end to end: CLI, receiver, worker, console, metrics -----------------------------------


@pytest.fixture(scope="module")
def rcv(ops: Settings) -> Iterator[Receiver]:
    with ops_receiver(None, WEBHOOKS_ADMIN_TOKENS=f"fay:{TOKEN}") as running:
        yield running


def _source(sessions: sessionmaker[Session], settings: Settings, **route: Any) -> MadeSource:
    made = make_source(sessions, settings, provider="stripe", routes=[{"handler": "log", **route}])
    remember(made.secret)
    return made


def _post(
    rcv: Receiver, source: MadeSource, amount: int, event_type: str = "charge.succeeded"
) -> str:
    event_id = f"evt_{uuid.uuid4().hex}"
    body_obj = {
        "id": event_id,
        "object": "event",
        "type": event_type,
        "created": 1,
        "data": {"object": {"id": "ch_1", "object": "charge", "amount": amount}},
    }
    headers, body = sign(
        "stripe", source.secret, event_id=event_id, event_type=event_type, body_obj=body_obj
    )
    answer = httpx.post(
        f"{rcv.url}/webhooks/{source.public_id}", headers=headers, content=body, timeout=10
    )
    assert answer.status_code == 202, answer.text
    return event_id


def _deliveries(engine: Engine, source: MadeSource, event_id: str) -> list[Any]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                text(
                    "SELECT d.id, d.route_id, d.status, d.last_error, d.attempts"
                    " FROM deliveries d JOIN receipts r"
                    "   ON r.id = d.receipt_id AND r.expires_at = d.expires_at"
                    " WHERE r.source_id = :s AND r.event_id = :e ORDER BY d.route_id"
                ),
                {"s": source.id, "e": event_id},
            )
        )


def _routes(engine: Engine, source: MadeSource) -> list[Any]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                text("SELECT id, filter FROM routes WHERE source_id = :s ORDER BY id"),
                {"s": source.id},
            )
        )


def _audits(engine: Engine) -> int:
    """Route changes audited (a console login is audited too)."""
    with engine.connect() as conn:
        return int(
            conn.execute(
                text("SELECT count(*) FROM audit_log WHERE action LIKE 'route.%'")
            ).scalar_one()
        )


def _text(page: str) -> str:
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", page)).split())


@contextmanager
def _console(rcv: Receiver) -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30) as http:
        login = console_login(http, rcv.admin_url, TOKEN)
        assert login.status_code in (302, 303), login.status_code
        yield http


def _csrf(http: httpx.Client, rcv: Receiver) -> str:
    found = CSRF.search(http.get(f"{rcv.admin_url}/console/routes").text)
    assert found is not None
    return found.group(1)


@pytest.mark.slow
def test_a_bad_filter_is_refused_at_save_and_nothing_is_saved(
    rcv: Receiver, sessions: sessionmaker[Session], ops: Settings, engine: Engine
) -> None:
    made = _source(sessions, ops)
    before, audits = _routes(engine, made), _audits(engine)
    env = ops_env()

    added = cli(
        "routes", "add", made.public_id, "--handler", "log", "--filter", "body.amount >= `1` &&",
        env=env,
    )  # fmt: skip
    assert added.returncode == 1
    assert added.stderr.strip().count("\n") == 0, added.stderr  # one line
    assert "filter refused at position 21: Incomplete expression" in added.stderr
    updated = cli(
        "routes", "update", str(made.route_ids[0]), "--filter", "nope(body)", "--reason", "t",
        env=env,
    )  # fmt: skip
    assert updated.returncode == 1
    assert "filter refused at position 0: unknown function nope()" in updated.stderr
    # Issue 36 item 4: the refusal names the section on saving a filter.
    filters = TOPICS["filters"].path
    assert added.stderr.rstrip().endswith(f"(see {filters})"), added.stderr
    assert _routes(engine, made) == before
    assert _audits(engine) == audits

    with _console(rcv) as http:
        csrf = _csrf(http, rcv)
        page = http.post(
            f"{rcv.admin_url}/console/sources/{made.public_id}/routes",
            data={"csrf": csrf, "handler": "log", "events": "*", "filter": "type == "},
        )
        assert page.status_code == 400, page.status_code
        assert "filter refused at position 7: Incomplete expression" in _text(page.text)
        page = http.post(
            f"{rcv.admin_url}/console/routes/{made.route_ids[0]}/filter",
            data={"csrf": csrf, "filter": "matches(type, '(')", "reason": "try"},
        )
        assert page.status_code == 400, page.status_code
        assert "filter refused at position 16: matches(): bad pattern: missing )" in _text(
            page.text
        )
    assert _routes(engine, made) == before
    assert _audits(engine) == audits

    # A good one is saved (audited), through each way in.
    good = cli(
        "routes", "add", made.public_id, "--handler", "log", "--filter", BIG, env=env,
    )  # fmt: skip
    assert good.returncode == 0, good.stderr
    assert f"filter: {BIG}" in good.stdout
    with _console(rcv) as http:
        page = http.post(
            f"{rcv.admin_url}/console/routes/{made.route_ids[0]}/filter",
            data={"csrf": _csrf(http, rcv), "filter": "type == 'x'", "reason": "narrow"},
            follow_redirects=False,
        )
        assert page.status_code in (302, 303), page.text
        assert "type == &#39;x&#39;" in http.get(f"{rcv.admin_url}/console/routes").text
    assert [r.filter for r in _routes(engine, made)] == ["type == 'x'", BIG]
    assert _audits(engine) == audits + 2


@pytest.mark.slow
def test_a_filtered_event_makes_no_work_shows_everywhere_and_replays_on_purpose(
    rcv: Receiver,
    sessions: sessionmaker[Session],
    ops: Settings,
    engine: Engine,
    tmp_path: Path,
) -> None:
    flush(ops)
    made = make_source(
        sessions,
        ops,
        provider="stripe",
        routes=[{"handler": "log", "filter": BIG}, {"handler": "log", "events": "invoice.*"}],
    )
    remember(made.secret)
    route = made.route_ids[0]
    before = scrape_metrics(rcv.admin_port)
    key = ("webhooks_filtered_total", (("route", str(route)), ("source", made.public_id)))

    big = _post(rcv, made, 5000)
    small = _post(rcv, made, 10)
    [matching] = _deliveries(engine, made, big)
    [filtered] = _deliveries(engine, made, small)
    assert (matching.status, filtered.status) == ("pending", "filtered")
    assert filtered.last_error == f"route {route}: filter did not match"

    # No worker runs yet: the broker holds the matching delivery's message and nothing else.
    wait_for(lambda: queued_ids(ops), timeout=10, what="the matching delivery's message")
    assert queued_ids(ops) == [matching.id]
    assert scrape_metrics(rcv.admin_port).get(key, 0.0) - before.get(key, 0.0) == 1.0

    # One line per request: the filtered one's names the route, the matching one's none.
    def webhook_lines() -> dict[str, dict[str, Any]]:
        return {
            line["event_id"]: line
            for line in json_log_lines(rcv.log_path)
            if line.get("event") == "webhook" and line.get("event_id") in (big, small)
        }

    wait_for(lambda: len(webhook_lines()) == 2, timeout=10, what="the two requests' lines")
    lines = webhook_lines()
    assert lines[small]["filtered"] == [route]
    assert "filtered" not in lines[big]
    assert not [
        line for line in json_log_lines(rcv.log_path) if line.get("event") == "webhook.filtered"
    ]

    # A duplicate of the filtered event is answered with its outcome.
    headers, body = sign(
        "stripe",
        made.secret,
        event_id=small,
        event_type="charge.succeeded",
        body_obj={
            "id": small,
            "object": "event",
            "type": "charge.succeeded",
            "created": 1,
            "data": {"object": {"id": "ch_1", "object": "charge", "amount": 10}},
        },
    )
    again = httpx.post(
        f"{rcv.url}/webhooks/{made.public_id}", headers=headers, content=body, timeout=10
    )
    assert again.status_code == 200
    assert (again.json()["outcome"], again.json()["deliveries"]) == ("filtered", {"filtered": 1})

    env = {**ops_env(), "COLUMNS": "200"}
    shown = cli("events", "show", small, "--source", made.public_id, env=env)
    assert shown.returncode == 0, shown.stderr
    assert (
        f"delivery {filtered.id}: route {route} (log) filtered, 0 attempts, key generation 0: "
        f"route {route}: filter did not match"
    ) in shown.stdout
    as_json = json.loads(
        cli("events", "show", small, "--source", made.public_id, "--json", env=env).stdout
    )
    assert [d["status"] for d in as_json["deliveries"]] == ["filtered"]

    with engine.connect() as conn:
        receipt = conn.execute(
            text("SELECT id FROM receipts WHERE source_id = :s AND event_id = :e"),
            {"s": made.id, "e": small},
        ).scalar_one()
    with _console(rcv) as http:
        page = _text(http.get(f"{rcv.admin_url}/console/events/{receipt}").text)
        listed = http.get(
            f"{rcv.admin_url}/console/events",
            params={"source": made.public_id, "status": "filtered"},
        ).text
    assert small in listed
    assert big not in listed
    assert f"log filtered 0 filtered route {route}: filter did not match" in page

    with running_worker("filters", tmp_path, concurrency=2, **OPS):
        wait_status(engine, matching.id, "succeeded")
        # A blanket replay of the source's dead letters never selects it.
        blanket = cli(
            "replay", "--source", made.public_id, "--reason", "all", "--yes", env=env,
        )  # fmt: skip
        assert blanket.returncode == 0, blanket.stderr
        assert "nothing to replay" in blanket.stdout
        assert _deliveries(engine, made, small)[0].status == "filtered"
        assert attempts(engine, filtered.id) == []
        # Named by its id: it runs, although its filter did not match.
        chosen = cli(
            "replay", str(filtered.id), "--reason", "deliver it anyway", "--yes", env=env,
        )  # fmt: skip
        assert chosen.returncode == 0, chosen.stderr
        assert "1 filtered" in chosen.stdout
        assert "filtered ones run although their route's filter did not match" in chosen.stdout
        done = wait_status(engine, filtered.id, "succeeded")
    assert done.last_error is None
    assert [a.outcome for a in attempts(engine, filtered.id)] == ["succeeded"]


@pytest.mark.slow
def test_a_changed_filter_applies_to_the_events_accepted_afterwards(
    rcv: Receiver, sessions: sessionmaker[Session], ops: Settings, engine: Engine
) -> None:
    made = _source(sessions, ops)  # no filter yet
    route = str(made.route_ids[0])
    first = _post(rcv, made, 10)  # the receiver now holds the source, with no filter
    env = ops_env()

    # Added while the receiver's cache says there is none: the accept notices.
    narrowed = cli("routes", "update", route, "--filter", BIG, "--reason", "big only", env=env)
    assert narrowed.returncode == 0, narrowed.stderr
    assert f"filter {BIG}" in narrowed.stdout
    second = _post(rcv, made, 10)
    # Widened: applies at once as well.
    widened = cli(
        "routes", "update", route, "--filter", "body.data.object.amount >= `1`", env=env,
    )  # fmt: skip
    assert widened.returncode == 0, widened.stderr
    third = _post(rcv, made, 10)
    cleared = cli("routes", "update", route, "--filter", "none", env=env)
    assert cleared.returncode == 0, cleared.stderr
    assert "filter none" in cleared.stdout
    shown = cli("routes", "show", route, env=env)
    assert "filter: none (every event of its types)" in shown.stdout
    fourth = _post(rcv, made, 10)

    # A test send (`webhooks send`, audited in the accept's transaction) through a stale
    # cache again: one audit row, for the accept that wrote, none for the one that did not.
    sent_id = f"evt_sent_{uuid.uuid4().hex}"
    again = cli("routes", "update", route, "--filter", BIG, env=env)
    assert again.returncode == 0, again.stderr
    sent = cli(
        "send", made.public_id, "--url", rcv.url, "--type", "charge.succeeded",
        "--id", sent_id, "--data", '{"id": "ch_9", "amount": 10}', env=env,
    )  # fmt: skip
    assert sent.returncode == 0, sent.stderr
    assert "202" in sent.stdout

    statuses = [
        _deliveries(engine, made, e)[0].status for e in (first, second, third, fourth, sent_id)
    ]
    assert statuses == ["pending", "filtered", "pending", "pending", "filtered"]
    with engine.connect() as conn:
        sends = conn.execute(
            text(
                "SELECT target->>'outcome' FROM audit_log WHERE action = 'event.send'"
                " AND target->>'event_id' = :e"
            ),
            {"e": sent_id},
        ).all()
    assert [s[0] for s in sends] == ["accepted"]
    with engine.connect() as conn:
        changes = conn.execute(
            text(
                "SELECT target->>'before', target->>'after' FROM audit_log"
                " WHERE action = 'route.filter' AND (target->>'route')::bigint = :r ORDER BY id"
            ),
            {"r": int(route)},
        ).all()
    assert [tuple(c) for c in changes] == [
        (None, BIG),
        (BIG, "body.data.object.amount >= `1`"),
        ("body.data.object.amount >= `1`", None),
        (None, BIG),
    ]


def test_migration_0027_goes_down_and_up_again() -> None:
    """Downgrade drops what the old code cannot read (the filtered deliveries, the column) and
    restores 0018's accept functions; upgrade brings the filters back to working."""
    with own_database(f"{TEST_DB}_filters_0027") as (settings, engine, sessions):
        made = make_source(
            sessions, settings, provider="stripe", routes=[{"handler": "log", "filter": BIG}]
        )
        receipt = _receipt(made)
        verdict = evaluate(
            made.route_ids[0], BIG, document(receipt.payload, receipt.event_type, {})
        )
        with psycopg.connect(settings.psycopg_dsn, autocommit=True) as conn:
            rows = conn.execute(
                ACCEPT_MANY_SQL, accept_many_params([_with(receipt, verdict)], NO_GRACE)
            ).fetchall()
        assert decide_many([receipt], rows)[0].filtered_routes == made.route_ids
        config = alembic_config(settings)
        command.downgrade(config, "0026")
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM deliveries")).scalar_one() == 0
            assert conn.execute(text("SELECT count(*) FROM receipts")).scalar_one() == 1
        command.upgrade(config, "head")
        with engine.begin() as conn:
            conn.execute(text("UPDATE routes SET filter = :f"), {"f": BIG})
        again = replace(_receipt(made), verdicts=(verdict,))
        with psycopg.connect(settings.psycopg_dsn, autocommit=True) as conn:
            rows = conn.execute(ACCEPT_MANY_SQL, accept_many_params([again], NO_GRACE)).fetchall()
        assert decide_many([again], rows)[0].filtered_routes == made.route_ids


def test_a_filtered_delivery_is_no_queue_lag(
    sessions: sessionmaker[Session], settings: Settings, engine: Engine
) -> None:
    """A filtered delivery never ends, so it has no lag: counted, it would look like work
    waiting since its event arrived and inflate the measured p99 the TTL is checked with."""
    made = make_source(
        sessions, settings, provider="stripe", routes=[{"handler": "log", "filter": BIG}]
    )
    receipt = _receipt(made)
    verdict = evaluate(made.route_ids[0], BIG, document(receipt.payload, receipt.event_type, {}))
    with psycopg.connect(settings.psycopg_dsn, autocommit=True) as conn:
        rows = conn.execute(
            ACCEPT_MANY_SQL, accept_many_params([_with(receipt, verdict)], NO_GRACE)
        ).fetchall()
    assert decide_many([receipt], rows)[0].filtered_routes == made.route_ids
    with engine.connect() as conn:
        later = datetime.now(UTC) + timedelta(hours=1)
        assert queue_lag.measure(conn, later, timedelta(days=1), made.id) == {}


def test_a_recovered_event_is_judged_by_its_routes_filters(
    sessions: sessionmaker[Session], settings: Settings, engine: Engine
) -> None:
    """Reconciliation accepts an event the provider's API lists through the same statement:
    its routes' filters judge it too (no request headers), read in its own transaction."""
    made = make_source(
        sessions,
        settings,
        provider="stripe",
        routes=[{"handler": "log", "filter": "body.data.object.amount >= `1000`"}],
    )
    box = SecretBox(settings.secret_key.get_secret_value())
    with sessions() as session:
        target = load_target(session, box, settings, made.public_id)
    events = {
        amount: ProviderEvent(
            f"evt_{uuid.uuid4().hex}",
            "charge.succeeded",
            datetime.now(UTC),
            orjson.dumps({"data": {"object": {"amount": amount}}}),
        )
        for amount in (10, 5000)
    }
    with psycopg.connect(settings.psycopg_dsn) as conn:
        small = accept_recovered(conn, settings, target, events[10])
        big = accept_recovered(conn, settings, target, events[5000])
    assert small == ("accepted", ())
    assert big[0] == "accepted"
    assert len(big[1]) == 1
    statuses = {
        amount: [d.status for d in _deliveries(engine, made, e.event_id)]
        for amount, e in events.items()
    }
    assert statuses == {10: ["filtered"], 5000: ["pending"]}
