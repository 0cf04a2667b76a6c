"""The admin HTTP API as deployed: under /admin on the admin address of the real receiver
(``webhooks serve``), over real HTTP. Replays processed by a real worker are in
test_operators_e2e.py; the admin plane's guard (token before body, caps, names) in
test_admin_plane.py."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import httpx
import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from core.settings import Settings
from ingest.admin import create_admin_app
from models import replays
from tests.factories import make_source
from tests.leakcheck import remember
from tests.operators_support import (
    accept,
    kill,
    ops_receiver,
    ops_settings,
    queue_length,
    replay_rows,
    source_with,
    status_of,
    succeed,
)
from tests.processes import Receiver

pytestmark = pytest.mark.timeout(120)

TOKEN = "adm_" + secrets.token_urlsafe(24)
remember(TOKEN)


@pytest.fixture(scope="module")
def api() -> Iterator[Receiver]:
    with ops_receiver(TOKEN) as running:
        yield running


def _get(api: Receiver, path: str, token: str | None = TOKEN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    return httpx.get(f"{api.admin_url}/admin{path}", headers=headers, timeout=10)


def _post(api: Receiver, path: str, body: object, token: str | None = TOKEN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    return httpx.post(f"{api.admin_url}/admin{path}", json=body, headers=headers, timeout=10)


def test_missing_or_wrong_token_is_401_and_the_right_one_is_served(
    api: Receiver, ops: Settings, sessions: sessionmaker[Session]
) -> None:
    source = source_with(sessions, ops)
    accept(ops, source)
    missing = _get(api, "/events", token=None)
    assert missing.status_code == 401
    assert missing.headers["www-authenticate"] == "Bearer"
    wrong = _get(api, "/events", token=TOKEN + "x")
    assert wrong.status_code == 401
    not_bearer = httpx.get(
        f"{api.admin_url}/admin/events", headers={"Authorization": f"Basic {TOKEN}"}
    )
    assert not_bearer.status_code == 401
    for path in ("/dead", "/replays", "/events/1", "/replays/1"):
        assert _get(api, path, token="nope").status_code == 401
    assert _post(api, "/replays", {"reason": "b", "ids": [1]}, None).status_code == 401

    right = _get(api, f"/events?source={source.public_id}")
    assert right.status_code == 200
    [event] = right.json()
    assert event["source"] == source.public_id
    assert event["deliveries"] == {"pending": 1}


def test_the_api_is_off_when_no_token_is_configured(ops: Settings) -> None:
    with ops_receiver(None) as off:
        for path in ("/events", "/dead", "/replays", "/openapi.json", "/docs"):
            response = httpx.get(
                f"{off.admin_url}/admin{path}", headers={"Authorization": f"Bearer {TOKEN}"}
            )
            assert response.status_code == 404, path
        posted = httpx.post(
            f"{off.admin_url}/admin/replays",
            json={"reason": "b", "ids": [1]},
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        assert posted.status_code == 404
        # The receiver itself is unaffected.
        assert httpx.get(f"{off.url}/healthz").status_code == 200
        # /metrics is not the API: it still answers, without a token.
        assert httpx.get(f"{off.admin_url}/metrics").status_code == 200
    # docker-compose passes an unset token as an empty string: also off, nothing routed.
    for empty in ("", None):
        assert [r.path for r in create_admin_app(ops_settings(admin_token=empty)).app.routes] == [
            "/metrics"
        ]
    on = create_admin_app(ops_settings(admin_token=TOKEN)).app.routes
    assert [r.path for r in on] == ["/metrics", "/admin", "/console"]


def test_the_openapi_schema_documents_every_route_and_the_bearer_scheme(api: Receiver) -> None:
    schema = _get(api, "/openapi.json").json()
    paths = schema["paths"]
    assert set(paths) >= {
        "/events",
        "/events/{event}",
        "/deliveries/{delivery}",
        "/dead",
        "/replays",
        "/replays/{replay_id}",
    }
    assert schema["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    post = paths["/replays"]["post"]
    assert post["description"]
    assert post["responses"]["202"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/ReplayCreatedOut"
    )
    assert {"400", "409", "429"} <= set(post["responses"])
    assert "422" not in post["responses"]
    body = schema["components"]["schemas"]["ReplayIn"]
    assert set(body["required"]) == {"reason"}
    assert "operator" not in body["properties"]  # the audit records the token's name
    assert body["properties"]["rate"]["maximum"] == replays.MAX_RATE
    detail = schema["components"]["schemas"]["EventDetail"]
    assert "payload" not in detail["properties"]
    assert detail["description"]


def test_replay_requests_follow_the_cli_rules(
    api: Receiver, ops: Settings, sessions: sessionmaker[Session], engine: Engine
) -> None:
    source = source_with(sessions, ops)
    dead = accept(ops, source)
    kill(sessions, dead)
    done = accept(ops, source)
    succeed(sessions, done)
    before = len(replay_rows(engine))

    no_reason = _post(api, "/replays", {"reason": "", "ids": dead})
    assert no_reason.status_code == 400
    blank = _post(api, "/replays", {"reason": "   ", "ids": dead})
    assert blank.status_code == 400
    assert blank.json()["reason"] == "no_reason"
    too_fast = _post(
        api,
        "/replays",
        {"reason": "x", "ids": dead, "rate": replays.MAX_RATE * 2},
    )
    assert too_fast.status_code == 400
    both = _post(api, "/replays", {"reason": "x", "ids": dead, "source": source.public_id})
    assert both.status_code == 400
    refused = _post(api, "/replays", {"reason": "again", "ids": done})
    assert refused.status_code == 409
    assert refused.json()["reason"] == "succeeded"
    assert "--rerun-succeeded" in refused.json()["detail"]
    unknown_source = _post(api, "/replays", {"reason": "x", "source": "src_does_not_exist"})
    assert unknown_source.status_code == 400

    dry = _post(
        api,
        "/replays",
        {"reason": "look", "source": source.public_id, "dry_run": True},
    )
    assert dry.status_code == 200
    assert dry.json()["replay"] is None
    assert dry.json()["preview"]["count"] == 1
    assert dry.json()["preview"]["sample"][0]["delivery_id"] == dead[0]

    assert status_of(engine, dead + done) == {dead[0]: "dead", done[0]: "succeeded"}
    assert len(replay_rows(engine)) == before
    assert queue_length(ops) == 0
    assert _get(api, "/replays/999999").status_code == 404


def test_event_views_never_contain_a_secret_or_the_payload(
    api: Receiver, ops: Settings, sessions: sessionmaker[Session]
) -> None:
    source = source_with(sessions, ops)
    private = "card-4242-" + secrets.token_hex(6)
    remember(private)
    [delivery] = accept(ops, source, body={"id": "evt_x", "data": {"card": private}})
    kill(sessions, [delivery])
    listed = _get(api, f"/events?source={source.public_id}&status=dead")
    [event] = listed.json()
    shown = _get(api, f"/events/receipt:{event['id']}")  # a bare number may be a delivery id
    assert shown.status_code == 200
    assert shown.json()["deliveries"][0]["status"] == "dead"
    assert shown.json()["payload_bytes"] > 0
    dead = _get(api, f"/dead?source={source.public_id}")
    assert dead.json()[0]["sample_ids"] == [delivery]
    for response in (listed, shown, dead):
        assert source.secret not in response.text
        assert private not in response.text
        assert TOKEN not in response.text


def test_a_routes_view_shows_its_filter_and_lane_options(
    api: Receiver, ops: Settings, sessions: sessionmaker[Session]
) -> None:
    """GET /routes/{id}: the route's filter, order key, lane-on-dead and supersede (issue 37
    item 6) beside its pause and breaker; an unknown route is 404."""
    route = {
        "handler": "log",
        "filter": "type == 'test.event'",
        "order_key": "body.data.customer",
        "lane_on_dead": "skip",
        "supersede": True,
    }
    made = make_source(sessions, ops, routes=[route])
    remember(made.secret)
    view = _get(api, f"/routes/{made.route_ids[0]}")
    assert view.status_code == 200
    body = view.json()
    assert body["filter"] == "type == 'test.event'"
    assert body["order_key"] == "body.data.customer"
    assert body["lane_on_dead"] == "skip"
    assert body["supersede"] is True
    assert body["breaker"]["state"] == "closed"
    assert _get(api, "/routes/999999999").status_code == 404
