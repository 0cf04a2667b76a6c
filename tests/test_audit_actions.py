"""Issue 34 item 5: every operator action that creates or changes data is audited.

Here ``webhooks send`` through a real receiver (``webhooks serve``): its events are recorded
with ``arrived_via = 'test'`` and an ``audit_log`` row each (the operator, the source, the
event's type and id, never the payload), because the receiver verifies the request's
test-send mark (:mod:`core.send_marks`); a mark that does not verify is refused and nothing is
written. And ``webhooks audit list`` lists bulk replays beside the other actions. The
console's actions and logins: ``tests/test_console.py``.
"""

from __future__ import annotations

import getpass
import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core import send_marks
from core.providers import sending
from core.settings import Settings
from tests.conftest import BASE_ENV, BIN, test_env
from tests.factories import MadeSource, make_source
from tests.leakcheck import remember
from tests.operators_support import accept, cli, flush, kill, ops_env, ops_settings
from tests.processes import Receiver, receiver

KEYS = send_marks.mark_keys(BASE_ENV["WEBHOOKS_SECRET_KEY"])
OTHER_KEYS = send_marks.mark_keys("another-installation-" + "o" * 32)
PAYLOAD_MARK = "payload-only-" + uuid.uuid4().hex  # must never reach the audit trail


def webhooks(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "webhooks"), *args], env=test_env(), capture_output=True, text=True, timeout=90
    )


@pytest.fixture(scope="module")
def live() -> Iterator[Receiver]:
    with receiver() as r:
        yield r


def _receipts(engine: Engine, source: MadeSource) -> dict[str, str]:
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT event_id, arrived_via FROM receipts WHERE source_id = :s"),
            {"s": source.id},
        ).all()
    return {r.event_id: r.arrived_via for r in rows}


def _sends(engine: Engine, source: MadeSource) -> list[Any]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                text(
                    "SELECT operator, action, target, reason, count, via FROM audit_log"
                    " WHERE action = 'event.send' AND target->>'source' = :s ORDER BY id"
                ),
                {"s": source.public_id},
            ).all()
        )


def test_send_is_recorded_as_test_and_audited_with_its_operator_never_its_payload(
    live: Receiver, engine: Engine, sessions: sessionmaker[Session], settings: Settings
) -> None:
    source = make_source(sessions, settings, provider="stripe")
    data = json.dumps({"id": "in_1", "note": PAYLOAD_MARK})
    sent = webhooks(
        "send", source.public_id, "--type", "invoice.paid", "--data", data, "--id", "evt_aud",
        "--count", "2", "--url", live.url, "--as", "dora",
    )  # fmt: skip
    assert sent.returncode == 0, sent.stderr
    again = webhooks("send", source.name, "--id", "evt_aud-1", "--url", live.url)  # a conflict
    assert again.returncode == 0, again.stderr
    assert _receipts(engine, source) == {"evt_aud-1": "test", "evt_aud-2": "test"}
    rows = _sends(engine, source)
    assert [(r.operator, r.action, r.count, r.via) for r in rows] == [
        ("dora", "event.send", 1, "cli"),
        ("dora", "event.send", 1, "cli"),
        (getpass.getuser(), "event.send", 1, "cli"),  # the OS user, as every CLI audit row
    ]
    base = {"source": source.public_id, "provider": "stripe", "arrived_via": "test"}
    assert [r.target for r in rows] == [
        {**base, "event_id": "evt_aud-1", "event_type": "invoice.paid", "outcome": "accepted"},
        {**base, "event_id": "evt_aud-2", "event_type": "invoice.paid", "outcome": "accepted"},
        {**base, "event_id": "evt_aud-1", "event_type": "invoice.paid", "outcome": "conflict"},
    ]
    for r in rows:
        assert PAYLOAD_MARK not in json.dumps(list(r), default=str)
        assert r.reason == "test event (webhooks send)"
    # Listed with the other audited actions, and the event says how it arrived.
    listed = webhooks("audit", "list", "--action", "event.send", "--limit", "500", "--json")
    assert listed.returncode == 0, listed.stderr
    mine = [a for a in json.loads(listed.stdout) if a["target"]["source"] == source.public_id]
    assert len(mine) == 3
    assert PAYLOAD_MARK not in listed.stdout
    shown = webhooks("events", "show", "evt_aud-2", "--source", source.public_id)
    assert shown.returncode == 0, shown.stderr
    [via] = [line.split() for line in shown.stdout.splitlines() if line.startswith("via:")]
    assert via == ["via:", "test"]
    as_json = webhooks("events", "show", "evt_aud-2", "--source", source.public_id, "--json")
    assert json.loads(as_json.stdout)["arrived_via"] == "test"


def test_a_batch_provider_send_audits_each_event_of_the_request(
    live: Receiver, engine: Engine, sessions: sessionmaker[Session], settings: Settings
) -> None:
    """Adyen sends its events in one request (the receiver's batch path): each event gets its
    row, in the same transaction as the receipts."""
    source = make_source(sessions, settings, provider="adyen", secret="ab" * 32)
    sent = webhooks("send", source.public_id, "--id", "PSP_AUD", "--url", live.url, "--as", "eve")
    assert sent.returncode == 0, sent.stderr
    [(event_id, via)] = _receipts(engine, source).items()
    assert via == "test"
    [row] = _sends(engine, source)
    assert (row.operator, row.target["event_id"], row.target["outcome"]) == (
        "eve",
        event_id,
        "accepted",
    )


def _mark_for(case: str, source: MadeSource, body: bytes) -> str:
    now = int(time.time())
    made = send_marks.make(KEYS, source=source.public_id, body=body, operator="mallory", at=now)
    if case == "other-installation-key":
        return send_marks.make(
            OTHER_KEYS, source=source.public_id, body=body, operator="mallory", at=now
        )
    if case == "other-source":
        return send_marks.make(KEYS, source="src_" + "x" * 20, body=body, operator="m", at=now)
    if case == "other-body":
        return send_marks.make(KEYS, source=source.public_id, body=b"{}", operator="m", at=now)
    if case == "stale":
        return send_marks.make(KEYS, source=source.public_id, body=body, operator="m", at=now - 600)
    if case == "operator-changed":  # the name is signed: another name breaks the MAC
        return made.replace("op=bWFsbG9yeQ", "op=cm9vdA")
    if case == "no-mac":
        return f"t={now},op=bWFsbG9yeQ"
    assert case == "not-a-mark"
    return "yes please"


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("other-installation-key", "signature"),
        ("other-source", "signature"),
        ("other-body", "signature"),
        ("stale", "stale"),
        ("operator-changed", "signature"),
        ("no-mac", "malformed"),
        ("not-a-mark", "malformed"),
    ],
)
def test_a_mark_that_does_not_verify_is_refused_and_writes_nothing(
    case: str,
    reason: str,
    live: Receiver,
    engine: Engine,
    sessions: sessionmaker[Session],
    settings: Settings,
) -> None:
    """A stranger (or a CLI holding another key) cannot make a request a test send, nor move a
    mark to another body or source: refused 401, no receipt, no audit row. The same request
    without a mark is an ordinary event (``webhook``, unaudited); with a good mark, ``test``."""
    source = make_source(sessions, settings, provider="standard")
    remember(source.secret)
    headers, body = sending.sign(
        "standard", source.secret, event_id="evt_forged", timestamp=int(time.time())
    )
    forged = {**headers, "Webhooks-Test-Send": _mark_for(case, source, body)}
    url = f"{live.url}/webhooks/{source.public_id}"
    refused = httpx.post(url, content=body, headers=forged)
    assert refused.status_code == 401, refused.text
    assert refused.json() == {"error": f"test-send mark refused: {reason}"}
    assert _receipts(engine, source) == {}
    assert _sends(engine, source) == []

    plain = httpx.post(url, content=body, headers=headers)
    assert plain.status_code == 202
    headers2, body2 = sending.sign(
        "standard", source.secret, event_id="evt_marked", timestamp=int(time.time())
    )
    mark = send_marks.make(
        KEYS, source=source.public_id, body=body2, operator="dora", at=int(time.time())
    )
    marked = httpx.post(url, content=body2, headers={**headers2, "Webhooks-Test-Send": mark})
    assert marked.status_code == 202
    assert _receipts(engine, source) == {"evt_forged": "webhook", "evt_marked": "test"}
    assert [(r.operator, r.target["event_id"]) for r in _sends(engine, source)] == [
        ("dora", "evt_marked")
    ]


def test_marks_verify_under_every_listed_key_and_never_another_purpose() -> None:
    """Pure. A rotation (``NEW,OLD``) still verifies what OLD signed; the mark key is derived
    for this purpose, so it is not the stored secrets' Fernet key material itself."""
    from core.crypto import stretched_key

    old = "old-installation-key-" + "a" * 32
    new = "new-installation-key-" + "b" * 32
    made = send_marks.make(
        send_marks.mark_keys(old), source="src_a", body=b"x", operator="dora", at=1000
    )
    both = send_marks.mark_keys(f"{new},{old}")
    assert send_marks.verify(both, made, source="src_a", body=b"x", now=1200).operator == "dora"
    with pytest.raises(send_marks.MarkRefused, match="signature"):
        send_marks.verify(send_marks.mark_keys(new), made, source="src_a", body=b"x", now=1000)
    assert stretched_key(old) not in send_marks.mark_keys(old)
    with pytest.raises(ValueError, match="printable"):
        send_marks.make(both, source="src_a", body=b"x", operator="a\nb", at=1)


def test_audit_list_shows_bulk_replays_and_discards_with_counts_and_selection(
    sessions: sessionmaker[Session], engine: Engine
) -> None:
    """A bulk action is one audit row with its selection (the filter as given) and its count,
    as a single action is (a replay: its ``replays`` row; a discard: its ``audit_log`` row and
    the ids under it); ``webhooks audit list`` shows both kinds, as the console's page does."""
    ops = ops_settings()
    source = make_source(sessions, ops, provider="standard", routes=[{"handler": "log"}])
    remember(source.secret)
    ids = [d for _ in range(3) for d in accept(ops, source, event_type="bulk.audit")]
    kill(sessions, ids)
    try:
        discarded = cli(
            "dead", "discard", str(ids[0]), "--reason", "junk", "--as", "dora", "--yes",
            env=ops_env(),
        )  # fmt: skip
        assert discarded.returncode == 0, discarded.stderr
        replayed = cli(
            "replay", "--source", source.public_id, "--type", "bulk.*", "--reason",
            "downstream back", "--as", "dora", "--yes", env=ops_env(),
        )  # fmt: skip
        assert replayed.returncode == 0, replayed.stderr
    finally:
        flush(ops)
    listed = cli("audit", "list", "--limit", "500", "--json", env=ops_env())
    assert listed.returncode == 0, listed.stderr
    rows = [a for a in json.loads(listed.stdout) if a["operator"] == "dora"]
    # This source's: the console's tests replay "bulk.*" as dora too, in the same database.
    [replay] = [
        a for a in rows if a["kind"] == "replay" and a["target"].get("source") == source.public_id
    ]
    assert replay["target"] == {"source": source.public_id, "type": "bulk.*", "status": "dead"}
    assert (replay["action"], replay["count"], replay["reason"], replay["via"]) == (
        "replay",
        2,
        "downstream back",
        "cli",
    )
    assert replay["status"] == "done"
    [discard] = [a for a in rows if a["action"] == "discard" and a["target"] == {"ids": [ids[0]]}]
    assert (discard["kind"], discard["count"], discard["reason"]) == ("audit", 1, "junk")
    shown = cli("audit", "list", "--action", "replay", "--limit", "500", env=ops_env())
    assert f"replay:{replay['id']} " in shown.stdout
    assert "replay (done)" in shown.stdout
    assert f"source={source.public_id}" in shown.stdout
    assert "discard" not in shown.stdout  # --action filters both kinds
