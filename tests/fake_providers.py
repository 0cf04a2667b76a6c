"""Local fakes of the provider APIs reconciliation talks to (issue 22), served by
``http.server`` in a thread on 127.0.0.1: realistic pages, pagination, rate limiting and
errors, scripted per test. Each request is recorded (path, query, when, whether the
credential matched) so a test can assert what the client did."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, BinaryIO
from urllib.parse import parse_qs, urlsplit


@dataclass
class Seen:
    method: str
    path: str
    query: dict[str, list[str]]
    at: float  # time.monotonic()
    authorised: bool
    status: int = 200


@dataclass
class Scripted:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: dict[str, Any] = field(default_factory=dict)


@dataclass
class Streamed:
    """An answer whose body ``write`` writes itself, at its own size and pace (a huge body, a
    trickling one). ``length``: the ``Content-Length`` to declare; None: none, the body ends
    when the connection closes."""

    write: Callable[[BinaryIO], None]
    length: int | None = None


class FakeStripe:
    """``GET /v1/webhook_endpoints/{endpoint_id}`` (its ``enabled_events``) and
    ``GET /v1/events``: newest first, ``created[gte]``, ``limit`` (the fake serves at most
    ``page_size`` a page, as Stripe may serve fewer than asked), ``starting_after``; every other
    path 404. ``fail(n, ...)`` scripts the answer of the n-th events request (1-based)."""

    def __init__(
        self, api_key: str, page_size: int = 5, enabled_events: tuple[str, ...] = ("*",)
    ) -> None:
        self.api_key = api_key
        self.page_size = page_size
        self.endpoint_id = "we_1Recon"
        self.enabled_events = list(enabled_events)
        # The endpoint as Stripe holds it (the subscription watchdog reads and re-enables it):
        # status enabled or disabled, the URL it posts to; deleted: answered 404.
        self.endpoint_status = "enabled"
        self.endpoint_url = "https://example.invalid/webhooks/src"
        self.endpoint_deleted = False
        # Scripted answers of the n-th endpoint request (GET or POST), 1-based.
        self.endpoint_script: dict[int, Scripted] = {}
        self.last_body: dict[str, Any] = {}  # set by the handler before answer
        self.events: list[dict[str, Any]] = []
        self.seen: list[Seen] = []
        self.script: dict[int, Scripted] = {}
        self.lock = threading.Lock()
        self.url = ""

    def add_event(self, event_id: str, created: int, event_type: str = "invoice.paid") -> None:
        with self.lock:
            self.events.append(
                {
                    "id": event_id,
                    "object": "event",
                    "api_version": "2024-06-20",
                    "created": created,
                    "type": event_type,
                    "livemode": False,
                    "pending_webhooks": 0,
                    "request": {"id": None, "idempotency_key": None},
                    "data": {"object": {"id": f"in_{event_id[-8:]}", "object": "invoice"}},
                }
            )

    def fail(self, nth: int, status: int, headers: dict[str, str] | None = None) -> None:
        kind = "rate_limit_error" if status == 429 else "api_error"
        body = {"error": {"type": kind, "message": f"scripted {status}"}}
        self.script[nth] = Scripted(status, headers or {}, body)

    def events_requests(self) -> list[Seen]:
        return [s for s in self.seen if s.path == "/v1/events"]

    def endpoint_requests(self, method: str | None = None) -> list[Seen]:
        path = f"/v1/webhook_endpoints/{self.endpoint_id}"
        return [s for s in self.seen if s.path == path and method in (None, s.method)]

    def endpoint(self) -> dict[str, Any]:
        """The webhook endpoint object, as the API documents it (``secret`` only at creation)."""
        return {
            "id": self.endpoint_id,
            "object": "webhook_endpoint",
            "api_version": None,
            "application": None,
            "created": 1_700_000_000,
            "description": None,
            "enabled_events": self.enabled_events,
            "livemode": False,
            "metadata": {},
            "status": self.endpoint_status,
            "url": self.endpoint_url,
        }

    def answer(
        self, method: str, path: str, query: dict[str, list[str]], auth: str | None
    ) -> tuple[int, dict[str, str], dict[str, Any]]:
        authorised = auth == f"Bearer {self.api_key}"
        seen = Seen(method, path, query, time.monotonic(), authorised)
        with self.lock:
            self.seen.append(seen)
            if not authorised:
                seen.status = 401
                return 401, {}, {"error": {"type": "invalid_request_error", "message": "bad key"}}
            if path == f"/v1/webhook_endpoints/{self.endpoint_id}" and method in ("GET", "POST"):
                scripted = self.endpoint_script.pop(len(self.endpoint_requests()), None)
                if scripted is not None:
                    seen.status = scripted.status
                    return scripted.status, scripted.headers, scripted.body
                if self.endpoint_deleted:
                    seen.status = 404
                    return (
                        404,
                        {},
                        {
                            "error": {
                                "type": "invalid_request_error",
                                "code": "resource_missing",
                                "message": "No such",
                            }
                        },
                    )
                if method == "POST":  # update: disabled=true|false is the only field used
                    disabled = str(self.last_body.get("disabled", "")).lower()
                    if disabled in ("true", "false"):
                        self.endpoint_status = "disabled" if disabled == "true" else "enabled"
                return 200, {}, self.endpoint()
            if method != "GET" or path != "/v1/events":
                seen.status = 404
                return 404, {}, {"error": {"type": "invalid_request_error", "message": "no"}}
            scripted = self.script.pop(len(self.events_requests()), None)
            if scripted is not None:
                seen.status = scripted.status
                return scripted.status, scripted.headers, scripted.body
            gte = int(query.get("created[gte]", ["0"])[0])
            limit = min(int(query.get("limit", ["10"])[0]), self.page_size)
            listed = sorted(
                (e for e in self.events if e["created"] >= gte),
                key=lambda e: (e["created"], e["id"]),
                reverse=True,
            )
            after = query.get("starting_after", [None])[0]
            if after is not None:
                ids = [e["id"] for e in listed]
                listed = listed[ids.index(after) + 1 :]
            page = listed[:limit]
            return (
                200,
                {},
                {
                    "object": "list",
                    "url": "/v1/events",
                    "has_more": len(listed) > limit,
                    "data": page,
                },
            )


def _body(raw: bytes, content_type: str) -> dict[str, Any]:
    """A request's body: JSON (GitHub, Svix), or a form (the ``stripe`` library's POSTs)."""
    if not raw:
        return {}
    if content_type.startswith("application/x-www-form-urlencoded"):
        return {k: v[-1] for k, v in parse_qs(raw.decode()).items()}
    loaded: dict[str, Any] = json.loads(raw)
    return loaded


class _Resets:
    """Which requests (1-based, in the order the server reads them) get their connection
    reset instead of an answer."""

    def __init__(self, nths: tuple[int, ...]) -> None:
        self.nths = set(nths)
        self.count = 0
        self.lock = threading.Lock()

    def take(self) -> bool:
        with self.lock:
            self.count += 1
            return self.count in self.nths


class _Handler(BaseHTTPRequestHandler):
    fake: Any
    resets: _Resets

    def _serve(self) -> None:
        if self.resets.take():  # a dropped connection: RST (linger 0), no answer, not seen
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            self.close_connection = True
            return
        parts = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        raw_in = self.rfile.read(length) if length else b""
        self.fake.last_body = _body(raw_in, self.headers.get("Content-Type") or "")
        # Shopify's Admin API takes its token in X-Shopify-Access-Token, the others in
        # Authorization.
        credential = self.headers.get(getattr(self.fake, "auth_header", "Authorization"))
        status, headers, body = self.fake.answer(
            self.command, parts.path, parse_qs(parts.query), credential
        )
        if isinstance(body, Streamed):
            self.send_response(status)
            if body.length is not None:
                self.send_header("Content-Length", str(body.length))
            for key, value in headers.items():
                self.send_header(key, value)
            self.end_headers()
            self.close_connection = True
            body.write(self.wfile)
            return
        raw = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(raw)

    do_GET = _serve  # noqa: N815
    do_POST = _serve  # noqa: N815
    do_PATCH = _serve  # noqa: N815

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass


# serve_forever checks for shutdown() every poll_interval (0.5 s by default): each fake's
# exit waited a quarter of a second on average for nothing.
POLL = 0.05


@contextmanager
def serving(fake: Any, *, reset: tuple[int, ...] = ()) -> Iterator[Any]:
    """Serve ``fake`` on 127.0.0.1. ``reset``: the n-th requests (1-based) have their
    connection reset unanswered, as a network or a provider's load balancer may; the fake
    does not see them."""
    handler = type("Handler", (_Handler,), {"fake": fake, "resets": _Resets(reset)})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    fake.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": POLL}, daemon=True
    )
    thread.start()
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _record(
    fake: FakeGitHub | FakeSvix,
    method: str,
    path: str,
    query: dict[str, list[str]],
    auth: str | None,
    unauthorised: dict[str, Any],
) -> tuple[Seen, tuple[int, dict[str, str], Any] | None]:
    """Log the request as the fake saw it; with it the answer when it is refused (401) or
    scripted (the n-th request's status), else None: the fake answers it."""
    seen = Seen(method, path, query, time.monotonic(), auth == f"Bearer {fake.token}")
    with fake.lock:
        fake.seen.append(seen)
        scripted = fake.script.pop(len(fake.seen), None)
    if not seen.authorised:
        seen.status = 401
        return seen, (401, {}, unauthorised)
    if scripted is not None:
        seen.status = scripted.status
        return seen, (scripted.status, scripted.headers, scripted.body)
    return seen, None


class FakeGitHub:
    """One hook's deliveries API: ``GET /{hook}/deliveries`` newest first, ``per_page`` (at
    most ``page_size`` served), the next page's ``cursor`` in ``Link``; ``POST
    /{hook}/deliveries/{id}/attempts`` answers 202 and calls ``on_redeliver(delivery)`` (a
    test sends the signed webhook to the receiver there), then lists the redelivery as a new
    delivery with the same guid. ``fail(n, ...)`` scripts the n-th request of any kind."""

    def __init__(self, token: str, hook: str, page_size: int = 3) -> None:
        self.token = token
        self.hook = hook
        self.page_size = page_size
        self.deliveries: list[dict[str, Any]] = []  # newest first
        self.seen: list[Seen] = []
        self.script: dict[int, Scripted] = {}
        self.on_redeliver: Any = None
        self.lock = threading.Lock()
        self.url = ""
        self._ids = iter(range(90_000_000, 99_999_999))
        # The hook as GitHub holds it, read and PATCHed by the subscription watchdog (a
        # deleted one is answered 404).
        self.active = True
        self.events = ["*"]
        self.hook_url = "https://example.invalid/webhooks/src"
        self.hook_deleted = False
        self.last_response: dict[str, Any] = {"code": 200, "status": "active", "message": "OK"}
        self.last_body: dict[str, Any] = {}  # set by the handler before answer

    def hook_requests(self, method: str | None = None) -> list[Seen]:
        return [s for s in self.seen if s.path == f"/{self.hook}" and method in (None, s.method)]

    def hook_object(self) -> dict[str, Any]:
        """The hook, as GitHub's REST API documents "Get a repository webhook"."""
        number = int(self.hook.rsplit("/", 1)[-1])
        api = f"https://api.github.com/{self.hook}"
        return {
            "type": "Repository",
            "id": number,
            "name": "web",
            "active": self.active,
            "events": self.events,
            "config": {
                "content_type": "json",
                "insecure_ssl": "0",
                "url": self.hook_url,
            },
            "updated_at": "2026-12-01T00:00:00Z",
            "created_at": "2026-01-01T00:00:00Z",
            "url": api,
            "test_url": f"{api}/test",
            "ping_url": f"{api}/pings",
            "deliveries_url": f"{api}/deliveries",
            "last_response": self.last_response,
        }

    def add_delivery(
        self, guid: str, delivered_at: datetime, *, status_code: int, event: str = "issues"
    ) -> int:
        delivery_id = next(self._ids)
        with self.lock:
            self.deliveries.insert(
                0,
                {
                    "id": delivery_id,
                    "guid": guid,
                    "delivered_at": delivered_at.isoformat().replace("+00:00", "Z"),
                    "redelivery": False,
                    "duration": 0.27,
                    "status": "OK"
                    if status_code < 300
                    else f"Invalid HTTP Response: {status_code}",
                    "status_code": status_code,
                    "event": event,
                    "action": "opened",
                    "installation_id": None,
                    "repository_id": 1,
                },
            )
            self.deliveries.sort(key=lambda d: d["delivered_at"], reverse=True)
        return delivery_id

    def fail(self, nth: int, status: int, headers: dict[str, str] | None = None) -> None:
        self.script[nth] = Scripted(status, headers or {}, {"message": f"scripted {status}"})

    def attempts(self) -> list[str]:
        return [s.path for s in self.seen if s.method == "POST" and s.status == 202]

    def answer(
        self, method: str, path: str, query: dict[str, list[str]], auth: str | None
    ) -> tuple[int, dict[str, str], Any]:
        seen, early = _record(self, method, path, query, auth, {"message": "Bad credentials"})
        if early is not None:
            return early
        if path == f"/{self.hook}" and method in ("GET", "PATCH"):
            if self.hook_deleted:
                seen.status = 404
                return 404, {}, {"message": "Not Found"}
            if method == "PATCH" and isinstance(self.last_body.get("active"), bool):
                self.active = self.last_body["active"]
            return 200, {}, self.hook_object()
        prefix = f"/{self.hook}/deliveries"
        if method == "GET" and path == prefix:
            with self.lock:
                listed = list(self.deliveries)
            start = int(query.get("cursor", ["0"])[0])
            size = min(int(query.get("per_page", ["30"])[0]), self.page_size)
            headers = {}
            if start + size < len(listed):
                headers["Link"] = (
                    f'<{self.url}{prefix}?per_page={size}&cursor={start + size}>; rel="next"'
                )
            return 200, headers, listed[start : start + size]
        if method == "POST" and path.startswith(prefix + "/") and path.endswith("/attempts"):
            delivery_id = int(path.split("/")[-2])
            with self.lock:
                found = [d for d in self.deliveries if d["id"] == delivery_id]
            if not found:
                seen.status = 404
                return 404, {}, {"message": "Not Found"}
            if self.on_redeliver is not None:
                self.on_redeliver(found[0])
            self.add_delivery(
                found[0]["guid"], datetime.now(UTC), status_code=202, event=found[0]["event"]
            )
            seen.status = 202
            return 202, {}, {}
        seen.status = 404
        return 404, {}, {"message": "Not Found"}


class FakeSvix:
    """One application's messages, ``GET /api/v1/app/{app}/msg`` (``after``, ``limit`` with
    at most ``page_size`` served, ``iterator``), and ``POST
    /api/v1/app/{app}/endpoint/{endpoint}/recover``: 202, recorded with its ``since``, and
    ``on_recover(message)`` for each message of the window marked failed (a test sends the
    signed webhook to the receiver there). ``fail(n, ...)`` scripts the n-th request."""

    def __init__(self, token: str, app_id: str, endpoint_id: str, page_size: int = 3) -> None:
        self.token = token
        self.app_id = app_id
        self.endpoint_id = endpoint_id
        self.page_size = page_size
        self.messages: list[dict[str, Any]] = []
        self.failed: set[str] = set()
        self.recovers: list[dict[str, Any]] = []
        self.seen: list[Seen] = []
        self.script: dict[int, Scripted] = {}
        self.on_recover: Any = None
        # The endpoint as Svix holds it, read and PATCHed by the subscription watchdog (a
        # deleted one is answered 404); filter_types None: every type.
        self.disabled = False
        self.endpoint_url = "https://example.invalid/webhooks/src"
        self.filter_types: list[str] | None = None
        self.endpoint_deleted = False
        self.lock = threading.Lock()
        self.url = ""

    def add_message(self, msg_id: str, at: datetime, *, failed: bool) -> None:
        with self.lock:
            self.messages.append(
                {
                    "id": msg_id,
                    "eventType": "invoice.paid",
                    "eventId": None,
                    "payload": {},
                    "channels": None,
                    "timestamp": at.isoformat().replace("+00:00", "Z"),
                    "tags": None,
                }
            )
            if failed:
                self.failed.add(msg_id)

    def fail(self, nth: int, status: int) -> None:
        self.script[nth] = Scripted(status, {}, {"code": "scripted", "detail": f"{status}"})

    def endpoint_requests(self, method: str | None = None) -> list[Seen]:
        path = f"/api/v1/app/{self.app_id}/endpoint/{self.endpoint_id}"
        return [s for s in self.seen if s.path == path and method in (None, s.method)]

    def endpoint(self) -> dict[str, Any]:
        """The endpoint, as Svix's API documents EndpointOut."""
        return {
            "id": self.endpoint_id,
            "uid": None,
            "description": "",
            "url": self.endpoint_url,
            "version": 1,
            "rateLimit": None,
            "disabled": self.disabled,
            "filterTypes": self.filter_types,
            "channels": None,
            "metadata": {},
            "createdAt": "2026-01-01T00:00:00Z",
            "updatedAt": "2026-12-01T00:00:00Z",
        }

    def answer(
        self, method: str, path: str, query: dict[str, list[str]], auth: str | None
    ) -> tuple[int, dict[str, str], Any]:
        seen, early = _record(
            self,
            method,
            path,
            query,
            auth,
            {"code": "authentication_failed", "detail": "bad token"},
        )
        if early is not None:
            return early
        app = f"/api/v1/app/{self.app_id}"
        if path == f"{app}/endpoint/{self.endpoint_id}" and method in ("GET", "PATCH"):
            if self.endpoint_deleted:
                seen.status = 404
                return 404, {}, {"code": "not_found", "detail": "Endpoint not found"}
            if method == "PATCH" and isinstance(self.last_body.get("disabled"), bool):
                self.disabled = self.last_body["disabled"]
            return 200, {}, self.endpoint()
        if method == "GET" and path.rstrip("/") == f"{app}/msg":
            after = datetime.fromisoformat(query["after"][0].replace("Z", "+00:00"))
            with self.lock:
                listed = sorted(
                    (m for m in self.messages if _when(m["timestamp"]) > after),
                    key=lambda m: m["timestamp"],
                    reverse=True,
                )
            start = int(query.get("iterator", ["0"])[0])
            size = min(int(query.get("limit", ["50"])[0]), self.page_size)
            done = start + size >= len(listed)
            return (
                200,
                {},
                {
                    "data": listed[start : start + size],
                    "iterator": None if done else str(start + size),
                    "prevIterator": None,
                    "done": done,
                },
            )
        if method == "POST" and path == f"{app}/endpoint/{self.endpoint_id}/recover":
            seen.status = 202
            since = self.last_body["since"]
            self.recovers.append(self.last_body)
            with self.lock:
                resend = [
                    m
                    for m in self.messages
                    if m["id"] in self.failed and _when(m["timestamp"]) >= _when(since)
                ]
                self.failed -= {m["id"] for m in resend}
            for message in resend:
                if self.on_recover is not None:
                    self.on_recover(message)
            return (
                202,
                {},
                {
                    "id": "qtask_1",
                    "status": "running",
                    "task": "endpoint.recover",
                    "updatedAt": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
                },
            )
        seen.status = 404
        return 404, {}, {"code": "not_found", "detail": "Not Found"}

    last_body: dict[str, Any] = {}  # noqa: RUF012  (set by the handler before answer)


class FakeShopify:
    """One shop's webhook subscriptions of one app, ``GET
    /admin/api/{version}/webhooks.json`` (``topic``, ``address``, ``limit`` up to 250 with at
    most ``page_size`` served, ``page_info`` through the ``Link`` header's ``rel="next"``), as
    Shopify's REST Admin API documents the webhook resource; the token in
    ``X-Shopify-Access-Token`` (a wrong one: 401). ``fail(n, status)`` scripts the n-th
    request; every other path 404."""

    auth_header = "X-Shopify-Access-Token"

    def __init__(self, token: str, shop: str = "watch-test.myshopify.com") -> None:
        self.token = token
        self.shop = shop
        self.page_size = 250
        self.subscriptions: list[dict[str, Any]] = []
        self.next_id = 1_047_000_000
        self.seen: list[Seen] = []
        self.script: dict[int, Scripted] = {}
        self.lock = threading.Lock()
        self.url = ""

    def subscribe(self, topic: str, address: str) -> dict[str, Any]:
        """A subscription as the API documents it (its fields at version 2025-10)."""
        with self.lock:
            self.next_id += 1
            sub = {
                "id": self.next_id,
                "address": address,
                "topic": topic,
                "created_at": "2026-11-02T10:00:00-05:00",
                "updated_at": "2026-11-02T10:00:00-05:00",
                "format": "json",
                "fields": [],
                "metafield_namespaces": [],
                "api_version": "2025-10",
                "private_metafield_namespaces": [],
            }
            self.subscriptions.append(sub)
            return sub

    def delete(self, topic: str) -> None:
        """What Shopify does after 8 failed deliveries over 4 hours."""
        with self.lock:
            self.subscriptions = [s for s in self.subscriptions if s["topic"] != topic]

    def fail(self, nth: int, status: int) -> None:
        headers = {"Retry-After": "2.0"} if status == 429 else {}
        said = (
            "Exceeded 2 calls per second for api client. Reduce request rates to resume"
            " uninterrupted service."
            if status == 429
            else f"scripted {status}"
        )
        self.script[nth] = Scripted(status, headers, {"errors": said})

    def answer(
        self, method: str, path: str, query: dict[str, list[str]], auth: str | None
    ) -> tuple[int, dict[str, str], Any]:
        seen = Seen(method, path, query, time.monotonic(), auth == self.token)
        with self.lock:
            self.seen.append(seen)
            scripted = self.script.pop(len(self.seen), None)
        if not seen.authorised:
            seen.status = 401
            return (
                401,
                {},
                {
                    "errors": "[API] Invalid API key or access token (unrecognized login or"
                    " wrong password)"
                },
            )
        if scripted is not None:
            seen.status = scripted.status
            return scripted.status, scripted.headers, scripted.body
        parts = path.split("/")
        if (
            method == "GET"
            and len(parts) == 5
            and parts[:3] == ["", "admin", "api"]
            and (parts[4] == "webhooks.json")
        ):
            with self.lock:
                listed = [
                    s
                    for s in self.subscriptions
                    if s["topic"] in query.get("topic", [s["topic"]])
                    and s["address"] in query.get("address", [s["address"]])
                ]
            start = int(query.get("page_info", ["0"])[0])
            size = min(int(query.get("limit", ["50"])[0]), 250, self.page_size)
            headers = {}
            if start + size < len(listed):
                following = f"{self.url}{path}?limit={size}&page_info={start + size}"
                headers["Link"] = f'<{following}>; rel="next"'
            return 200, headers, {"webhooks": listed[start : start + size]}
        seen.status = 404
        return 404, {}, {"errors": "Not Found"}

    last_body: dict[str, Any] = {}  # noqa: RUF012  (set by the handler before answer)


def _when(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))
