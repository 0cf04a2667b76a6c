"""The forward handler's hardened edges (issue 11): a huge answer is never read whole, a
malformed Retry-After is ignored and counted, plain http only to loopback or when allowed.
A real HTTP server on loopback; the handler runs in-process so its memory can be measured."""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import socket
import ssl
import threading
import tracemalloc
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path
from urllib.parse import unquote

import pytest

from core.clock import SystemClock
from core.metrics import RETRY_AFTER_IGNORED
from tasks import aio
from tasks.context import Event, EventMeta, HandlerContext, RouteInfo
from tasks.errors import DownstreamError, LeaseFenced, PermanentError, RetryableError
from tasks.handlers import forward_client
from tasks.handlers.forward import check_url, forward, parse_retry_after
from tasks.handlers.forward_client import MAX_RESPONSE_BYTES
from tests.loopback import Loopback, Quiet


@pytest.fixture(autouse=True, params=["loop", "sync"])
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test twice: through the event loop's client (threads and prefork pools) and the
    synchronous one (the gevent pool, told here by ``is_green``)."""
    monkeypatch.setattr(forward_client, "is_green", lambda: request.param == "sync")
    return str(request.param)


SECRET = "whsec_" + "Rm9yd2FyZEVkZ2VzVGVzdFNlY3JldEtleTEy"
HUGE = 64 * 1024 * 1024


class HugeAnswer:
    """Answers every POST with HTTP 500 and a 64 MB body, and counts what it managed to send
    before the client went away."""

    def __init__(self) -> None:
        self.sent = 0
        self.done = threading.Event()
        server = self

        class Handler(Quiet):
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

        self.loopback = Loopback(Handler, "/hook", daemon_threads=False)
        self.url = self.loopback.url

    def close(self) -> None:
        self.loopback.close()


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
    event, ctx = context(huge.url, allow_private="true")
    with pytest.raises(RetryableError):  # the loop, its session and the TLS context exist
        forward(event, ctx)  # before the measurement
    assert huge.done.wait(10)
    huge.done.clear()
    before = ignored()
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
    assert huge.sent < HUGE // 4  # the server was cut off long before the end (both calls)


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
    private = {"allow_private": "true"}
    assert check_url("https://billing.example/hook") == "https://billing.example/hook"
    for loopback in ("http://127.0.0.1:8080/h", "http://localhost/h", "http://[::1]:9/h"):
        assert check_url(loopback, private) == loopback
    with pytest.raises(PermanentError) as refused:
        check_url("http://billing.example/hook")
    assert refused.value.reason == "insecure_url"
    assert "allow_http=true" in str(refused.value)
    assert check_url("http://billing.example/hook", {"allow_http": "true"})
    for broken in (None, "ftp://x/y", "billing.example/hook", "http:///nohost", "https://[::1/"):
        with pytest.raises(PermanentError) as bad:
            check_url(broken)
        assert bad.value.reason == "misconfigured"


# --- addresses a forward may not reach (issue 18, item 7) -------------------------------------


def refused_reason(url: str, **options: str) -> str:
    with pytest.raises(PermanentError) as refused:
        check_url(url, dict(options))
    assert refused.value.reason == "address_refused"
    assert url not in str(refused.value)  # the class of address, never the URL
    return str(refused.value)


@pytest.mark.parametrize(
    "url",
    [
        "https://169.254.10.20/hook",
        "https://[fe80::1]/hook",
        "https://[::ffff:169.254.1.1]/hook",
    ],
)
def test_link_local_is_refused_whatever_the_route_allows(url: str) -> None:
    for options in ({}, {"allow_private": "true"}):
        assert "link-local" in refused_reason(url, **options)


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254/latest/meta-data/",
        "https://100.100.100.200/latest/meta-data/",
        "https://[fd00:ec2::254]/latest",
        "https://192.0.0.192/opc/v2/instance",
        "http://metadata.google.internal/computeMetadata/v1/",
        "http://[64:ff9b::a9fe:a9fe]/",  # NAT64 of 169.254.169.254
    ],
)
def test_cloud_metadata_is_refused_whatever_the_route_allows(url: str) -> None:
    for options in ({}, {"allow_private": "true"}):
        assert "metadata" in refused_reason(url, **options)


@pytest.mark.parametrize(
    "url",
    [
        "https://10.0.0.8/hook",
        "https://172.16.5.4/hook",
        "https://192.168.1.10/hook",
        "https://100.64.0.1/hook",
        "https://[fd12:3456::1]/hook",
        "http://127.0.0.1:8001/admin/events",
        "http://localhost:6379/",
        "http://[::1]:5432/",
        "http://0.0.0.0:5555/",
        "http://2130706433:8001/",  # 127.0.0.1, as the resolver reads it
    ],
)
def test_private_and_loopback_only_when_the_route_allows_them(url: str) -> None:
    assert "--option allow_private=true" in refused_reason(url)
    assert check_url(url, {"allow_private": "true", "allow_http": "true"}) == url


def test_allow_private_must_say_true_or_false() -> None:
    with pytest.raises(PermanentError) as bad:
        check_url("https://billing.example/hook", {"allow_private": "ture"})
    assert bad.value.reason == "misconfigured"
    assert "true or false" in str(bad.value)


class Recorder:
    """A downstream on loopback that answers 204 and keeps each request's headers; over TLS
    with a certificate for ``name`` only when ``tls`` is given (and records the SNI)."""

    def __init__(self, tls: ssl.SSLContext | None = None, cookie: str | None = None) -> None:
        self.requests: list[dict[str, str]] = []
        self.sni: list[str | None] = []
        recorder = self

        class Handler(Quiet):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["content-length"]))
                recorder.requests.append({k.lower(): v for k, v in self.headers.items()})
                self.send_response(204)
                if cookie is not None:
                    self.send_header("set-cookie", cookie)
                self.end_headers()

        if tls is not None:
            tls.sni_callback = lambda _sock, name, _ctx: recorder.sni.append(name)  # type: ignore[assignment,misc]
        self.loopback = Loopback(Handler, tls=tls, daemon_threads=False)
        self.port = self.loopback.port

    def close(self) -> None:
        self.loopback.close()


@pytest.fixture
def downstream() -> Iterator[Recorder]:
    server = Recorder()
    yield server
    server.close()


def test_loopback_is_reached_only_when_the_route_allows_it(downstream: Recorder) -> None:
    url = f"http://127.0.0.1:{downstream.port}/hook"
    event, ctx = context(url)
    with pytest.raises(PermanentError) as refused:
        forward(event, ctx)
    assert refused.value.reason == "address_refused"
    assert downstream.requests == []
    event, ctx = context(url, allow_private="true")
    forward(event, ctx)
    assert len(downstream.requests) == 1


def test_a_lease_lost_while_the_connection_opens_sends_nothing(downstream: Recorder) -> None:
    """The lease is checked again at the request's first write, after the connection was
    found or opened: a worker frozen between the handler's check and the send (issue 32's
    drill: it woke and called after another worker had committed the success) sends nothing.
    Here the lease reads 60 s at the handler's check and 0.5 s at the write."""
    url = f"http://127.0.0.1:{downstream.port}/hook"
    event, ctx = context(url, allow_private="true")
    reads = iter([60.0, 0.5])
    with pytest.raises(LeaseFenced):
        forward(event, dataclasses.replace(ctx, lease_left=lambda: next(reads)))
    assert downstream.requests == []
    forward(event, ctx)  # the same pooled clients, a live lease: the call goes
    assert len(downstream.requests) == 1


def _loopback_name() -> str:
    """This machine's host name when it resolves to loopback or a private address only."""
    name = socket.gethostname()
    try:
        found = {info[4][0] for info in socket.getaddrinfo(name, 80, type=socket.SOCK_STREAM)}
    except OSError:
        pytest.skip(f"{name} does not resolve")
    if any(ipaddress.ip_address(str(a).partition("%")[0]).is_global for a in found):
        pytest.skip(f"{name} resolves to a public address")
    return name


def test_a_name_that_resolves_to_loopback_is_refused_at_delivery(downstream: Recorder) -> None:
    """A name passes when the route is made (no DNS then); the worker resolves it, judges every
    address and refuses before connecting. The system resolver, not a stand-in."""
    name = _loopback_name()
    url = f"http://{name}:{downstream.port}/hook"
    event, ctx = context(url, allow_http="true")
    assert check_url(url, {"allow_http": "true"}) == url
    with pytest.raises(PermanentError) as refused:
        forward(event, ctx)
    assert refused.value.reason == "address_refused"
    assert downstream.requests == []
    event, ctx = context(url, allow_http="true", allow_private="true")
    forward(event, ctx)
    assert [r["host"] for r in downstream.requests] == [f"{name}:{downstream.port}"]


class OneAnswerDns:
    """A DNS server standing in for an attacker's (a third party): answers ``first`` to the
    first lookup and ``later`` to every other, as a rebinding name does."""

    def __init__(self, first: str, later: str) -> None:
        self.answers = [first, later]
        self.lookups: list[str] = []

    def __call__(self, host: str, port: int) -> list[ipaddress.IPv4Address]:
        self.lookups.append(host)
        answer = self.answers[0] if len(self.lookups) == 1 else self.answers[1]
        return [ipaddress.IPv4Address(answer)]


def test_the_connection_goes_to_the_address_that_was_checked(
    downstream: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rebinding: the name is looked up once per connection, and that checked answer is where
    the connection goes (a second lookup would say 127.0.0.2, where nothing listens). And the
    other way round: a public first answer is never followed by a private connection."""
    dns = OneAnswerDns("127.0.0.1", "127.0.0.2")
    monkeypatch.setattr(forward_client, "resolve", dns)
    monkeypatch.setattr(forward_client, "_sessions", {})
    monkeypatch.setattr(forward_client, "_idle", {False: [], True: []})
    event, ctx = context(
        f"http://rebind.test:{downstream.port}/hook", allow_http="true", allow_private="true"
    )
    forward(event, ctx)
    assert dns.lookups == ["rebind.test"]
    assert [r["host"] for r in downstream.requests] == [f"rebind.test:{downstream.port}"]
    # Refused on the answer it checked: a private address without allow_private.
    dns = OneAnswerDns("127.0.0.1", "93.184.215.14")
    monkeypatch.setattr(forward_client, "resolve", dns)
    event, ctx = context(f"http://rebind.test:{downstream.port}/hook", allow_http="true")
    with pytest.raises(PermanentError) as refused:
        forward(event, ctx)
    assert refused.value.reason == "address_refused"
    assert (dns.lookups, len(downstream.requests)) == (["rebind.test"], 1)


def _certificate(name: str) -> tuple[bytes, bytes]:
    """A self-signed certificate for ``name`` only (PEM certificate, PEM key)."""
    from cryptography import x509  # noqa: PLC0415
    from cryptography.hazmat.primitives import hashes, serialization  # noqa: PLC0415
    from cryptography.hazmat.primitives.asymmetric import ec  # noqa: PLC0415
    from cryptography.x509.oid import NameOID  # noqa: PLC0415

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.now(UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    pem_key = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM), pem_key


def test_https_keeps_the_hosts_name_for_sni_and_verification(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Connected to the checked address, TLS still names and verifies the URL's host: the
    certificate is valid for ``hooks.test`` only, so connecting "to 127.0.0.1" would fail."""
    cert, key = _certificate("hooks.test")
    (tmp_path / "cert.pem").write_bytes(cert)
    (tmp_path / "key.pem").write_bytes(key)
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_tls.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    client_tls = ssl.create_default_context(cafile=str(tmp_path / "cert.pem"))
    monkeypatch.setattr(forward_client, "_tls", client_tls)
    monkeypatch.setattr(forward_client, "_sessions", {})
    monkeypatch.setattr(forward_client, "_idle", {False: [], True: []})
    monkeypatch.setattr(forward_client, "resolve", OneAnswerDns("127.0.0.1", "127.0.0.1"))
    server = Recorder(server_tls)
    try:
        event, ctx = context(f"https://hooks.test:{server.port}/hook", allow_private="true")
        forward(event, ctx)
    finally:
        server.close()
    assert server.sni == ["hooks.test"]
    assert [r["host"] for r in server.requests] == [f"hooks.test:{server.port}"]


# --- header values (issue 18, item 8) -------------------------------------------------------


def test_non_ascii_type_and_content_type_never_fail_an_attempt(downstream: Recorder) -> None:
    """The type goes percent-encoded under a header saying so; a content type that is not
    printable ASCII (stored as the sender's bytes read as Latin-1) becomes octet-stream.
    Before, httpx refused to encode them, and every attempt failed until the delivery died."""
    url = f"http://127.0.0.1:{downstream.port}/hook"
    event, ctx = context(url, allow_private="true")
    meta = dataclasses.replace(
        event.meta, event_type="bestellung.geändert\r\nx: y", content_type="text/plain; ü"
    )
    forward(Event(meta, event.body), ctx)
    (seen,) = downstream.requests
    assert "x-webhooks-event-type" not in seen
    assert "x" not in seen  # no header injection
    assert unquote(seen["x-webhooks-event-type-utf8"]) == meta.event_type
    assert seen["content-type"] == "application/octet-stream"
    # An ASCII type and content type go as they are.
    forward(event, ctx)
    assert downstream.requests[1]["x-webhooks-event-type"] == "edge.case"
    assert downstream.requests[1]["content-type"] == "application/json"


def test_a_downstreams_cookie_is_never_sent_on_a_later_call() -> None:
    """A forward keeps no cookies: what one call's downstream set (Set-Cookie) never goes
    with a later call, of this route or of another one to the same host. By name: a cookie
    jar keeps no cookie for an address literal."""
    server = Recorder(cookie="session=secret-of-route-a; Path=/")
    try:
        for route in ("a", "b", "a"):
            event, ctx = context(f"http://localhost:{server.port}/{route}", allow_private="true")
            forward(event, ctx)
    finally:
        server.close()
    assert len(server.requests) == 3
    assert [r.get("cookie") for r in server.requests] == [None, None, None]


def test_a_downstream_that_never_answers_times_out_at_the_io_timeout() -> None:
    """The whole call is bounded by the handler's I/O timeout: a listener that accepts and
    never answers costs one timeout (a retryable failure the breaker counts), not a wait
    for the loop's own backstop."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        event, ctx = context(
            f"http://127.0.0.1:{silent.getsockname()[1]}/hook", allow_private="true"
        )
        with pytest.raises(DownstreamError) as raised:
            forward(event, dataclasses.replace(ctx, io_timeout=0.5))
    assert raised.value.reason == "timeout"
    assert "LoopStalled" not in str(raised.value)


def test_a_call_the_loop_never_finishes_frees_its_thread_and_is_cancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A coroutine that overstays its bound (a bug: every one here bounds itself) does not
    hold the handler's thread: past the bound and the margin the caller gets LoopStalled, a
    timeout, and the coroutine is cancelled on the loop."""
    monkeypatch.setattr(aio, "WAIT_MARGIN_S", 0.2)
    cancelled = threading.Event()

    async def overstays() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(aio.LoopStalled):
        aio.call(overstays(), 0.1)
    assert cancelled.wait(5)
