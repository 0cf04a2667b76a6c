"""The forward handler's hardened edges (issue 11): a huge answer is never read whole, a
malformed Retry-After is ignored and counted, plain http only to loopback or when allowed.
A real HTTP server on loopback; the handler runs in-process so its memory can be measured."""

from __future__ import annotations

import threading
import tracemalloc
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tasks.context import Event, EventMeta, HandlerContext, RouteInfo
from tasks.errors import PermanentError, RetryableError
from tasks.handlers.forward import (
    MAX_RESPONSE_BYTES,
    _http,
    check_url,
    forward,
    parse_retry_after,
)
from webhooks.clock import SystemClock
from webhooks.metrics import RETRY_AFTER_IGNORED

SECRET = "whsec_" + "Rm9yd2FyZEVkZ2VzVGVzdFNlY3JldEtleTEy"
HUGE = 64 * 1024 * 1024


class HugeAnswer:
    """Answers every POST with HTTP 500 and a 64 MB body, and counts what it managed to send
    before the client went away."""

    def __init__(self) -> None:
        self.sent = 0
        self.done = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["content-length"]))
                self.send_response(500)
                self.send_header("content-length", str(HUGE))
                self.send_header("retry-after", "²")
                self.end_headers()
                chunk = b"x" * 65536
                try:
                    while server.sent < HUGE:
                        self.wfile.write(chunk)
                        server.sent += len(chunk)
                except OSError:
                    pass  # the client closed the connection: what we wanted
                finally:
                    server.done.set()

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/hook"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def huge() -> Iterator[HugeAnswer]:
    server = HugeAnswer()
    yield server
    server.close()


def context(url: str, **options: str) -> tuple[Event, HandlerContext]:
    meta = EventMeta(
        receipt_id=1,
        source_id=1,
        source="src_test",
        provider="standard",
        event_id="evt_edge",
        event_type="edge.case",
        occurred_at=None,
        received_at=datetime.now(UTC),
        content_type="application/json",
    )
    ctx = HandlerContext(
        idempotency_key="key-edge",
        delivery_id=1,
        attempt=1,
        generation=0,
        meta=meta,
        route=RouteInfo(1, "forward", {"url": url, **options}, SECRET),
        session=None,  # type: ignore[arg-type]  # forward never touches the database
        clock=SystemClock(),
        io_timeout=5.0,
    )
    return Event(meta, b'{"id":"evt_edge"}'), ctx


def ignored() -> float:
    return RETRY_AFTER_IGNORED._value.get()  # type: ignore[attr-defined,no-any-return]


def test_a_huge_error_answer_is_never_read_whole(huge: HugeAnswer) -> None:
    event, ctx = context(huge.url)
    before = ignored()
    _http()  # the shared client (its TLS context) exists before the measurement
    tracemalloc.start()
    try:
        with pytest.raises(RetryableError) as raised:
            forward(event, ctx)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert raised.value.reason == "http_retryable"
    assert raised.value.delay is None  # "²" is no delay: the policy's backoff applies
    assert ignored() == before + 1
    assert huge.done.wait(10)
    assert peak < 16 * MAX_RESPONSE_BYTES  # 1 MiB: a few buffers, not 64 MB (nor twice that)
    assert huge.sent < HUGE // 4  # the server was cut off long before the end


def test_retry_after_takes_seconds_or_an_http_date_and_ignores_the_rest() -> None:
    now = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
    assert parse_retry_after(None, now) is None
    assert parse_retry_after(" 120 ", now) == 120.0
    assert parse_retry_after(format_datetime(now + timedelta(seconds=90), usegmt=True), now) == 90.0
    assert parse_retry_after(format_datetime(now - timedelta(hours=1), usegmt=True), now) == 0.0
    assert parse_retry_after("99999999999", now) == 7 * 86400.0  # capped
    before = ignored()
    for bad in ("²", "-5", "1e9", "soon", "12.5", "Mon, 99 Foo 2026", "٣"):
        assert parse_retry_after(bad, now) is None, bad
    assert ignored() == before + 7


def test_plain_http_only_to_loopback_or_when_the_route_allows_it() -> None:
    assert check_url("https://billing.example/hook") == "https://billing.example/hook"
    for loopback in ("http://127.0.0.1:8080/h", "http://localhost/h", "http://[::1]:9/h"):
        assert check_url(loopback) == loopback
    with pytest.raises(PermanentError) as refused:
        check_url("http://billing.example/hook")
    assert refused.value.reason == "insecure_url"
    assert "allow_http=true" in str(refused.value)
    assert check_url("http://billing.example/hook", {"allow_http": "true"})
    for broken in (None, "ftp://x/y", "billing.example/hook", "http:///nohost"):
        with pytest.raises(PermanentError) as bad:
            check_url(broken)
        assert bad.value.reason == "misconfigured"
