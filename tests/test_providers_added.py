"""The providers added for issue 13 (Resend, Clerk, GitLab, Linear, Paddle, Typeform,
WooCommerce, Intercom, Sentry, Calendly): signed as each sender signs (svix's library for the
Svix senders, Paddle's SDK for its HMAC, the documented scheme otherwise), accepted by a real
``webhooks serve``; tampered, wrong-secret, stale and future deliveries answered 401 with
nothing written; plus each scheme's own edges, checked directly against the provider modules."""

from __future__ import annotations

import hashlib
import hmac
import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
import svix.webhooks
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from core.providers import (
    AuthError,
    Challenge,
    EventMeta,
    MalformedEvent,
    authenticate,
    default_tolerance,
    extract,
    registry,
)
from core.settings import Settings
from tests import signing
from tests.conftest import count_rows
from tests.factories import MadeSource, make_source
from tests.leakcheck import remember
from tests.processes import Receiver, receiver

ADDED = (
    "resend",
    "clerk",
    "gitlab",
    "linear",
    "paddle",
    "typeform",
    "woocommerce",
    "intercom",
    "sentry",
    "calendly",
)
TOLERANCE = {
    "resend": timedelta(minutes=5),
    "clerk": timedelta(minutes=5),
    "linear": timedelta(seconds=60),
    "paddle": timedelta(seconds=5),
    "calendly": timedelta(minutes=3),
}
NOW = datetime(2026, 5, 1, 12, 0, 0, tzinfo=UTC)


@pytest.fixture(scope="module")
def rcv() -> Iterator[Receiver]:
    with receiver() as running:
        yield running


def new_source(sessions: sessionmaker[Session], settings: Settings, provider: str) -> MadeSource:
    made = make_source(sessions, settings, provider=provider)
    remember(made.secret)
    return made


def post(rcv: Receiver, source: MadeSource, headers: dict[str, str], body: bytes) -> Any:
    return httpx.post(
        f"{rcv.url}/webhooks/{source.public_id}", headers=headers, content=body, timeout=10
    )


def test_every_added_provider_is_registered_with_its_contract() -> None:
    for name in ADDED:
        provider = registry.get(name)
        assert provider.citation.startswith("https://"), name
        # GitLab's tolerance applies to its signing token; its secret token signs no time.
        expected = TOLERANCE.get(name, timedelta(minutes=5) if name == "gitlab" else None)
        assert provider.default_tolerance() == expected, name
    assert registry.get("resend").key_format == registry.get("clerk").key_format == "whsec"


# --- through a real receiver ----------------------------------------------------------------


@pytest.mark.parametrize("provider", ADDED)
def test_a_signed_delivery_is_accepted_once(
    provider: str,
    rcv: Receiver,
    sessions: sessionmaker[Session],
    settings: Settings,
    engine: Engine,
) -> None:
    source = new_source(sessions, settings, provider)
    sent_id = f"evt_{uuid.uuid4().hex}"
    headers, body = signing.sign(provider, source.secret, event_id=sent_id)
    remember(body)
    expected = signing.expected_event_id(provider, sent_id, None, body)
    first = post(rcv, source, headers, body)
    assert (first.status_code, first.json()) == (
        202,
        {"status": "accepted", "event_id": expected},
    ), first.text
    again = post(rcv, source, headers, body)
    assert (again.status_code, again.json()["status"]) == (200, "duplicate")


ATTACKS = [
    (provider, attack)
    for provider in ADDED
    for attack in ("tampered", "wrong_secret", "stale", "future")
    # A shared token signs nothing, so GitLab cannot see a changed body; only the timed
    # schemes have a time to be stale or early.
    if not (provider == "gitlab" and attack == "tampered")
    and (provider in TOLERANCE or attack not in ("stale", "future"))
]


@pytest.mark.parametrize(("provider", "attack"), ATTACKS)
def test_a_forged_delivery_is_401_and_writes_nothing(
    provider: str,
    attack: str,
    rcv: Receiver,
    sessions: sessionmaker[Session],
    settings: Settings,
    engine: Engine,
) -> None:
    source = new_source(sessions, settings, provider)
    now = datetime.now(UTC)
    secret = source.secret
    when: datetime | None = None
    if attack == "wrong_secret":
        secret = new_source(sessions, settings, provider).secret
    elif attack in ("stale", "future"):
        beyond = TOLERANCE[provider] + timedelta(seconds=30)
        when = now - beyond if attack == "stale" else now + beyond
    headers, body = signing.sign(
        provider, secret, event_id=f"evt_{uuid.uuid4().hex}", timestamp=when
    )
    if attack == "tampered":
        body = body.replace(b'"', b' "', 1)  # still JSON, no longer the signed bytes
    remember(body)
    before = count_rows(engine)
    response = post(rcv, source, headers, body)
    assert (response.status_code, response.json()) == (401, {"error": "unauthenticated"})
    assert count_rows(engine) == before


def test_woocommerce_ping_is_answered_and_not_stored(
    rcv: Receiver, sessions: sessionmaker[Session], settings: Settings, engine: Engine
) -> None:
    source = new_source(sessions, settings, "woocommerce")
    headers, body = signing.sign_woocommerce(source.secret, event_id="x", raw_body=b"webhook_id=12")
    headers["Content-Type"] = "application/x-www-form-urlencoded"
    before = count_rows(engine)
    response = post(rcv, source, headers, body)
    assert (response.status_code, response.content) == (200, b"")
    assert count_rows(engine) == before


# --- the schemes' own edges, against the modules ------------------------------------------


def secret_for(provider: str, n: int = 0) -> str:
    if registry.get(provider).key_format == "whsec":
        return "whsec_" + __import__("base64").b64encode(bytes([n + 1]) * 32).decode()
    return f"{provider}-secret-{n}-" + "x" * 24


def check(
    provider: str, headers: dict[str, str], body: bytes, *, now: datetime = NOW, n: int = 0
) -> str:
    return authenticate(
        provider,
        signing.lower(headers),
        body,
        [("s1", secret_for(provider, n))],
        config={},
        now=now,
        tolerance=None,
    )


def reason(provider: str, headers: dict[str, str], body: bytes, **kw: Any) -> str:
    with pytest.raises(AuthError) as caught:
        check(provider, headers, body, **kw)
    return caught.value.reason


def signed(provider: str, **kw: Any) -> tuple[dict[str, str], bytes]:
    kw.setdefault("event_id", "evt_1")
    kw.setdefault("timestamp", NOW)
    return signing.sign(provider, secret_for(provider), **kw)


@pytest.mark.parametrize("provider", ADDED)
def test_meta_comes_from_the_documented_fields(provider: str) -> None:
    headers, body = signed(provider)
    assert check(provider, headers, body) == "s1"
    meta = extract(provider, signing.lower(headers), body, config={})
    assert isinstance(meta, EventMeta)
    assert meta.event_id == signing.expected_event_id(provider, "evt_1", None, body)
    assert meta.event_type == signing.DEFAULT_TYPES[provider]
    timed = {"resend", "clerk", "linear", "paddle", "typeform", "intercom", "calendly"}
    assert meta.occurred_at == (NOW if provider in timed else None)


@pytest.mark.parametrize("provider", ADDED)
def test_a_missing_signature_header_is_refused(provider: str) -> None:
    headers, body = signed(provider)
    names = {"gitlab": "X-Gitlab-Token", "resend": "svix-signature", "clerk": "svix-signature"}
    name = names.get(provider) or next(k for k in headers if "signature" in k.lower())
    del headers[name]
    assert reason(provider, headers, body) == "missing_signature"


@pytest.mark.parametrize("provider", sorted(TOLERANCE))
def test_timestamps_inside_the_tolerance_pass_either_way(provider: str) -> None:
    inside = TOLERANCE[provider] - timedelta(seconds=1)
    for when in (NOW - inside, NOW + inside):
        headers, body = signed(provider, timestamp=when)
        assert check(provider, headers, body) == "s1"
    assert default_tolerance(provider) == TOLERANCE[provider]


def test_svix_senders_are_verified_by_the_svix_library_too() -> None:
    for provider in ("resend", "clerk"):
        headers, body = signed(provider, timestamp=datetime.now(UTC))
        svix.webhooks.Webhook(secret_for(provider)).verify(body, headers)  # raises if not
        with pytest.raises(svix.webhooks.WebhookVerificationError):
            svix.webhooks.Webhook(secret_for(provider, 1)).verify(body, headers)


def test_gitlab_compares_the_whole_token_and_takes_the_idempotency_key() -> None:
    headers, body = signed("gitlab")
    token = headers["X-Gitlab-Token"]
    for wrong in (token[:-1], token + "x", token.upper(), ""):
        forged = {**headers, "X-Gitlab-Token": wrong}
        assert reason("gitlab", forged, body) in ("bad_signature", "missing_signature")
    lowered = signing.lower(headers)
    assert extract("gitlab", lowered, body, config={}) == EventMeta("evt_1", "Push Hook", None)
    del lowered["idempotency-key"]
    fallback = extract("gitlab", lowered, body, config={})
    assert isinstance(fallback, EventMeta)
    assert fallback.event_id == headers["X-Gitlab-Event-UUID"]


def test_linear_needs_its_signed_body_timestamp() -> None:
    headers, body = signed("linear")
    obj = json.loads(body)
    del obj["webhookTimestamp"]
    headers, body = signed("linear", body_obj=obj)
    assert reason("linear", headers, body) == "missing_timestamp"
    obj["webhookTimestamp"] = "soon"
    headers, body = signed("linear", body_obj=obj)
    assert reason("linear", headers, body) == "malformed_timestamp"


def test_paddle_accepts_any_of_several_h1_and_the_official_primitive() -> None:
    from paddle_billing.Notifications.PaddleSignature import PaddleSignature

    headers, body = signing.sign_paddle(
        [secret_for("paddle", 1), secret_for("paddle")], event_id="evt_1", timestamp=NOW
    )
    assert headers["Paddle-Signature"].count(";h1=") == 2
    assert check("paddle", headers, body) == "s1"
    ts = int(NOW.timestamp())
    expected = PaddleSignature.calculate_hmac(secret_for("paddle"), f"{ts}:".encode() + body)
    assert headers["Paddle-Signature"].endswith("h1=" + expected.hexdigest())


def test_sentry_ids_follow_the_signed_body_not_the_unsigned_request_id() -> None:
    headers, body = signed("sentry")
    lowered = signing.lower(headers)
    one = extract("sentry", lowered, body, config={})
    two = extract("sentry", {**lowered, "request-id": "another"}, body, config={})
    assert isinstance(one, EventMeta)
    assert one == two
    assert one.event_id == "sha256:" + hashlib.sha256(body).hexdigest()


def test_calendly_needs_the_invitee_uri() -> None:
    headers, body = signed("calendly", body_obj={"event": "invitee.created", "payload": {}})
    check("calendly", headers, body)
    with pytest.raises(MalformedEvent, match="missing_id"):
        extract("calendly", signing.lower(headers), body, config={})


def test_intercom_is_sha1_of_the_body() -> None:
    headers, body = signed("intercom")
    digest = hmac.new(secret_for("intercom").encode(), body, hashlib.sha1).hexdigest()
    assert headers["X-Hub-Signature"] == f"sha1={digest}"
    sha256 = {**headers, "X-Hub-Signature": "sha256=" + digest}
    assert reason("intercom", sha256, body) == "malformed_signature"


def test_woocommerce_ping_is_a_challenge() -> None:
    headers, body = signing.sign_woocommerce(
        secret_for("woocommerce"), event_id="x", raw_body=b"webhook_id=7"
    )
    check("woocommerce", headers, body)
    assert isinstance(extract("woocommerce", signing.lower(headers), body, config={}), Challenge)


# --- GitLab's signing token (Standard Webhooks headers) -------------------------------------


def gitlab_signing_token(n: int = 0) -> str:
    return "whsec_" + __import__("base64").b64encode(bytes([n + 7]) * 32).decode()


def test_gitlab_signing_token_deliveries_are_verified_as_standard_webhooks() -> None:
    token = gitlab_signing_token()
    secrets = [("tok", "gitlab-secret-token-" + "x" * 8), ("sig", token)]

    def auth(headers: dict[str, str], body: bytes, now: datetime = NOW) -> str:
        return authenticate(
            "gitlab", signing.lower(headers), body, secrets, config={}, now=now, tolerance=None
        )

    headers, body = signing.sign_gitlab_signed(token, event_id="idem_1", timestamp=NOW)
    assert auth(headers, body) == "sig"
    meta = extract("gitlab", signing.lower(headers), body, config={})
    assert meta == EventMeta("idem_1", "Push Hook", None)
    forged = {**headers, "webhook-id": "idem_2", "Idempotency-Key": "idem_2"}
    for bad_headers, bad_body, now, why in (
        (forged, body, NOW, "bad_signature"),
        (headers, body + b" ", NOW, "bad_signature"),
        (headers, body, NOW + timedelta(minutes=6), "stale"),
        (headers, body, NOW - timedelta(minutes=6), "future"),
    ):
        with pytest.raises(AuthError) as caught:
            auth(bad_headers, bad_body, now)
        assert caught.value.reason == why
    other, body = signing.sign_gitlab_signed(gitlab_signing_token(1), event_id="i", timestamp=NOW)
    with pytest.raises(AuthError, match="bad_signature"):
        auth(other, body)


def test_gitlab_signing_token_through_the_receiver(
    rcv: Receiver, sessions: sessionmaker[Session], settings: Settings, engine: Engine
) -> None:
    token = gitlab_signing_token(2)
    source = make_source(sessions, settings, provider="gitlab", secret=token)
    remember(token)
    headers, body = signing.sign_gitlab_signed(token, event_id=f"idem_{uuid.uuid4().hex}")
    accepted = post(rcv, source, headers, body)
    assert accepted.status_code == 202, accepted.text
    stale, body = signing.sign_gitlab_signed(
        token, event_id="idem_stale", timestamp=datetime.now(UTC) - timedelta(minutes=6)
    )
    before = count_rows(engine)
    assert post(rcv, source, stale, body).status_code == 401
    assert count_rows(engine) == before
