"""Issue 34, item 6: event types only from signed parts by default.

The live probe repeated: a signed GitHub body re-sent with another ``X-GitHub-Event`` (and a
WooCommerce action body under another topic) is refused, nothing written; where the body does
not name the type (Shopify's topic, a WooCommerce resource topic, a GitHub event no body
identifies) the header's type is kept but shown as unsigned by ``webhooks events show`` and
the console; ``webhooks routes add`` warns for a route on such a type. Through a real
receiver (``webhooks serve``, its admin port for the console), real Postgres, the real CLI.
"""

from __future__ import annotations

import html
import json
import re
import secrets as pysecrets
import subprocess
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from core.providers import MalformedEvent, extract, registry, validate_config
from core.settings import Settings
from models import route_catalog
from models.schema import Source
from tests import signing
from tests.conftest import BIN, test_env
from tests.factories import MadeSource, make_source
from tests.leakcheck import remember
from tests.operators_support import console_login
from tests.processes import Receiver, receiver
from tests.provider_specs import post, receipts, written

CONSOLE_TOKEN = "adm_types_" + pysecrets.token_urlsafe(24)
remember(CONSOLE_TOKEN)


@pytest.fixture(scope="module")
def rcv() -> Iterator[Receiver]:
    with receiver(WEBHOOKS_ADMIN_TOKENS=f"vera:{CONSOLE_TOKEN}") as running:
        yield running


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30) as c:
        yield c


def secret() -> str:
    value = "s" + pysecrets.token_hex(16)
    remember(value)
    return value


def source_for(
    sessions: sessionmaker[Session],
    settings: Settings,
    provider: str,
    key: str,
    config: dict[str, Any] | None = None,
) -> MadeSource:
    return make_source(sessions, settings, provider=provider, secret=key, config=config)


def webhooks(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "webhooks"), *args], env=test_env(), capture_output=True, text=True, timeout=60
    )


def shown(event_id: str, source: MadeSource) -> str:
    """`webhooks events show`'s type line."""
    text = webhooks("events", "show", event_id, "--source", source.public_id)
    assert text.returncode == 0, text.stderr
    [line] = [x for x in text.stdout.splitlines() if x.startswith("type:")]
    return " ".join(line.split())


def shown_json(event_id: str, source: MadeSource) -> dict[str, Any]:
    as_json = webhooks("events", "show", event_id, "--source", source.public_id, "--json")
    assert as_json.returncode == 0, as_json.stderr
    found: dict[str, Any] = json.loads(as_json.stdout)
    return found


def refused(response: httpx.Response) -> None:
    assert response.status_code == 400, response.text
    assert response.json() == {"error": "malformed event: bad_type"}


# --- GitHub: the probe -----------------------------------------------------------------------


def test_a_signed_github_body_resent_as_release_is_refused_and_writes_nothing(
    rcv: Receiver,
    client: httpx.Client,
    sessions: sessionmaker[Session],
    settings: Settings,
    engine: Engine,
) -> None:
    key = secret()
    source = source_for(sessions, settings, "github", key)
    headers, body = signing.sign_github(key, event_id="gh-1", event_type="pull_request.opened")
    first = post(client, rcv, source, headers, body)
    assert first.status_code == 202, first.text
    # The probe: the same signed body, a new delivery id, X-GitHub-Event: release.
    for named in ("release", "issues", "ping"):
        probe = {**headers, "X-GitHub-Delivery": f"gh-forged-{named}", "X-GitHub-Event": named}
        refused(post(client, rcv, source, probe, body))
    assert [(r[0], r[1]) for r in receipts(engine, source)] == [("gh-1", "pull_request.opened")]
    assert written(engine, source) == 1
    # The genuine type is signed: shown without a mark.
    assert shown("gh-1", source) == "type: pull_request.opened"
    assert shown_json("gh-1", source)["type_unsigned"] is None


def test_a_github_event_no_body_identifies_keeps_the_header_and_is_shown_unsigned(
    rcv: Receiver,
    client: httpx.Client,
    sessions: sessionmaker[Session],
    settings: Settings,
    engine: Engine,
) -> None:
    key = secret()
    source = source_for(sessions, settings, "github", key)
    headers, body = signing.sign_github(key, event_id="gh-w", event_type="watch.started")
    answer = post(client, rcv, source, headers, body)
    assert answer.status_code == 202, answer.text
    assert [(r[0], r[1]) for r in receipts(engine, source)] == [("gh-w", "watch.started")]
    as_json = shown_json("gh-w", source)
    assert as_json["type_unsigned"] == "X-GitHub-Event"
    assert as_json["event_type"] == "watch.started"
    # And the console's event page marks it.
    page = console_event(rcv, receipt_of(as_json))
    assert 'id="type-unsigned"' in page
    assert "read from X-GitHub-Event, outside the signature" in text_of(page)


def test_type_from_header_opts_out_and_takes_the_forged_header_marked_unsigned(
    rcv: Receiver,
    client: httpx.Client,
    sessions: sessionmaker[Session],
    settings: Settings,
    engine: Engine,
) -> None:
    """The documented opt-out: the header as sent (the risk the docs name), shown unsigned."""
    key = secret()
    source = source_for(sessions, settings, "github", key, {"type_from": "header"})
    headers, body = signing.sign_github(key, event_id="gh-2", event_type="pull_request.opened")
    probe = {**headers, "X-GitHub-Event": "release"}
    answer = post(client, rcv, source, probe, body)
    assert answer.status_code == 202, answer.text
    assert [(r[0], r[1]) for r in receipts(engine, source)] == [("gh-2", "release.opened")]
    assert shown("gh-2", source) == (
        "type: release.opened (unsigned: read from X-GitHub-Event, outside the signature)"
    )


def test_github_options_are_checked() -> None:
    assert validate_config("github", {"type_from": " Body "}) == {}
    assert validate_config("github", {"type_from": "header"}) == {"type_from": "header"}
    with pytest.raises(ValueError, match="'type_from' must be body"):
        validate_config("github", {"type_from": "headers"})
    with pytest.raises(ValueError, match="cannot be combined with type_from=header"):
        validate_config("github", {"hook_event": "issues", "type_from": "header"})


def test_every_event_of_the_github_table_is_known_from_its_own_body() -> None:
    """Each event's body, with the keys GitHub's schema requires, is taken under its header and
    refused under any other event of the table (the order of BODY_KEYS decides ties)."""
    from core.providers import github

    names = [name for name, _ in github.BODY_KEYS]
    for name, keys in github.BODY_KEYS:
        body = json.dumps({"action": "x", **{k: {} for k in keys}}).encode()
        headers = {"x-github-delivery": "d", "x-github-event": name}
        assert extract("github", headers, body, config={}).event_type == f"{name}.x"  # type: ignore[union-attr]
        other = names[(names.index(name) + 1) % len(names)]
        with pytest.raises(MalformedEvent, match="bad_type"):
            extract("github", {**headers, "x-github-event": other}, body, config={})


# --- WooCommerce -----------------------------------------------------------------------------


def woo_action(key: str, event_id: str, topic: str) -> tuple[dict[str, str], bytes]:
    """A custom action's delivery as WooCommerce builds it (class-wc-webhook.php)."""
    return signing.sign_woocommerce(
        key,
        event_id=event_id,
        event_type=topic,
        raw_body=b'{"action":"woocommerce_add_to_cart","arg":5}',
    )


def test_woocommerce_action_topics_come_from_the_signed_body(
    rcv: Receiver,
    client: httpx.Client,
    sessions: sessionmaker[Session],
    settings: Settings,
    engine: Engine,
) -> None:
    key = secret()
    source = source_for(sessions, settings, "woocommerce", key)
    headers, body = woo_action(key, "wc-1", "action.woocommerce_add_to_cart")
    answer = post(client, rcv, source, headers, body)
    assert answer.status_code == 202, answer.text
    # The action's body re-sent under a resource topic or another action: refused.
    for n, topic in enumerate(("order.created", "action.woocommerce_checkout")):
        probe = {**headers, "X-WC-Webhook-Delivery-ID": f"wc-f{n}", "X-WC-Webhook-Topic": topic}
        refused(post(client, rcv, source, probe, body))
    # A resource's body under an action topic: refused too.
    order_headers, order = signing.sign_woocommerce(
        key, event_id="wc-o", event_type="order.created"
    )
    refused(post(client, rcv, source, {**order_headers, "X-WC-Webhook-Topic": "action.x"}, order))
    assert [(r[0], r[1]) for r in receipts(engine, source)] == [
        ("wc-1", "action.woocommerce_add_to_cart")
    ]
    assert shown("wc-1", source) == "type: action.woocommerce_add_to_cart"


def test_a_woocommerce_resource_topic_is_the_header_shown_unsigned(
    rcv: Receiver,
    client: httpx.Client,
    sessions: sessionmaker[Session],
    settings: Settings,
    engine: Engine,
) -> None:
    key = secret()
    source = source_for(sessions, settings, "woocommerce", key)
    headers, body = signing.sign_woocommerce(key, event_id="wc-r", event_type="order.created")
    probe = {**headers, "X-WC-Webhook-Topic": "order.updated"}  # nothing signed says otherwise
    answer = post(client, rcv, source, probe, body)
    assert answer.status_code == 202, answer.text
    assert shown("wc-r", source) == (
        "type: order.updated (unsigned: read from X-WC-Webhook-Topic, outside the signature)"
    )
    # Opted out (type_from=header): even an action's body takes any topic, unchecked.
    opted = source_for(sessions, settings, "woocommerce", key, {"type_from": "header"})
    headers, body = woo_action(key, "wc-h", "order.created")
    answer = post(client, rcv, opted, headers, body)
    assert answer.status_code == 202, answer.text
    assert [(r[0], r[1]) for r in receipts(engine, opted)] == [("wc-h", "order.created")]


# --- Shopify ---------------------------------------------------------------------------------


def test_a_shopify_topic_is_always_the_header_shown_unsigned(
    rcv: Receiver,
    client: httpx.Client,
    sessions: sessionmaker[Session],
    settings: Settings,
    engine: Engine,
) -> None:
    """Shopify's body never names its topic: the re-sent topic cannot be refused, only shown."""
    key = secret()
    source = source_for(sessions, settings, "shopify", key)
    headers, body = signing.sign_shopify(key, event_id="sh-1", event_type="orders/create")
    probe = {**headers, "X-Shopify-Topic": "orders/paid"}
    answer = post(client, rcv, source, probe, body)
    assert answer.status_code == 202, answer.text
    assert shown("sh-1", source) == (
        "type: orders/paid (unsigned: read from X-Shopify-Topic, outside the signature)"
    )
    page = console_event(rcv, receipt_id(engine, source, "sh-1"))
    assert "read from X-Shopify-Topic, outside the signature" in text_of(page)


# --- routes add ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("provider", "config", "events", "header"),
    [
        ("github", {}, "watch.*", "X-GitHub-Event"),
        ("github", {}, "*.opened", "X-GitHub-Event"),
        ("github", {}, "issues.*", None),
        ("github", {}, "*", None),
        ("github", {"type_from": "header"}, "issues.*", "X-GitHub-Event"),
        ("github", {"hook_event": "watch"}, "watch.*", None),
        ("shopify", {}, "orders/paid", "X-Shopify-Topic"),
        ("woocommerce", {}, "order.created", "X-WC-Webhook-Topic"),
        ("woocommerce", {}, "action.*", None),
        ("woocommerce", {"type_from": "header"}, "action.*", "X-WC-Webhook-Topic"),
        ("bitbucket", {}, "repo:push", "X-Event-Key"),
        ("bitbucket", {"type_from_body": True}, "repo:push", None),
        ("gitlab", {}, "Push Hook", "X-Gitlab-Event"),
        ("stripe", {}, "invoice.paid", None),
    ],
    ids=[
        "github-watch",
        "github-any-opened",
        "github-issues",
        "github-all",
        "github-header-issues",
        "github-hook-event",
        "shopify-topic",
        "woocommerce-resource",
        "woocommerce-action",
        "woocommerce-header-action",
        "bitbucket",
        "bitbucket-body",
        "gitlab",
        "stripe",
    ],
)
def test_a_route_on_a_type_only_an_unsigned_header_carries_is_flagged(
    provider: str, config: dict[str, Any], events: str, header: str | None
) -> None:
    warning = route_catalog.unsigned_type_warning(Source(provider=provider, config=config), events)
    if header is None:
        assert warning is None
        return
    assert warning is not None
    assert f"{provider} event types matching {events!r} are read from {header}, " in warning
    assert "which the signature does not cover" in warning


def test_routes_add_prints_the_warning_and_adds_the_route(
    sessions: sessionmaker[Session], settings: Settings
) -> None:
    github = make_source(sessions, settings, provider="github", routes=[])
    added = webhooks("routes", "add", github.public_id, "--handler", "log", "--events", "watch.*")
    assert added.returncode == 0, added.stderr
    assert "log for watch.*" in added.stdout  # added, not refused
    [warning] = [x for x in added.stderr.splitlines() if x.startswith("warning:")]
    assert "are read from X-GitHub-Event, which the signature does not cover" in warning
    signed = webhooks("routes", "add", github.public_id, "--handler", "log", "--events", "issues.*")
    assert signed.returncode == 0, signed.stderr
    assert "warning" not in signed.stderr
    shopify = make_source(sessions, settings, provider="shopify", routes=[])
    as_json = webhooks(
        "routes", "add", shopify.public_id, "--handler", "log", "--events", "orders/paid", "--json"
    )
    assert as_json.returncode == 0, as_json.stderr
    view = json.loads(as_json.stdout)
    assert view["events"] == "orders/paid"
    assert "are read from X-Shopify-Topic" in view["warning"]
    with sessions() as s:
        assert [r.events_glob for r in route_catalog.list_routes(s, s.get(Source, github.id))] == [
            "watch.*",
            "issues.*",
        ]


def test_every_provider_answers_where_its_unsigned_types_come_from() -> None:
    """Every provider whose type is not signed names where it comes from, and no other."""
    for name in registry.names():
        found = registry.get(name)
        typed = found.signed_fields({}).get("type", "")
        where = found.unsigned_type({}, "some.type")
        assert (where is not None) == typed.startswith("unsigned") or name in (
            "github",
            "woocommerce",
        ), name


# --- helpers ---------------------------------------------------------------------------------


def receipt_of(as_json: dict[str, Any]) -> int:
    return int(as_json["id"])


def receipt_id(engine: Engine, source: MadeSource, event_id: str) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                text("SELECT id FROM receipts WHERE source_id = :s AND event_id = :e"),
                {"s": source.id, "e": event_id},
            ).scalar_one()
        )


def console_event(rcv: Receiver, receipt: int) -> str:
    with httpx.Client(timeout=30) as http:
        login = console_login(http, rcv.admin_url, CONSOLE_TOKEN)
        assert login.status_code in (302, 303), login.status_code
        page = http.get(f"{rcv.admin_url}/console/events/{receipt}")
        assert page.status_code == 200, page.status_code
        return page.text


def text_of(page: str) -> str:
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", page)).split())
