"""Generic HMAC: the event id only from signed content (issue 11, finding 3), through real
``webhooks sources add`` and a real ``webhooks serve``; and migration 0009 on stored sources."""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest
from alembic import command
from sqlalchemy import Engine, text

from models.db import alembic_config, upgrade
from tests.conftest import BIN, make_settings, test_env
from tests.leakcheck import remember
from tests.processes import Receiver, receiver
from tests.signing import sign_hmac

TEMPLATE = "{header:x-webhook-id}.{header:x-webhook-timestamp}.{body}"


@pytest.fixture(scope="module")
def rcv() -> Iterator[Receiver]:
    with receiver() as running:
        yield running


def webhooks(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "webhooks"), *args], env=test_env(), capture_output=True, text=True, timeout=60
    )


def add_source(*config: str) -> dict[str, Any]:
    args = ["sources", "add", f"hmac-{uuid.uuid4().hex[:8]}", "--provider", "hmac", "--json"]
    for item in config:
        args += ["--config", item]
    added = webhooks(*args)
    assert added.returncode == 0, added.stderr
    view: dict[str, Any] = json.loads(added.stdout)
    remember(view["secret"])
    return view


def receipts(engine: Engine, public_id: str) -> list[str]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                text(
                    "SELECT r.event_id FROM receipts r JOIN sources s ON s.id = r.source_id "
                    "WHERE s.public_id = :p ORDER BY r.id"
                ),
                {"p": public_id},
            ).scalars()
        )


def post(rcv: Receiver, view: dict[str, Any], headers: dict[str, str], body: bytes) -> Any:
    return httpx.post(f"{rcv.url}/webhooks/{view['id']}", headers=headers, content=body, timeout=10)


def test_one_signed_body_under_three_header_ids_is_one_event(rcv: Receiver, engine: Engine) -> None:
    view = add_source()
    assert view["config"]["id_header"] is None
    headers, body = sign_hmac(view["secret"], event_id="evt_body_1")
    remember(body)
    answers = []
    for header_id in ("hdr_a", "hdr_b", "hdr_c"):
        response = post(rcv, view, {**headers, "X-Webhook-Id": header_id}, body)
        answer = response.json()
        answers.append((response.status_code, {k: answer[k] for k in ("status", "event_id")}))
        if answer["status"] == "duplicate":  # with the first arrival's recorded outcome
            assert answer["outcome"] in ("pending", "processing", "succeeded", "no_routes")
    assert answers == [
        (202, {"status": "accepted", "event_id": "evt_body_1"}),
        (200, {"status": "duplicate", "event_id": "evt_body_1"}),
        (200, {"status": "duplicate", "event_id": "evt_body_1"}),
    ]
    assert receipts(engine, view["id"]) == ["evt_body_1"]


def test_a_header_id_covered_by_the_signature_cannot_be_changed(
    rcv: Receiver, engine: Engine
) -> None:
    view = add_source(
        f"signed_content={TEMPLATE}",
        "id_header=x-webhook-id",
        "timestamp_header=x-webhook-timestamp",
        "id_field=",
    )
    config = {k: v for k, v in view["config"].items() if v is not None}
    headers, body = sign_hmac(view["secret"], event_id="hdr_signed_1", config=config)
    remember(body)
    first = post(rcv, view, headers, body)
    assert (first.status_code, first.json()["event_id"]) == (202, "hdr_signed_1")
    for forged in ("hdr_signed_2", "hdr_signed_3"):
        response = post(rcv, view, {**headers, "X-Webhook-Id": forged}, body)
        assert (response.status_code, response.json()) == (401, {"error": "unauthenticated"})
    assert receipts(engine, view["id"]) == ["hdr_signed_1"]


def test_id_from_unsigned_header_keeps_the_old_replayable_behaviour(
    rcv: Receiver, engine: Engine
) -> None:
    view = add_source("id_header=x-webhook-id", "id_from_unsigned_header=true")
    assert view["config"]["id_from_unsigned_header"] is True
    headers, body = sign_hmac(view["secret"], event_id="evt_body_2")
    remember(body)
    for header_id in ("old_a", "old_b", "old_c"):
        response = post(rcv, view, {**headers, "X-Webhook-Id": header_id}, body)
        assert (response.status_code, response.json()["event_id"]) == (202, header_id)
    assert receipts(engine, view["id"]) == ["old_a", "old_b", "old_c"]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (["id_header=x-webhook-id"], "is not signed, so a captured request could be replayed"),
        (["signed_content={header:x-webhook-id}"], "{body} exactly once"),
        (["signed_content={nonce}.{body}"], "placeholder {nonce} is unknown"),
        (["timestamp_header=x-ts", "signed_content={body}"], "must sign the timestamp header"),
        (["id_from_unsigned_header=perhaps"], "must be true or false"),
    ],
)
def test_sources_add_refuses_an_unsafe_or_broken_template(
    engine: Engine, config: list[str], message: str
) -> None:
    with engine.connect() as conn:
        before = conn.execute(text("SELECT count(*) FROM sources")).scalar_one()
    args = ["sources", "add", f"bad-{uuid.uuid4().hex[:8]}", "--provider", "hmac"]
    for item in config:
        args += ["--config", item]
    result = webhooks(*args)
    assert result.returncode != 0
    assert message in " ".join((result.stderr + result.stdout).split())
    assert "Traceback" not in result.stderr
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM sources")).scalar_one() == before


# --- migration 0009 ---------------------------------------------------------------------------

OLD_DEFAULTS = {
    "signature_header": "x-signature",
    "algorithm": "sha256",
    "encoding": "hex",
    "prefix": "",
    "timestamp_header": None,
    "id_header": "x-webhook-id",
    "id_field": "id",
    "type_header": None,
    "type_field": "type",
    "time_field": None,
}


def test_migration_0009_reads_the_body_id_unless_the_header_was_chosen() -> None:
    from core.providers import validate_config

    name = f"webhooks_mig_{uuid.uuid4().hex[:8]}"
    url = f"postgresql://postgres@127.0.0.1:5432/{name}"
    settings = make_settings(database_url=url)
    rows = {
        "implicit": OLD_DEFAULTS,
        "chosen": {**OLD_DEFAULTS, "id_header": "x-request-id"},
        "header-only": {**OLD_DEFAULTS, "id_field": None},
        "body-only": {**OLD_DEFAULTS, "id_header": None},
    }
    try:
        upgrade(settings, "0008")
        with psycopg.connect(url, autocommit=True) as conn:
            for n, (label, config) in enumerate(rows.items()):
                conn.execute(
                    "INSERT INTO sources (public_id, name, provider, config) "
                    "VALUES (%s, %s, 'hmac', %s::jsonb)",
                    (f"src_mig{n}", label, json.dumps(config)),
                )
            conn.execute(
                "INSERT INTO sources (public_id, name, provider) VALUES ('src_migs', 's', 'stripe')"
            )
        command.upgrade(alembic_config(settings), "0009")
        with psycopg.connect(url) as conn:
            got = dict(conn.execute("SELECT name, config FROM sources").fetchall())
        assert got["s"] == {}
        assert got["implicit"] == {
            **OLD_DEFAULTS,
            "id_header": None,
            "signed_content": None,
            "id_from_unsigned_header": False,
        }
        assert got["chosen"]["id_header"] == "x-request-id"
        assert got["chosen"]["id_from_unsigned_header"] is True
        assert got["header-only"]["id_header"] == "x-webhook-id"
        assert got["header-only"]["id_from_unsigned_header"] is True
        assert got["body-only"]["id_header"] is None
        assert got["body-only"]["id_from_unsigned_header"] is False
        for label in rows:  # every migrated row is valid, and already in its stored form
            assert validate_config("hmac", got[label]) == got[label], label
        command.downgrade(alembic_config(settings), "0008")
        with psycopg.connect(url) as conn:
            back = dict(conn.execute("SELECT name, config FROM sources").fetchall())
        assert back["implicit"] == OLD_DEFAULTS
        assert back["chosen"] == rows["chosen"]
    finally:
        with psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
