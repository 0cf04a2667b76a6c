"""Issue 18, items 2, 3, 4 and 6: ids and expiry only from signed parts, bounded batches, and
unsigned type headers documented or replaced by the signed body.

Through a real receiver (``webhooks serve``), real Postgres and Redis where the item is about
what gets written; the providers' pure functions where it is about a reason or a shape.
"""

from __future__ import annotations

import base64
import json
import secrets as pysecrets
import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core.providers import (
    AuthError,
    EventMeta,
    MalformedEvent,
    TooManyEvents,
    authenticate,
    extract,
    registry,
    validate_config,
)
from core.settings import Settings
from core.ttl import TtlOverrides, derive_ttl
from tests import signing
from tests.conftest import BIN, test_env
from tests.factories import MadeSource, make_source
from tests.leakcheck import remember
from tests.processes import Receiver, receiver
from tests.provider_specs import BY_NAME, new_source, post, receipts, written

NOW = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)


@pytest.fixture(scope="module")
def rcv() -> Iterator[Receiver]:
    with receiver() as running:
        yield running


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30) as c:
        yield c


def whsec() -> str:
    secret = "whsec_" + base64.b64encode(pysecrets.token_bytes(32)).decode()
    remember(secret)
    return secret


def expiry(engine: Engine, source: MadeSource) -> list[tuple[datetime, datetime]]:
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT received_at, expires_at FROM receipts WHERE source_id = :s"),
            {"s": source.id},
        ).all()
    return [(r[0], r[1]) for r in rows]


# --- item 2: ids come from signed parts only ------------------------------------------------


def test_gitlab_signing_token_id_ignores_the_unsigned_idempotency_key() -> None:
    secret = whsec()
    headers, body = signing.sign_gitlab_signed(secret, event_id="signed-id-1", timestamp=NOW)
    headers = signing.lower(headers)
    headers["idempotency-key"] = "attacker-chosen-2"
    authenticate("gitlab", headers, body, [("s", secret)], config={}, now=NOW, tolerance=None)
    found = extract("gitlab", headers, body, config={})
    assert isinstance(found, EventMeta)
    assert found.event_id == "signed-id-1"
    # The plain token signs nothing: there the Idempotency-Key is the id, as before.
    token = pysecrets.token_hex(20)
    headers, body = signing.sign_gitlab(token, event_id="idem-3")
    found = extract("gitlab", signing.lower(headers), body, config={})
    assert isinstance(found, EventMeta)
    assert found.event_id == "idem-3"


def test_gitlab_replay_with_a_new_idempotency_key_is_a_duplicate(
    rcv: Receiver,
    client: httpx.Client,
    sessions: sessionmaker[Session],
    settings: Settings,
    engine: Engine,
) -> None:
    secret = whsec()
    source = make_source(sessions, settings, provider="gitlab", secret=secret)
    event_id = f"gl-{pysecrets.token_hex(8)}"
    headers, body = signing.sign_gitlab_signed(secret, event_id=event_id)
    first = post(client, rcv, source, headers, body)
    assert first.status_code == 202, first.text
    for n in range(2):  # the captured request, re-sent with new unsigned keys
        replay = {**headers, "Idempotency-Key": f"fresh-{n}-{pysecrets.token_hex(4)}"}
        again = post(client, rcv, source, replay, body)
        assert (again.status_code, again.json()["status"]) == (200, "duplicate"), again.text
        assert again.json()["event_id"] == event_id
    assert [r[0] for r in receipts(engine, source)] == [event_id]


# --- item 3: Adyen's unsigned fields -----------------------------------------------------------


def test_adyen_back_dated_event_date_does_not_expire_the_receipt_early(
    rcv: Receiver,
    client: httpx.Client,
    sessions: sessionmaker[Session],
    settings: Settings,
    engine: Engine,
) -> None:
    source, key, _ = new_source(sessions, settings, BY_NAME["adyen"])
    ttl = derive_ttl("adyen", TtlOverrides(), settings).total  # 33 days and 10 minutes
    # eventDate is not signed: a replay can set it to just inside the TTL's reach.
    back_dated = datetime.now(UTC) - ttl + timedelta(minutes=1)
    item = {**signing.adyen_item("psp-old"), "eventDate": back_dated.isoformat()}
    headers, body = signing.sign_adyen(key, [item])
    response = post(client, rcv, source, headers, body)
    assert response.status_code == 202, response.text
    [(received_at, expires_at)] = expiry(engine, source)
    # Anchored on the arrival: the whole TTL from now, not one minute.
    assert expires_at >= received_at + ttl - timedelta(minutes=1)
    stored = json.loads(receipts(engine, source)[0][3])
    assert stored["unsigned"]["eventDate"] == back_dated.isoformat()  # kept, marked unsigned
    assert "eventDate" not in stored["signed"]


def test_adyen_payload_says_what_the_signature_covered() -> None:
    key = pysecrets.token_hex(32)
    item = {**signing.adyen_item("psp9"), "reason": "ok", "amount": {"value": 5, "currency": "EUR"}}
    headers, body = signing.sign_adyen(key, [item])
    found = extract("adyen", signing.lower(headers), body, config={})
    [event] = found.events  # type: ignore[union-attr]
    assert event.time_signed is False
    payload = json.loads(event.payload or b"")
    assert payload["signed"] == {
        "amount": {"value": 5, "currency": "EUR"},
        "eventCode": "AUTHORISATION",
        "merchantAccountCode": "TestMerchant",
        "merchantReference": "order-psp9",
        "originalReference": "",
        "pspReference": "psp9",
        "success": "true",
    }
    assert set(payload["unsigned"]) == {"eventDate", "paymentMethod", "reason", "additionalData"}


def test_adyen_refuses_at_the_first_forged_item_before_reading_the_next() -> None:
    """Each item's HMAC is checked when it is reached: a forged first item is bad_signature
    even though a later entry is not even an item (the old code read every item first and
    answered missing_signature)."""
    key = pysecrets.token_hex(32)
    forged = {**signing.adyen_item("psp1"), "additionalData": {"hmacSignature": "AAAA"}}
    body = json.dumps(
        {"live": "false", "notificationItems": [{"NotificationRequestItem": forged}, "junk"]}
    ).encode()
    with pytest.raises(AuthError) as caught:
        authenticate("adyen", {}, body, [("s", key)], config={}, now=NOW, tolerance=None)
    assert caught.value.reason == "bad_signature"
    # A good first item under one key, a second signed by another: refused all the same.
    other = pysecrets.token_hex(32)
    one = signing.adyen_signed(signing.adyen_item("a"), key)
    two = signing.adyen_signed(signing.adyen_item("b"), other)
    wrapped = [{"NotificationRequestItem": i} for i in (one, two)]
    body = json.dumps({"live": "false", "notificationItems": wrapped}).encode()
    secrets = [("k1", key), ("k2", other)]
    with pytest.raises(AuthError, match="bad_signature"):
        authenticate("adyen", {}, body, secrets, config={}, now=NOW, tolerance=None)


# --- item 4: items per request are capped ------------------------------------------------------


def test_hubspot_batch_at_the_documented_cap_is_accepted_whole_and_one_over_is_413(
    rcv: Receiver,
    client: httpx.Client,
    sessions: sessionmaker[Session],
    settings: Settings,
    engine: Engine,
) -> None:
    assert registry.get("hubspot").max_events == 100
    source, key, config = new_source(sessions, settings, BY_NAME["hubspot"])
    base = pysecrets.token_hex(4)
    over = [f"{base}-{i}" for i in range(101)]
    headers, body = signing.sign_hubspot(key, event_ids=over, url=config["public_url"])
    response = post(client, rcv, source, headers, body)
    assert response.status_code == 413, response.text
    assert response.json() == {"error": "too many events in one request", "limit": 100}
    assert written(engine, source) == 0
    at_cap = over[:100]
    headers, body = signing.sign_hubspot(key, event_ids=at_cap, url=config["public_url"])
    response = post(client, rcv, source, headers, body)
    assert response.status_code == 202, response.text
    assert sorted(r[0] for r in receipts(engine, source)) == sorted(at_cap)


def test_adyen_over_its_bound_is_413_before_any_hmac_and_writes_nothing(
    rcv: Receiver,
    client: httpx.Client,
    sessions: sessionmaker[Session],
    settings: Settings,
    engine: Engine,
) -> None:
    limit = registry.get("adyen").max_events
    assert limit == 1000
    source, _, _ = new_source(sessions, settings, BY_NAME["adyen"])
    # Unsigned items: the count alone decides, before any HMAC work.
    items = [{"NotificationRequestItem": {"pspReference": str(i)}} for i in range(limit + 1)]
    body = json.dumps({"live": "false", "notificationItems": items}).encode()
    response = post(client, rcv, source, {"Content-Type": "application/json"}, body)
    assert response.status_code == 413, response.text
    assert response.json()["limit"] == limit
    assert written(engine, source) == 0


def test_a_configured_bound_caps_sendgrid_and_a_batch_at_it_is_accepted_whole(
    rcv: Receiver,
    client: httpx.Client,
    sessions: sessionmaker[Session],
    settings: Settings,
    engine: Engine,
) -> None:
    private, public = signing.sendgrid_keypair()
    source = make_source(
        sessions, settings, provider="sendgrid", secret=public, config={"max_events": "3"}
    )
    now = int(time.time())
    tag = pysecrets.token_hex(4)
    events = [signing.sendgrid_event(f"sg-{tag}-{i}", ts=now) for i in range(4)]
    headers, body = signing.sign_sendgrid(private, events, timestamp=now)
    response = post(client, rcv, source, headers, body)
    assert (response.status_code, response.json()["limit"]) == (413, 3)
    assert written(engine, source) == 0
    headers, body = signing.sign_sendgrid(private, events[:3], timestamp=now)
    response = post(client, rcv, source, headers, body)
    assert response.status_code == 202, response.text
    assert len(receipts(engine, source)) == 3


@pytest.mark.parametrize("provider", ["sendgrid", "adyen"])
def test_max_events_is_validated_like_other_options(provider: str) -> None:
    assert validate_config(provider, {}) == {}
    assert validate_config(provider, {"max_events": "2000"}) == {"max_events": 2000}
    for bad in ("0", "5001", "many", -1, True, 1.5):
        with pytest.raises(ValueError, match="'max_events' must be a whole number"):
            validate_config(provider, {"max_events": bad})
    with pytest.raises(ValueError, match="unknown option 'algorithm'"):
        validate_config(provider, {"algorithm": "sha256"})


def test_a_plugin_batch_is_bounded_even_when_its_extract_does_not_count() -> None:
    from core.providers.base import DEFAULT_MAX_EVENTS, Batch, Provider  # noqa: PLC0415

    many = Batch(events=tuple(EventMeta(str(i), "t", None) for i in range(DEFAULT_MAX_EVENTS + 1)))
    plugin = Provider(
        name="bulk",
        authenticate=lambda h, b, s, c: ("s", None),
        extract=lambda h, b, c: many,
        retry_window=timedelta(days=1),
        citation="test",
        signed="test",
        batched=True,
    )
    with pytest.raises(TooManyEvents) as caught:
        plugin.check_count(len(many.events))
    assert caught.value.limit == DEFAULT_MAX_EVENTS


# --- item 6: unsigned type headers -------------------------------------------------------------


def github(event: str, action: str | None, header: str) -> tuple[dict[str, str], bytes]:
    secret = "g" * 32
    headers, body = signing.sign_github(
        secret, event_id="d-1", event_type=f"{event}.{action}" if action else event
    )
    headers = signing.lower(headers)
    headers["x-github-event"] = header
    return headers, body


def test_github_hook_event_takes_the_type_from_the_signed_body() -> None:
    config = validate_config("github", {"hook_event": " issues "})
    assert config == {"hook_event": "issues"}
    headers, body = github("issues", "opened", "issues")
    found = extract("github", headers, body, config=config)
    assert isinstance(found, EventMeta)
    assert found.event_type == "issues.opened"
    # The captured body re-sent as another event: refused, not relabelled.
    headers, body = github("issues", "opened", "pull_request")
    with pytest.raises(MalformedEvent, match="bad_type"):
        extract("github", headers, body, config=config)
    # Without the option too (the body identifies issues); only type_from=header takes it.
    with pytest.raises(MalformedEvent, match="bad_type"):
        extract("github", headers, body, config={})
    header = validate_config("github", {"type_from": "header"})
    assert extract("github", headers, body, config=header).event_type == "pull_request.opened"  # type: ignore[union-attr]
    # GitHub's ping (body with hook and zen) is named from the body.
    ping = json.dumps({"zen": "Keep it logically awesome.", "hook_id": 1, "hook": {}}).encode()
    found = extract(
        "github", {"x-github-event": "ping", "x-github-delivery": "d-2"}, ping, config=config
    )
    assert found.event_type == "ping"  # type: ignore[union-attr]


@pytest.mark.parametrize("bad", ["Issues", "issues opened", "", 3, "x" * 65])
def test_github_hook_event_is_validated(bad: object) -> None:
    with pytest.raises(ValueError, match="'hook_event' must be the one GitHub event"):
        validate_config("github", {"hook_event": bad})
    with pytest.raises(ValueError, match="unknown option 'event'"):
        validate_config("github", {"event": "issues"})


def test_bitbucket_type_from_body_reads_the_signed_event_key() -> None:
    assert validate_config("bitbucket", {"type_from_body": "true"}) == {"type_from_body": True}
    assert validate_config("bitbucket", {"type_from_body": "no"}) == {}
    with pytest.raises(ValueError, match="'type_from_body' must be true or false"):
        validate_config("bitbucket", {"type_from_body": "maybe"})
    with pytest.raises(ValueError, match="unknown option"):
        validate_config("bitbucket", {"key": "x"})
    config = {"type_from_body": True}
    body_obj = {"eventKey": "repo:refs_changed", "repository": {"slug": "r"}}
    headers, body = signing.sign_bitbucket("b" * 32, event_id="u-1", body_obj=body_obj)
    headers = signing.lower(headers)
    headers["x-event-key"] = "pr:merged"  # unsigned: ignored
    found = extract("bitbucket", headers, body, config=config)
    assert found.event_type == "repo:refs_changed"  # type: ignore[union-attr]
    assert extract("bitbucket", headers, body, config={}).event_type == "pr:merged"  # type: ignore[union-attr]
    cloud = json.dumps({"push": {}}).encode()  # Bitbucket Cloud's body names no event
    with pytest.raises(MalformedEvent, match="missing_type"):
        extract("bitbucket", headers, cloud, config=config)


def test_github_hook_event_through_the_receiver_refuses_a_relabelled_capture(
    rcv: Receiver,
    client: httpx.Client,
    sessions: sessionmaker[Session],
    settings: Settings,
    engine: Engine,
) -> None:
    secret = pysecrets.token_hex(20)
    remember(secret)
    source = make_source(
        sessions, settings, provider="github", secret=secret, config={"hook_event": "issues"}
    )
    headers, body = signing.sign_github(secret, event_id="gh-1", event_type="issues.opened")
    relabelled = {**headers, "X-GitHub-Event": "pull_request", "X-GitHub-Delivery": "gh-2"}
    response = post(client, rcv, source, relabelled, body)
    assert (response.status_code, response.json()) == (400, {"error": "malformed event: bad_type"})
    assert written(engine, source) == 0
    response = post(client, rcv, source, headers, body)
    assert response.status_code == 202, response.text
    assert [(r[0], r[1]) for r in receipts(engine, source)] == [("gh-1", "issues.opened")]


def test_providers_list_shows_which_fields_are_signed() -> None:
    result = subprocess.run(
        [str(BIN / "webhooks"), "providers", "list", "--json"],
        env=test_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    views: dict[str, Any] = {v["name"]: v for v in json.loads(result.stdout)}
    assert views["bitbucket"]["signed_fields"] == {"id": "unsigned", "type": "unsigned"}
    # GitHub and WooCommerce: the type from the signed body where it names one (issue 34).
    assert views["github"]["signed_fields"] == {
        "id": "unsigned",
        "type": "signed for the events the body identifies, else unsigned",
    }
    assert views["woocommerce"]["signed_fields"] == {
        "id": "unsigned",
        "type": "signed for action.* topics, else unsigned",
    }
    assert views["shopify"]["signed_fields"] == {
        "id": "unsigned",
        "type": "unsigned",
        "time": "unsigned",
    }
    assert views["stripe"]["signed_fields"] == {"id": "signed", "type": "signed", "time": "signed"}
    assert views["adyen"]["signed_fields"]["time"] == "unsigned"
    assert views["gitlab"]["signed_fields"]["id"] == "signed with the signing token"
    assert views["hubspot"]["max_events"] == 100
    for name in ("shopify", "bitbucket"):  # the type is named unsigned
        assert "(the type) are unsigned" in views[name]["signed"], name
    assert "X-WC-Webhook-Topic too" in views["woocommerce"]["signed"]
    assert "else X-GitHub-Event, unsigned" in views["github"]["signed"]
    table = subprocess.run(
        [str(BIN / "webhooks"), "providers", "list", "--wide"],  # issue 20: prose is --wide
        env={**test_env(), "COLUMNS": "400"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert table.returncode == 0, table.stderr
    assert "id: unsigned, type: unsigned" in table.stdout
