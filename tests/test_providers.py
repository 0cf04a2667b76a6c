"""Unit tests of ``core.providers``: signature schemes, freshness, event metadata.

Pure: no database, no network, no sleeping. Requests are signed by the providers' official
libraries (tests/signing.py) and checked against a pinned ``NOW``. Published test vectors are
cited where they are used.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from core.providers import (
    AUTH_REASONS,
    BUILTIN_PROVIDERS,
    AuthError,
    Challenge,
    EventMeta,
    MalformedEvent,
    authenticate,
    default_tolerance,
    extract,
    validate_config,
)
from tests import signing

NOW = datetime(2026, 5, 1, 12, 0, 0, tzinfo=UTC)
TS = int(NOW.timestamp())
EVENT_ID = "evt_1NqXb2Lz"


@dataclass(frozen=True)
class Case:
    name: str
    provider: str
    signature_header: str  # lower-case
    timestamp_header: str | None = None  # lower-case; Stripe's time is inside its signature
    timed: bool = False
    config: dict[str, Any] = field(default_factory=dict)
    parses_body: bool = True

    def __str__(self) -> str:
        return self.name


CASES = [
    Case("stripe", "stripe", "stripe-signature", timed=True),
    Case("github", "github", "x-hub-signature-256"),
    Case("shopify", "shopify", "x-shopify-hmac-sha256", parses_body=False),
    Case("slack", "slack", "x-slack-signature", "x-slack-request-timestamp", timed=True),
    Case("standard", "standard", "webhook-signature", "webhook-timestamp", timed=True),
    Case("svix", "svix", "svix-signature", "svix-timestamp", timed=True),
    Case("hmac", "hmac", "x-signature"),
    Case(
        "hmac-timestamped",
        "hmac",
        "x-hub-sig",
        "x-timestamp",
        timed=True,
        config={
            "signature_header": "X-Hub-Sig",
            "timestamp_header": "X-Timestamp",
            "algorithm": "sha512",
            "encoding": "base64",
            "prefix": "sha512=",
            "time_field": "meta.sent_at",
        },
    ),
    Case(
        "hmac-headers",
        "hmac",
        "x-hook-signature",
        config={
            "signature_header": "x-hook-signature",
            "algorithm": "sha1",
            "id_header": "x-request-id",
            "id_field": None,
            "id_from_unsigned_header": "true",
            "type_header": "x-event",
            "type_field": None,
        },
        parses_body=False,
    ),
    Case(
        "hmac-signed-headers",
        "hmac",
        "x-hook-signature",
        "x-hook-timestamp",
        timed=True,
        config={
            "signature_header": "x-hook-signature",
            "timestamp_header": "x-hook-timestamp",
            "signed_content": "{header:x-request-id}.{header:x-hook-timestamp}.{body}",
            "id_header": "x-request-id",
            "id_field": None,
            "type_header": "x-event",
            "type_field": None,
        },
        parses_body=False,
    ),
]
BY_NAME = {case.name: case for case in CASES}
TIMED = [case for case in CASES if case.timed]
UNTIMED = [case for case in CASES if not case.timed]
BODY_PARSERS = [case for case in CASES if case.parses_body]
ids = str


def secret_for(provider: str, n: int = 0) -> str:
    """A fixed secret in the provider's format; ``n`` picks another one."""
    if provider in ("standard", "svix"):
        return "whsec_" + base64.b64encode(bytes([n + 1]) * 32).decode()
    if provider == "stripe":
        return f"whsec_test{n}" + "a" * 24
    return f"{provider}-secret-{n}-" + "x" * 24


def signed(
    case: Case, secret: str | list[str] | None = None, *, ts: int = TS, **kw: Any
) -> tuple[dict[str, str], bytes]:
    kw.setdefault("event_id", EVENT_ID)
    headers, body = signing.sign(
        case.provider,
        secret_for(case.provider) if secret is None else secret,
        timestamp=ts,
        config=case.config or None,
        **kw,
    )
    return signing.lower(headers), body


def auth(
    case: Case,
    headers: dict[str, str],
    body: bytes,
    secrets: list[tuple[str, str]] | None = None,
    *,
    now: datetime = NOW,
    tolerance: timedelta | None = None,
) -> str:
    return authenticate(
        case.provider,
        headers,
        body,
        [("s1", secret_for(case.provider))] if secrets is None else secrets,
        config=validate_config(case.provider, case.config),
        now=now,
        tolerance=tolerance,
    )


def meta(case: Case, headers: dict[str, str], body: bytes) -> EventMeta | Challenge:
    return extract(case.provider, headers, body, config=validate_config(case.provider, case.config))


def auth_reason(case: Case, headers: dict[str, str], body: bytes, **kw: Any) -> str:
    with pytest.raises(AuthError) as caught:
        auth(case, headers, body, **kw)
    assert caught.value.reason in AUTH_REASONS
    return caught.value.reason


def malformed_reason(case: Case, headers: dict[str, str], body: bytes) -> str:
    with pytest.raises(MalformedEvent) as caught:
        meta(case, headers, body)
    return caught.value.reason


def without_timestamp(case: Case, headers: dict[str, str]) -> dict[str, str]:
    out = dict(headers)
    if case.provider == "stripe":
        parts = out["stripe-signature"].split(",")
        out["stripe-signature"] = ",".join(p for p in parts if not p.startswith("t="))
    else:
        assert case.timestamp_header is not None
        del out[case.timestamp_header]
    return out


def with_timestamp_text(case: Case, headers: dict[str, str], text: str) -> dict[str, str]:
    out = dict(headers)
    if case.provider == "stripe":
        parts = [
            f"t={text}" if p.startswith("t=") else p for p in out["stripe-signature"].split(",")
        ]
        out["stripe-signature"] = ",".join(parts)
    else:
        assert case.timestamp_header is not None
        out[case.timestamp_header] = text
    return out


# The providers this file covers; the newer ones have their own tests/test_providers_*.py.
CLASSIC = ("stripe", "github", "shopify", "slack", "standard", "svix", "hmac")


def test_every_provider_is_covered() -> None:
    assert {case.provider for case in CASES} == set(CLASSIC)
    assert set(CLASSIC) <= set(BUILTIN_PROVIDERS)


# --- authentication: the happy path and rotation ------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_request_signed_by_the_official_signer_verifies(case: Case) -> None:
    headers, body = signed(case)
    assert auth(case, headers, body) == "s1"


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_rotation_returns_the_id_of_the_secret_that_matches(case: Case) -> None:
    headers, body = signed(case, secret_for(case.provider, 1))
    secrets = [("old", secret_for(case.provider, 0)), ("new", secret_for(case.provider, 1))]
    assert auth(case, headers, body, secrets) == "new"


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_first_matching_secret_wins(case: Case) -> None:
    headers, body = signed(case)
    secret = secret_for(case.provider)
    assert auth(case, headers, body, [("a", secret), ("b", secret)]) == "a"


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_empty_secrets_are_skipped(case: Case) -> None:
    headers, body = signed(case)
    assert auth(case, headers, body, [("blank", ""), ("s1", secret_for(case.provider))]) == "s1"


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.provider not in ("slack", "standard", "svix")], ids=ids
)
def test_an_empty_secret_never_verifies(case: Case) -> None:
    # An empty key is public knowledge; those providers' own signers refuse it outright.
    headers, body = signed(case, "")
    secrets = [("blank", ""), ("s1", secret_for(case.provider))]
    assert auth_reason(case, headers, body, secrets=secrets) == "bad_signature"


@pytest.mark.parametrize("case", CASES, ids=ids)
@pytest.mark.parametrize("secrets", [[], [("blank", "")]], ids=["none", "blank"])
def test_a_source_without_a_usable_secret_verifies_nothing(
    case: Case, secrets: list[tuple[str, str]]
) -> None:
    headers, body = signed(case)
    assert auth_reason(case, headers, body, secrets=secrets) == "no_secret"


@pytest.mark.parametrize("provider", ["stripe", "standard", "svix"])
def test_sender_side_rotation_any_offered_signature_may_match(provider: str) -> None:
    case = BY_NAME[provider]
    both = [secret_for(provider, 7), secret_for(provider, 0)]
    headers, body = signed(case, both)
    assert auth(case, headers, body) == "s1"
    assert auth(case, headers, body, [("seven", secret_for(provider, 7))]) == "seven"


# --- authentication: rejections -------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_tampered_body_is_rejected(case: Case) -> None:
    headers, body = signed(case)
    flipped = body[:-1] + bytes([body[-1] ^ 1])
    assert auth_reason(case, headers, flipped) == "bad_signature"
    assert auth_reason(case, headers, body + b" ") == "bad_signature"
    assert auth_reason(case, headers, b"") == "bad_signature"


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_wrong_secret_is_rejected(case: Case) -> None:
    headers, body = signed(case, secret_for(case.provider, 3))
    assert auth_reason(case, headers, body) == "bad_signature"


@pytest.mark.parametrize("case", CASES, ids=ids)
@pytest.mark.parametrize("value", [None, ""], ids=["absent", "empty"])
def test_missing_signature_header(case: Case, value: str | None) -> None:
    headers, body = signed(case)
    if value is None:
        del headers[case.signature_header]
    else:
        headers[case.signature_header] = value
    assert auth_reason(case, headers, body) == "missing_signature"


MALFORMED_SIGNATURES = [
    ("stripe", f"t={TS}", "malformed_signature"),
    ("stripe", f"t={TS},v0={'0' * 64}", "malformed_signature"),
    ("stripe", f"t={TS},v1=not-hex", "malformed_signature"),
    ("stripe", f"v1={'0' * 64}", "missing_timestamp"),
    ("github", "sha1=" + "0" * 40, "malformed_signature"),
    ("github", "sha256=zz", "malformed_signature"),
    ("github", "0" * 64, "malformed_signature"),
    ("shopify", "not base64!", "malformed_signature"),
    ("slack", "v1=" + "0" * 64, "malformed_signature"),
    ("slack", "v0=xyz", "malformed_signature"),
    ("standard", "v1a,AAAA", "malformed_signature"),
    ("standard", "v2,AAAA v1", "malformed_signature"),
    ("standard", "v1,not base64!", "malformed_signature"),
    ("svix", "garbage", "malformed_signature"),
    ("hmac", "zz", "malformed_signature"),
    ("hmac-timestamped", "sha256=" + "A" * 88, "malformed_signature"),
    ("hmac-timestamped", "sha512=***", "malformed_signature"),
]


@pytest.mark.parametrize(("name", "value", "reason"), MALFORMED_SIGNATURES)
def test_malformed_signature_headers(name: str, value: str, reason: str) -> None:
    case = BY_NAME[name]
    headers, body = signed(case)
    headers[case.signature_header] = value
    assert auth_reason(case, headers, body) == reason


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_non_ascii_signature_is_rejected_not_crashed(case: Case) -> None:
    headers, body = signed(case)
    headers[case.signature_header] = headers[case.signature_header][:-2] + "é€"
    auth_reason(case, headers, body)


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_error_messages_carry_no_secret_signature_or_body(case: Case) -> None:
    secret = secret_for(case.provider, 5)
    headers, body = signed(case, secret, body_obj={"type": "x", "id": "1", "card": "4242-SECRET"})
    with pytest.raises(AuthError) as caught:
        auth(case, headers, body)  # verified against secret 0: bad_signature
    text = str(caught.value) + repr(caught.value)
    assert caught.value.reason == "bad_signature"
    assert "bad_signature" in text
    assert secret not in text
    assert "4242-SECRET" not in text
    assert headers[case.signature_header] not in text
    assert secret_for(case.provider) not in text


# --- freshness ------------------------------------------------------------------------------


@pytest.mark.parametrize("case", TIMED, ids=ids)
def test_stale_timestamp_is_rejected(case: Case) -> None:
    headers, body = signed(case)
    assert auth_reason(case, headers, body, now=NOW + timedelta(seconds=301)) == "stale"


@pytest.mark.parametrize("case", TIMED, ids=ids)
def test_future_timestamp_is_rejected(case: Case) -> None:
    headers, body = signed(case)
    assert auth_reason(case, headers, body, now=NOW - timedelta(seconds=301)) == "future"


@pytest.mark.parametrize("case", TIMED, ids=ids)
@pytest.mark.parametrize("skew", [-300, -1, 0, 1, 300])
def test_timestamps_within_the_default_tolerance_pass(case: Case, skew: int) -> None:
    headers, body = signed(case)
    assert auth(case, headers, body, now=NOW + timedelta(seconds=skew)) == "s1"


@pytest.mark.parametrize("case", TIMED, ids=ids)
def test_explicit_tolerance_overrides_the_default(case: Case) -> None:
    headers, body = signed(case)
    ten = timedelta(seconds=10)
    assert auth(case, headers, body, now=NOW + ten, tolerance=ten) == "s1"
    assert auth(case, headers, body, now=NOW - ten, tolerance=ten) == "s1"
    assert auth_reason(case, headers, body, now=NOW + ten * 1.1, tolerance=ten) == "stale"
    assert auth_reason(case, headers, body, now=NOW - ten * 1.1, tolerance=ten) == "future"
    hour = timedelta(hours=1)
    assert auth(case, headers, body, now=NOW + hour, tolerance=hour) == "s1"


@pytest.mark.parametrize("case", TIMED, ids=ids)
def test_a_stale_forgery_is_reported_as_a_bad_signature(case: Case) -> None:
    headers, body = signed(case, secret_for(case.provider, 9))
    assert auth_reason(case, headers, body, now=NOW + timedelta(days=1)) == "bad_signature"


@pytest.mark.parametrize("case", TIMED, ids=ids)
def test_missing_timestamp(case: Case) -> None:
    headers, body = signed(case)
    assert auth_reason(case, without_timestamp(case, headers), body) == "missing_timestamp"


@pytest.mark.parametrize("case", TIMED, ids=ids)
@pytest.mark.parametrize("text", ["soon", "-5", "1.5", " 12", "\uff11\uff12\uff13", "9" * 12])
def test_malformed_timestamp(case: Case, text: str) -> None:
    headers, body = signed(case)
    assert auth_reason(case, with_timestamp_text(case, headers, text), body) == (
        "malformed_timestamp"
    )


@pytest.mark.parametrize("case", TIMED, ids=ids)
def test_changing_the_timestamp_breaks_the_signature(case: Case) -> None:
    headers, body = signed(case)
    moved = with_timestamp_text(case, headers, str(TS + 1))
    assert auth_reason(case, moved, body) == "bad_signature"


@pytest.mark.parametrize("case", UNTIMED, ids=ids)
def test_schemes_without_a_signed_time_ignore_the_clock(case: Case) -> None:
    headers, body = signed(case)
    far = NOW + timedelta(days=365)
    assert auth(case, headers, body, now=far) == "s1"
    assert auth(case, headers, body, now=far, tolerance=timedelta(seconds=1)) == "s1"


def test_now_must_be_aware() -> None:
    case = BY_NAME["github"]
    headers, body = signed(case)
    with pytest.raises(ValueError, match="aware"):
        auth(case, headers, body, now=NOW.replace(tzinfo=None))


def test_now_in_another_zone_is_the_same_instant() -> None:
    case = BY_NAME["slack"]
    headers, body = signed(case)
    elsewhere = NOW.astimezone(timezone(timedelta(hours=-7)))
    assert auth(case, headers, body, now=elsewhere) == "s1"
    assert auth_reason(case, headers, body, now=elsewhere + timedelta(minutes=6)) == "stale"


@pytest.mark.parametrize(
    ("provider", "config", "expected"),
    [
        ("stripe", None, timedelta(seconds=300)),
        ("slack", None, timedelta(seconds=300)),
        ("standard", None, timedelta(seconds=300)),
        ("svix", None, timedelta(seconds=300)),
        ("github", None, None),
        ("shopify", None, None),
        ("hmac", None, None),
        ("hmac", {}, None),
        ("hmac", {"timestamp_header": "x-timestamp"}, timedelta(seconds=300)),
    ],
)
def test_default_tolerance(
    provider: str, config: dict[str, Any] | None, expected: timedelta | None
) -> None:
    assert default_tolerance(provider, config) == expected


# --- provider specifics ---------------------------------------------------------------------


def test_stripe_ignores_test_mode_v0_and_accepts_any_v1() -> None:
    case = BY_NAME["stripe"]
    headers, body = signed(case)
    t, v1 = headers["stripe-signature"].split(",")
    headers["stripe-signature"] = f"{t},v0={'1' * 64},v1={'2' * 64},{v1}"
    assert auth(case, headers, body) == "s1"


def test_stripe_uses_the_first_timestamp_as_its_library_does() -> None:
    case = BY_NAME["stripe"]
    headers, body = signed(case)
    headers["stripe-signature"] += f",t={TS + 1}"
    assert auth(case, headers, body) == "s1"


def test_standard_skips_asymmetric_v1a_entries() -> None:
    case = BY_NAME["standard"]
    headers, body = signed(case)
    headers["webhook-signature"] = "v1a,AAAA " + headers["webhook-signature"]
    assert auth(case, headers, body) == "s1"


@pytest.mark.parametrize("name", ["standard", "svix"])
def test_standard_webhook_id_is_signed_and_required(name: str) -> None:
    case = BY_NAME[name]
    headers, body = signed(case)
    id_header = "svix-id" if name == "svix" else "webhook-id"
    assert auth_reason(case, {**headers, id_header: "msg_other"}, body) == "bad_signature"
    del headers[id_header]
    assert auth_reason(case, headers, body) == "missing_id"


def test_svix_accepts_webhook_headers_when_svix_ones_are_absent() -> None:
    case = BY_NAME["svix"]
    headers, body = signing.sign_standard(
        secret_for("svix"), event_id="msg_white", timestamp=TS, event_type="user.created"
    )
    lowered = signing.lower(headers)
    assert auth(case, lowered, body) == "s1"
    assert meta(case, lowered, body) == EventMeta("msg_white", "user.created", NOW)


def test_svix_prefers_svix_headers() -> None:
    case = BY_NAME["svix"]
    headers, body = signed(case)
    noise = {"webhook-id": "msg_x", "webhook-timestamp": "1", "webhook-signature": "v1,AAAA"}
    assert auth(case, {**headers, **noise}, body) == "s1"
    assert meta(case, {**headers, **noise}, body).event_id == EVENT_ID  # type: ignore[union-attr]


def test_standard_rejects_a_body_that_is_not_utf8() -> None:
    case = BY_NAME["standard"]
    headers, _ = signed(case)
    assert auth_reason(case, headers, b"\xff\xfe{}") == "bad_signature"


def test_github_signs_raw_bytes_even_when_not_utf8() -> None:
    case = BY_NAME["github"]
    headers, body = signed(case, raw_body=b'{"x": "\xff"}')
    assert auth(case, headers, body) == "s1"


def test_generic_hmac_prefix_is_case_insensitive_and_required() -> None:
    case = BY_NAME["hmac-timestamped"]
    headers, body = signed(case)
    value = headers["x-hub-sig"]
    assert auth(case, {**headers, "x-hub-sig": "SHA512=" + value[7:]}, body) == "s1"
    assert auth_reason(case, {**headers, "x-hub-sig": value[7:]}, body) == "malformed_signature"


def test_generic_hmac_hex_is_case_insensitive() -> None:
    case = BY_NAME["hmac"]
    headers, body = signed(case)
    headers["x-signature"] = headers["x-signature"].upper()
    assert auth(case, headers, body) == "s1"


def test_the_same_secret_under_different_algorithms_is_not_confused() -> None:
    secret = "shared-secret-value"
    for name in ("hmac", "hmac-headers", "hmac-timestamped", "github"):
        case = BY_NAME[name]
        headers, body = signed(case, secret)
        assert auth(case, headers, body, [("k", secret)]) == "k"


def test_the_key_cache_survives_many_secrets() -> None:
    case = BY_NAME["github"]
    for n in range(1100):
        secret = f"rotating-{n}"
        headers, body = signed(case, secret)
        assert auth(case, headers, body, [("k", secret)]) == "k"
    assert auth_reason(case, headers, body, secrets=[("k", "rotating-0")]) == "bad_signature"


# --- published test vectors ----------------------------------------------------------------


def test_github_documented_vector() -> None:
    # docs.github.com/en/webhooks/using-webhooks/validating-webhook-deliveries
    case = BY_NAME["github"]
    headers = {
        "x-hub-signature-256": (
            "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"
        )
    }
    secrets = [("gh", "It's a Secret to Everybody")]
    assert auth(case, headers, b"Hello, World!", secrets) == "gh"
    assert auth_reason(case, headers, b"Hello, World?", secrets=secrets) == "bad_signature"


STANDARD_VECTOR = {
    "webhook-id": "msg_p5jXN8AQM9LWM0D4loKWxJek",
    "webhook-timestamp": "1614265330",
    "webhook-signature": "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=",
}


@pytest.mark.parametrize("name", ["standard", "svix"])
def test_standard_webhooks_vector(name: str) -> None:
    # standard-webhooks libraries/python/tests/test_webhooks.py::test_sign_function;
    # svix-webhooks python/tests/test_webhooks.py::test_sign_function
    case = BY_NAME[name]
    secrets = [("sw", "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")]
    signed_at = datetime.fromtimestamp(1614265330, UTC)
    body = b'{"test": 2432232314}'
    assert auth(case, STANDARD_VECTOR, body, secrets, now=signed_at) == "sw"
    assert auth_reason(case, STANDARD_VECTOR, body, secrets=secrets) == "stale"
    assert auth_reason(case, STANDARD_VECTOR, body[:-1] + b"5}", secrets=secrets) == (
        "bad_signature"
    )


def test_slack_documented_vector() -> None:
    # python-slack-sdk tests/slack_sdk/signature/test_signature_verifier.py, after
    # docs.slack.dev/authentication/verifying-requests-from-slack/
    case = BY_NAME["slack"]
    body = (
        b"token=xyzz0WbapA4vBCDEFasx0q6G&team_id=T1DC2JH3J&team_domain=testteamnow"
        b"&channel_id=G8PSS9T3V&channel_name=foobar&user_id=U2CERLKJA&user_name=roadrunner"
        b"&command=%2Fwebhook-collect&text=&response_url=https%3A%2F%2Fhooks.slack.com"
        b"%2Fcommands%2FT1DC2JH3J%2F397700885554%2F96rGlfmibIGlgcZRskXaIFfN"
        b"&trigger_id=398738663015.47445629121.803a0bc887a14d10d2c447fce8b6703c"
    )
    headers = {
        "x-slack-request-timestamp": "1531420618",
        "x-slack-signature": (
            "v0=a2114d57b48eac39b9ad189dd8316235a7b4a8d21a10bd27519666489c69b503"
        ),
    }
    secrets = [("sl", "8f742231b10e8888abcd99yyyzzz85a5")]
    signed_at = datetime.fromtimestamp(1531420618, UTC)
    assert auth(case, headers, body, secrets, now=signed_at) == "sl"
    assert auth_reason(case, headers, body + b"-", secrets=secrets, now=signed_at) == (
        "bad_signature"
    )


# --- extraction -----------------------------------------------------------------------------


EXPECTED_META = {
    "stripe": EventMeta(EVENT_ID, "invoice.paid", NOW),
    "github": EventMeta(EVENT_ID, "issues.opened", None),
    "shopify": EventMeta(EVENT_ID, "orders/create", NOW, time_signed=False),
    "slack": EventMeta(EVENT_ID, "app_mention", NOW),
    "standard": EventMeta(EVENT_ID, "invoice.paid", NOW),
    "svix": EventMeta(EVENT_ID, "user.created", NOW),
    "hmac": EventMeta(EVENT_ID, "order.created", None),
    "hmac-timestamped": EventMeta(EVENT_ID, "order.created", NOW),
    "hmac-headers": EventMeta(EVENT_ID, "order.created", None),
    "hmac-signed-headers": EventMeta(EVENT_ID, "order.created", None),
}


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_extracts_id_type_and_time(case: Case) -> None:
    headers, body = signed(case)
    auth(case, headers, body)
    got = meta(case, headers, body)
    assert got == EXPECTED_META[case.name]
    assert isinstance(got, EventMeta)
    if got.occurred_at is not None:
        assert got.occurred_at.utcoffset() == timedelta(0)


@pytest.mark.parametrize("case", CASES, ids=ids)
@pytest.mark.parametrize(
    ("event_id", "reason"),
    [
        ("x" * 256, "bad_id"),
        ("evt 1", "bad_id"),
        ("evt\t1", "bad_id"),
        (" evt1", "bad_id"),
        ("évt1", "bad_id"),
        ("evt\x7f", "bad_id"),
    ],
    ids=["too-long", "space", "tab", "leading-space", "non-ascii", "del"],
)
def test_malformed_event_ids(case: Case, event_id: str, reason: str) -> None:
    headers, body = signed(case, event_id=event_id)
    auth(case, headers, body)
    assert malformed_reason(case, headers, body) == reason


@pytest.mark.parametrize("case", CASES, ids=ids)
@pytest.mark.parametrize("event_id", ["x" * 255, "a", "~!#$%&'()*+,-./:;<=>?@[]^_`{|}"])
def test_event_id_limits_that_pass(case: Case, event_id: str) -> None:
    headers, body = signed(case, event_id=event_id)
    auth(case, headers, body)
    assert meta(case, headers, body).event_id == event_id  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.provider not in ("standard", "svix")], ids=ids
)
def test_missing_event_id(case: Case) -> None:
    headers, body = signed(case, event_id="")
    auth(case, headers, body)
    assert malformed_reason(case, headers, body) == "missing_id"


@pytest.mark.parametrize("case", [c for c in CASES if c.name != "slack"], ids=ids)
def test_missing_event_type(case: Case) -> None:
    headers, body = signed(case, event_type="")
    auth(case, headers, body)
    assert malformed_reason(case, headers, body) == "missing_type"


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_overlong_event_type(case: Case) -> None:
    headers, body = signed(case, event_type="t" * 256)
    auth(case, headers, body)
    assert malformed_reason(case, headers, body) == "bad_type"


@pytest.mark.parametrize("case", BODY_PARSERS, ids=ids)
@pytest.mark.parametrize("raw", [b"not json", b"[1, 2]", b'"evt"', b"", b'{"id": '])
def test_body_that_is_not_a_json_object(case: Case, raw: bytes) -> None:
    headers, body = signed(case, raw_body=raw)
    auth(case, headers, body)
    assert malformed_reason(case, headers, body) == "bad_json"


@pytest.mark.parametrize("name", ["shopify", "hmac-headers"])
def test_header_only_schemes_never_parse_the_body(name: str) -> None:
    case = BY_NAME[name]
    headers, body = signed(case, raw_body=b"<?xml version='1.0'?><order/>")
    auth(case, headers, body)
    assert meta(case, headers, body).event_id == EVENT_ID  # type: ignore[union-attr]


BAD_TIMES: list[tuple[str, dict[str, Any]]] = [
    ("stripe", {"id": EVENT_ID, "type": "charge.succeeded", "created": "yesterday"}),
    ("stripe", {"id": EVENT_ID, "type": "charge.succeeded", "created": True}),
    ("stripe", {"id": EVENT_ID, "type": "charge.succeeded", "created": 10**20}),
    ("slack", {"type": "event_callback", "event_id": EVENT_ID, "event_time": "soon"}),
    ("standard", {"type": "invoice.paid", "timestamp": "not a date"}),
    ("standard", {"type": "invoice.paid", "timestamp": {"at": 1}}),
    ("svix", {"type": "user.created", "timestamp": "2024-13-01T00:00:00Z"}),
    ("hmac-timestamped", {"id": EVENT_ID, "type": "order.created", "meta": {"sent_at": "x"}}),
]


@pytest.mark.parametrize(("name", "body_obj"), BAD_TIMES)
def test_present_but_unparseable_time(name: str, body_obj: dict[str, Any]) -> None:
    case = BY_NAME[name]
    headers, body = signed(case, body_obj=body_obj)
    auth(case, headers, body)
    assert malformed_reason(case, headers, body) == "bad_time"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (TS, NOW),
        ("2026-05-01T12:00:00Z", NOW),
        ("2026-05-01T14:00:00+02:00", NOW),
        ("2026-05-01T12:00:00", NOW),
        ("2026-05-01T12:00:00.250Z", NOW + timedelta(milliseconds=250)),
        (None, None),
    ],
)
def test_standard_timestamp_forms(value: Any, expected: datetime | None) -> None:
    case = BY_NAME["standard"]
    body_obj: dict[str, Any] = {"type": "invoice.paid", "data": {}}
    if value is not None:
        body_obj["timestamp"] = value
    headers, body = signed(case, body_obj=body_obj)
    got = meta(case, headers, body)
    assert isinstance(got, EventMeta)
    assert got.occurred_at == expected
    if expected is not None:
        assert got.occurred_at is not None
        assert got.occurred_at.tzinfo is not None
        assert got.occurred_at.utcoffset() == timedelta(0)


@pytest.mark.parametrize(
    ("triggered", "expected"),
    [
        ("2026-05-01T12:00:00.127817898Z", NOW + timedelta(microseconds=127817)),
        ("2026-05-01T08:00:00-04:00", NOW),
        ("yesterday", None),
        ("", None),
        (None, None),
    ],
)
def test_shopify_triggered_at_is_informational(
    triggered: str | None, expected: datetime | None
) -> None:
    case = BY_NAME["shopify"]
    headers, body = signed(case)
    if triggered is None:
        del headers["x-shopify-triggered-at"]
    else:
        headers["x-shopify-triggered-at"] = triggered
    assert meta(case, headers, body) == EventMeta(
        EVENT_ID, "orders/create", expected, time_signed=False
    )


@pytest.mark.parametrize(
    ("event_type", "body_obj", "expected"),
    [
        ("push", {"ref": "refs/heads/main", "pusher": {}}, "push"),
        ("issues", {"action": "opened", "issue": {}}, "issues.opened"),
        ("issues", {"action": 3, "issue": {}}, "issues"),
        ("issues", {"action": "", "issue": {}}, "issues"),
        ("ping", {"zen": "Keep it logically awesome.", "hook_id": 1, "hook": {}}, "ping"),
        ("watch", {"action": "started"}, "watch.started"),  # no body names it: the header's
    ],
)
def test_github_type_appends_the_action(
    event_type: str, body_obj: dict[str, Any], expected: str
) -> None:
    case = BY_NAME["github"]
    headers, body = signed(case, event_type=event_type, body_obj=body_obj)
    assert meta(case, headers, body) == EventMeta(EVENT_ID, expected, None)


def test_github_form_encoded_payload() -> None:
    case = BY_NAME["github"]
    raw = b"payload=%7B%22action%22%3A%22closed%22%2C%22pull_request%22%3A%7B%7D%7D"
    headers, body = signed(case, event_type="pull_request", raw_body=raw)
    headers["content-type"] = "application/x-www-form-urlencoded"
    auth(case, headers, body)
    assert meta(case, headers, body) == EventMeta(EVENT_ID, "pull_request.closed", None)
    headers_no_payload, other = signed(case, event_type="push", raw_body=b"a=1")
    headers_no_payload["content-type"] = "application/x-www-form-urlencoded"
    assert malformed_reason(case, headers_no_payload, other) == "bad_json"


def test_slack_url_verification_is_answered_with_the_challenge() -> None:
    case = BY_NAME["slack"]
    challenge = "3eZbrw1aBm2rZgRNFdxV2595E9CY3gmdALWMmHkvFXO7tYXAYM8P"
    headers, body = signing.slack_url_verification(secret_for("slack"), challenge, timestamp=TS)
    lowered = signing.lower(headers)
    assert auth(case, lowered, body) == "s1"
    assert meta(case, lowered, body) == Challenge(challenge.encode(), "text/plain")


@pytest.mark.parametrize("challenge", [None, "", 42])
def test_slack_url_verification_without_a_challenge(challenge: Any) -> None:
    case = BY_NAME["slack"]
    body_obj: dict[str, Any] = {"type": "url_verification", "token": "x"}
    if challenge is not None:
        body_obj["challenge"] = challenge
    headers, body = signed(case, body_obj=body_obj)
    assert malformed_reason(case, headers, body) == "bad_challenge"


def test_slack_type_falls_back_to_the_top_level_type() -> None:
    case = BY_NAME["slack"]
    body_obj = {"type": "event_callback", "event_id": "Ev01", "event_time": TS}
    headers, body = signed(case, body_obj=body_obj)
    assert meta(case, headers, body) == EventMeta("Ev01", "event_callback", NOW)
    headers, body = signed(case, body_obj={"event_id": "Ev01", "event": {"text": "no type"}})
    assert malformed_reason(case, headers, body) == "missing_type"


def test_generic_hmac_id_comes_from_the_signed_body_by_default() -> None:
    # Issue 11, finding 3: an unsigned x-webhook-id header no longer names the event.
    case = BY_NAME["hmac"]
    body_obj = {"id": "body_1", "type": "order.created"}
    headers, body = signed(case, event_id="body_1", body_obj=body_obj)
    for forged in ("hdr_1", "hdr_2"):
        replayed = {**headers, "x-webhook-id": forged}
        auth(case, replayed, body)  # still a valid signature: the header is not signed
        assert meta(case, replayed, body).event_id == "body_1"  # type: ignore[union-attr]


def test_generic_hmac_unsigned_id_header_only_when_asked_for() -> None:
    case = Case(
        "unsigned-id",
        "hmac",
        "x-signature",
        config={"id_header": "x-webhook-id", "id_from_unsigned_header": "true"},
    )
    body_obj = {"id": "body_1", "type": "order.created"}
    headers, body = signed(case, event_id="hdr_1", body_obj=body_obj)
    assert meta(case, headers, body).event_id == "hdr_1"  # type: ignore[union-attr]
    del headers["x-webhook-id"]
    assert meta(case, headers, body).event_id == "body_1"  # type: ignore[union-attr]


def test_generic_hmac_a_signed_id_header_cannot_be_changed() -> None:
    case = BY_NAME["hmac-signed-headers"]
    headers, body = signed(case, event_id="req_1")
    auth(case, headers, body)
    assert meta(case, headers, body).event_id == "req_1"  # type: ignore[union-attr]
    assert auth_reason(case, {**headers, "x-request-id": "req_2"}, body) == "bad_signature"
    del headers["x-request-id"]
    assert auth_reason(case, headers, body) == "missing_header"


def test_generic_hmac_signed_content_template_is_signed_as_written() -> None:
    template = "v1:{{literal}}:{header:X-Webhook-Id}:{body}"
    case = Case(
        "template",
        "hmac",
        "x-signature",
        config={"signed_content": template, "id_header": "x-webhook-id"},
    )
    headers, body = signed(case, event_id="e_1")
    expected = b"v1:{literal}:e_1:" + body
    assert signing.render_signed_content(template, headers, body) == expected
    key = secret_for("hmac").encode()
    assert headers["x-signature"] == hmac.new(key, expected, hashlib.sha256).hexdigest()
    assert auth(case, headers, body) == "s1"


def test_generic_hmac_numeric_body_id_and_nested_fields() -> None:
    case = Case(
        "nested",
        "hmac",
        "x-signature",
        config={"id_header": None, "id_field": "event.id", "type_field": "event.kind"},
    )
    body_obj = {"event": {"id": 12345, "kind": "paid"}}
    headers, body = signed(case, body_obj=body_obj)
    auth(case, headers, body)
    assert meta(case, headers, body) == EventMeta("12345", "paid", None)
    headers, body = signed(case, body_obj={"event": "flat"})
    assert malformed_reason(case, headers, body) == "missing_id"


def test_unknown_provider_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="unknown provider"):
        authenticate("paypal", {}, b"", [("a", "b")], config={}, now=NOW, tolerance=None)
    with pytest.raises(ValueError, match="unknown provider"):
        extract("paypal", {}, b"", config={})
    with pytest.raises(ValueError, match="unknown provider"):
        default_tolerance("paypal")
    with pytest.raises(ValueError, match="unknown provider"):
        validate_config("paypal", {})


# --- validate_config -------------------------------------------------------------------------

# The documented defaults, as the test signer states them (tests/signing.py).
HMAC_DEFAULTS = signing.HMAC_DEFAULTS


def test_generic_hmac_defaults_are_filled_in() -> None:
    assert validate_config("hmac", {}) == HMAC_DEFAULTS


def test_generic_hmac_options_are_normalised_and_idempotent() -> None:
    got = validate_config(
        "hmac",
        {
            "signature_header": " X-Sig ",
            "algorithm": "SHA512",
            "encoding": "Base64",
            "prefix": "sha512=",
            "timestamp_header": "X-Timestamp",
            "type_header": "",
        },
    )
    assert got == {
        **HMAC_DEFAULTS,
        "signature_header": "x-sig",
        "algorithm": "sha512",
        "encoding": "base64",
        "prefix": "sha512=",
        "timestamp_header": "x-timestamp",
    }
    assert validate_config("hmac", got) == got


@pytest.mark.parametrize(
    ("config", "names"),
    [
        ({"algo": "sha256"}, "'algo'"),
        ({"algorithm": "md5"}, "'algorithm'"),
        ({"encoding": "base32"}, "'encoding'"),
        ({"signature_header": ""}, "'signature_header'"),
        ({"signature_header": None}, "'signature_header'"),
        ({"timestamp_header": "X Timestamp"}, "'timestamp_header'"),
        ({"id_field": "a..b"}, "'id_field'"),
        ({"prefix": 5}, "'prefix'"),
        ({"time_field": ["x"]}, "'time_field'"),
        ({"id_header": None, "id_field": None}, "'id_header' and 'id_field'"),
        ({"type_header": None, "type_field": None}, "'type_header' and 'type_field'"),
        ({"id_header": "x-webhook-id"}, "'id_header' .x-webhook-id. is not signed"),
        ({"id_from_unsigned_header": "true"}, "needs an 'id_header'"),
        ({"id_from_unsigned_header": "maybe"}, "'id_from_unsigned_header' must be true or"),
        ({"signed_content": "{header:x-id}"}, "{body} exactly once"),
        ({"signed_content": "{body}.{body}"}, "{body} exactly once"),
        ({"signed_content": "{id}.{body}"}, "placeholder {id} is unknown"),
        ({"signed_content": "{header:bad name}.{body}"}, "not a header name"),
        ({"signed_content": "x}{body}"}, "lone '}'"),
        ({"signed_content": "{" + "x" * 600 + "}{body}"}, "longer than 512"),
        (
            {"timestamp_header": "x-ts", "signed_content": "{body}"},
            "must sign the timestamp header",
        ),
    ],
)
def test_generic_hmac_bad_options_are_named(config: dict[str, Any], names: str) -> None:
    with pytest.raises(ValueError, match=names):
        validate_config("hmac", config)


def test_generic_hmac_bad_options_fail_at_authentication_too() -> None:
    with pytest.raises(ValueError, match="'algorithm'"):
        authenticate(
            "hmac",
            {"x-signature": "00"},
            b"{}",
            [("a", "b")],
            config={"algorithm": "md5"},
            now=NOW,
            tolerance=None,
        )


# GitHub takes hook_event (tests/test_providers_edges.py).
@pytest.mark.parametrize("provider", [p for p in CLASSIC if p not in ("hmac", "github")])
def test_named_providers_take_no_options(provider: str) -> None:
    assert validate_config(provider, {}) == {}
    with pytest.raises(ValueError, match=f"{provider!r}: takes no options"):
        validate_config(provider, {"algorithm": "sha256"})


def test_config_must_be_a_mapping() -> None:
    with pytest.raises(ValueError, match="mapping"):
        validate_config("hmac", ["algorithm"])  # type: ignore[arg-type]


def test_hmac_signer_matches_the_documented_scheme() -> None:
    # The test-side signer itself, checked once by hand so the generic cases mean something.
    headers, body = signing.sign_hmac("k", event_id="e", timestamp=TS)
    assert headers["X-Signature"] == hmac.new(b"k", body, hashlib.sha256).hexdigest()
    headers, body = signing.sign_hmac(
        "k", event_id="e", timestamp=TS, config=BY_NAME["hmac-timestamped"].config
    )
    digest = hmac.new(b"k", f"{TS}.".encode() + body, hashlib.sha512).digest()
    assert headers["X-Hub-Sig"] == "sha512=" + base64.b64encode(digest).decode()
    assert headers["X-Timestamp"] == str(TS)


def test_generic_hmac_id_path_is_another_name_for_id_field() -> None:
    got = validate_config("hmac", {"id_path": "event.id"})
    assert got["id_field"] == "event.id"
    assert "id_path" not in got
    assert validate_config("hmac", got) == got
    with pytest.raises(ValueError, match="'id_path' and 'id_field' are the same"):
        validate_config("hmac", {"id_path": "a", "id_field": "b"})
