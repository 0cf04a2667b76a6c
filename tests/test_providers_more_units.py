"""Issue 13, second half, pure: each new provider's scheme against its official library (or
its documented scheme where the library only verifies), forgeries, freshness, URL binding,
handshakes and batches. No database, no network, no sleeping: ``now`` is pinned.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets as pysecrets
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sendgrid.helpers.eventwebhook import EventWebhook
from square.utils.webhooks_helper import verify_signature as square_verify
from twilio.request_validator import RequestValidator

from core.crypto import check_key, generate_secret
from core.providers import (
    AuthError,
    Batch,
    Challenge,
    EventMeta,
    MalformedEvent,
    authenticate,
    extract,
    get_provider,
    validate_config,
)
from tests import signing
from tests.provider_specs import BY_NAME, OTHER_URL, SPECS, URL, Spec, text_secret

NOW = datetime(2026, 5, 1, 12, 0, 0, tzinfo=UTC)
TS = int(NOW.timestamp())


def auth(spec: Spec, headers: dict[str, str], body: bytes, secret: str, **kw: Any) -> str:
    return authenticate(
        spec.provider,
        signing.lower(headers),
        body,
        [("sec_1", secret)],
        config=kw.pop("config", spec.config),
        now=kw.pop("now", NOW),
        tolerance=None,
    )


def events_of(spec: Spec, headers: dict[str, str], body: bytes) -> list[EventMeta]:
    found = extract(spec.provider, signing.lower(headers), body, config=spec.config)
    if isinstance(found, Batch):
        return list(found.events)
    assert isinstance(found, EventMeta), found
    return [found]


def test_every_new_provider_is_registered_with_its_whole_contract() -> None:
    for spec in SPECS:
        provider = get_provider(spec.provider)
        assert provider.retry_window > timedelta(0)
        assert provider.citation.startswith("https://"), spec
        assert provider.signed
        assert provider.summary
        assert (provider.tolerance is not None) == spec.timed, spec
        assert provider.signs_url == spec.url_signed, spec


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_signed_delivery_verifies_and_names_its_event(spec: Spec) -> None:
    signer, secret = spec.keys()
    headers, body = spec.sign(signer, TS, "evt_1234")
    assert auth(spec, headers, body, secret) == "sec_1"
    events = events_of(spec, headers, body)
    assert events
    assert all(e.event_id and e.event_type for e in events)


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_tampered_body_is_refused(spec: Spec) -> None:
    signer, secret = spec.keys()
    headers, body = spec.sign(signer, TS, "evt_1234")
    if spec.provider == "twilio":
        tampered = body.replace(b"delivered", b"failed")
    elif spec.provider == "mailgun":  # only timestamp + token are signed: change the token
        obj = json.loads(body)
        obj["signature"]["token"] = "x" + obj["signature"]["token"]
        tampered = json.dumps(obj).encode()
    elif spec.provider == "adyen":  # the signed fields of an item
        tampered = body.replace(b'"value":1130', b'"value":1')
    else:
        tampered = body.replace(b"}", b' , "x": 1}', 1) if body.startswith(b"{") else body + b" "
        tampered = tampered if tampered != body else body[:-1]
    assert tampered != body
    with pytest.raises(AuthError, match="bad_signature"):
        auth(spec, headers, tampered, secret)


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_wrong_secret_is_refused(spec: Spec) -> None:
    signer, _ = spec.keys()
    _, other = spec.keys()
    headers, body = spec.sign(signer, TS, "evt_1234")
    with pytest.raises(AuthError, match="bad_signature"):
        auth(spec, headers, body, other)


@pytest.mark.parametrize("spec", [s for s in SPECS if s.timed], ids=str)
@pytest.mark.parametrize("skew", [-1, 1])
def test_stale_and_future_timestamps_are_refused(spec: Spec, skew: int) -> None:
    signer, secret = spec.keys()
    tolerance = get_provider(spec.provider).tolerance
    assert tolerance is not None
    offset = int(tolerance.total_seconds()) + 5
    headers, body = spec.sign(signer, TS + skew * offset, "evt_1234")
    with pytest.raises(AuthError, match="future" if skew > 0 else "stale"):
        auth(spec, headers, body, secret)
    inside = spec.sign(signer, TS + skew * (offset - 10), "evt_1234")
    assert auth(spec, *inside, secret) == "sec_1"


@pytest.mark.parametrize("spec", [s for s in SPECS if s.url_signed], ids=str)
def test_a_signature_over_another_url_is_refused(spec: Spec) -> None:
    signer, secret = spec.keys()
    headers, body = spec.sign(signer, TS, "evt_1234")
    assert auth(spec, headers, body, secret) == "sec_1"
    with pytest.raises(AuthError, match="bad_signature"):
        auth(spec, headers, body, secret, config={"public_url": OTHER_URL})


@pytest.mark.parametrize("provider", ["square", "hubspot", "twilio"])
def test_url_signed_providers_need_a_public_url(provider: str) -> None:
    with pytest.raises(ValueError, match="needs public_url"):
        validate_config(provider, {})
    with pytest.raises(ValueError, match="absolute http"):
        validate_config(provider, {"public_url": "/webhooks/x"})
    with pytest.raises(ValueError, match="unknown option"):
        validate_config(provider, {"public_url": URL, "host": "x"})
    assert validate_config(provider, {"public_url": URL}) == {"public_url": URL}


# --- the signers agree with the providers' own verifiers -------------------------------------


def test_signers_agree_with_official_verifiers() -> None:
    secret = text_secret()
    headers, body = signing.sign_square(secret, event_id="e1", url=URL)
    assert square_verify(
        request_body=body.decode(),
        signature_header=headers["x-square-hmacsha256-signature"],
        signature_key=secret,
        notification_url=URL,
    )
    private, public = signing.sendgrid_keypair()
    headers, body = signing.sign_sendgrid(private, [signing.sendgrid_event("e1")])
    assert EventWebhook(public).verify_signature(
        body.decode(),
        headers["X-Twilio-Email-Event-Webhook-Signature"],
        headers["X-Twilio-Email-Event-Webhook-Timestamp"],
    )
    headers, body = signing.sign_twilio("12345", url=URL)
    from urllib.parse import parse_qs  # noqa: PLC0415

    params = {k: v[0] for k, v in parse_qs(body.decode()).items()}
    assert RequestValidator("12345").validate(URL, params, headers["X-Twilio-Signature"])


def test_twilio_published_vector() -> None:
    # twilio-python tests/unit/test_request_validator.py: token 12345, this URL and params.
    url = "https://mycompany.com/myapp.php?foo=1&bar=2"
    params = [
        ("CallSid", "CA1234567890ABCDE"),
        ("Caller", "+14158675309"),
        ("Digits", "1234"),
        ("From", "+14158675309"),
        ("To", "+18005551212"),
    ]
    headers, body = signing.sign_twilio("12345", url=url, params=params)
    assert headers["X-Twilio-Signature"] == "RSOYDt4T1cUTdK1PDd93/VVr8B8="
    found = authenticate(
        "twilio",
        signing.lower(headers),
        body,
        [("s", "12345")],
        config={"public_url": url},
        now=NOW,
        tolerance=None,
    )
    assert found == "s"


def test_twilio_shared_key_signs_with_sha256_and_form_params_name_the_event() -> None:
    spec = BY_NAME["twilio"]
    secret = text_secret()
    headers, body = signing.sign_twilio(secret, url=URL, sid="SM42", algorithm="HMAC_SHA256")
    assert auth(spec, headers, body, secret) == "sec_1"
    [event] = events_of(spec, headers, body)
    assert (event.event_id, event.event_type) == ("SM42:delivered", "message.delivered")
    headers["I-Twilio-Idempotency-Token"] = "idem-77"
    assert events_of(spec, headers, body)[0].event_id == "idem-77"


def test_adyen_published_vector_and_hex_keys() -> None:
    # Adyen/adyen-python-api-library test/test_util.py::test_notification_request_item_hmac
    key = "44782DEF547AAA06C910C43932B1EB0C71FC68D9D0C057550C48EC2ACF6BA056"
    item = {
        "pspReference": "7914073381342284",
        "merchantReference": "TestPayment-1407325143704",
        "merchantAccountCode": "TestMerchant",
        "amount": {"currency": "EUR", "value": 1130},
        "eventCode": "AUTHORISATION",
        "success": "true",
        "eventDate": "2019-05-06T17:15:34.121+02:00",
        "paymentMethod": "visa",
        "reason": "reason",
    }
    from core.providers.adyen import sign_item  # noqa: PLC0415

    assert sign_item(item, key) == "coqCmt/IZ4E3CzPvMY8zTjQVL5hYJUiBRg8UU+iCWo0="
    with pytest.raises(ValueError, match="hex"):
        check_key("adyen", "not-hex-" * 8)
    check_key("adyen", key)


def test_mailgun_id_is_the_one_time_token() -> None:
    spec = BY_NAME["mailgun"]
    secret = text_secret()
    headers, body = signing.sign_mailgun(secret, event_id="tok" * 10, timestamp=TS)
    [event] = events_of(spec, headers, body)
    assert (event.event_id, event.event_type) == ("tok" * 10, "delivered")
    # A captured signature block reused with another event-data is the same id: dedup holds it.
    obj = json.loads(body)
    obj["event-data"]["event"] = "failed"
    forged = json.dumps(obj).encode()
    assert auth(spec, headers, forged, secret) == "sec_1"
    assert events_of(spec, headers, forged)[0].event_id == event.event_id


# --- public keys ------------------------------------------------------------------------------


def test_public_key_formats_are_checked_and_never_generated() -> None:
    _, discord_key = signing.discord_keypair()
    check_key("discord", discord_key)
    for bad in ("ab" * 31, "zz" * 32, text_secret()):
        with pytest.raises(ValueError, match="64 hex"):
            check_key("discord", bad)
    _, sendgrid_key = signing.sendgrid_keypair()
    check_key("sendgrid", sendgrid_key)
    with pytest.raises(ValueError, match="P-256"):
        check_key("sendgrid", base64.b64encode(b"\x30" * 91).decode())
    for provider in ("discord", "sendgrid", "adyen"):
        with pytest.raises(ValueError, match="issued by the sender"):
            generate_secret(provider)


def test_sendgrid_published_vector_verifies() -> None:
    # sendgrid/sendgrid-python test/unit/test_eventwebhook.py: SendGrid's key, signature,
    # timestamp and CRLF-terminated payload, verified by our receiver's own ECDSA check.
    public = (
        "MFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAE83T4O/n84iotIvIW4mdBgQ/7dAfSmpqIM8kF9mN1flpVKS3GRqe6"
        "2gw+2fNNRaINXvVpiglSI8eNEc6wEA3F+g=="
    )
    signature = (
        "MEUCIGHQVtGj+Y3LkG9fLcxf3qfI10QysgDWmMOVmxG0u6ZUAiEAyBiXDWzM+uOe5W0JuG+luQAbPIqHh89M15T"
        "luLtEZtM="
    )
    event = {
        "email": "hello@world.com",
        "event": "dropped",
        "reason": "Bounced Address",
        "sg_event_id": "ZHJvcC0xMDk5NDkxOS1MUnpYbF9OSFN0T0doUTRrb2ZTbV9BLTA",
        "sg_message_id": "LRzXl_NHStOGhQ4kofSm_A.filterdrecv-p3mdw1-756b745b58-kmzbl-18-5F5FC76C-9.0",
        "smtp-id": "<LRzXl_NHStOGhQ4kofSm_A@ismtpd0039p1iad1.sendgrid.net>",
        "timestamp": 1600112492,
    }
    body = json.dumps([event], sort_keys=True, separators=(",", ":")).encode() + b"\r\n"
    headers = {
        "x-twilio-email-event-webhook-signature": signature,
        "x-twilio-email-event-webhook-timestamp": "1600112502",
    }
    check_key("sendgrid", public)
    when = datetime.fromtimestamp(1600112502, UTC)
    spec = BY_NAME["sendgrid"]
    assert auth(spec, headers, body, public, now=when) == "sec_1"
    with pytest.raises(AuthError, match="bad_signature"):
        auth(spec, headers, body.replace(b"dropped", b"bounced"), public, now=when)
    [found] = events_of(spec, headers, body)
    assert (found.event_id, found.event_type) == (event["sg_event_id"], "dropped")


def test_discord_signer_matches_pynacl_verify_and_a_forged_key_fails() -> None:
    import nacl.signing  # noqa: PLC0415

    signer, public = signing.discord_keypair()
    headers, body = signing.sign_discord(signer, timestamp=TS)
    sig = bytes.fromhex(headers["X-Signature-Ed25519"])
    nacl.signing.VerifyKey(bytes.fromhex(public)).verify(str(TS).encode() + body, sig)
    with pytest.raises(AuthError, match="malformed_signature"):
        auth(BY_NAME["discord"], {**headers, "X-Signature-Ed25519": "ab" * 10}, body, public)


# --- handshakes -------------------------------------------------------------------------------


def test_twitch_callback_verification_is_the_raw_challenge() -> None:
    secret = text_secret()
    challenge = "pogchamp-kappa-360noscope-vohiyo"
    headers, body = signing.sign_twitch(
        secret,
        event_id="m1",
        timestamp=TS,
        message_type="webhook_callback_verification",
        body_obj={"challenge": challenge, "subscription": {"type": "channel.follow"}},
    )
    assert auth(BY_NAME["twitch"], headers, body, secret) == "sec_1"
    found = extract("twitch", signing.lower(headers), body, config={})
    assert found == Challenge(body=challenge.encode(), content_type="text/plain")
    headers, body = signing.sign_twitch(
        secret,
        event_id="m2",
        timestamp=TS,
        message_type="revocation",
        body_obj={"subscription": {"type": "channel.follow", "status": "authorization_revoked"}},
    )
    [event] = events_of(BY_NAME["twitch"], headers, body)
    assert (event.event_id, event.event_type) == ("m2", "revocation")


def test_zoom_url_validation_answers_with_the_verifying_secret() -> None:
    secret = text_secret()
    body_obj = {"event": "endpoint.url_validation", "payload": {"plainToken": "qgg8vlvZRS6U"}}
    headers, body = signing.sign_zoom(secret, body_obj=body_obj, timestamp=TS)
    assert auth(BY_NAME["zoom"], headers, body, secret) == "sec_1"
    found = extract("zoom", signing.lower(headers), body, config={})
    assert isinstance(found, Challenge)
    assert found.sign is not None
    expected = hmac.new(secret.encode(), b"qgg8vlvZRS6U", hashlib.sha256).hexdigest()
    assert json.loads(found.sign(secret)) == {
        "plainToken": "qgg8vlvZRS6U",
        "encryptedToken": expected,
    }


def test_meta_get_verification() -> None:
    verify_get = get_provider("meta").verify_get
    assert verify_get is not None
    config = validate_config("meta", {"verify_token": "tok-" + "v" * 20})
    query = {
        "hub.mode": "subscribe",
        "hub.verify_token": config["verify_token"],
        "hub.challenge": "1158201444",
    }
    assert verify_get(query, config) == Challenge(body=b"1158201444", content_type="text/plain")
    with pytest.raises(AuthError):
        verify_get({**query, "hub.verify_token": "nope"}, config)
    with pytest.raises(AuthError):
        verify_get({**query, "hub.mode": "unsubscribe"}, config)
    with pytest.raises(ValueError, match="verify_token"):
        validate_config("meta", {"verify_token": "short"})


def test_discord_pings() -> None:
    signer, public = signing.discord_keypair()
    headers, body = signing.sign_discord(signer, body_obj={"type": 1, "id": "1"}, timestamp=TS)
    assert auth(BY_NAME["discord"], headers, body, public) == "sec_1"
    assert extract("discord", signing.lower(headers), body, config={}) == Challenge(
        body=b'{"type":1}', content_type="application/json"
    )
    headers, body = signing.sign_discord(signer, body_obj={"version": 1, "type": 0}, timestamp=TS)
    found = extract("discord", signing.lower(headers), body, config={})
    assert isinstance(found, Challenge)
    assert found.status == 204
    assert found.body == b""


# --- batches ----------------------------------------------------------------------------------


def test_batches_name_each_event_with_its_own_payload() -> None:
    key = pysecrets.token_hex(32)
    items = [signing.adyen_item("psp1"), signing.adyen_item("psp2", event_code="REFUND")]
    headers, body = signing.sign_adyen(key, items)
    assert auth(BY_NAME["adyen"], headers, body, key) == "sec_1"
    found = extract("adyen", signing.lower(headers), body, config={})
    assert isinstance(found, Batch)
    assert found.answer is not None
    assert found.answer.body == b"[accepted]"
    assert [(e.event_id, e.event_type) for e in found.events] == [
        ("psp1:AUTHORISATION:true", "AUTHORISATION"),
        ("psp2:REFUND:true", "REFUND"),
    ]
    stored = json.loads(found.events[1].payload or b"")
    assert stored["signed"]["pspReference"] == "psp2"
    assert stored["unsigned"]["eventDate"] == items[1]["eventDate"]

    private, public = signing.sendgrid_keypair()
    events = [signing.sendgrid_event("sg1", ts=TS), signing.sendgrid_event("sg2", "open", TS)]
    headers, body = signing.sign_sendgrid(private, events, timestamp=TS)
    assert auth(BY_NAME["sendgrid"], headers, body, public) == "sec_1"
    found = extract("sendgrid", signing.lower(headers), body, config={})
    assert isinstance(found, Batch)
    assert found.answer is None
    assert [e.event_id for e in found.events] == ["sg1", "sg2"]


def test_adyen_one_unsigned_item_refuses_the_whole_request() -> None:
    key = pysecrets.token_hex(32)
    headers, body = signing.sign_adyen(key, [signing.adyen_item("psp1")])
    obj = json.loads(body)
    obj["notificationItems"].append({"NotificationRequestItem": signing.adyen_item("psp9")})
    with pytest.raises(AuthError, match="missing_signature"):
        auth(BY_NAME["adyen"], headers, json.dumps(obj).encode(), key)


def test_malformed_bodies_are_400_reasons() -> None:
    with pytest.raises(MalformedEvent):
        extract("sendgrid", {}, b"{}", config={})
    with pytest.raises(MalformedEvent):
        extract("hubspot", {}, b"[]", config={"public_url": URL})


# --- handlers get form bodies with their content type ----------------------------------------


def _event(body: bytes, content_type: str | None) -> Any:
    from tasks.context import Event  # noqa: PLC0415
    from tasks.context import EventMeta as TaskMeta

    meta = TaskMeta(
        1, 1, "src_x", "twilio", "SM1:delivered", "message.delivered", None, NOW, content_type
    )
    return Event(meta, body)


def test_event_form_parses_form_bodies_and_json_says_to_use_it() -> None:
    from tasks.errors import PermanentError  # noqa: PLC0415

    _, body = signing.sign_twilio("12345", url=URL, sid="SM1")
    event = _event(body, "application/x-www-form-urlencoded; charset=utf-8")
    assert event.form["MessageSid"] == ["SM1"]
    assert event.form["Body"] == ["Hello & welcome = 100%"]
    with pytest.raises(PermanentError, match=r"read event\.form"):
        _ = event.json
    as_json = _event(b'{"a": 1}', "application/json")
    assert as_json.json == {"a": 1}
    with pytest.raises(PermanentError, match=r"read event\.json"):
        _ = as_json.form


def test_square_published_vector() -> None:
    # square/square-python-sdk tests/integration/test_webhooks_helper.py: Square's own
    # signature, key and notification URL, verified by the receiver; another URL is refused.
    body = (
        b'{"merchant_id":"MLEFBHHSJGVHD","type":"webhooks.test_notification","event_id":'
        b'"ac3ac95b-f97d-458c-a6e6-18981597e05f","created_at":"2022-07-13T20:30:59.037339943Z",'
        b'"data":{"type":"webhooks","id":"bc368e64-01aa-407e-b46e-3231809b1129"}}'
    )
    headers = {"x-square-hmacsha256-signature": "GF4YkrJgGBDZ9NIYbNXBnMzqb2HoL4RW/S6vkZ9/2N4="}
    url = "https://webhook.site/679a4f3a-dcfa-49ee-bac5-9d0edad886b9"
    spec = BY_NAME["square"]
    key = "Ibxx_5AKakO-3qeNVR61Dw"
    assert auth(spec, headers, body, key, config={"public_url": url}) == "sec_1"
    with pytest.raises(AuthError, match="bad_signature"):
        auth(spec, headers, body, key, config={"public_url": url.replace("679a", "79a")})
    [found] = events_of(spec, headers, body)
    assert (found.event_id, found.event_type) == (
        "ac3ac95b-f97d-458c-a6e6-18981597e05f",
        "webhooks.test_notification",
    )
