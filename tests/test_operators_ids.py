"""Every id an operator sees resolves with the command the README names (issue 10).

Flower and the logs show delivery ids, `dead list` too; `events list` shows receipts as
``receipt:N``. Receipts and deliveries are numbered by two sequences, so the tests set both
sequences to one value and make numbers that are both a receipt and a delivery id, and
numbers that are only a delivery id: `events show` must refuse them (naming `deliveries show`)
instead of showing another event. Attempt histories read in time order with each replay as a
separator carrying its audit row; event data is printed literally, never as rich markup.
Real Postgres, the real CLI in a subprocess, the real receiver for the admin API.
"""

from __future__ import annotations

import base64
import json
import re
import secrets
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core.settings import Settings
from models import queries, transitions
from models.delivery_history import AttemptView, ReplayAudit, replay_marks
from tasks.context import idempotency_key
from tests.factories import MadeSource, accept_event
from tests.leakcheck import remember
from tests.operators_support import (
    accept,
    cli,
    kill,
    ops_env,
    ops_receiver,
    replay_rows,
    source_with,
)
from tests.processes import Receiver

pytestmark = pytest.mark.timeout(180)

TOKEN = "adm_" + secrets.token_urlsafe(24)
remember(TOKEN)
ROW = re.compile(r"^[│|] (\d+) +[│|]")


@pytest.fixture(scope="module")
def api() -> Iterator[Receiver]:
    with ops_receiver(TOKEN) as running:
        yield running


def env() -> dict[str, str]:
    return {**ops_env(), "COLUMNS": "250"}


def run(*args: str) -> Any:
    done = cli(*args, env=env())
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def run_json(*args: str) -> Any:
    return json.loads(run(*args, "--json").stdout)


def refused(*args: str) -> str:
    """A refusal: exit 1, one line on stderr, no traceback; returns that line."""
    done = cli(*args, env=env())
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def _align_sequences(engine: Engine) -> int:
    """Both id sequences at one value, above every id in use: the next receipt and the next
    delivery get the same number."""
    with engine.begin() as conn:
        top = conn.execute(
            text(
                "SELECT greatest((SELECT last_value FROM receipts_id_seq),"
                " (SELECT last_value FROM deliveries_id_seq)) + 100"
            )
        ).scalar_one()
        conn.execute(
            text("SELECT setval('receipts_id_seq', :v), setval('deliveries_id_seq', :v)"),
            {"v": top},
        )
    return int(top)


def _colliding(
    engine: Engine, sessions: sessionmaker[Session], ops: Settings
) -> tuple[MadeSource, list[tuple[str, int, list[int]]]]:
    """Two events on a source with two routes: receipts top+1, top+2; deliveries top+1 to
    top+4, so top+1 and top+2 are both, top+3 and top+4 only delivery ids."""
    source = source_with(sessions, ops, "log", "noop")
    top = _align_sequences(engine)
    made = []
    for _ in range(2):
        event_id, outcome = accept_event(ops, source)
        assert outcome.receipt_id is not None
        made.append((event_id, outcome.receipt_id, list(outcome.delivery_ids)))
    assert [m[1] for m in made] == [top + 1, top + 2]
    assert [m[2] for m in made] == [[top + 1, top + 2], [top + 3, top + 4]]
    return source, made


def test_events_show_refuses_a_number_that_is_a_delivery_id_and_names_the_command(
    ops: Settings, sessions: sessionmaker[Session], engine: Engine
) -> None:
    _source, [(first, r1, _), (second, r2, [d3, d4])] = _colliding(engine, sessions, ops)

    both = refused("events", "show", str(r1))
    assert f"webhooks deliveries show {r1}" in both
    assert f"receipt:{r1}" in both
    only_delivery = refused("events", "show", str(d3))
    assert "is a delivery id" in only_delivery
    assert f"webhooks deliveries show {d3}" in only_delivery

    # The unambiguous forms resolve, each to the event it names.
    assert run_json("events", "show", f"receipt:{r1}")["event_id"] == first
    assert run_json("events", "show", f"receipt:{r2}")["event_id"] == second
    assert run_json("events", "show", f"delivery:{d4}")["event_id"] == second
    assert run_json("events", "show", f"event:{first}")["id"] == r1
    assert run_json("events", "show", second)["id"] == r2
    # A delivery id shows that delivery, with its event.
    shown = run_json("deliveries", "show", str(d3))
    assert (shown["id"], shown["event_id"], shown["receipt"]) == (d3, second, f"receipt:{r2}")
    assert run_json("deliveries", "show", f"delivery:{d3}")["id"] == d3

    assert "no such delivery: 999999999" in refused("deliveries", "show", "999999999")
    assert "not a delivery id" in refused("deliveries", "show", "abc")
    assert "no such event" in refused("events", "show", "receipt:999999999")
    assert "no such delivery" in refused("events", "show", "delivery:999999999")


def test_every_id_a_listing_prints_resolves(
    ops: Settings, sessions: sessionmaker[Session], engine: Engine
) -> None:
    source, made = _colliding(engine, sessions, ops)
    dead = made[1][2][1]
    kill(sessions, [dead])

    listed = run("events", "list", "--source", source.public_id).stdout
    receipts = re.findall(r"receipt:\d+", listed)
    assert sorted(receipts) == sorted(f"receipt:{r}" for _, r, _ in made)
    for ref in receipts:
        assert run_json("events", "show", ref)["source"] == source.public_id

    dead_list = run("dead", "list", "--source", source.public_id).stdout
    assert "latest delivery ids" in dead_list
    assert "webhooks deliveries show ID" in dead_list
    [group] = run_json("dead", "list", "--source", source.public_id)
    assert group["sample_ids"] == [dead]
    assert str(dead) in dead_list
    shown = run_json("deliveries", "show", str(dead))
    assert shown["delivery"]["status"] == "dead"
    human = run("deliveries", "show", str(dead)).stdout
    assert f"webhooks replay {dead}" in human
    assert f"webhooks events show receipt:{made[1][1]}" in human

    # What Flower and the logs show: the delivery id, the event id and the source.
    assert run_json("events", "show", made[0][0], "--source", source.public_id)["id"] == made[0][1]


def test_an_event_id_in_two_sources_needs_the_source(
    ops: Settings, sessions: sessionmaker[Session]
) -> None:
    one, two = source_with(sessions, ops), source_with(sessions, ops)
    event_id = f"evt_shared_{secrets.token_hex(4)}"
    accept_event(ops, one, event_id=event_id)
    accept_event(ops, two, event_id=event_id)
    line = refused("events", "show", event_id)
    assert "--source" in line
    assert one.public_id in line
    assert two.public_id in line
    assert run_json("events", "show", event_id, "--source", two.name)["source"] == two.public_id


def test_deliveries_show_names_route_key_and_dead_reason(
    ops: Settings, sessions: sessionmaker[Session]
) -> None:
    source = source_with(sessions, ops, "log")
    event_id, outcome = accept_event(ops, source, event_type="invoice.paid")
    [delivery] = outcome.delivery_ids
    kill(sessions, [delivery], reason="max_attempts")
    shown = run_json("deliveries", "show", str(delivery))
    d = shown["delivery"]
    assert (d["status"], d["dead_reason"], d["handler"]) == ("dead", "max_attempts", "log")
    assert (shown["route_events"], shown["route_active"]) == ("*", True)
    assert shown["idempotency_key"] == idempotency_key(source.id, event_id, source.route_ids[0], 0)
    assert (shown["event_type"], shown["source"]) == ("invoice.paid", source.public_id)
    assert shown["received_at"].endswith("Z")
    human = run("deliveries", "show", str(delivery)).stdout
    assert shown["idempotency_key"] in human
    assert "dead: max_attempts" in human


# Attempt history -----------------------------------------------------------------------------


def _attempt(sessions: sessionmaker[Session], delivery: int, outcome: str) -> None:
    """One attempt as a worker makes it, at this instant (later than everything before)."""
    now = datetime.now(UTC)
    with sessions() as session, session.begin():
        found = transitions.claim(
            session, delivery, now=now, lease=timedelta(minutes=5), max_redeliveries=3,
            worker="test:0",
        )  # fmt: skip
        assert found is not None
        if outcome == "retry":
            transitions.retry_later(
                session, found, now=now, next_attempt_at=now, error_class="RetryableError",
                error="503 from downstream",
            )  # fmt: skip
        elif outcome == "dead":
            transitions.kill(
                session, found, now=now, reason="max_attempts", error_class="RetryableError",
                error="503 from downstream",
            )  # fmt: skip
        else:
            transitions.succeed(session, found, now=now)


def _replay(delivery: int, operator: str, reason: str, *extra: str) -> None:
    run("replay", str(delivery), "--reason", reason, "--as", operator, "--yes", *extra)


def _timeline(stdout: str) -> list[str]:
    """The attempt rows (#n) and the replay separators (by operator), in printed order."""
    out = []
    for line in stdout.splitlines():
        found = ROW.match(line)
        if found:
            out.append(f"#{found.group(1)}")
        elif "── replay" in line or "── re-run" in line:
            out.append(line.split(" by ")[1].split(" ")[0])
    return out


def test_attempt_history_continues_across_replays_in_time_order_with_separators(
    ops: Settings, sessions: sessionmaker[Session], engine: Engine
) -> None:
    source = source_with(sessions, ops, "log")
    [d] = accept(ops, source)
    _attempt(sessions, d, "retry")  # 1
    _attempt(sessions, d, "dead")  # 2
    _replay(d, "alice", "bug 1 fixed")
    waiting = run_json("deliveries", "show", str(d))["delivery"]
    assert [(m["operator"], m["first_attempt"]) for m in waiting["replays"]] == [("alice", None)]
    assert "(no attempt yet)" in run("deliveries", "show", str(d)).stdout
    _attempt(sessions, d, "retry")  # 3
    _attempt(sessions, d, "dead")  # 4
    _replay(d, "bob", "bug 2 fixed")
    _attempt(sessions, d, "succeeded")  # 5
    _replay(d, "carol", "downstream lost it", "--rerun-succeeded")
    _attempt(sessions, d, "succeeded")  # 6, key generation 1

    shown = run_json("deliveries", "show", str(d))["delivery"]
    log = shown["attempt_log"]
    assert [a["number"] for a in log] == [1, 2, 3, 4, 5, 6]
    assert [a["started_at"] for a in log] == sorted(a["started_at"] for a in log)
    assert [a["generation"] for a in log] == [0, 0, 0, 0, 0, 1]
    assert (shown["attempts"], shown["attempts_since_replay"], shown["generation"]) == (6, 1, 1)
    audit = {r.operator: r.id for r in replay_rows(engine) if r.filter == {"ids": [d]}}
    marks = [
        (m["replay_id"], m["operator"], m["reason"], m["first_attempt"], m["rerun"])
        for m in shown["replays"]
    ]
    assert marks == [
        (audit["alice"], "alice", "bug 1 fixed", 3, False),
        (audit["bob"], "bob", "bug 2 fixed", 5, False),
        (audit["carol"], "carol", "downstream lost it", 6, True),
    ]

    for args in (("deliveries", "show", str(d)), ("events", "show", f"delivery:{d}")):
        human = run(*args).stdout
        # The header's count is the rows shown.
        assert f"delivery {d}: route {source.route_ids[0]} (log) succeeded, 6 attempts" in human
        assert "(1 since the last replay)" in human
        assert _timeline(human) == [
            "#1", "#2", "alice", "#3", "#4", "bob", "#5", "carol", "#6",
        ]  # fmt: skip
        assert f"── replay {audit['alice']} at " in human
        assert f"── re-run (new key generation) {audit['carol']} at " in human


def _a(number: int, minute: int, outcome: str, generation: int = 0) -> AttemptView:
    at = datetime(2026, 11, 30, 12, minute, tzinfo=UTC)
    return AttemptView(number, generation, "w", at, at, outcome, None, None)


def _r(replay_id: int, minute: int, flt: dict[str, Any]) -> ReplayAudit:
    at = datetime(2026, 11, 30, 12, minute, 30, tzinfo=UTC)
    return ReplayAudit(replay_id, "op", "why", "cli", at, False, flt)


def test_replay_marks_find_a_replay_after_a_crash_and_pick_the_replay_that_moved_it() -> None:
    # Died by crashing (its last attempt says crashed, not dead), then replayed: the first
    # attempt after attempt_base opens the new run.
    crashed = [_a(1, 0, "crashed"), _a(2, 1, "crashed"), _a(3, 5, "succeeded")]
    [mark] = replay_marks(crashed, [_r(7, 3, {"source": "src_x"})], attempt_base=2)
    assert (mark.replay_id, mark.first_attempt) == (7, 3)
    # Two replays after a death: the one naming the delivery, the earliest, moved it; a
    # filter replay of another source is no candidate (queries leaves it out before this).
    died = [_a(1, 0, "dead"), _a(2, 9, "succeeded")]
    both = [_r(8, 2, {"source": "src_y"}), _r(9, 3, {"ids": [5]}), _r(10, 4, {"ids": [5]})]
    [mark] = replay_marks(died, both, attempt_base=1)
    assert (mark.replay_id, mark.first_attempt) == (9, 2)
    # No audit row (older than the replays kept): the separator is still there.
    [mark] = replay_marks(died, [], attempt_base=1)
    assert (mark.replay_id, mark.first_attempt) == (None, 2)
    # No replay: retries only, no separator.
    assert replay_marks([_a(1, 0, "retry"), _a(2, 1, "dead")], [], attempt_base=0) == []


# Event data is printed literally ---------------------------------------------------------------

MARKUP_TYPE = "[link=https://evil.example]pay[/link].now"
MARKUP_ERROR = "[bold]boom[/bold] [link=https://evil.example]x[/link]"
MARKUP_REASON = "[blink]bad[/blink]"


def test_event_data_is_printed_literally_never_as_markup(
    ops: Settings, sessions: sessionmaker[Session]
) -> None:
    source = source_with(sessions, ops, "log")
    event_id, outcome = accept_event(ops, source, event_type=MARKUP_TYPE)
    [d] = outcome.delivery_ids
    now = datetime.now(UTC)
    with sessions() as session, session.begin():
        found = transitions.claim(
            session, d, now=now, lease=timedelta(minutes=5), max_redeliveries=3, worker="w:1"
        )
        assert found is not None
        transitions.kill(
            session, found, now=now, reason=MARKUP_REASON, error_class="PermanentError",
            error=MARKUP_ERROR,
        )  # fmt: skip
    outputs = {
        "events list": run("events", "list", "--source", source.public_id).stdout,
        "events show": run("events", "show", event_id).stdout,
        "deliveries show": run("deliveries", "show", str(d)).stdout,
        "dead list": run("dead", "list", "--source", source.public_id).stdout,
        "replay preview": run("replay", str(d), "--dry-run").stdout,
        "discard preview": run("dead", "discard", str(d), "--dry-run").stdout,
    }
    for name, out in outputs.items():
        assert MARKUP_TYPE in out or MARKUP_REASON in out, name
    for name in ("events show", "deliveries show"):
        assert MARKUP_TYPE in outputs[name], name
        assert MARKUP_ERROR in outputs[name], name
        assert MARKUP_REASON in outputs[name], name
    assert MARKUP_REASON in outputs["dead list"]


# The admin API -------------------------------------------------------------------------------


def _get(api: Receiver, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
    auth = {"Authorization": f"Bearer {TOKEN}"} if headers is None else headers
    return httpx.get(f"{api.admin_url}/admin{path}", headers=auth, timeout=10)


def _basic(password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"ops:{password}".encode()).decode()}


def test_the_admin_api_looks_deliveries_up_and_refuses_an_ambiguous_event_number(
    api: Receiver, ops: Settings, sessions: sessionmaker[Session], engine: Engine
) -> None:
    _source, [(first, r1, [d1, _]), (_second, _r2, [d3, _])] = _colliding(engine, sessions, ops)
    shown = _get(api, f"/deliveries/{d3}")
    assert shown.status_code == 200, shown.text
    body = shown.json()
    with sessions() as session:
        expected = queries.get_delivery(session, d3, key_of=idempotency_key)
    assert (body["id"], body["receipt"], body["idempotency_key"]) == (
        d3,
        expected.receipt,
        expected.idempotency_key,
    )
    assert body["received_at"].endswith("Z")
    assert body["delivery"]["created_at"].endswith("Z")
    missing = _get(api, "/deliveries/999999999")
    assert (missing.status_code, missing.json()["reason"]) == (404, "not_found")

    ambiguous = _get(api, f"/events/{d1}")
    assert (ambiguous.status_code, ambiguous.json()["reason"]) == (400, "ambiguous_id")
    assert "deliveries show" in ambiguous.json()["detail"]
    assert _get(api, f"/events/receipt:{r1}").json()["event_id"] == first


def test_an_api_replay_is_recorded_under_the_tokens_name(
    api: Receiver, ops: Settings, sessions: sessionmaker[Session], engine: Engine
) -> None:
    source = source_with(sessions, ops, "log")
    [d] = accept(ops, source)
    kill(sessions, [d])
    auth = {"Authorization": f"Bearer {TOKEN}"}
    claimed = httpx.post(
        f"{api.admin_url}/admin/replays",
        json={"reason": "r", "ids": [d], "operator": "someone-else"},
        headers=auth,
        timeout=10,
    )
    assert claimed.status_code == 400  # a client-named operator is no longer accepted
    assert claimed.json()["errors"][0]["field"] == "body.operator"
    started = httpx.post(
        f"{api.admin_url}/admin/replays",
        json={"reason": "no operator named", "ids": [d]},
        headers=auth,
        timeout=10,
    )
    assert started.status_code == 202, started.text
    [row] = replay_rows(engine, id=started.json()["replay"]["id"])
    assert (row.operator, row.via) == ("admin", "api")  # WEBHOOKS_ADMIN_TOKEN's name


def test_the_admin_docs_work_offline_and_need_the_token(api: Receiver) -> None:
    for path in ("/docs", "/openapi.json", "/docs/assets/swagger-ui-bundle.js"):
        missing = _get(api, path, headers={})
        assert missing.status_code == 401, path
        assert missing.headers["www-authenticate"].startswith("Basic"), path
        assert _get(api, path, headers=_basic("wrong")).status_code == 401, path
    page = _get(api, "/docs", headers=_basic(TOKEN))
    assert page.status_code == 200
    assert "/admin/docs/assets/swagger-ui-bundle.js" in page.text
    assert "/admin/openapi.json" in page.text
    assert "http://" not in page.text
    assert "https://" not in page.text
    for asset in ("swagger-ui-bundle.js", "swagger-ui.css"):
        served = _get(api, f"/docs/assets/{asset}", headers=_basic(TOKEN))
        assert served.status_code == 200, asset
        assert len(served.content) > 10_000, asset
    assert _get(api, "/docs/assets/index.html", headers=_basic(TOKEN)).status_code == 404
    schema = _get(api, "/openapi.json").json()
    assert schema["paths"]
    # The bundled Swagger UI is 4.x: it renders OpenAPI 3.0 documents and refuses 3.1 ones
    # ("Unable to render this definition"), as seen in headless Chromium.
    assert schema["openapi"].startswith("3.0.")
    # The API itself takes the bearer token only.
    assert _get(api, "/events", headers=_basic(TOKEN)).status_code == 401
