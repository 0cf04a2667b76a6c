"""Issue 13, second half, end to end: each new provider through a real receiver
(``webhooks serve``), real Postgres and Redis. Valid deliveries are stored; forgeries, stale or
future timestamps and signatures over another URL are 401 and write nothing; handshakes are
answered as each provider expects and write nothing; batches are one receipt per event in one
transaction; form bodies are stored as received.
"""

from __future__ import annotations

import json
import secrets as pysecrets
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core.settings import Settings
from tests import signing
from tests.factories import make_source
from tests.leakcheck import remember
from tests.processes import Receiver, receiver
from tests.provider_specs import (
    BY_NAME,
    OTHER_URL,
    SPECS,
    Spec,
    new_source,
    post,
    receipts,
    sign_for,
    written,
)

PATH_URL = "https://hooks.example.com/webhooks/{id}"


@pytest.fixture(scope="module")
def rcv() -> Iterator[Receiver]:
    with receiver() as running:
        yield running


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=10) as c:
        yield c


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_signed_delivery_is_accepted_and_stored(
    spec: Spec,
    rcv: Receiver,
    client: httpx.Client,
    sessions: sessionmaker[Session],
    settings: Settings,
    engine: Engine,
) -> None:
    source, signer, _ = new_source(sessions, settings, spec)
    _, headers, body = sign_for(spec, signer)
    response = post(client, rcv, source, headers, body)
    assert response.status_code == 202, response.text
    if spec.provider == "adyen":
        assert response.text == "[accepted]"
    stored = receipts(engine, source)
    assert len(stored) == 1
    if spec.provider in ("adyen", "sendgrid", "hubspot"):  # a batch: the event's own item
        assert json.loads(stored[0][3]) in _items(spec.provider, body)
    else:
        assert stored[0][3] == body  # as received
        assert stored[0][2] == headers["Content-Type"]
    again = post(client, rcv, source, headers, body)  # a retry is a duplicate
    assert again.status_code in (200, 202)
    assert len(receipts(engine, source)) == 1


# The fields Adyen's HMAC signs (docs.adyen.com, "Verify HMAC signatures"), stated here
# rather than borrowed from core.providers.adyen; of the amount, its value and currency.
ADYEN_SIGNED = (
    "pspReference",
    "originalReference",
    "merchantAccountCode",
    "merchantReference",
    "eventCode",
    "success",
)


def _adyen_split(item: dict[str, Any]) -> dict[str, Any]:
    """What the receiver stores of one of the test's items (amount holds only the signed
    value and currency): ``{"signed": ..., "unsigned": ...}``."""
    signed = {k: v for k, v in item.items() if k in ADYEN_SIGNED or k == "amount"}
    unsigned = {k: v for k, v in item.items() if k not in signed}
    return {"signed": signed, "unsigned": unsigned}


def _items(provider: str, body: bytes) -> list[Any]:
    obj = json.loads(body)
    if provider == "adyen":  # stored split into its signed and unsigned fields
        return [_adyen_split(i["NotificationRequestItem"]) for i in obj["notificationItems"]]
    return list(obj)


ATTACKS = [
    (spec, attack)
    for spec in SPECS
    for attack in ("tampered", "wrong_secret", "stale", "future", "other_url")
    if (attack not in ("stale", "future") or spec.timed)
    and (attack != "other_url" or spec.url_signed)
]


@pytest.mark.parametrize(("spec", "attack"), ATTACKS, ids=str)
def test_forgeries_are_401_and_write_nothing(
    spec: Spec,
    attack: str,
    rcv: Receiver,
    client: httpx.Client,
    sessions: sessionmaker[Session],
    settings: Settings,
    engine: Engine,
) -> None:
    source, signer, _config = new_source(sessions, settings, spec)
    now = int(time.time())
    if attack == "wrong_secret":
        signer, _ = spec.keys()
    tolerance = 900 if spec.provider == "mailgun" else 600 if spec.provider == "twitch" else 300
    ts = {"stale": now - tolerance - 60, "future": now + tolerance + 60}.get(attack, now)
    if attack == "other_url":  # signed for another endpoint of the same kind
        event_id = f"evt_{pysecrets.token_hex(8)}"
        headers, body = _sign_with_url(spec.provider, signer, OTHER_URL, event_id)
    else:
        _, headers, body = sign_for(spec, signer, ts)
    if attack == "tampered":
        if spec.provider == "twilio":
            body = body.replace(b"delivered", b"undelivered")
        elif spec.provider == "mailgun":
            obj = json.loads(body)
            obj["signature"]["token"] += "x"
            body = json.dumps(obj).encode()
        elif spec.provider == "adyen":
            body = body.replace(b'"value":1130', b'"value":1')
        else:
            body = body.replace(b"{", b'{"injected":1,', 1)
    response = post(client, rcv, source, headers, body)
    assert response.status_code == 401, (attack, response.text)
    assert response.json() == {"error": "unauthenticated"}
    assert written(engine, source) == 0


def _sign_with_url(
    provider: str, key: str, url: str, event_id: str
) -> tuple[dict[str, str], bytes]:
    if provider == "square":
        return signing.sign_square(key, event_id=event_id, url=url)
    if provider == "hubspot":
        return signing.sign_hubspot(key, event_ids=[event_id], url=url)
    return signing.sign_twilio(key, url=url, sid=event_id)


def test_the_host_header_never_stands_in_for_the_public_url(
    rcv: Receiver,
    client: httpx.Client,
    sessions: sessionmaker[Session],
    settings: Settings,
    engine: Engine,
) -> None:
    spec = BY_NAME["twilio"]
    source, key, config = new_source(sessions, settings, spec)
    # Signed over the URL the request actually reached (what a Host-trusting receiver rebuilds).
    seen_url = f"{rcv.url}/webhooks/{source.public_id}"
    headers, body = signing.sign_twilio(key, url=seen_url, sid="SMhost1")
    assert post(client, rcv, source, headers, body).status_code == 401
    # Signed over the configured public URL, with a Host header that names something else.
    headers, body = signing.sign_twilio(key, url=config["public_url"], sid="SMhost2")
    response = post(client, rcv, source, {**headers, "Host": "evil.example.net"}, body)
    assert response.status_code == 202, response.text
    [(event_id, event_type, content_type, payload)] = receipts(engine, source)
    assert (event_id, event_type) == ("SMhost2:delivered", "message.delivered")
    assert content_type == headers["Content-Type"]
    assert payload == body


# --- handshakes: answered as the provider expects, nothing written -----------------------------


def test_post_handshakes_are_answered_and_write_nothing(
    rcv: Receiver,
    client: httpx.Client,
    sessions: sessionmaker[Session],
    settings: Settings,
    engine: Engine,
) -> None:
    now = int(time.time())
    # Twitch: the raw challenge, text/plain.
    source, key, _ = new_source(sessions, settings, BY_NAME["twitch"])
    headers, body = signing.sign_twitch(
        key,
        event_id="hs-1",
        timestamp=now,
        message_type="webhook_callback_verification",
        body_obj={"challenge": "pogchamp-kappa-360", "subscription": {"type": "channel.follow"}},
    )
    response = post(client, rcv, source, headers, body)
    assert (response.status_code, response.text) == (200, "pogchamp-kappa-360")
    assert response.headers["content-type"].startswith("text/plain")
    assert written(engine, source) == 0
    # ...and a forged one is not answered.
    response = post(client, rcv, source, {**headers, "Twitch-Eventsub-Message-Id": "x"}, body)
    assert response.status_code == 401

    # Zoom: plainToken + encryptedToken under the source's secret.
    source, key, _ = new_source(sessions, settings, BY_NAME["zoom"])
    body_obj = {"event": "endpoint.url_validation", "payload": {"plainToken": "qgg8vlvZRS6U"}}
    headers, body = signing.sign_zoom(key, body_obj=body_obj, timestamp=now)
    response = post(client, rcv, source, headers, body)
    assert response.status_code == 200, response.text
    import hashlib  # noqa: PLC0415
    import hmac  # noqa: PLC0415

    assert response.json() == {
        "plainToken": "qgg8vlvZRS6U",
        "encryptedToken": hmac.new(key.encode(), b"qgg8vlvZRS6U", hashlib.sha256).hexdigest(),
    }
    # Unsigned, it is refused: the answer would be an HMAC oracle for forged signatures.
    unsigned = {k: v for k, v in headers.items() if k != "x-zm-signature"}
    assert post(client, rcv, source, unsigned, body).status_code == 401
    assert written(engine, source) == 0

    # Discord: interaction PING -> {"type": 1}; webhook-event PING -> 204, no body.
    source, signer, _ = new_source(sessions, settings, BY_NAME["discord"])
    headers, body = signing.sign_discord(signer, body_obj={"type": 1, "id": "77"}, timestamp=now)
    response = post(client, rcv, source, headers, body)
    assert (response.status_code, response.json()) == (200, {"type": 1})
    headers, body = signing.sign_discord(signer, body_obj={"version": 1, "type": 0}, timestamp=now)
    response = post(client, rcv, source, headers, body)
    assert (response.status_code, response.content) == (204, b"")
    assert written(engine, source) == 0


def test_meta_get_verification_and_405_for_others(
    rcv: Receiver,
    client: httpx.Client,
    sessions: sessionmaker[Session],
    settings: Settings,
    engine: Engine,
) -> None:
    source, _, config = new_source(sessions, settings, BY_NAME["meta"])
    url = f"{rcv.url}/webhooks/{source.public_id}"
    query = {
        "hub.mode": "subscribe",
        "hub.verify_token": config["verify_token"],
        "hub.challenge": "1158201444",
    }
    response = client.get(url, params=query)
    assert (response.status_code, response.text) == (200, "1158201444")
    assert response.headers["content-type"].startswith("text/plain")
    assert response.headers["x-content-type-options"] == "nosniff"  # an echo of sender text
    response = client.get(url, params={**query, "hub.verify_token": "wrong-token-123456"})
    assert response.status_code == 403
    assert client.get(url).status_code == 403
    assert written(engine, source) == 0
    other, _, _ = new_source(sessions, settings, BY_NAME["bitbucket"])
    response = client.get(f"{rcv.url}/webhooks/{other.public_id}", params=query)
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    assert client.get(f"{rcv.url}/webhooks/src_00000000000000000000").status_code == 404


# --- batches -----------------------------------------------------------------------------------


def test_adyen_batch_is_one_receipt_per_item_each_deduplicated(
    rcv: Receiver,
    client: httpx.Client,
    sessions: sessionmaker[Session],
    settings: Settings,
    engine: Engine,
) -> None:
    source, key, _ = new_source(sessions, settings, BY_NAME["adyen"])
    first = [signing.adyen_item("psp1"), signing.adyen_item("psp2", event_code="CAPTURE")]
    headers, body = signing.sign_adyen(key, first)
    response = post(client, rcv, source, headers, body)
    assert (response.status_code, response.text) == (202, "[accepted]")
    again = post(client, rcv, source, headers, body)  # all duplicates: the same answer, 200
    assert (again.status_code, again.text) == (200, "[accepted]")
    stored = receipts(engine, source)
    assert [(r[0], r[1], r[2]) for r in stored] == [
        ("psp1:AUTHORISATION:true", "AUTHORISATION", "application/json"),
        ("psp2:CAPTURE:true", "CAPTURE", "application/json"),
    ]
    assert json.loads(stored[1][3])["signed"]["pspReference"] == "psp2"
    # A retry with one old and one new item: only the new one is added; the same answer.
    second = [signing.adyen_item("psp2", event_code="CAPTURE"), signing.adyen_item("psp3")]
    headers, body = signing.sign_adyen(key, second)
    response = post(client, rcv, source, headers, body)
    assert (response.status_code, response.text) == (202, "[accepted]")
    assert [r[0] for r in receipts(engine, source)] == [
        "psp1:AUTHORISATION:true",
        "psp2:CAPTURE:true",
        "psp3:AUTHORISATION:true",
    ]


def test_a_batch_is_all_or_nothing(
    rcv: Receiver,
    client: httpx.Client,
    sessions: sessionmaker[Session],
    settings: Settings,
    engine: Engine,
) -> None:
    spec = BY_NAME["sendgrid"]
    source, private, _ = new_source(sessions, settings, spec)
    now = int(time.time())
    good = signing.sendgrid_event("sg-ok-1", ts=now)
    bad = {**signing.sendgrid_event("sg-bad", ts=now), "sg_event_id": "has space"}
    headers, body = signing.sign_sendgrid(private, [good, bad], timestamp=now)
    response = post(client, rcv, source, headers, body)
    assert response.status_code == 400, response.text
    assert written(engine, source) == 0
    events = [good, signing.sendgrid_event("sg-ok-2", "open", now)]
    headers, body = signing.sign_sendgrid(private, events, timestamp=now)
    response = post(client, rcv, source, headers, body)
    assert response.status_code == 202, response.text
    assert response.json() == {
        "status": "accepted",
        "events": [
            {"event_id": "sg-ok-1", "status": "accepted"},
            {"event_id": "sg-ok-2", "status": "accepted"},
        ],
    }
    assert [r[0] for r in receipts(engine, source)] == ["sg-ok-1", "sg-ok-2"]
    response = post(client, rcv, source, headers, body)
    assert response.status_code == 200
    assert response.json()["status"] == "duplicate"


def test_sources_refuse_missing_options_and_keys_not_in_the_senders_format(
    sessions: sessionmaker[Session], settings: Settings, engine: Engine
) -> None:
    from models.catalog import CatalogError  # noqa: PLC0415

    def count() -> int:
        with engine.connect() as conn:
            return int(conn.execute(text("SELECT count(*) FROM sources")).scalar_one())

    before = count()
    with pytest.raises(CatalogError, match="issued by the sender"):
        make_source(sessions, settings, provider="discord")  # no key: none can be generated
    with pytest.raises(CatalogError, match="64 hex"):
        make_source(sessions, settings, provider="discord", secret="ab" * 20)
    with pytest.raises(CatalogError, match="P-256"):
        make_source(sessions, settings, provider="sendgrid", secret="x" * 40)
    with pytest.raises(CatalogError, match="hex"):
        make_source(sessions, settings, provider="adyen", secret="not-a-hex-key-" * 3)
    with pytest.raises(ValueError, match="needs public_url"):
        make_source(sessions, settings, provider="twilio", secret="t" * 32)
    with pytest.raises(ValueError, match="verify_token"):
        make_source(sessions, settings, provider="meta", secret="m" * 32)
    assert count() == before


def test_overlapping_batches_racing_store_each_event_once(
    rcv: Receiver,
    client: httpx.Client,
    sessions: sessionmaker[Session],
    settings: Settings,
    engine: Engine,
) -> None:
    """Retries of a batch overlapping the original, in flight together and in other orders:
    no error, and every event is stored exactly once (the accept takes its per-event locks in
    one global order, so batches never deadlock)."""
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    source, private, _ = new_source(sessions, settings, BY_NAME["sendgrid"])
    now = int(time.time())
    ids = [f"sg-race-{i}" for i in range(12)]
    requests = []
    for start in range(0, 12, 2):
        chosen = ids[start : start + 6] if start % 4 else list(reversed(ids[start : start + 6]))
        requests.append(
            signing.sign_sendgrid(
                private, [signing.sendgrid_event(i, ts=now) for i in chosen], timestamp=now
            )
        )
    url = f"{rcv.url}/webhooks/{source.public_id}"

    def send(request: tuple[dict[str, str], bytes]) -> int:
        with httpx.Client(timeout=10) as own:
            return own.post(url, headers=request[0], content=request[1]).status_code

    with ThreadPoolExecutor(len(requests) * 2) as pool:
        statuses = list(pool.map(send, requests * 2))
    assert set(statuses) <= {200, 202}, statuses
    stored = [r[0] for r in receipts(engine, source)]
    assert sorted(stored) == sorted(ids)  # each once


def test_a_handler_reads_a_twilio_form_with_its_content_type(
    sessions: sessionmaker[Session], settings: Settings, engine: Engine, tmp_path: Any
) -> None:
    """Receiver -> broker -> worker: the handler gets the form body as received, with its
    content type; ``event.form`` parses it and ``event.json`` says to read ``event.form``."""
    from tests.handlers_providers_more import FORM_SEEN_DDL  # noqa: PLC0415
    from tests.workers import flush_redis, running_worker, wait_for, worker_settings  # noqa: PLC0415

    flush_redis()  # claim keys of an earlier run's delivery ids (each run has a fresh database)
    with engine.begin() as conn:
        conn.execute(text(FORM_SEEN_DDL))
    spec = BY_NAME["twilio"]
    signer, secret = spec.keys()
    remember(secret)
    source = make_source(
        sessions,
        settings,
        provider="twilio",
        secret=secret,
        config=dict(spec.config),
        routes=[{"handler": "form_seen"}],
    )
    headers, body = signing.sign_twilio(signer, url=spec.config["public_url"], sid="SMform1")
    modules = ["tests.handlers_providers_more"]
    with (
        receiver(  # publishing to the workers' broker
            WEBHOOKS_HANDLER_MODULES=json.dumps(modules),
            WEBHOOKS_BROKER_URL=worker_settings().broker_url,
        ) as rcv,
        running_worker("forms", tmp_path, handler_modules=modules) as worker,
        httpx.Client(timeout=10) as http,
    ):
        response = post(http, rcv, source, headers, body)
        assert response.status_code == 202, response.text

        def seen() -> Any:
            with engine.connect() as conn:
                return conn.execute(
                    text(
                        "SELECT content_type, form, json_error FROM test_form_seen WHERE event_id = :e"
                    ),
                    {"e": "SMform1:delivered"},
                ).first()

        try:
            content_type, form, json_error = wait_for(seen, timeout=60, what="the handler's row")
        except TimeoutError:
            with engine.connect() as conn:
                rows = conn.execute(
                    text(
                        "SELECT id, status FROM deliveries d WHERE receipt_id IN (SELECT id FROM receipts WHERE source_id = :s)"
                    ),
                    {"s": source.id},
                ).all()
            raise AssertionError(
                f"{rows}\n{worker.output()[-3000:]}\n{rcv.log_path.read_text()[-3000:]}"
            ) from None
    assert content_type == headers["Content-Type"]
    assert form["MessageSid"] == ["SMform1"]
    assert form["Body"] == ["Hello & welcome = 100%"]
    assert "read event.form" in json_error


def test_twilio_forms_of_too_many_parameters_are_refused_before_any_signature_work(
    rcv: Receiver,
    client: httpx.Client,
    sessions: sessionmaker[Session],
    settings: Settings,
    engine: Engine,
) -> None:
    """Issue 18: a form of more than MAX_PARAMS parameters is 400 and writes nothing, even
    correctly signed (the count is checked before the body is parsed); one at the cap, signed,
    is accepted and stored whole."""
    from core.providers.twilio import MAX_PARAMS  # noqa: PLC0415

    spec = BY_NAME["twilio"]
    source, key, config = new_source(sessions, settings, spec)
    url = config["public_url"]

    def form(count: int) -> list[tuple[str, str]]:
        base = [("MessageSid", f"SM{pysecrets.token_hex(16)}"), ("MessageStatus", "delivered")]
        return base + [(f"P{i}", str(i)) for i in range(count - len(base))]

    over, body_over = signing.sign_twilio(key, url=url, params=form(MAX_PARAMS + 1))
    response = post(client, rcv, source, over, body_over)
    assert response.status_code == 400, response.text
    assert response.json() == {"error": "body refused: too_many_parameters"}
    assert receipts(engine, source) == []

    at_cap, body_cap = signing.sign_twilio(key, url=url, params=form(MAX_PARAMS))
    response = post(client, rcv, source, at_cap, body_cap)
    assert response.status_code == 202, response.text
    stored = receipts(engine, source)
    assert len(stored) == 1
    assert stored[0][3] == body_cap
