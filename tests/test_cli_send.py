"""``webhooks send`` (issue 20 item 1): a signed test event for every built-in provider with a
shared secret, checked against the providers' official libraries and through a real receiver.
"""

from __future__ import annotations

import base64
import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core.providers import Batch, EventMeta, authenticate, extract, sending
from core.settings import Settings
from tests.conftest import BIN, free_port, test_env
from tests.factories import MadeSource, make_source
from tests.leakcheck import remember
from tests.processes import Receiver, receiver
from tests.signing import MORE_CONFIGS, lower, new_secret

SHARED = sorted(sending.SIGNERS)
NOW = int(time.time())


def webhooks(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "webhooks"), *args],
        env=test_env(**env),
        capture_output=True,
        text=True,
        timeout=90,
    )


def _secret(provider: str) -> str:
    return (
        "whsec_" + base64.b64encode(b"g" * 32).decode()
        if provider == "gitlab"
        else (new_secret(provider))
    )


def _config(provider: str) -> dict[str, Any]:
    return dict(MORE_CONFIGS.get(provider, {}))


def test_every_built_in_provider_is_covered_or_says_why() -> None:
    from core.providers import BUILTIN_PROVIDERS

    assert set(BUILTIN_PROVIDERS) == set(sending.SIGNERS) | set(sending.PUBLIC_KEY)
    assert set(sending.PUBLIC_KEY) == {"sendgrid", "discord"}


@pytest.mark.parametrize("provider", SHARED)
def test_the_signature_verifies_as_the_receiver_checks_it(provider: str) -> None:
    secret = _secret(provider)
    headers, body = sending.sign(
        provider, secret, event_id="evt_1", timestamp=NOW, config=_config(provider)
    )
    found = authenticate(
        provider,
        lower(headers),
        body,
        [("sec_other", new_secret(provider)), ("sec_1", secret)],
        config=_config(provider),
        now=datetime.fromtimestamp(NOW, UTC),
        tolerance=None,
    )
    assert found == "sec_1"
    meta = extract(provider, lower(headers), body, config=_config(provider))
    assert isinstance(meta, EventMeta | Batch)
    kind = meta.event_type if isinstance(meta, EventMeta) else meta.events[0].event_type
    assert sending.DEFAULT_TYPES[provider] in kind or provider == "twilio"


def test_official_libraries_accept_what_send_signs() -> None:
    """The senders' own libraries verify these requests (not only our receiver)."""
    import slack_sdk.signature
    import standardwebhooks
    import stripe
    import svix.webhooks
    from twilio.request_validator import RequestValidator

    when = datetime.fromtimestamp(NOW, UTC)
    secret = new_secret("stripe")
    headers, body = sending.sign("stripe", secret, event_id="evt_s", timestamp=NOW)
    stripe.WebhookSignature.verify_header(
        body.decode(), headers["Stripe-Signature"], secret, tolerance=None
    )
    for provider in ("standard", "svix", "resend", "clerk"):
        secret = new_secret(provider)
        headers, body = sending.sign(provider, secret, event_id="msg_1", timestamp=NOW)
        lib: Any = standardwebhooks.Webhook if provider == "standard" else svix.webhooks.Webhook
        prefix = "webhook" if provider == "standard" else "svix"
        signature = lib(secret).sign("msg_1", when, body.decode())
        assert headers[f"{prefix}-signature"] == signature
    secret = new_secret("slack")
    headers, body = sending.sign("slack", secret, event_id="Ev1", timestamp=NOW)
    verifier = slack_sdk.signature.SignatureVerifier(secret)
    assert (
        verifier.generate_signature(timestamp=str(NOW), body=body) == headers["X-Slack-Signature"]
    )
    secret, config = new_secret("twilio"), MORE_CONFIGS["twilio"]
    headers, body = sending.sign("twilio", secret, event_id="SM1", timestamp=NOW, config=config)
    from urllib.parse import parse_qsl

    params = dict(parse_qsl(body.decode()))
    assert RequestValidator(secret).validate(
        config["public_url"], params, headers["X-Twilio-Signature"]
    )
    from Adyen.util import is_valid_hmac_notification

    key = new_secret("adyen")
    _, body = sending.sign("adyen", key, event_id="PSP1", timestamp=NOW)
    item = json.loads(body)["notificationItems"][0]["NotificationRequestItem"]
    assert is_valid_hmac_notification(item, key)


def test_public_key_providers_and_bad_options_say_so_in_one_line() -> None:
    for provider in ("sendgrid", "discord"):
        with pytest.raises(sending.CannotSign, match="private key"):
            sending.sign(provider, "k", event_id="e", timestamp=NOW)
    with pytest.raises(sending.CannotSign, match="public_url"):
        sending.sign("square", "s" * 20, event_id="e", timestamp=NOW, config={})


@pytest.fixture(scope="module")
def live() -> Iterator[Receiver]:
    with receiver() as r:
        yield r


def _receipts(engine: Engine, source: MadeSource) -> list[tuple[str, str]]:
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT event_id, event_type FROM receipts WHERE source_id = :s ORDER BY id"),
            {"s": source.id},
        ).all()
    return [(r[0], r[1]) for r in rows]


@pytest.mark.parametrize("provider", SHARED)
def test_send_reaches_a_real_receiver_for_each_provider(
    provider: str,
    live: Receiver,
    engine: Engine,
    sessions: sessionmaker[Session],
    settings: Settings,
) -> None:
    source = make_source(
        sessions, settings, provider=provider, secret=_secret(provider), config=_config(provider)
    )
    remember(source.secret)
    the_id = f"evt_{uuid.uuid4().hex[:10]}"
    sent = webhooks("send", source.public_id, "--id", the_id, "--url", live.url)
    assert sent.returncode == 0, sent.stderr
    assert " -> 202 " in sent.stdout, sent.stdout
    assert source.secret not in sent.stdout + sent.stderr
    stored = _receipts(engine, source)
    assert len(stored) == 1
    assert stored[0][0] in sent.stdout  # the id printed is the id the receiver stored


def test_send_type_data_count_and_the_answer(
    live: Receiver, engine: Engine, sessions: sessionmaker[Session], settings: Settings,
    tmp_path: Path,
) -> None:  # fmt: skip
    source = make_source(sessions, settings, provider="stripe")
    data = tmp_path / "invoice.json"
    data.write_text(json.dumps({"id": "in_42", "object": "invoice", "amount_due": 4200}))
    sent = webhooks(
        "send", source.name, "--type", "invoice.created", "--data", f"@{data}",
        "--id", "evt_many", "--count", "3", "--url", live.url,
    )  # fmt: skip
    assert sent.returncode == 0, sent.stderr
    assert _receipts(engine, source) == [(f"evt_many-{n}", "invoice.created") for n in (1, 2, 3)]
    again = webhooks("send", source.public_id, "--id", "evt_many-1", "--url", live.url)
    assert again.returncode == 0
    # The same id with another body (the default data): the receiver's answer is printed.
    assert '"status":"conflict"' in again.stdout.replace(" ", "")
    with engine.connect() as conn:
        payload = conn.execute(
            text("SELECT payload FROM receipts WHERE source_id = :s LIMIT 1"), {"s": source.id}
        ).scalar_one()
    assert json.loads(bytes(payload))["data"]["object"]["amount_due"] == 4200


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--data", "{not json"], "--data is not JSON"),
        (["--data", "@/nonexistent/file.json"], "cannot read the file"),
        (["--count", "0"], "--count must be from 1"),
        (["--url", "localhost:8000"], "give an http(s) URL"),
    ],
)
def test_bad_input_gets_one_line_and_sends_nothing(
    args: list[str], message: str, engine: Engine, sessions: sessionmaker[Session],
    settings: Settings,
) -> None:  # fmt: skip
    source = make_source(sessions, settings, provider="github")
    result = webhooks("send", source.public_id, *args)
    assert result.returncode == 1
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert _receipts(engine, source) == []


def test_public_key_source_no_receiver_and_unknown_source(
    sessions: sessionmaker[Session], settings: Settings
) -> None:
    from tests.signing import new_key

    sendgrid = make_source(sessions, settings, provider="sendgrid", secret=new_key("sendgrid"))
    for ref, url, message in (
        (sendgrid.public_id, None, "SendGrid signs with its own private key"),
        ("no-such-source", None, "no such source"),
        (
            make_source(sessions, settings, provider="github").public_id,
            f"http://127.0.0.1:{free_port()}",
            "no receiver at",
        ),
    ):
        result = webhooks("send", ref, *(["--url", url] if url else []))
        assert result.returncode == 1, result.stdout
        assert message in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert "Traceback" not in result.stderr


def test_follow_waits_for_the_deliveries_and_shows_them(
    sessions: sessionmaker[Session], settings: Settings, tmp_path: Path
) -> None:
    from tests.workers import BROKER_URL, CLAIMS_URL, running_worker

    source = make_source(sessions, settings, provider="standard", routes=[{"handler": "log"}])
    with (
        receiver(WEBHOOKS_BROKER_URL=BROKER_URL, WEBHOOKS_REDIS_URL=CLAIMS_URL) as rcv,
        running_worker("send-follow", tmp_path),
    ):
        sent = webhooks(
            "send", source.public_id, "--id", "evt_follow", "--url", rcv.url, "--follow",
            "--timeout", "60",
        )  # fmt: skip
    assert sent.returncode == 0, sent.stderr
    assert "evt_follow -> 202" in sent.stdout
    assert "(log) succeeded, 1 attempt" in sent.stdout


def test_follow_without_a_route_says_so_at_once_and_fails(
    sessions: sessionmaker[Session], settings: Settings
) -> None:
    """Acknowledged with no delivery: none will ever come (the accept writes both in one
    transaction), so --follow says why at once and exits 1; it waited its whole --timeout
    and exited 0 before (a --timeout past this run's own 90 s limit shows the difference)."""
    source = make_source(sessions, settings, provider="standard", routes=[])
    with receiver() as rcv:
        sent = webhooks(
            "send", source.public_id, "--id", "evt_no_route", "--url", rcv.url, "--follow",
            "--timeout", "600",
        )  # fmt: skip
    assert sent.returncode == 1, sent.stdout
    assert "evt_no_route -> 202" in sent.stdout
    assert (
        f"error: no delivery for evt_no_route: no active route of {source.public_id} takes it"
        in sent.stderr
    )
    assert "Traceback" not in sent.stderr


def test_follow_that_runs_out_of_time_shows_what_is_left_and_fails(
    sessions: sessionmaker[Session], settings: Settings
) -> None:
    """No worker: the delivery stays pending past --timeout; --follow shows it, names it as
    unfinished and exits 1 (a script waiting on --follow must not read that as done)."""
    source = make_source(sessions, settings, provider="standard", routes=[{"handler": "log"}])
    with receiver() as rcv:
        sent = webhooks(
            "send", source.public_id, "--id", "evt_left", "--url", rcv.url, "--follow",
            "--timeout", "1",
        )  # fmt: skip
    assert sent.returncode == 1, sent.stdout
    assert "(log) pending" in sent.stdout
    assert "error: still waiting after 1s: deliveries " in sent.stderr
    assert "unfinished (webhooks deliveries show ID)" in sent.stderr
