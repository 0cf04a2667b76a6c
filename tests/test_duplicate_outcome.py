"""A duplicate is answered with its event's recorded outcome (issue 35 item 1, seed 004: "A
duplicate that finds a completed receipt gets the previously recorded outcome. One that finds
pending work should receive a response consistent with the retry contract").

Real receiver and worker processes, real Postgres and Redis: the duplicate's 200 carries
where the first arrival's deliveries stand (pending while no worker runs, then succeeded or
dead), when it was first accepted, and the result references its handlers returned; never
the payload. A handler's result reference is stored with its success on both success paths
(written through ``ctx.session``, or nothing written), and what is not one is refused with a
line that does not quote it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core.settings import Settings
from core.states import receipt_outcome
from tasks.context import MAX_RESULT_REF, result_reference
from tests.factories import MadeSource, make_source
from tests.leakcheck import remember
from tests.operators_support import cli
from tests.processes import Receiver, receiver
from tests.signing import sign, sign_hubspot
from tests.workers import BROKER_URL, CLAIMS_URL, running_worker, wait_status, worker_env

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("clean_worker_state")]

HUBSPOT_URL = "https://hooks.example.com/hubspot?portal=1"


@pytest.fixture(scope="module")
def rcv() -> Iterator[Receiver]:
    with receiver(WEBHOOKS_BROKER_URL=BROKER_URL, WEBHOOKS_REDIS_URL=CLAIMS_URL) as r:
        yield r


def _source(
    sessions: sessionmaker[Session], settings: Settings, routes: list[dict[str, Any]], **kw: Any
) -> MadeSource:
    made = make_source(
        sessions, settings, provider=kw.pop("provider", "stripe"), routes=routes, **kw
    )
    remember(made.secret)
    return made


_BODIES: dict[str, bytes] = {}  # event id -> the body first sent: a retry re-sends it


def _send(rcv: Receiver, source: MadeSource, event_id: str) -> httpx.Response:
    headers, body = sign("stripe", source.secret, event_id=event_id, raw_body=_BODIES.get(event_id))
    _BODIES.setdefault(event_id, body)
    remember(body)
    return httpx.post(
        f"{rcv.url}/webhooks/{source.public_id}", headers=headers, content=body, timeout=10
    )


def _deliveries(engine: Engine, source: MadeSource) -> list[Any]:
    """The source's deliveries in the order of its routes (as the test lists them): the
    accept statement numbers one event's deliveries in whatever order it reads the routes."""
    with engine.connect() as conn:
        return list(
            conn.execute(
                text(
                    "SELECT id, result_ref FROM deliveries WHERE source_id = :s"
                    " ORDER BY route_id, id"
                ),
                {"s": source.id},
            )
        )


def _first_accepted(engine: Engine, source: MadeSource, event_id: str) -> datetime:
    with engine.connect() as conn:
        at: datetime = conn.execute(
            text("SELECT received_at FROM receipts WHERE source_id = :s AND event_id = :e"),
            {"s": source.id, "e": event_id},
        ).scalar_one()
    return at


def _duplicate(rcv: Receiver, source: MadeSource, event_id: str) -> dict[str, Any]:
    response = _send(rcv, source, event_id)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    assert answer["status"] == "duplicate"
    assert "invoice" not in response.text  # the payload's type, never echoed
    return answer


def test_a_duplicate_is_answered_with_what_its_event_became(
    rcv: Receiver,
    sessions: sessionmaker[Session],
    settings: Settings,
    engine: Engine,
    tmp_path: Path,
) -> None:
    made = _source(
        sessions,
        settings,
        [
            # Writes through ctx.session: the success commits with the effect.
            {"handler": "result_ref", "options": {"ref": "order-{event_id}", "session": "1"}},
            # Writes nothing: the grouped success statement records it.
            {"handler": "result_ref", "options": {"ref": "row-{event_id}"}},
        ],
    )
    dead = _source(sessions, settings, [{"handler": "permanent"}])
    refused = _source(
        sessions,
        settings,
        [
            {"handler": "result_ref", "options": {"returns": bad}}
            for bad in ("dict", "long", "newline")
        ],
    )
    ids = {s.public_id: f"evt_{uuid.uuid4().hex}" for s in (made, dead, refused)}
    for source in (made, dead, refused):
        assert _send(rcv, source, ids[source.public_id]).status_code == 202

    # No worker yet: pending work, answered 200 (the sender need not retry).
    first = _duplicate(rcv, made, ids[made.public_id])
    accepted_at = datetime.fromisoformat(first.pop("first_accepted_at"))
    assert accepted_at == _first_accepted(engine, made, ids[made.public_id])
    assert first == {
        "status": "duplicate",
        "event_id": ids[made.public_id],
        "outcome": "pending",
        "deliveries": {"pending": 2},
    }

    with running_worker("dup-outcome", tmp_path, concurrency=4) as worker:
        for row in _deliveries(engine, made) + _deliveries(engine, refused):
            wait_status(engine, row.id, "succeeded")
        wait_status(engine, _deliveries(engine, dead)[0].id, "dead")
    event = ids[made.public_id]
    assert [r.result_ref for r in _deliveries(engine, made)] == [f"order-{event}", f"row-{event}"]

    done = _duplicate(rcv, made, event)
    assert datetime.fromisoformat(done.pop("first_accepted_at")) == accepted_at
    assert done == {
        "status": "duplicate",
        "event_id": event,
        "outcome": "succeeded",
        "deliveries": {"succeeded": 2},
        "results": [f"order-{event}", f"row-{event}"],
    }
    # `webhooks events show` shows each delivery's result reference, in text and JSON.
    env = {**worker_env(), "COLUMNS": "200"}
    shown = cli("events", "show", event, "--source", made.public_id, env=env)
    assert shown.returncode == 0, shown.stderr
    assert f"result order-{event}" in shown.stdout
    assert f"result row-{event}" in shown.stdout
    as_json = cli("events", "show", event, "--source", made.public_id, "--json", env=env)
    assert [d["result_ref"] for d in json.loads(as_json.stdout)["deliveries"]] == [
        f"order-{event}",
        f"row-{event}",
    ]

    gone = _duplicate(rcv, dead, ids[dead.public_id])
    assert (gone["outcome"], gone["deliveries"]) == ("dead", {"dead": 1})
    assert "results" not in gone

    # What is not a result reference is refused, the success standing; never stored, never
    # quoted in the line that says so.
    kept = _duplicate(rcv, refused, ids[refused.public_id])
    assert (kept["outcome"], kept["deliveries"]) == ("succeeded", {"succeeded": 3})
    assert "results" not in kept
    assert [r.result_ref for r in _deliveries(engine, refused)] == [None, None, None]
    lines = [line for line in worker.json_lines() if line["event"] == "delivery.result_ref_refused"]
    by_delivery = {line["delivery_id"]: line["reason"] for line in lines}
    refused_ids = [r.id for r in _deliveries(engine, refused)]
    assert [by_delivery.get(i) for i in refused_ids] == [
        "not text (dict)",
        f"201 characters (1 to {MAX_RESULT_REF})",
        "not printable",
    ]
    assert not any(ids[refused.public_id] in str(line) for line in lines)


def test_duplicates_in_a_batch_each_carry_their_outcome(
    rcv: Receiver, sessions: sessionmaker[Session], settings: Settings
) -> None:
    source = _source(
        sessions,
        settings,
        [{"handler": "log"}],
        provider="hubspot",
        config={"public_url": HUBSPOT_URL},
    )
    old, new = f"{uuid.uuid4().int % 10**12}", f"{uuid.uuid4().int % 10**12}"
    # One instant for both requests: each event's occurredAt comes from it, and HubSpot
    # re-sends an event with the occurredAt it first had (two seconds would make the old
    # event's body differ: a conflict, not a duplicate).
    sent_at = int(time.time())

    def post(event_ids: list[str]) -> httpx.Response:
        headers, body = sign_hubspot(
            source.secret, event_ids=event_ids, url=HUBSPOT_URL, timestamp=sent_at
        )
        remember(body)
        return httpx.post(
            f"{rcv.url}/webhooks/{source.public_id}", headers=headers, content=body, timeout=10
        )

    assert post([old]).status_code == 202
    response = post([old, new])
    assert response.status_code == 202
    events = response.json()["events"]
    assert [(e["event_id"], e["status"]) for e in events] == [
        (old, "duplicate"),
        (new, "accepted"),
    ]
    assert (events[0]["outcome"], events[0]["deliveries"]) == ("pending", {"pending": 1})
    assert "outcome" not in events[1]


def test_the_outcome_word_names_unfinished_work_first() -> None:
    assert receipt_outcome({"succeeded": 2}) == "succeeded"
    assert receipt_outcome({"succeeded": 1, "dead": 1}) == "dead"
    assert receipt_outcome({"dead": 1, "retrying": 1}) == "retrying"
    assert receipt_outcome({"pending": 1, "processing": 1}) == "processing"
    assert receipt_outcome({"discarded": 1, "succeeded": 1}) == "succeeded"
    assert receipt_outcome({}) == "no_routes"


def test_a_result_reference_is_short_printable_text() -> None:
    assert result_reference(None) == (None, None)
    assert result_reference("ord_42") == ("ord_42", None)
    assert result_reference("r" * MAX_RESULT_REF) == ("r" * MAX_RESULT_REF, None)
    assert result_reference(42) == (None, "not text (int)")
    assert result_reference("") == (None, f"0 characters (1 to {MAX_RESULT_REF})")
    assert result_reference("a\tb") == (None, "not printable")
